"""Multi-position decoding against the decode caches, for speculative decoding (rl/speculative.py): a verify
forward of S = k + 1 tokens per row that leaves the caches untouched, a commit of its first n positions, and the
MTP block (`mtp.0`) run incrementally as the draft model with its own sliding-window cache.

Exactness (why the caches end as plain decoding leaves them). `verify_forward` reads the caches and returns, per
layer, the S positions' pending state (raw K=V vectors, compressor projections A and Z) without writing anything;
`commit` then applies positions p0 .. p0 + n - 1 with the same per-token updates `dsv4.cache.decode_attention`
makes (ring slot t mod W, `dsv4.cache.absorb` for each compressor), so rejected positions never reach the caches:
no overwritten ring slot, no partial compression window or emitted entry from a rejected token has to be rolled
back, whatever the window (CSA ratio 4, HCA ratio 128, the indexer's). Inside the verify, query p0 + j sees
exactly the keys plain decoding shows it at that position:
  - the ring as committed (positions < p0) plus the block's own K=V at p0 .. p0 + j, under the window mask
    (a ring slot that plain decoding would already have overwritten at p0 + j holds a position >= W behind it,
    masked either way); with the FP8 cache the block's keys are FP8 round-tripped, as decoding reads its own key
    back from the FP8 ring;
  - the compressed entries of a working copy of the compressor states advanced token by token over the block
    (`absorb`), under the visibility w < floor((t+1)/m) of its own position (entries completed later in the block
    are invisible to it; the CSA indexer scores and selects per query over the same working keys).
Only the keys' order in the softmax and the GEMM shapes differ from one-token decoding, so logits agree to float
rounding (tests/rl/test_speculative.py compares greedy rollouts token for token with fp32 weights, and the verify's
logits with one-token decoding's on the FP8 rollout). The FP8 rollout quantises the same way on both paths (the
activations per token and 1 x 128 block, the cache per vector and 64 dims), but not bitwise: a GEMM's rows round
differently with its row count (B (k + 1) rows here, B in a decode step; XLA:CPU and GPU BLAS alike), and an FP8
rounding of an activation can turn that 1-ulp difference into a visible one, so a near-tied greedy argmax can flip
(`benchmarks/speculative.py --greedy-only` counts the rows; plain greedy at another batch shape differs likewise).

MTP (spec §7; DeepSeek-V3's convention): the block at position t reads the main model's final residual streams
h_t and the embedding of token t + 1 and predicts token t + 2; its cache is one sliding-window ring like a main
layer's (`mtp_cache`). Chained drafting feeds the block its own output streams as the next position's h.
Sources: speculative decoding (Leviathan et al. 2023; Chen et al. 2023), DeepSeek-V3 MTP as served by SGLang /
vLLM (one MTP layer reused for k steps); the cache math is dsv4/cache.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.attention import attend
from dsv4.cache import (LayerCache, absorb, cache_shapes, encode_entries, gather_rows, index_keys, read_entries,
                        run_blocks)
from dsv4.config import CSA, HCA

_COMP_KEYS = ("ca", "cz", "pa", "pz", "comp")
_IDX_KEYS = ("ia", "iz", "ipa", "ipz", "ik")


def verify_attention(attn, x: jax.Array, p0: jax.Array, cache: LayerCache, extra=None):
    """S tokens per row at positions p0 .. p0 + S - 1 against `cache` (not modified).

    x [B, S, D] normalised block input, p0 [B] int32. extra: optional (keys [B, E, d] in the compute dtype,
    positions [B, E] int32; < 0 = empty) of uncommitted earlier positions to attend to as well (sliding layers
    only: the chained MTP drafts). Returns (out [B, S, D], pending {kv [B, S, d], and per compressor (a, z)
    [B, S, c d] float32}) for `commit_layer`.
    """
    b, s, _ = x.shape
    pos = p0[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    cos, sin = attn.rope(pos)
    q, q_latent = attn.query(x, cos, sin)
    kv = attn.key_value(x, cos, sin)
    own = read_entries(encode_entries(cache, "kv", kv), "kv", kv.dtype)  # FP8 round trip when the cache is FP8
    keys = [read_entries(cache, "kv", kv.dtype), own]
    kpos = [cache["pos"], pos]
    if extra is not None:
        keys.insert(1, extra[0].astype(kv.dtype))
        kpos.insert(1, extra[1])
    keys, kpos = jnp.concatenate(keys, axis=1), jnp.concatenate(kpos, axis=1)
    tt, kp = pos[:, :, None], kpos[:, None, :]
    mask = (kp >= 0) & (kp <= tt) & (tt - kp < attn.window)  # [B, S, K]
    pending = {"kv": kv}
    if attn.kind in (CSA, HCA):
        work = dict(cache)
        pending["comp"] = _advance(attn.compressor, x, pos, work, _COMP_KEYS)
        n_c = work["comp"].shape[1]
        vis = jnp.arange(n_c)[None, None] < ((pos + 1) // attn.ratio)[:, :, None]  # [B, S, Wc]
        if attn.kind == CSA:
            ix = attn.indexer
            pending["index"] = _advance(ix.compressor, x, pos, work, _IDX_KEYS)
            qi, omega = ix.queries(x, q_latent, cos, sin)
            vis = ix.select(ix.scores(qi, omega, *index_keys(work), fp8=attn.fp8_dots, kernel=attn.kernel_matmul),
                             vis)
        keys = jnp.concatenate([keys, read_entries(work, "comp", keys.dtype)], axis=1)
        mask = jnp.concatenate([mask, vis], axis=-1)
    o = attend(q, keys, mask, attn.attn_sink[...], attn.head_dim ** -0.5)
    return attn.output(o, cos, sin), pending


def _advance(comp, x, pos, work: LayerCache, keys):
    """Absorb the S tokens one by one into the working copy `work` (modified); returns their (a, z)."""
    a, z = comp.project(x)
    for j in range(x.shape[1]):
        absorb(comp, a[:, j], z[:, j], pos[:, j], work, keys)
    return a, z


def commit_layer(attn, cache: LayerCache, pending: dict, p0: jax.Array, n: jax.Array) -> LayerCache:
    """The cache after feeding positions p0 .. p0 + n - 1 (n [B] int32 in [0, S]; per row) of a verify:
    ring slots and positions, then the compressors token by token (`dsv4.cache.absorb`)."""
    c = dict(cache)
    s = pending["kv"].shape[1]
    pos = p0[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    live = jnp.arange(s)[None] < n[:, None]
    ring_commit(c, pending["kv"], pos, live, attn.window)
    for name, keys in (("comp", _COMP_KEYS), ("index", _IDX_KEYS)):
        if name in pending:
            comp = attn.compressor if name == "comp" else attn.indexer.compressor
            a, z = pending[name]
            for j in range(s):
                absorb(comp, a[:, j], z[:, j], pos[:, j], c, keys, live[:, j])
    return c


def ring_commit(c: LayerCache, kv: jax.Array, pos: jax.Array, live: jax.Array, window: int) -> None:
    """Write K=V vectors kv [B, S, d] at positions pos [B, S] (S <= W consecutive per row) into the ring of c
    (in place) where live [B, S] (and pos >= 0)."""
    live = live & (pos >= 0)
    slot = jnp.mod(pos, window)
    scatter = jax.vmap(lambda buf, i, v: buf.at[i].set(v))
    for k, v in encode_entries(c, "kv", kv).items():
        old = gather_rows(c[k], slot)
        c[k] = scatter(c[k], slot, jnp.where(live.reshape(*live.shape, *(1,) * (v.ndim - 2)), v, old))
    c["pos"] = scatter(c["pos"], slot, jnp.where(live, pos, gather_rows(c["pos"], slot)))


def verify_forward(model, tokens: jax.Array, p0: jax.Array, caches: list, dispatch_fn=None, layer_fn=None):
    """Main-model forward of tokens [B, S] at positions p0 .. p0 + S - 1 against the caches (unchanged).

    Returns (logits [B, S, V] f32, routing [B, S, L, k] int32, final streams [B, S, n, D], pending) — the
    pending state (per layer its attention module and dict; use it in the same trace) goes to
    `commit`. layer_fn: as `dsv4.cache.prefill`.
    """
    cfg = model.config
    b, s = tokens.shape
    x = jnp.broadcast_to(model.embed_tokens(tokens)[:, :, None, :], (b, s, cfg.hc_mult, cfg.hidden_size))

    def attend(i, attn, h):
        out, pend = verify_attention(attn, h, p0, caches[i])
        return out, (attn, pend)

    x, routing, pending = run_blocks(model, x, tokens, attend, layer_fn=layer_fn, dispatch_fn=dispatch_fn,
                                     n_layers=len(caches))
    logits = model.lm_head(model.collapse(x))
    return logits, routing, x, pending


def commit(caches: list, pending, p0: jax.Array, n: jax.Array) -> list:
    """Caches after feeding the first n [B] positions of a `verify_forward` (its `pending`; see `commit_layer`)."""
    return [commit_layer(a, c, pend, p0, n) for (a, pend), c in zip(pending, caches)]


def mtp_cache(model, batch: int, dtype, kv_fp8: str | None = None) -> LayerCache:
    """Empty ring cache of the MTP block (a sliding layer): kv [B, W, d] (or its FP8 parts), pos [B, W] = -1."""
    attn = model.mtp[0].attn
    return cache_shapes(attn, batch, attn.window, dtype, kv_fp8)


def mtp_forward(model, h: jax.Array, next_tokens: jax.Array, p0: jax.Array, cache: LayerCache, extra=None,
                dispatch_fn=None):
    """The MTP block over S positions p0 .. p0 + S - 1 against its ring `cache` (not modified).

    h [B, S, n, D] main-model final streams at those positions (or, chained, the block's own output streams),
    next_tokens [B, S] the token at each position + 1; extra: uncommitted earlier entries as in
    `verify_attention`. Returns (logits [B, S, V] f32 for the tokens at position + 2, output streams [B, S, n, D],
    kv [B, S, d] of the positions, for `ring_commit` or as `extra`).
    """
    blk = model.mtp[0]
    xm = blk.inputs(model.embed_tokens(next_tokens), h)
    xm, _, pend, _ = blk.step(xm, next_tokens, lambda attn, y: verify_attention(attn, y, p0, cache, extra),
                           dispatch_fn=dispatch_fn)
    return model.lm_head(model.collapse(xm, owner=blk)), xm, pend["kv"]


__all__ = ["commit", "commit_layer", "mtp_cache", "mtp_forward", "ring_commit", "verify_attention",
           "verify_forward"]
