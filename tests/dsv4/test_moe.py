"""The decode-time routed-expert implementations of `dsv4.moe` equal the stock ragged one (fp32 <= 1e-5; bf16
within bf16 rounding), for few and many tokens, with all tokens on one expert and with repeated picks; the
size-based choice of `routed_experts_small_batch`; the sampler's default dispatch on CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import moe

E, I, D, K, LIMIT = 16, 24, 32, 2, 7.0


def _inputs(t, *, seed=0, same_expert=False, dtype=jnp.float32):
    rs = np.random.RandomState(seed)
    x = jnp.asarray(rs.randn(t, D), jnp.float32)
    if same_expert:
        ids = np.tile(np.array([[3, 11]]), (t, 1))
    else:
        ids = np.stack([rs.permutation(E)[:K] for _ in range(t)])
    w = jnp.asarray(rs.rand(t, K) + 0.1, jnp.float32)
    w1, w3 = (jnp.asarray(rs.randn(E, I, D) / np.sqrt(D), dtype) for _ in range(2))
    w2 = jnp.asarray(rs.randn(E, D, I) / np.sqrt(I), dtype)
    return x, jnp.asarray(ids, jnp.int32), w, w1, w3, w2


def _run(fn, args, dtype):
    return np.asarray(jax.jit(functools.partial(fn, limit=LIMIT, dtype=dtype))(*args))


@pytest.mark.parametrize("fn", [moe.routed_experts_dense, moe.routed_experts_gathered,
                                moe.routed_experts_small_batch])
@pytest.mark.parametrize("t,same", [(1, False), (3, False), (8, False), (8, True), (40, False)])
def test_matches_ragged_fp32(fn, t, same):
    args = _inputs(t, seed=t, same_expert=same)
    ref = _run(moe.routed_experts_ragged, args, jnp.float32)
    out = _run(fn, args, jnp.float32)
    assert out.shape == (t, D) and out.dtype == np.float32
    assert np.abs(ref).max() > 0.1  # not a trivially zero comparison
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", [moe.routed_experts_dense, moe.routed_experts_gathered])
def test_matches_ragged_bf16(fn):
    args = _inputs(8, seed=1, dtype=jnp.bfloat16)
    ref = _run(moe.routed_experts_ragged, args, jnp.bfloat16)
    out = _run(fn, args, jnp.bfloat16)
    # both round the swiglu hidden to bf16 before w2; accumulation order differs
    np.testing.assert_allclose(out, ref, atol=3e-2 * np.abs(ref).max())


def test_small_batch_choice(monkeypatch):
    """T k <= E/4 -> gathered, <= 4E -> dense, else ragged (static shapes only)."""
    called = []
    for name in ("routed_experts_gathered", "routed_experts_dense", "routed_experts_ragged"):
        orig = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _n=name, _o=orig, **k: (called.append(_n), _o(*a, **k))[1])
    for t, want in ((1, "routed_experts_gathered"), (2, "routed_experts_gathered"), (3, "routed_experts_dense"),
                    (32, "routed_experts_dense"), (33, "routed_experts_ragged")):
        called.clear()
        moe.routed_experts_small_batch(*_inputs(t), limit=LIMIT, dtype=jnp.float32)
        assert called == [want], (t, called)


def test_sampler_default_dispatch_on_cpu():
    from flax import nnx

    from dsv4 import DSV4Config, DSV4ForCausalLM
    from rl.sampler import Sampler

    model = DSV4ForCausalLM(DSV4Config.tiny(), rngs=nnx.Rngs(0))
    assert Sampler(model, max_prompt_len=16).dispatch_fn is moe.routed_experts_small_batch
    custom = functools.partial(moe.routed_experts_ragged)
    assert Sampler(model, max_prompt_len=16, dispatch_fn=custom).dispatch_fn is custom
