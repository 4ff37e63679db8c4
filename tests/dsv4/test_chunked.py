"""Chunked prefill (dsv4/chunked.py) == whole-prompt prefill: logits, routing, decode caches and the decode steps
that follow, for prompt lengths that are not multiples of the chunk, the window or the compression ratios."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from dsv4.cache import decode_step, prefill
from dsv4.chunked import check_chunk, chunk_multiple, prefill_chunked
from dsv4.model import Block
from randomize import randomize

CFG = DSV4Config.tiny()  # window 8, CSA m=4 (top-3), HCA m=8
LENS = np.array([37, 5, 21, 1, 11], np.int32)  # right-padded rows of a 37-token bucket
CACHE_LEN = 64


def _valid_cache_parts(c, lens, cfg_ratio):
    """The parts of a layer cache a decode step can read (ring slots holding a position, complete entries)."""
    out = {"kv": np.where(np.asarray(c["pos"])[..., None] >= 0, np.asarray(c["kv"]), 0), "pos": np.asarray(c["pos"])}
    if "comp" in c:
        n = np.asarray(lens) // cfg_ratio
        out["comp"] = np.where(np.arange(c["comp"].shape[1])[None, :, None] < n[:, None, None], np.asarray(c["comp"]), 0)
    return out


@pytest.mark.parametrize("chunk", [8, 24])
def test_chunked_prefill_equals_whole_prompt(chunk, monkeypatch):
    steps, real = [], Block.step  # every path runs its layers through the one Block.step (counted at trace time)
    monkeypatch.setattr(Block, "step", lambda self, *a, **kw: steps.append(type(self).__name__) or real(self, *a, **kw))
    model = randomize(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), attn_block_q=8), seed=1, scale=0.1)
    rs = np.random.RandomState(0)
    p = int(LENS.max())
    ids = jnp.asarray(np.where(np.arange(p)[None] < LENS[:, None], rs.randint(3, CFG.vocab_size, (len(LENS), p)), 0),
                      jnp.int32)
    lens = jnp.asarray(LENS)
    ref = nnx.jit(lambda m, i, n: prefill(m, i, n, CACHE_LEN))(model, ids, lens)
    out = nnx.jit(lambda m, i, n: prefill_chunked(m, i, n, CACHE_LEN, chunk))(model, ids, lens)
    # XLA:CPU's GEMMs round a chunk's rows differently from a whole prompt's: equal to float rounding (~4e-6 on
    # logits of magnitude 3), routing exact
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
    assert np.abs(np.asarray(ref[0])).max() > 1.0
    for i, (a, b) in enumerate(zip(ref[2], out[2])):
        assert jnp.asarray(a["kv"]).shape == jnp.asarray(b["kv"]).shape
        ratio = CFG.compress_ratios[i]
        va, vb = _valid_cache_parts(a, LENS, ratio), _valid_cache_parts(b, LENS, ratio)
        np.testing.assert_array_equal(va["pos"], vb["pos"])
        for k in va:
            np.testing.assert_allclose(vb[k], va[k], atol=1e-5, rtol=0, err_msg=f"layer {i} {k}")
    step = nnx.jit(lambda m, tok, t, c: decode_step(m, tok, t, c))
    ca, cb, t = ref[2], out[2], LENS.copy()
    for g in range(12):  # across window and compression boundaries
        tok = jnp.asarray(rs.randint(3, CFG.vocab_size, len(LENS)), jnp.int32)
        la, ra, ca = step(model, tok, jnp.asarray(t), ca)
        lb, rb, cb = step(model, tok, jnp.asarray(t), cb)
        np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(rb), np.asarray(ra))
        t = t + 1
    assert steps == ["Block"] * (3 * CFG.num_hidden_layers)  # prefill, chunked prefill, decode


def test_chunk_checks():
    assert chunk_multiple(CFG) == 8
    assert check_chunk(CFG, 0) == 0 and check_chunk(CFG, 16) == 16
    with pytest.raises(ValueError, match=r"--prefill-chunk 12: expected 0 .* multiple of 8"):
        check_chunk(CFG, 12)
    from rl.config.run import RunConfig
    assert RunConfig().rollout.prefill_chunk == 2048
    assert RunConfig(**{"rollout.prefill_chunk": 256}).rollout.prefill_chunk == 256
    with pytest.raises(ValueError, match="--rollout.prefill_chunk"):
        RunConfig(**{"rollout.prefill_chunk": -1})


def test_chunked_prefill_with_the_fp8_cache():
    """With the FP8 KV cache (dsv4.cache's layout) the chunked prefill writes every cache part in that layout and
    its chunks read the earlier chunks' keys back dequantised, as decoding does: logits within the FP8 cache's own
    effect of the whole-prompt FP8 prefill (which attends to unquantised keys); the first layer's routing of the
    first chunk (before any cache read) exact."""
    model = DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), attn_block_q=8)
    rs = np.random.RandomState(0)
    p = int(LENS.max())
    ids = jnp.asarray(np.where(np.arange(p)[None] < LENS[:, None], rs.randint(3, CFG.vocab_size, (len(LENS), p)), 0),
                      jnp.int32)
    lens = jnp.asarray(LENS)
    ref = nnx.jit(lambda m, i, n: prefill(m, i, n, CACHE_LEN, kv_fp8="e4m3fn"))(model, ids, lens)
    out = nnx.jit(lambda m, i, n: prefill_chunked(m, i, n, CACHE_LEN, 8, kv_fp8="e4m3fn"))(model, ids, lens)
    for a, b in zip(ref[2], out[2]):
        assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
        assert b["kv"].dtype == jnp.float8_e4m3fn and b["kv_scale"].dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(out[1])[:, :8, 0], np.asarray(ref[1])[:, :8, 0])  # before any cache read
    lp = lambda x: np.asarray(jax.nn.log_softmax(x, -1))  # noqa: E731
    diff = np.abs(lp(out[0]) - lp(ref[0]))
    print("fp8 chunked vs whole: max", diff.max(), "mean", diff.mean())
    assert diff.max() < 0.1 and diff.mean() < 0.01
