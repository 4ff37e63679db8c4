"""The memory-linear (blocked) attention equals the dense reference: forward and gradients, every layer kind.

Tiny config (sliding window 8, CSA m=4 with top-3 of the indexer, HCA m=8), random non-trivial weights. Block
sizes are chosen small (queries 16, HCA entries 2 per online-softmax step) so that S = 37 / 70 spans several
query blocks and key blocks, none of the sizes divides S, and S = 3 is shorter than every compression ratio.
Each case is one jitted function computing both paths (few compiles). The indexer's discrete top-k selection is
checked to be identical (not only close). Run: .venv/bin/python -m pytest -q tests/dsv4/test_blocked.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config
from dsv4.model import remat_policy
from randomize import random_model

TOL = 1e-5
BLOCK_Q, BLOCK_K = 16, 2


@pytest.fixture(scope="module")
def cfg():
    return DSV4Config.tiny()


@pytest.fixture(scope="module")
def model(cfg):
    return random_model(cfg, seed=0)


def _attn_pair(model, layer):
    """(dense, blocked) copies of one layer's attention module."""
    out = []
    for impl in ("dense", "blocked"):
        m = nnx.clone(model).set_options(attention_impl=impl, attn_block_q=BLOCK_Q, attn_block_k=BLOCK_K)
        out.append(m.layers[layer].attn)
    return out


def _max_rel(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(1.0, float(np.abs(np.asarray(y)).max())))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("layer,kind", [(0, "sliding"), (1, "csa"), (2, "hca")])
@pytest.mark.parametrize("s", [37, 3, 70])
def test_blocked_equals_dense_forward_and_grads(cfg, model, layer, kind, s):
    assert cfg.layer_kind(layer) == kind
    dense, blocked = _attn_pair(model, layer)
    rs = np.random.RandomState(s + layer)
    x = jnp.asarray(rs.randn(2, s, cfg.hidden_size), jnp.float32)
    ct = jnp.asarray(rs.randn(2, s, cfg.hidden_size), jnp.float32)  # random output cotangent
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
    gd_d, st_d = nnx.split(dense)
    gd_b, st_b = nnx.split(blocked)

    def loss(gd, st, x):
        return jnp.sum(nnx.merge(gd, st)(x, pos) * ct)

    @jax.jit
    def both(st_d, st_b, x):
        out = []
        for gd, st in ((gd_d, st_d), (gd_b, st_b)):
            y = nnx.merge(gd, st)(x, pos)
            g = jax.grad(loss, argnums=(1, 2))(gd, st, x)
            out.append((y, g))
        return out

    (yd, gd), (yb, gb) = both(st_d, st_b, x)
    assert np.abs(np.asarray(yd)).max() > 0.1
    assert _max_rel(yb, yd) <= TOL, f"forward {kind} S={s}: {_max_rel(yb, yd):.2e}"
    assert _max_rel(gb, gd) <= TOL, f"grads {kind} S={s}: {_max_rel(gb, gd):.2e}"
    g_sink = np.asarray(gd[0]["attn_sink"][...])
    assert np.abs(g_sink).max() > 0  # the sink term really takes part in both paths


@pytest.mark.parametrize("s", [37, 70])
def test_indexer_selection_identical(cfg, model, s):
    """The blocked indexer selects exactly the entries of the dense mask (a discrete choice: no tolerance)."""
    attn = model.layers[1].attn
    ix = attn.indexer
    rs = np.random.RandomState(s)
    x = jnp.asarray(rs.randn(2, s, cfg.hidden_size), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))

    @jax.jit
    def both(x):
        cos, sin = attn.rope(pos)
        _, ql = attn.query(x, cos, sin)
        dense = ix.full(x, ql, pos, cos, sin)[0]
        (idx, valid), _ = ix.select_blocked(x, ql, pos, cos, sin, block_q=BLOCK_Q)
        return dense, idx, valid

    dense, idx, valid = map(np.asarray, both(x))
    rebuilt = np.zeros(dense.shape, bool)
    b_, s_, k_ = np.nonzero(valid)
    rebuilt[b_, s_, idx[b_, s_, k_]] = True
    np.testing.assert_array_equal(rebuilt, dense)
    assert dense.sum(-1).max() == cfg.index_topk and dense.shape[-1] > cfg.index_topk  # a real choice


def test_model_blocked_equals_dense_with_left_padding(cfg, model):
    """Whole model, left-padded rows, logits and every parameter's gradient of a token loss: blocked == dense.

    End to end (4 layers, random weights std 0.15, logits up to ~5) fp32 rounding is amplified as in
    test_model.py's padding tests (PAD_ATOL 2e-5 there); each attention call is checked at 1e-5 above."""
    s = 40
    rs = np.random.RandomState(3)
    ids = jnp.asarray(rs.randint(0, cfg.vocab_size, (3, s)), jnp.int32)
    mask = np.ones((3, s), np.int32)
    mask[1, :11] = 0
    mask[2, :33] = 0  # 7 real tokens: shorter than the HCA ratio 8 (no HCA entry), one CSA entry
    mask = jnp.asarray(mask)
    pair = [nnx.split(nnx.clone(model).set_options(attention_impl=impl, attn_block_q=BLOCK_Q, attn_block_k=BLOCK_K),
                      nnx.Param, ...) for impl in ("dense", "blocked")]

    def loss(params, gd, rest):
        lg = nnx.merge(gd, params, rest)(ids, attention_mask=mask).logits
        lp = jax.nn.log_softmax(lg, -1)
        return jnp.sum(jnp.where(mask[:, :, None] > 0, lp, 0.0)[..., 0]), lg

    @jax.jit
    def both(st_d, st_b):
        return [jax.grad(loss, has_aux=True)(st, gd, rest) for st, (gd, _, rest) in zip((st_d, st_b), pair)]

    (g_d, lg_d), (g_b, lg_b) = both(pair[0][1], pair[1][1])
    real = np.asarray(mask) > 0
    assert np.abs(np.asarray(lg_b)[real] - np.asarray(lg_d)[real]).max() <= 2e-5
    assert _max_rel(g_b, g_d) <= 2e-5


def test_remat_policies_give_the_same_gradients():
    """`--remat block|dots` change what the backward keeps, not the gradient (vs `none`). Two layers (CSA, HCA;
    the sliding kind is the CSA layer minus its compressed part), one compile for the three policies."""
    cfg = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8, 0))
    model = random_model(cfg, seed=2)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 24)), jnp.int32)
    runs = [nnx.split(nnx.clone(model).set_options(remat=r), nnx.Param, ...) for r in ("none", "block", "dots")]

    def loss(params, gd, rest):
        return jnp.mean(jax.nn.log_softmax(nnx.merge(gd, params, rest)(ids).logits, -1)[..., 1])

    @jax.jit
    def grads(states):
        return [jax.grad(loss)(st, gd, rest) for st, (gd, _, rest) in zip(states, runs)]

    g_none, g_block, g_dots = grads([p for _, p, _ in runs])
    assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(g_none)) > 1e-3
    assert _max_rel(g_block, g_none) <= 1e-6
    assert _max_rel(g_dots, g_none) <= 1e-6


def test_unknown_options_are_one_line_errors(model):
    from rl.config.algo import LearnerConfig
    from rl.config.run import RunConfig

    for make in (remat_policy, lambda r: LearnerConfig(remat=r), lambda r: RunConfig(**{"learner.remat": r})):
        with pytest.raises(ValueError, match=r"^--remat must be one of block\|dots\|none, got 'full'$"):
            make("full")
    assert LearnerConfig().remat == RunConfig().learner.remat == "block"
    with pytest.raises(ValueError, match="attention_impl"):
        nnx.clone(model).set_options(attention_impl="flash")
