"""rl/algo/logprobs.py against hand computations from the model's own logits (tiny config cut to 2 layers, float32).

Run: `.venv/bin/python -m pytest -q tests/rl/test_logprobs.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from rl.algo.logprobs import effective_temperature, token_logprobs

N, S = 3, 10


@pytest.fixture(scope="module")
def setup():
    cfg = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(0, 4, 0))  # hash + learned MoE; sliding + CSA
    model = dsv4.DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, cfg.vocab_size, (N, S)).astype(np.int32)
    mask = np.zeros((N, S), np.int32)
    mask[0, :] = 1            # no padding
    mask[1, 3:] = 1           # left padding
    mask[2, 2:7] = 1          # left and right padding
    ids = np.where(mask > 0, ids, 0)
    out = jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask)
    return model, jnp.asarray(ids), jnp.asarray(mask), np.asarray(out.logits, np.float64), np.asarray(out.routing)


def _hand(logits, ids, mask, t):
    """float64 reference: lp[i, j] = log softmax(logits[i, j-1] / t)[ids[i, j]], entropy; 0 where invalid."""
    lp, ent = np.zeros((N, S)), np.zeros((N, S))
    for i in range(N):
        for j in range(1, S):
            if mask[i, j] and mask[i, j - 1]:
                z = logits[i, j - 1] / t
                logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
                lp[i, j] = logp[ids[i, j]]
                ent[i, j] = -(np.exp(logp) * logp).sum()
    return lp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_hand_computation(setup, temperature):
    model, ids, mask, logits, routing = setup
    lp, ent, rt = jax.jit(lambda i, m: token_logprobs(model, i, m, temperature=temperature, return_entropy=True))(
        ids, mask)
    ref_lp, ref_ent = _hand(logits, np.asarray(ids), np.asarray(mask), temperature)
    assert lp.shape == (N, S) and lp.dtype == jnp.float32 and ent.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(rt), routing)
    # Invalid positions (j = 0, padding, a real token whose predecessor is padding) are exactly 0.
    m = np.asarray(mask)
    valid = np.zeros((N, S), bool)
    valid[:, 1:] = (m[:, 1:] > 0) & (m[:, :-1] > 0)
    assert np.all(np.asarray(lp)[~valid] == 0) and np.all(np.asarray(ent)[~valid] == 0)
    assert np.all(np.asarray(lp)[valid] < 0)


def test_temperature_divides_and_greedy_is_one(setup):
    model, ids, mask, logits, _ = setup
    assert effective_temperature(0.0) == 1.0 and effective_temperature(0.5) == 0.5
    with pytest.raises(ValueError, match="temperature"):
        effective_temperature(-1.0)
    # Scoring at T equals scoring the hand-scaled logits at T = 1: the division is by T, not by anything else.
    lp_t, _ = _hand(logits, np.asarray(ids), np.asarray(mask), 2.0)
    lp_scaled, _ = _hand(logits / 2.0, np.asarray(ids), np.asarray(mask), 1.0)
    np.testing.assert_allclose(lp_t, lp_scaled, atol=1e-12)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(model, ids, mask, chunk_size=0)


def test_chunked_equals_full_values_and_grads(setup):
    """chunk_size=4 over S - 1 = 9 positions (a ragged last chunk): same logprobs, entropy and parameter grads."""
    model, ids, mask, _, _ = setup
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def objective(p, chunk):
        m = nnx.merge(graphdef, p, rest)
        lp, ent, _ = token_logprobs(m, ids, mask, temperature=0.8, return_entropy=True, chunk_size=chunk)
        return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)

    (v_full, (lp_full, ent_full)), g_full = jax.jit(jax.value_and_grad(lambda p: objective(p, None), has_aux=True))(
        params)
    (v_chunk, (lp_chunk, ent_chunk)), g_chunk = jax.jit(jax.value_and_grad(lambda p: objective(p, 4), has_aux=True))(
        params)
    np.testing.assert_allclose(np.asarray(lp_chunk), np.asarray(lp_full), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent_chunk), np.asarray(ent_full), atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(v_chunk), float(v_full), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_full))
