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
FP8 layout (`cache_shapes(..., fp8="e4m3fn" | "e4m3fnuz")`, the rollout engine's FP8 KV layout; spec §5.7-5.8,
the release's own cache): the ring `kv` and the compressed entries `comp` hold their d - r no-RoPE dims as FP8
with one power-of-two (ue8m0) scale per `KV_FP8_BLOCK` = 64 dims, stored as its exponent byte (`<name>_scale`
[.., (d - r) / 64] uint8, 2^(b - 127)), and their r = qk_rope_head_dim RoPE dims in bf16 (`<name>_rope`): 583 B
per 512-dim entry instead of 1,024 (DeepSeek's kernels pad it to 584). The indexer keys `ik` are FP8 with one
ue8m0 scale per key (`ik_scale` [.., 1]; DeepSeek-V3.2's indexer cache: 128 FP8 + one scale). Compressor window
states stay float32 (the release keeps them f32). Scales: s = 2^ceil(log2(amax / fmax)), v -> fp8(v / s), read
back as fp8 * s in the compute dtype inside the attention / indexer of the decode step (`read_entries`).
Rows are independent: each has its own position t_b (prompts are right-padded; a row's cache never holds
another row's tokens, and garbage written at positions >= its length is overwritten before it becomes visible).

An entry is emitted when (t+1) mod m == 0, pooled from the window state and (CSA) the previous window, then
normalised and rotated at position w m: the same math as the full-sequence path, so cached decode equals the
full forward at every position (tests/dsv4/test_cache.py). Sources: official `Compressor` decode path and
`Attention` kv_cache layout; HF `DeepseekV4HCACache` / `DeepseekV4CSACache`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dsv4.attention import Attention, attend
from dsv4.compressor import Compressor, window_pool
from dsv4.config import CSA, HCA
from dsv4.decode_kernel import fp8_decode_attention, kernel_fits

LayerCache = dict
KV_FP8_BLOCK = 64  # dims per ue8m0 scale of the ring / compressed entries (spec §5.8)
KV_FP8_FORMATS = {"e4m3fn": jnp.float8_e4m3fn, "e4m3fnuz": jnp.float8_e4m3fnuz}
_ROPE_DTYPE = jnp.bfloat16  # the RoPE dims of FP8 entries (the release keeps them bf16)


def _fp8_encode(x: jax.Array, fp8_dtype, block: int) -> tuple[jax.Array, jax.Array]:
    """x [..., n] float -> (q [..., n] fp8_dtype, e [..., n / block] uint8 ue8m0 exponent bytes).

    Per block of `block` dims: s = 2^ceil(log2(amax / fmax)) (s = 1 for an all-zero block), q = fp8(x / s)
    (saturating; x / s is exact, a power-of-two division). Byte b = log2(s) + 127, clamped to [1, 254]."""
    fmax = float(jnp.finfo(fp8_dtype).max)
    n = x.shape[-1]
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    mant, ex = jnp.frexp(amax / fmax)
    e = jnp.where(amax > 0, jnp.where(mant == 0.5, ex - 1, ex), 0)
    e = jnp.clip(e, -126, 127).astype(jnp.int32)
    q = jnp.clip(xb / jnp.ldexp(jnp.float32(1), e)[..., None], -fmax, fmax).astype(fp8_dtype)
    return q.reshape(x.shape), (e + 127).astype(jnp.uint8)


def _ue8m0(e: jax.Array) -> jax.Array:
    """Stored exponent bytes e (uint8) -> the scales 2^(e - 127), float32."""
    return jnp.ldexp(jnp.float32(1), e.astype(jnp.int32) - 127)


def _fp8_decode(q: jax.Array, e: jax.Array, dtype) -> jax.Array:
    """(q [..., n] fp8, e [..., n / block] uint8) -> q * 2^(e - 127) [..., n] in `dtype` (exact in float32)."""
    nb = e.shape[-1]
    qb = q.astype(jnp.float32).reshape(*q.shape[:-1], nb, q.shape[-1] // nb)
    return (qb * _ue8m0(e)[..., None]).reshape(q.shape).astype(dtype)


def _entry_zeros(name: str, prefix: tuple, d: int, dtype, fp8: str | None, rope: int) -> LayerCache:
    """Zeroed storage of `name` ([*prefix, d] dense in `dtype`, or the FP8 parts: `rope` = dims kept in bf16
    (0 = the whole vector FP8 under one scale, the indexer keys))."""
    if fp8 is None:
        return {name: jnp.zeros((*prefix, d), dtype)}
    nq = d - rope
    block = math.gcd(KV_FP8_BLOCK, nq) if rope else nq
    out = {name: jnp.zeros((*prefix, nq), KV_FP8_FORMATS[fp8]),
           name + "_scale": jnp.full((*prefix, nq // block), 127, jnp.uint8)}
    if rope:
        out[name + "_rope"] = jnp.zeros((*prefix, rope), _ROPE_DTYPE)
    return out


def encode_entries(c: LayerCache, name: str, x: jax.Array) -> LayerCache:
    """Vectors x [..., d] -> {part: array} in the storage layout of `name` in cache c (dense or FP8 parts)."""
    if name + "_scale" not in c:
        return {name: x.astype(c[name].dtype)}
    nq, nb = c[name].shape[-1], c[name + "_scale"].shape[-1]
    q, e = _fp8_encode(x[..., :nq], c[name].dtype, nq // nb)
    out = {name: q, name + "_scale": e}
    if name + "_rope" in c:
        out[name + "_rope"] = x[..., nq:].astype(c[name + "_rope"].dtype)
    return out


def read_entries(c: LayerCache, name: str, dtype) -> jax.Array:
    """The vectors of `name` ("kv", "comp", "ik") of cache c as [B, N, d] in `dtype`, dequantised when FP8."""
    if name + "_scale" not in c:
        return c[name].astype(dtype)
    x = _fp8_decode(c[name], c[name + "_scale"], dtype)
    if name + "_rope" in c:
        x = jnp.concatenate([x, c[name + "_rope"].astype(dtype)], axis=-1)
    return x


def index_keys(c: LayerCache) -> tuple[jax.Array, jax.Array | None]:
    """The indexer keys of cache c as `Indexer.scores` takes them: (keys [B, N, d_I] float32, None), or in the FP8
    layout the stored bytes and their per-vector scales (q [B, N, d_I] fp8, 2^(e - 127) [B, N] float32), applied
    after the dot (no f32 copy of the keys: 478 -> 188 MiB per CSA layer of the seed's decode step, H200 spec)."""
    if "ik_scale" not in c:
        return c["ik"].astype(jnp.float32), None
    return c["ik"], _ue8m0(c["ik_scale"][..., 0])


def is_fp8(c: LayerCache) -> bool:
    """Whether a layer cache uses the FP8 layout."""
    return "kv_scale" in c


def _set_rows(buf: jax.Array, idx: jax.Array, val: jax.Array) -> jax.Array:
    """buf [B, N, ...], idx [B] int, val [B, ...] -> buf with buf[b, idx[b]] = val[b]."""
    return jax.vmap(lambda c, i, v: jax.lax.dynamic_update_slice_in_dim(c, v[None].astype(c.dtype), i, 0))(
        buf, idx, val)


def gather_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
    """buf [B, N, ...], idx [B, M] int -> [B, M, ...] (indices clipped into range)."""
    idx = jnp.clip(idx, 0, buf.shape[1] - 1)
    return jax.vmap(lambda c, i: c[i])(buf, idx)


def cache_shapes(attn: Attention, batch: int, cache_len: int, dtype, fp8: str | None = None) -> LayerCache:
    """Zero-initialised cache of one layer (`pos` = -1). cache_len bounds positions: t < cache_len.

    dtype: the ring and compressed entries when unquantised (the compute dtype; indexer keys float32).
    fp8: None, or "e4m3fn" | "e4m3fnuz": the FP8 layout of the module docstring (ring, entries, indexer keys).
    Raises KeyError for another fp8 name."""
    w, d = attn.window, attn.head_dim
    rope = 2 * len(attn.inv_freq)
    c = {**_entry_zeros("kv", (batch, w), d, dtype, fp8, rope), "pos": jnp.full((batch, w), -1, jnp.int32)}
    if attn.kind in (CSA, HCA):
        comp: Compressor = attn.compressor
        m, width = comp.ratio, (2 if comp.overlap else 1) * comp.d
        c.update(_entry_zeros("comp", (batch, cache_len // m), d, dtype, fp8, rope))
        for k in ("ca", "cz", "pa", "pz"):
            c[k] = jnp.zeros((batch, m, width), jnp.float32)
    if attn.kind == CSA:
        ic: Compressor = attn.indexer.compressor
        c.update(_entry_zeros("ik", (batch, cache_len // ic.ratio), ic.d, jnp.float32, fp8, 0))
        for k in ("ia", "iz", "ipa", "ipz"):
            c[k] = jnp.zeros((batch, ic.ratio, 2 * ic.d), jnp.float32)
    return c


def build_layer_cache(attn: Attention, aux: dict, lengths: jax.Array, cache_len: int,
                      fp8: str | None = None) -> LayerCache:
    """Cache after a prefill of right-padded rows. aux: `Attention(..., return_aux=True)` tensors over P tokens;
    lengths [B] int32 real prompt lengths (1 <= len <= P); fp8: the cache layout (`cache_shapes`)."""
    kv = aux["kv"]
    b, p = kv.shape[:2]
    c = cache_shapes(attn, b, cache_len, kv.dtype, fp8)
    w = attn.window
    j = jnp.arange(w)[None]
    last = lengths[:, None] - 1
    p_j = last - jnp.mod(last - j, w)  # position held by ring slot j: p = j (mod W), p in [len - W, len)
    c.update(encode_entries(c, "kv", gather_rows(kv, p_j)))
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
    for k, v in encode_entries(c, kent, entries).items():
        c[k] = jax.lax.dynamic_update_slice_in_dim(c[k], v, 0, 1)
    cur = ((lengths // m) * m)[:, None] + jnp.arange(m)[None]  # positions of the current (incomplete) window
    c[ka], c[kz] = gather_rows(a, cur), gather_rows(z, cur)
    c[kpa], c[kpz] = gather_rows(a, cur - m), gather_rows(z, cur - m)


def _compress_step(comp: Compressor, x: jax.Array, t: jax.Array, c: LayerCache, keys) -> None:
    """Absorb token t (x [B, 1, D]) into the window state; emit entry w = (t+1)/m - 1 where complete."""
    a, z = comp.project(x)
    absorb(comp, a[:, 0], z[:, 0], t, c, keys)


def absorb(comp: Compressor, a: jax.Array, z: jax.Array, t: jax.Array, c: LayerCache, keys,
           live: jax.Array | None = None) -> None:
    """The window-state update of one token per row from its projections (`Compressor.project`): a, z [B, c d]
    float32 (z without ape) at positions t [B]; rows with live [B] False are left unchanged (None = all live).
    Writes the current window slot t mod m, and where (t+1) mod m == 0 the entry w = (t+1)/m - 1 and the previous
    window. Modifies c in place (`keys` = its (a, z, prev a, prev z, entries) names)."""
    ka, kz, kpa, kpz, kent = keys
    m = comp.ratio
    z = z + comp.ape[...].astype(jnp.float32)[t % m]
    slot = t % m
    if live is not None:
        a = jnp.where(live[:, None], a, gather_rows(c[ka], slot[:, None])[:, 0])
        z = jnp.where(live[:, None], z, gather_rows(c[kz], slot[:, None])[:, 0])
    c[ka] = _set_rows(c[ka], slot, a)
    c[kz] = _set_rows(c[kz], slot, z)
    complete = (t + 1) % m == 0
    if live is not None:
        complete = complete & live
    w = (t + 1) // m - 1
    pz = jnp.where((w <= 0)[:, None, None], -jnp.inf, c[kpz])  # window 0 has no previous window
    pooled = window_pool(c[ka][:, None], c[kz][:, None], overlap=comp.overlap, d=comp.d, prev_a=c[kpa], prev_z=pz)
    entry = comp.finish(pooled, jnp.maximum(w, 0))[:, 0]  # [B, d]
    wi = jnp.clip(w, 0, c[kent].shape[1] - 1)
    for k, v in encode_entries(c, kent, entry).items():
        old = gather_rows(c[k], wi[:, None])[:, 0]
        c[k] = _set_rows(c[k], wi, jnp.where(complete[:, None], v, old))
    c[kpa] = jnp.where(complete[:, None, None], c[ka], c[kpa])
    c[kpz] = jnp.where(complete[:, None, None], c[kz], c[kpz])


def _decode_kernel(attn: Attention, c: LayerCache) -> str | None:
    """How the decode step's attention over the FP8 cache c runs as one kernel (`dsv4.decode_kernel`): the layer's
    kernel matmul ("pallas" | "interpret", `Attention.kernel_matmul`) where its tiles fit; None: XLA's path."""
    if not is_fp8(c) or attn.kernel_matmul is None:
        return None
    nq, nb = c["kv"].shape[-1], c["kv_scale"].shape[-1]
    return attn.kernel_matmul if kernel_fits(attn.n_heads, nq // nb, attn.head_dim - nq) else None


def decode_attention(attn: Attention, x: jax.Array, t: jax.Array, cache: LayerCache):
    """One token per row: x [B, 1, D] normalised block input at positions t [B] -> (out [B, 1, D], cache)."""
    c = dict(cache)
    cos, sin = attn.rope(t[:, None])  # [B, 1, r/2]
    q, q_latent = attn.query(x, cos, sin)
    kv = attn.key_value(x, cos, sin)
    w = attn.window
    for k, v in encode_entries(c, "kv", kv[:, 0]).items():
        c[k] = _set_rows(c[k], t % w, v)
    c["pos"] = _set_rows(c["pos"], t % w, t)
    tt = t[:, None]
    mask = (c["pos"] >= 0) & (c["pos"] <= tt) & (tt - c["pos"] < w)  # [B, W]
    stores = [c]  # the stores of the entries attention reads: the ring, then the compressed entries
    if attn.kind in (CSA, HCA):
        _compress_step(attn.compressor, x, t, c, ("ca", "cz", "pa", "pz", "comp"))
        n_c = c["comp"].shape[1]
        vis = jnp.arange(n_c)[None] < ((t + 1) // attn.ratio)[:, None]  # [B, Wc]
        entries = c  # the compressed entries attention reads: all of them, or the indexer's top k
        if attn.kind == CSA:
            ix = attn.indexer
            _compress_step(ix.compressor, x, t, c, ("ia", "iz", "ipa", "ipz", "ik"))
            qi, omega = ix.queries(x, q_latent, cos, sin)
            sc = ix.scores(qi, omega, *index_keys(c), fp8=attn.fp8_dots, kernel=attn.kernel_matmul)  # [B, 1, Wc]
            if ix.topk < n_c:  # read only the k picked rows (4.5x fewer at Flash's 9,216 tokens), not all masked
                idx, vis = ix.top_entries(sc[:, 0], vis)  # [B, k]
                entries = {k: gather_rows(v, idx) for k, v in c.items() if k.split("_")[0] == "comp"}
        stores.append(entries)
        mask = jnp.concatenate([mask, vis], axis=-1)
    names = ("kv", "comp")[:len(stores)]
    scale, sink = attn.head_dim ** -0.5, attn.attn_sink[...]
    mode = _decode_kernel(attn, c)
    if mode is not None:  # the stored entries, read once
        kq, ks, kr = (jnp.concatenate(parts, axis=1) for parts in zip(*(
            (e[n], _ue8m0(e[n + "_scale"]), e[n + "_rope"]) for e, n in zip(stores, names))))
        o = fp8_decode_attention(q[:, 0], kq, ks, kr, mask, sink, scale, interpret=mode == "interpret")[:, None]
    else:  # dequantised on read (FP8 layout)
        keys = jnp.concatenate([read_entries(e, n, kv.dtype) for e, n in zip(stores, names)], axis=1)
        o = attend(q, keys, mask[:, None, :], sink, scale)
    return attn.output(o, cos, sin), c


# ------------------------------------------------------------------------------------------ model level

def _layers(model, layer_fn):
    """(i, x) -> (layer i, x): `layer_fn` when given, else `model.layers[i]` with x unchanged."""
    return layer_fn if layer_fn is not None else (lambda i, x: (model.layers[i], x))


def run_blocks(model, x: jax.Array, token_ids: jax.Array, attend, *, layer_fn=None, dispatch_fn=None,
               routing_replay: jax.Array | None = None, n_layers: int | None = None):
    """The main layers of the cached paths (prefill, decode, chunked prefill, speculative verify), each through
    `Block.step` with this path's attention.

    x [B, S, n, D] streams; token_ids [B, S] int32. attend: (i, attn, h [B, S, D]) -> (out [B, S, D], state) for
    layer i (its cache read / write; `Block.step`'s `attend` with i bound). layer_fn: optional (i, x) -> (Block, x)
    giving main layer i (the sampler builds layer i there, e.g. dequantising its weights once x is known; then
    `model.layers` is not read; `rl.rollout.layerwise.LayerwiseWeights`). routing_replay: [B, S, L, k] int32 expert
    ids to force (None = route freely). n_layers: how many layers (default: the config's).
    Returns (x' [B, S, n, D], routing [B, S, L, k] int32, [state of each layer])."""
    get = _layers(model, layer_fn)
    routes, states = [], []
    for i in range(model.config.num_hidden_layers if n_layers is None else n_layers):
        blk, x = get(i, x)
        forced = None if routing_replay is None else routing_replay[:, :, i]
        x, r, state, _ = blk.step(x, token_ids, functools.partial(attend, i), forced, dispatch_fn)
        routes.append(r)
        states.append(state)
    return x, jnp.stack(routes, axis=2), states


def layer_attentions(model, layer_fn, x: jax.Array) -> list:
    """The attention module of every main layer (`run_blocks`'s layer_fn or `model.layers`), for the static cache
    layout; x: any streams [B, S, n, D] to hand layer_fn."""
    get = _layers(model, layer_fn)
    return [get(i, x)[0].attn for i in range(model.config.num_hidden_layers)]


def prefill(model, ids: jax.Array, lengths: jax.Array, cache_len: int, routing_replay: jax.Array | None = None,
            dispatch_fn=None, layer_fn=None, kv_fp8: str | None = None, tail: int = 0):
    """Full forward over right-padded prompts and the decode caches.

    ids [B, P] int32 (row b real at [0, lengths[b])), lengths [B] int32 >= 1, cache_len >= P + max new tokens.
    layer_fn: optional (i, x) -> (Block, x) giving main layer i (then `model.layers` is not read; see
    `rl.rollout.layerwise.LayerwiseWeights`). kv_fp8: None (unquantised caches in the compute dtype) or the FP8
    cache layout "e4m3fn" | "e4m3fnuz" (`cache_shapes`; `decode_step` reads the layout from the caches).
    tail: 0, or T >= 1: also return the final residual streams of each row's last T real positions
    (speculative decoding's MTP block starts from them; rl/speculative.py).
    Returns (logits [B, V] float32 at each row's last real token,
    routing [B, P, L, k] int32, caches list[L]) and, with `tail`, streams [B, T, n, D] of positions
    lengths - T .. lengths - 1 (entries at negative positions are garbage).
    """
    cfg = model.config
    b, p = ids.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
    x = jnp.broadcast_to(model.embed_tokens(ids)[:, :, None, :], (b, p, cfg.hc_mult, cfg.hidden_size))

    def attend(i, attn, h):
        a, aux = attn(h, positions, return_aux=True)
        return a, build_layer_cache(attn, aux, lengths, cache_len, kv_fp8)

    x, routing, caches = run_blocks(model, x, ids, attend, layer_fn=layer_fn, dispatch_fn=dispatch_fn,
                                    routing_replay=routing_replay)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None, None], axis=1)[:, 0]  # [B, n, D]
    logits = model.lm_head(model.collapse(last))
    real = jnp.arange(p)[None] < lengths[:, None]
    routing = jnp.where(real[:, :, None, None], routing, -1)
    if tail:
        idx = jnp.clip(lengths[:, None] - tail + jnp.arange(tail)[None], 0, p - 1)
        return logits, routing, caches, jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
    return logits, routing, caches


def decode_step(model, tokens: jax.Array, t: jax.Array, caches: list, dispatch_fn=None, layer_fn=None):
    """Feed one token per row: tokens [B] int32 at positions t [B] -> (logits [B, V] f32, routing [B, L, k], caches).
    layer_fn: as in `prefill`."""
    cfg = model.config
    b = tokens.shape[0]
    ids = tokens[:, None]
    x = jnp.broadcast_to(model.embed_tokens(ids)[:, :, None, :], (b, 1, cfg.hc_mult, cfg.hidden_size))
    x, routing, new_caches = run_blocks(model, x, ids, lambda i, attn, h: decode_attention(attn, h, t, caches[i]),
                                        layer_fn=layer_fn, dispatch_fn=dispatch_fn, n_layers=len(caches))
    logits = model.lm_head(model.collapse(x[:, 0]))
    return logits, routing[:, 0], new_caches


def teacher_forced_logprobs(model, ids: jax.Array, lengths: jax.Array, n_new: int, cache_len: int, *,
                            kv_fp8: str | None = None) -> jax.Array:
    """Log-probs of given responses through the decode path (prefill + one token per step), e.g. to measure the
    FP8 cache's effect on the same tokens (tests/rl/test_kv_cache_fp8.py, benchmarks/kv_cache.py).

    ids [B, S] int32: row b = prompt ids[b, :L_b] then its response ids[b, L_b : L_b + n_new] (the rest padding;
    S - n_new >= every L_b); lengths [B] int32 = L_b >= 1; cache_len >= L_b + n_new; kv_fp8 as `prefill`.
    Returns [B, n_new] float32: log softmax(logits)[next token] at temperature 1, the sampler's logprobs of
    those tokens. Traceable (call it under jit)."""
    b, s = ids.shape
    rows = jnp.arange(b)
    logits, _, caches = prefill(model, ids[:, :s - n_new], lengths, cache_len, kv_fp8=kv_fp8)

    def target_lp(lg, j):
        return jnp.take_along_axis(jax.nn.log_softmax(lg.astype(jnp.float32), -1), ids[rows, j][:, None], -1)[:, 0]

    def body(c, i):
        pos = lengths + i
        lg, _, c = decode_step(model, ids[rows, pos], pos, c)
        return c, target_lp(lg, pos + 1)

    _, rest = jax.lax.scan(body, caches, jnp.arange(n_new - 1))
    return jnp.concatenate([target_lp(logits, lengths)[:, None], rest.T], axis=1)
