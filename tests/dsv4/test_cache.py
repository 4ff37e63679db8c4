"""Cached decode (prefill + one token per step) equals the full forward at every position (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from dsv4.cache import decode_step, prefill
from dsv4.model import Block
from randomize import randomize


def test_cached_decode_equals_full_forward_across_window_and_compression_boundaries(monkeypatch):
    cfg = DSV4Config.tiny()  # window 8, CSA m=4 (top-3 of the entries), HCA m=8
    steps, real = [], Block.step  # every path runs its layers through the one Block.step (counted at trace time)
    monkeypatch.setattr(Block, "step", lambda self, *a, **kw: steps.append(type(self).__name__) or real(self, *a, **kw))
    model = randomize(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0)), seed=1, scale=0.1)
    b, s, p_bucket, cache_len = 3, 43, 16, 48
    rs = np.random.RandomState(0)
    ids = jnp.asarray(rs.randint(0, cfg.vocab_size, (b, s)), jnp.int32)
    full = nnx.jit(lambda m, i: m(i))(model, ids)  # jitted: op by op the full forward costs more than its compile
    full_logits, full_routing = np.asarray(full.logits), np.asarray(full.routing)
    lens = np.array([5, 13, 1], np.int32)  # not multiples of 4 or 8; one single-token prompt
    prompt = jnp.where(jnp.arange(p_bucket)[None] < lens[:, None], ids[:, :p_bucket], 0)

    pf = nnx.jit(lambda m, i, n: prefill(m, i, n, cache_len))
    step = nnx.jit(lambda m, tok, t, c: decode_step(m, tok, t, c))
    logits, routing, caches = pf(model, prompt, jnp.asarray(lens))
    rows = np.arange(b)
    errs = [np.abs(np.asarray(logits) - full_logits[rows, lens - 1]).max()]
    np.testing.assert_array_equal(np.asarray(routing)[0, :5], full_routing[0, :5])
    t = lens.copy()
    route_mismatch = 0
    for _ in range(s - int(lens.max())):
        logits, r, caches = step(model, ids[rows, t], jnp.asarray(t), caches)
        errs.append(np.abs(np.asarray(logits) - full_logits[rows, t]).max())
        route_mismatch += int((np.asarray(r) != full_routing[rows, t]).sum())
        t = t + 1
    assert max(errs) <= 1e-5, f"max |delta logits| {max(errs):.2e}"
    assert route_mismatch == 0
    assert np.abs(full_logits).max() > 1.0  # not a vacuous comparison
    assert steps == ["Block"] * (3 * cfg.num_hidden_layers)  # full forward, prefill, decode: each layer one Block.step

