"""Chunked prefill: a prompt's forward runs `chunk` tokens at a time against the decode cache built so far.

`prefill_chunked` returns what `dsv4.cache.prefill` returns (logits at each row's last prompt token, prompt
routing, decode caches) but its temporaries are bounded by one chunk, not by the prompt: per chunk and layer,
  - the chunk's queries attend (memory-linear `dsv4.blocked.attend_blocked`) over [the last window of raw K=V
    read back from the cache's ring buffer | the chunk's own K=V | the compressed entries completed so far,
    the chunk's included];
  - the compressors pool the chunk's windows, CSA's first one with the previous window kept in the cache
    (`pa`/`pz`, exactly the decode cache's meaning), and write the entries into the cache;
  - the CSA indexer scores the chunk's queries against every indexer key in the cache (top-k per query);
  - the cache's ring buffer and window states advance to each row's progress min(length, chunk end).
A row's positions are 0..P-1 from its first real token (right-padded rows, as `prefill`); rows that ended in an
earlier chunk are left unchanged. The loop runs only as many chunks as the longest row needs (`lax.while_loop`).

Constraint: `chunk` is a multiple of every compression ratio (so no compressor window straddles two chunks);
with `chunk` also a multiple of the attention's `block_q`, the query blocks sit where the whole-prompt blocked
path puts them. Same math as the whole-prompt path; results agree to float rounding (XLA:CPU's GEMMs round a
chunk's rows differently from a whole prompt's; tests/dsv4/test_chunked.py).
Sources: chunked prefill as in vLLM / SGLang (prompt split into chunks that attend to the KV cache of the earlier
ones); the cache layout and its math are dsv4/cache.py's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsv4.blocked import FAR, attend_blocked
from dsv4.cache import (LayerCache, cache_shapes, encode_entries, gather_rows, index_keys, layer_attentions, prefill,
                        read_entries, run_blocks)
from dsv4.compressor import visible_entries, window_pool
from dsv4.config import CSA, HCA


def chunk_multiple(config) -> int:
    """The granularity a prefill chunk must be a multiple of: the lcm of the non-zero compression ratios."""
    ratios = [int(r) for r in config.compress_ratios if r]
    if any(config.layer_kind(i) == CSA for i in range(config.num_hidden_layers)):
        ratios.append(int(config.csa_compress_ratio))
    return math.lcm(*ratios) if ratios else 1


def check_chunk(config, chunk: int, flag: str = "--prefill-chunk") -> int:
    """`chunk` (0 = whole prompt) validated against `config`; ValueError (one line naming `flag`) otherwise."""
    m = chunk_multiple(config)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0 or chunk % m:
        raise ValueError(f"{flag} {chunk!r}: expected 0 (whole prompt) or a positive multiple of {m} (the lcm of "
                         f"the compression ratios)")
    return chunk


def _advance_window(c: LayerCache, a, z, s, c_len: int, m: int, progress, active, keys) -> None:
    """Window state after the chunk: `cur` = the row's incomplete window at its progress, `prev` = the window
    before it (only where those windows lie in this chunk; earlier chunks wrote them otherwise)."""
    ka, kz, kpa, kpz = keys
    cw = (progress // m) * m  # [B] start of the current window
    idx = (cw - s)[:, None] + jnp.arange(m)[None]
    take_cur = (active & (cw < s + c_len))[:, None, None]
    take_prev = (active & (cw - m >= s))[:, None, None]
    c[ka] = jnp.where(take_cur, gather_rows(a, idx), c[ka])
    c[kz] = jnp.where(take_cur, gather_rows(z, idx), c[kz])
    c[kpa] = jnp.where(take_prev, gather_rows(a, idx - m), c[kpa])
    c[kpz] = jnp.where(take_prev, gather_rows(z, idx - m), c[kpz])


def _compress_chunk(comp, x, s, c: LayerCache, progress, active, keys):
    """Entries of the chunk's windows (x [B, C, D], C a multiple of m, s the chunk start) written into the cache
    at s/m; window state advanced. Returns the cache dict (modified in place)."""
    ka, kz, kpa, kpz, kent = keys
    b, c_len, _ = x.shape
    m = comp.ratio
    a, z = comp.project(x)
    z = z + jnp.tile(comp.ape[...].astype(jnp.float32), (c_len // m, 1))
    width = a.shape[-1]
    prev_z = jnp.where(s == 0, -jnp.inf, c[kpz])  # window 0 has no previous window
    pooled = window_pool(a.reshape(b, c_len // m, m, width), z.reshape(b, c_len // m, m, width),
                         overlap=comp.overlap, d=comp.d, prev_a=c[kpa], prev_z=prev_z)
    entries = comp.finish(pooled, jnp.full((b,), s // m, jnp.int32))
    for k, v in encode_entries(c, kent, entries).items():  # dense, or the FP8 parts (dsv4.cache's layout)
        c[k] = jax.lax.dynamic_update_slice_in_dim(c[k], v, s // m, 1)
    _advance_window(c, a, z, s, c_len, m, progress, active, (ka, kz, kpa, kpz))
    return c


def _select_chunk(ix, x, q_latent, positions, cos, sin, keys: tuple, qb: int, attn):
    """CSA top-k of the chunk's queries over every indexer key in the cache (keys: `dsv4.cache.index_keys`); as
    `Indexer.select_blocked` -> (idx [B, C, k] int32, valid [B, C, k] bool), k = min(index_topk, N); attn: the
    layer, whose FP8 dots and kernels `Indexer.scores` follows."""
    b, c_len, _ = x.shape
    n = keys[0].shape[1]
    k = min(ix.topk, n)
    if k == n:
        return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, c_len, k)), visible_entries(positions, k, ix.ratio)
    nq = c_len // qb

    def blocks(t):
        return t.reshape(b, nq, qb, *t.shape[2:]).swapaxes(0, 1)

    def one(blk):
        xb, qlb, pb, cb, sb = blk
        q, omega = ix.queries(xb, qlb, cb, sb)
        sc = ix.scores(q, omega, *keys, fp8=attn.fp8_dots, kernel=attn.kernel_matmul)
        return ix.top_entries(sc, visible_entries(pb, n, ix.ratio))

    idx, valid = jax.lax.map(one, tuple(map(blocks, (x, q_latent, positions, cos, sin))))
    unblock = lambda t: t.swapaxes(0, 1).reshape(b, c_len, k)  # noqa: E731
    return unblock(idx), unblock(valid)


def chunk_attention(attn, x: jax.Array, s: jax.Array, lengths: jax.Array, cache: LayerCache):
    """One layer's attention for a chunk: x [B, C, D] normalised block input at positions s..s+C-1, against
    `cache` (the state after positions < s). Returns (out [B, C, D], cache advanced to min(lengths, s + C))."""
    b, c_len, _ = x.shape
    c = dict(cache)
    positions = jnp.broadcast_to(s + jnp.arange(c_len, dtype=jnp.int32)[None], (b, c_len))
    cos, sin = attn.rope(positions)
    q, q_latent = attn.query(x, cos, sin)
    kv = attn.key_value(x, cos, sin)
    w = attn.window
    qb = math.gcd(attn.block_q, c_len)  # query blocks tile the chunk (= block_q when it divides the chunk)
    n_pre = -(-(w - 1) // qb) * qb  # earlier keys a chunk query can see, in whole query blocks
    pp = s - n_pre + jnp.arange(n_pre, dtype=jnp.int32)  # their positions
    slot = jnp.mod(pp, w)
    pre_kv = read_entries(c, "kv", kv.dtype)[:, slot]  # dequantised when the cache is FP8
    pre_pos = jnp.where((c["pos"][:, slot] == pp[None]) & (pp[None] >= 0), pp[None], -FAR)  # not in the ring: masked
    progress = jnp.clip(lengths, s, s + c_len)
    active = lengths > s
    # ring buffer: the last W positions < progress (`build_layer_cache`'s formula), where they lie in this chunk
    last = (progress - 1)[:, None]
    p_j = last - jnp.mod(last - jnp.arange(w)[None], w)
    take = active[:, None] & (p_j >= s)
    for k, v in encode_entries(c, "kv", gather_rows(kv, p_j - s)).items():
        c[k] = jnp.where(take[..., None], v, c[k])
    c["pos"] = jnp.where(take, p_j, c["pos"]).astype(jnp.int32)
    entries = selected = None
    if attn.kind in (CSA, HCA):
        _compress_chunk(attn.compressor, x, s, c, progress, active, ("ca", "cz", "pa", "pz", "comp"))
        entries = read_entries(c, "comp", kv.dtype)
        if attn.kind == CSA:
            ix = attn.indexer
            _compress_chunk(ix.compressor, x, s, c, progress, active, ("ia", "iz", "ipa", "ipz", "ik"))
            idx, valid = _select_chunk(ix, x, q_latent, positions, cos, sin, index_keys(c), qb, attn)
            selected = (jnp.concatenate([jnp.zeros((b, n_pre, idx.shape[-1]), idx.dtype), idx], axis=1),
                        jnp.concatenate([jnp.zeros((b, n_pre, idx.shape[-1]), bool), valid], axis=1))
    q_ext = jnp.concatenate([jnp.zeros((b, n_pre) + q.shape[2:], q.dtype), q], axis=1)
    o = attend_blocked(q_ext, jnp.concatenate([pre_kv, kv], axis=1),
                       jnp.concatenate([jnp.broadcast_to(pre_pos, (b, n_pre)), positions], axis=1),
                       attn.attn_sink[...], attn.head_dim ** -0.5, window=w, entries=entries, ratio=attn.ratio,
                       selected=selected, block_q=qb, block_k=attn.block_k)[:, n_pre:]
    return attn.output(o, cos, sin), c


def prefill_chunked(model, ids: jax.Array, lengths: jax.Array, cache_len: int, chunk: int, dispatch_fn=None,
                    layer_fn=None, kv_fp8: str | None = None, tail: int = 0):
    """`dsv4.cache.prefill` in chunks of `chunk` tokens (see the module docstring); the same contract.

    ids [B, P] int32 right-padded (row b real at [0, lengths[b])), lengths [B] int32 >= 1, cache_len >= P + max
    new tokens, chunk: 0 or >= P = one whole-prompt `prefill`; else a multiple of `chunk_multiple(config)`.
    Returns (logits [B, V] float32 at each row's last real token, routing [B, P, L, k] int32 (-1 past a row's
    length), caches list[L] of `cache_len` positions).
    kv_fp8: the cache layout as `dsv4.cache.prefill` (None, or "e4m3fn" | "e4m3fnuz": FP8 entries). With the FP8
    cache a chunk reads the earlier chunks' keys and entries back dequantised, as decoding does, while its own
    keys stay unquantised, so chunked and whole-prompt prefills then differ by the FP8 rounding of earlier keys.
    tail: as `dsv4.cache.prefill` (also return the final streams [B, T, n, D] of the last T real positions).
    Raises ValueError: `chunk` not a multiple of the compression ratios.
    """
    cfg = model.config
    b, p = ids.shape
    if chunk <= 0 or chunk >= p:
        return prefill(model, ids, lengths, cache_len, dispatch_fn=dispatch_fn, layer_fn=layer_fn, kv_fp8=kv_fp8,
                       tail=tail)
    check_chunk(cfg, chunk)
    n_chunks = -(-p // chunk)
    p_pad = n_chunks * chunk
    ids = jnp.pad(ids, ((0, 0), (0, p_pad - p)))
    work_len = max(cache_len, p_pad)  # every chunk's entries fit; trimmed to cache_len at the end
    n_l, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    x0 = jnp.zeros((b, chunk, cfg.hc_mult, cfg.hidden_size), jnp.float32)
    attns = layer_attentions(model, layer_fn, x0)  # static layout only (unused weights are dropped by XLA)
    caches = [cache_shapes(a, b, work_len, a.dtype, kv_fp8) for a in attns]
    seen = {}

    def body(carry):
        i, caches, routing, last, tl = carry
        s = i * chunk
        ids_c = jax.lax.dynamic_slice_in_dim(ids, s, chunk, 1)
        x = jnp.broadcast_to(model.embed_tokens(ids_c)[:, :, None, :], (b, chunk, cfg.hc_mult, cfg.hidden_size))
        x, routes, new = run_blocks(model, x, ids_c,
                                    lambda li, attn, h: chunk_attention(attn, h, s, lengths, caches[li]),
                                    layer_fn=layer_fn, dispatch_fn=dispatch_fn)
        seen["dtype"] = x.dtype
        routing = jax.lax.dynamic_update_slice_in_dim(routing, routes.astype(jnp.int32), s, 1)
        j = lengths - 1 - s
        here = jnp.take_along_axis(x, jnp.clip(j, 0, chunk - 1)[:, None, None, None], axis=1)[:, 0]
        last = jnp.where(((j >= 0) & (j < chunk))[:, None, None], here.astype(jnp.float32), last)
        if tail:  # the last `tail` real positions that lie in this chunk
            jt = lengths[:, None] - tail + jnp.arange(tail)[None] - s
            got = jnp.take_along_axis(x, jnp.clip(jt, 0, chunk - 1)[:, :, None, None], axis=1)
            tl = jnp.where(((jt >= 0) & (jt < chunk))[:, :, None, None], got.astype(jnp.float32), tl)
        return i + 1, new, routing, last, tl

    carry = (jnp.int32(0), caches, jnp.full((b, p_pad, n_l, k), -1, jnp.int32),
             jnp.zeros((b, cfg.hc_mult, cfg.hidden_size), jnp.float32),
             jnp.zeros((b, max(tail, 1), cfg.hc_mult, cfg.hidden_size), jnp.float32))
    _, caches, routing, last, tl = jax.lax.while_loop(lambda c: c[0] * chunk < jnp.max(lengths), body, carry)
    logits = model.lm_head(model.collapse(last.astype(seen["dtype"])))  # exact: x's dtype round-trips via f32
    real = jnp.arange(p)[None] < lengths[:, None]
    routing = jnp.where(real[:, :, None, None], routing[:, :p], -1)
    out = []
    for a, c in zip(attns, caches):
        c = dict(c)
        for key in ("comp", "ik"):
            if key in c:
                m = a.ratio if key == "comp" else a.indexer.compressor.ratio
                for part in (key, key + "_scale", key + "_rope"):  # the FP8 layout's parts too
                    if part in c:
                        c[part] = c[part][:, :cache_len // m]
        out.append(c)
    if tail:
        return logits, routing, out, tl.astype(seen["dtype"])
    return logits, routing, out


__all__ = ["check_chunk", "chunk_attention", "chunk_multiple", "prefill_chunked"]
