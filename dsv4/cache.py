"""Decode caches and incremental (one token per row) inference: prefill, then `decode_step` (spec §5.7).

Per layer the cache is a dict of fixed-size arrays (a pytree, donated between steps):
  kv  [B, W, d]       ring buffer of the last W = sliding_window raw K=V vectors (token p at slot p mod W)
  pos [B, W] int32    the position held by each ring slot (-1 = empty)
CSA / HCA layers add (m = compress ratio, Wc = cache_len // m, c = 2 for CSA else 1):
  comp [B, Wc, d]              compressed entries (entry w valid once w < floor((t+1)/m))
  ca, cz [B, m, c d] float32   projections A and gate logits Z + ape of the current (partial) window
  pa, pz [B, m, c d] float32   the previous complete window (CSA needs its first halves)
CSA layers add the indexer's own compressor state and keys:
  ik [B, Wc, d_I], ia, iz, ipa, ipz [B, m, 2 d_I] float32.
Rows are independent: each has its own position t_b (prompts are right-padded; a row's cache never holds
another row's tokens, and garbage written at positions >= its length is overwritten before it becomes visible).

An entry is emitted when (t+1) mod m == 0, pooled from the window state and (CSA) the previous window, then
normalised and rotated at position w m: the same math as the full-sequence path, so cached decode equals the
full forward at every position (tests/dsv4/test_cache.py). Sources: official `Compressor` decode path and
`Attention` kv_cache layout; HF `DeepseekV4HCACache` / `DeepseekV4CSACache`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.attention import Attention, attend
from dsv4.compressor import Compressor, window_pool
from dsv4.config import CSA, HCA
from dsv4.mhc import hc_post

LayerCache = dict


def _set_rows(buf: jax.Array, idx: jax.Array, val: jax.Array) -> jax.Array:
    """buf [B, N, ...], idx [B] int, val [B, ...] -> buf with buf[b, idx[b]] = val[b]."""
    return jax.vmap(lambda c, i, v: jax.lax.dynamic_update_slice_in_dim(c, v[None].astype(c.dtype), i, 0))(
        buf, idx, val)


def _gather_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
    """buf [B, N, ...], idx [B, M] int -> [B, M, ...] (indices clipped into range)."""
    idx = jnp.clip(idx, 0, buf.shape[1] - 1)
    return jax.vmap(lambda c, i: c[i])(buf, idx)


def cache_shapes(attn: Attention, batch: int, cache_len: int, dtype) -> LayerCache:
    """Zero-initialised cache of one layer (`pos` = -1). cache_len bounds positions: t < cache_len."""
    w, d = attn.window, attn.head_dim
    c = {"kv": jnp.zeros((batch, w, d), dtype), "pos": jnp.full((batch, w), -1, jnp.int32)}
    if attn.kind in (CSA, HCA):
        comp: Compressor = attn.compressor
        m, width = comp.ratio, (2 if comp.overlap else 1) * comp.d
        c["comp"] = jnp.zeros((batch, cache_len // m, d), dtype)
        for k in ("ca", "cz", "pa", "pz"):
            c[k] = jnp.zeros((batch, m, width), jnp.float32)
    if attn.kind == CSA:
        ic: Compressor = attn.indexer.compressor
        c["ik"] = jnp.zeros((batch, cache_len // ic.ratio, ic.d), jnp.float32)
        for k in ("ia", "iz", "ipa", "ipz"):
            c[k] = jnp.zeros((batch, ic.ratio, 2 * ic.d), jnp.float32)
    return c


def build_layer_cache(attn: Attention, aux: dict, lengths: jax.Array, cache_len: int) -> LayerCache:
    """Cache after a prefill of right-padded rows. aux: `Attention(..., return_aux=True)` tensors over P tokens;
    lengths [B] int32 real prompt lengths (1 <= len <= P)."""
    kv = aux["kv"]
    b, p = kv.shape[:2]
    c = cache_shapes(attn, b, cache_len, kv.dtype)
    w = attn.window
    j = jnp.arange(w)[None]
    last = lengths[:, None] - 1
    p_j = last - jnp.mod(last - j, w)  # position held by ring slot j: p = j (mod W), p in [len - W, len)
    c["kv"] = _gather_rows(kv, p_j)
    c["pos"] = jnp.where(p_j >= 0, p_j, -1).astype(jnp.int32)

    if attn.kind in (CSA, HCA):
        _fill(c, attn.compressor, aux["ca"], aux["cz"], aux["comp"], lengths, ("ca", "cz", "pa", "pz", "comp"))
    if attn.kind == CSA:
        _fill(c, attn.indexer.compressor, aux["ia"], aux["iz"], aux["ik"], lengths, ("ia", "iz", "ipa", "ipz", "ik"))
    return c


def _fill(c, comp: Compressor, a, z, entries, lengths, keys) -> None:
    """Compressor state after the prefill: entries, the current partial window and the previous window."""
    ka, kz, kpa, kpz, kent = keys
    m = comp.ratio
    c[kent] = jax.lax.dynamic_update_slice_in_dim(c[kent], entries.astype(c[kent].dtype), 0, 1)
    cur = ((lengths // m) * m)[:, None] + jnp.arange(m)[None]  # positions of the current (incomplete) window
    c[ka], c[kz] = _gather_rows(a, cur), _gather_rows(z, cur)
    c[kpa], c[kpz] = _gather_rows(a, cur - m), _gather_rows(z, cur - m)


def _compress_step(comp: Compressor, x: jax.Array, t: jax.Array, c: LayerCache, keys) -> None:
    """Absorb token t (x [B, 1, D]) into the window state; emit entry w = (t+1)/m - 1 where complete."""
    ka, kz, kpa, kpz, kent = keys
    m = comp.ratio
    a, z = comp.project(x)
    z = z[:, 0] + comp.ape[...].astype(jnp.float32)[t % m]
    slot = t % m
    c[ka] = _set_rows(c[ka], slot, a[:, 0])
    c[kz] = _set_rows(c[kz], slot, z)
    complete = (t + 1) % m == 0
    w = (t + 1) // m - 1
    pz = jnp.where((w <= 0)[:, None, None], -jnp.inf, c[kpz])  # window 0 has no previous window
    pooled = window_pool(c[ka][:, None], c[kz][:, None], overlap=comp.overlap, d=comp.d, prev_a=c[kpa], prev_z=pz)
    entry = comp.finish(pooled, jnp.maximum(w, 0))[:, 0]  # [B, d]
    wi = jnp.clip(w, 0, c[kent].shape[1] - 1)
    old = _gather_rows(c[kent], wi[:, None])[:, 0]
    c[kent] = _set_rows(c[kent], wi, jnp.where(complete[:, None], entry.astype(old.dtype), old))
    c[kpa] = jnp.where(complete[:, None, None], c[ka], c[kpa])
    c[kpz] = jnp.where(complete[:, None, None], c[kz], c[kpz])


def decode_attention(attn: Attention, x: jax.Array, t: jax.Array, cache: LayerCache):
    """One token per row: x [B, 1, D] normalised block input at positions t [B] -> (out [B, 1, D], cache)."""
    c = dict(cache)
    cos, sin = attn.rope(t[:, None])  # [B, 1, r/2]
    q, q_latent = attn.query(x, cos, sin)
    kv = attn.key_value(x, cos, sin)
    w = attn.window
    c["kv"] = _set_rows(c["kv"], t % w, kv[:, 0])
    c["pos"] = _set_rows(c["pos"], t % w, t)
    tt = t[:, None]
    mask = (c["pos"] >= 0) & (c["pos"] <= tt) & (tt - c["pos"] < w)  # [B, W]
    keys = c["kv"]
    if attn.kind in (CSA, HCA):
        _compress_step(attn.compressor, x, t, c, ("ca", "cz", "pa", "pz", "comp"))
        n_c = c["comp"].shape[1]
        vis = jnp.arange(n_c)[None] < ((t + 1) // attn.ratio)[:, None]  # [B, Wc]
        if attn.kind == CSA:
            ix = attn.indexer
            _compress_step(ix.compressor, x, t, c, ("ia", "iz", "ipa", "ipz", "ik"))
            qi, omega = ix.queries(x, q_latent, cos, sin)
            sc = ix.scores(qi, omega, c["ik"])  # [B, 1, Wc]
            vis = ix.select(sc, vis[:, None])[:, 0]
        keys = jnp.concatenate([keys, c["comp"].astype(keys.dtype)], axis=1)
        mask = jnp.concatenate([mask, vis], axis=-1)
    o = attend(q, keys, mask[:, None, :], attn.attn_sink[...], attn.head_dim ** -0.5)
    return attn.output(o, cos, sin), c


# ------------------------------------------------------------------------------------------ model level

def _layers(model, layer_fn):
    """(i, x) -> (layer i, x): `layer_fn` when given (the sampler builds layer i there, e.g. dequantising its
    weights once x is known), else `model.layers[i]` with x unchanged."""
    if layer_fn is not None:
        return layer_fn
    return lambda i, x: (model.layers[i], x)


def prefill(model, ids: jax.Array, lengths: jax.Array, cache_len: int, routing_replay: jax.Array | None = None,
            dispatch_fn=None, layer_fn=None):
    """Full forward over right-padded prompts and the decode caches.

    ids [B, P] int32 (row b real at [0, lengths[b])), lengths [B] int32 >= 1, cache_len >= P + max new tokens.
    layer_fn: optional (i, x) -> (Block, x) giving main layer i (then `model.layers` is not read; see
    `rl.rollout_weights.LayerwiseWeights`). Returns (logits [B, V] float32 at each row's last real token,
    routing [B, P, L, k] int32, caches list[L]).
    """
    cfg = model.config
    b, p = ids.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
    x = jnp.broadcast_to(model.embed_tokens(ids)[:, :, None, :], (b, p, cfg.hc_mult, cfg.hidden_size))
    caches, routes = [], []
    get = _layers(model, layer_fn)
    for i in range(cfg.num_hidden_layers):
        blk, x = get(i, x)
        y, post, comb = blk._pre(x, "attn")
        a, aux = blk.attn(blk.attn_norm(y), positions, return_aux=True)
        caches.append(build_layer_cache(blk.attn, aux, lengths, cache_len))
        x = hc_post(x, a, post, comb)
        y, post, comb = blk._pre(x, "ffn")
        forced = None if routing_replay is None else routing_replay[:, :, i]
        f, r = blk.ffn(blk.ffn_norm(y), ids, forced, dispatch_fn)
        x = hc_post(x, f, post, comb)
        routes.append(r)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None, None], axis=1)[:, 0]  # [B, n, D]
    logits = model.lm_head(model.collapse(last))
    real = jnp.arange(p)[None] < lengths[:, None]
    routing = jnp.where(real[:, :, None, None], jnp.stack(routes, axis=2), -1)
    return logits, routing, caches


def decode_step(model, tokens: jax.Array, t: jax.Array, caches: list, dispatch_fn=None, layer_fn=None):
    """Feed one token per row: tokens [B] int32 at positions t [B] -> (logits [B, V] f32, routing [B, L, k], caches).
    layer_fn: as in `prefill`."""
    cfg = model.config
    b = tokens.shape[0]
    ids = tokens[:, None]
    x = jnp.broadcast_to(model.embed_tokens(ids)[:, :, None, :], (b, 1, cfg.hc_mult, cfg.hidden_size))
    new_caches, routes = [], []
    get = _layers(model, layer_fn)
    for i, cache in enumerate(caches):
        blk, x = get(i, x)
        y, post, comb = blk._pre(x, "attn")
        a, cache = decode_attention(blk.attn, blk.attn_norm(y), t, cache)
        new_caches.append(cache)
        x = hc_post(x, a, post, comb)
        y, post, comb = blk._pre(x, "ffn")
        f, r = blk.ffn(blk.ffn_norm(y), ids, None, dispatch_fn)
        x = hc_post(x, f, post, comb)
        routes.append(r[:, 0])
    logits = model.lm_head(model.collapse(x[:, 0]))
    return logits, jnp.stack(routes, axis=1), new_caches
