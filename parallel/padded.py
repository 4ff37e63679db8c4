"""The padded expert dispatch (GShard/Switch-style per-expert buffers) of `parallel.expert.make_ep_dispatch`, one
rank's body: a fixed capacity (backend "padded") or one sized per call from the actual loads (backend "sized").

Each (token, pick) pair of a rank gets a slot in its global expert's buffer of C rows (first come, in (token, k)
order, after `merge_repeated_picks`); the [E, C, D] buffer is [ep, n_local, C, D], so one all_to_all over the expert
axis gives every rank its experts' rows from every source, [n_local, ep * C, D], run as three batched dense matmuls
(`padded_ffn`), and back. C = T_local holds every routing (a token sends an expert at most one row): dropless, but
E / k times the routed work (43x at Flash decode) and traffic.

Load-sized capacity ("sized", `sized_body`): the rank counts the rows each of its tokens sends to each expert, the
largest count over all experts and all token ranks (one scalar `pmax` over the token axes) picks the smallest of a
few compiled capacities that holds it (`capacity_buckets`: geometric, x `growth`, from the mean load
ceil(T_local k / E) up to T_local, or up to `padded_capacity(f_max)`), and `jax.lax.switch` runs the padded body
at that capacity. Every rank takes the same branch (the index is the global max), so the branches' all_to_alls
match. Top bucket T_local: nothing is ever dropped (equal to `dsv4.moe.routed_experts_ragged`); top bucket
f_max: pairs past it are dropped as in "padded" with that factor, and counted. A balanced call runs the bottom
bucket: C = the max load <= growth x the mean, so the expert matmuls run <= growth x the routed rows, and the
all_to_all moves that much too. Memory is the largest branch's, the dropless (or f_max) bound. Gradients: the
switch index is an integer from the (non-differentiable) ids; the backward pass re-runs the chosen branch's
transpose. `check_vma` holds: the index and the capacity are invariant over every mesh axis.

C is set by the busiest (source rank, expert) cell, so random routing still pads: at Flash decode (128 tokens
per rank, k = 6, E = 256, ep = 8; uniform random picks) the peak cell holds 9 rows against a mean of 3, C = 12,
4x the routed rows. `compact=True` (`make_ep_dispatch`) adds a second compaction after the all_to_all: each
local expert's real rows (sum over the ep sources, peak/mean 1.6 there) move to the front and the FFN runs on the
smallest of a second set of row counts that holds the busiest expert (a nested `lax.switch`): 2x the routed
rows there, at the price of more compiled branches (outer x inner) and the gathers; the all_to_all still moves C.

FP8 experts (the rollout's FP8 GEMMs, `parallel.expert.make_ep_dispatch` given kind 'fp8' `QuantizedTensor`s): each
token's row is quantised once per 1 x 128 block (`expert_rows`, the release's `act_quant`), the buffers and the
all_to_all carry the FP8 bytes and their [.., D / 128] f32 scales (about half the bf16 rows' bytes), and `padded_ffn`
multiplies FP8 by FP8 (`dsv4.fp8_gemm.fp8_expert_matmul`): no dequantised copy of the experts. Experts whose
`matmul` is a kernel mode (the GPU rollout's default) run the block-scaled GEMM kernel (`dsv4.fp8_kernel`: the
scales applied inside, no partial sums) at any row count. XLA's FP8 dots (`matmul` "fp8") run up to
`fp8_rows_limit` rows per local expert (`FP8_ROWS_MAX`, doubled for a bf16 compute dtype; a static choice per
compiled capacity; above it the rank's experts are dequantised, which moves fewer bytes than the FP8 GEMMs' K-block
partials). Each K block's partial sum leaves its GEMM in the compute dtype (bf16 on GPUs: half the bytes of f32;
one bf16 rounding per 128-wide block, ~ the rounding of the bf16 output itself) and is scaled and summed in f32.

Every body returns `DispatchStats` (local counts; `make_ep_dispatch` sums them over the token axes): the chosen
bucket and capacity, the pairs dropped and the pairs routed (rows after merging repeated picks; pad tokens and
skipped picks excluded), so callers can log `train/expert_drop_frac` = dropped / routed. Unused, XLA drops them.
Sources (ideas): DeepEP low-latency buffers (the T_local bound); GShard/Switch capacity; jax `lax.switch`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv4.fp8_gemm import dequantize_rows, fp8_expert_matmul, quantize_rows
from dsv4.layers import dot_out
from dsv4.moe import swiglu
from dsv4.quant import ACT_BLOCK, KERNEL_MATMULS, QuantizedTensor, act_fake_quant


class DispatchStats(NamedTuple):
    """What one EP dispatch call did (int32 scalars): `bucket` the index of the compiled capacity that ran (0 for a
    fixed one), `capacity` its rows per (source rank, expert) ("padded"/"sized"; the per-rank buffer for
    "capacity"/"ragged"), `dropped` the (token, expert) pairs past it, `routed` the pairs routed, `rows` the
    expert FFN's rows per local expert ("padded"/"sized": ep x capacity, or the compacted count; else
    `capacity`)."""
    bucket: jax.Array
    capacity: jax.Array
    dropped: jax.Array
    routed: jax.Array
    rows: jax.Array


def fp8_layout_ok(w1: QuantizedTensor, w2: QuantizedTensor, tp: int) -> bool:
    """Whether the padded bodies can run FP8 expert GEMMs on these weights split `tp` ways along I (the tensor axes):
    kind 'fp8' with 128-wide K blocks (the activations' block), and each rank's I slice a whole number of scale
    blocks (so its scales are a slice of the stored ones and its w2 input blocks are the release's)."""
    if w1.kind != "fp8" or w2.kind != "fp8" or w1.block[1] != ACT_BLOCK or w2.block[1] != ACT_BLOCK:
        return False
    i = w1.shape[1]
    return tp == 1 or (i % tp == 0 and (i // tp) % w1.block[0] == 0 and (i // tp) % ACT_BLOCK == 0)


def local_fp8(w: QuantizedTensor, d_axis: int, i_axis: int, emb_axes: tuple, mlp_axes: tuple) -> QuantizedTensor:
    """Inside the shard_map: one rank's FP8 expert weight from its local bytes (q [n, I', D] or [n, D, I'], D
    all-gathered over `emb_axes` as bytes) and its experts' scales (all blocks: sliced along `i_axis` to this
    rank's I' / block rows over `mlp_axes`). Needs `fp8_layout_ok`."""
    q, sc = w.q, w.scale
    if emb_axes:
        u8 = jax.lax.all_gather(jax.lax.bitcast_convert_type(q, jnp.uint8), emb_axes, axis=d_axis, tiled=True)
        q = jax.lax.bitcast_convert_type(u8, w.q.dtype)
    if mlp_axes:
        n = q.shape[i_axis] // (w.block[0] if i_axis == 1 else w.block[1])
        sc = jax.lax.dynamic_slice_in_dim(sc, jax.lax.axis_index(mlp_axes) * n, n, axis=i_axis)
    return dataclasses.replace(w, q=q, scale=sc, shape=q.shape)


def return_dtype(dtype, partial: bool):
    """Dtype of the expert outputs on the way back: `dtype` holds them exactly (the w2 dot rounds to it), except
    tensor-parallel partial sums, which stay float32 until the psum."""
    return jnp.float32 if partial else jnp.dtype(dtype)


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    """The sum of the entries before each one along `axis` (0 first): same shape and dtype as `x` (int counts ->
    each group's start offset)."""
    return jnp.cumsum(x, axis=axis) - x


def merge_repeated_picks(ids: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One pick per (token, expert): a repeated pick of an expert (hash routing's table may repeat one; top-k never
    does) adds its weight to the token's first pick of that expert and is skipped (id -1).

    ids [T, k] int32 (< 0 = skipped, left as is), w [T, k] float32 -> (ids, w) of the same shapes. Exact for the
    routed-expert sum: expert e's output is linear in its routing weight (w2 (SwiGLU(x) * g), `grouped_ffn`).
    """
    k = ids.shape[-1]
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)  # [T, k (pick j), k (pick i)]
    same = same | jnp.eye(k, dtype=bool)[None]  # a skipped pick is its own first
    first = jnp.argmax(same, axis=-1)  # [T, k] the first pick of pick j's expert (j itself if none earlier)
    is_first = first == jnp.arange(k)[None, :]
    merged = jnp.einsum("tj,tji->ti", w, jax.nn.one_hot(first, k, dtype=w.dtype))
    return jnp.where(is_first | (ids < 0), ids, -1), jnp.where(is_first, merged, 0.0).astype(w.dtype)


# Rows per local expert above which the padded FFN dequantises FP8 experts instead of running FP8 GEMMs, for 4-byte
# (f32) K-block partials; 2-byte ones (a bf16 compute dtype) double it (`fp8_rows_limit`). The FP8 GEMM writes and
# reads p-byte partials [n, R, O] per 128-wide K block: 2 p R O K / 128 = W p R / 64 bytes for W bytes of FP8
# weights, against 5 W for the dequant path (read W, write and read 2 W of bf16) less the W both read: FP8 moves
# fewer bytes while R <= 256 / p (XLA:GPU, H200 spec, f32 partials: 0.50x at R = 24, 0.80x at 48, 1.37x at 96; bf16
# partials: 0.51x at 48, 0.81x at 96; benchmarks/README.md "FP8 expert GEMMs").
FP8_ROWS_MAX = 64


def fp8_rows_limit(dtype, rows_max: int | None = FP8_ROWS_MAX) -> int | None:
    """The FP8 expert GEMMs' row limit for a compute `dtype` (whose itemsize the K-block partials take): `rows_max`
    for f32 partials, x 4 / itemsize otherwise (bf16: 2 x); None (no limit) stays None."""
    return None if rows_max is None else rows_max * 4 // jnp.dtype(dtype).itemsize


def padded_ffn(xs, gate_w: jax.Array, w1, w3, w2, *, limit: float, dtype, partial: bool = False,
               act_q=None, fp8_rows_max: int | None = FP8_ROWS_MAX) -> jax.Array:
    """Clamped-SwiGLU FFN of capacity-padded per-expert buffers as batched dense matmuls (no `ragged_dot`).

    xs [n, R, D] rows of each local expert (compute dtype; empty slots are zero rows with gate_w 0);
    gate_w [n, R] float32; w1, w3 [n, I', D]; w2 [n, D, I'] (I' may be a tensor-parallel slice: then `partial`).
    Returns [n, R, D] float32; empty slots are exactly 0 (their routing weight is 0). Same math as `grouped_ffn`.
    FP8 experts (w1, w3, w2 kind 'fp8' `QuantizedTensor`s, q [n, I', D] / [n, D, I'] with their local scales):
    xs is `Fp8Rows` (q [n, R, D] fp8, s [n, R, D / 128]) and, for R <= `fp8_rows_limit(dtype, fp8_rows_max)` (None:
    any R), the three products are FP8 GEMMs (`dsv4.fp8_gemm.fp8_expert_matmul`, K-block partials in `dtype`), the
    w2 input quantised per 1 x 128 as the release does (act_q unused); above it, the local experts are dequantised
    and the rows and the w2 input fake-quantised (`FP8_ROWS_MAX`: where that moves fewer bytes; the same products).
    Experts whose `matmul` is a kernel mode (`dsv4.quant.KERNEL_MATMULS`: the block-scaled GEMM kernel,
    `dsv4.fp8_kernel`) write no K-block partials, so they run FP8 GEMMs at any R (no row limit).
    """
    kernel = isinstance(w1, QuantizedTensor) and w1.matmul in KERNEL_MATMULS
    limit_rows = None if kernel else fp8_rows_limit(dtype, fp8_rows_max)
    if isinstance(w1, QuantizedTensor) and (limit_rows is None or gate_w.shape[1] <= limit_rows):
        # the dequant path's dots return `dtype`; so do the release's FP8 GEMMs (bf16 out); the K blocks' partial
        # sums too (the module docstring: half the bytes of f32 ones in bf16)
        pd = jnp.dtype(dtype)
        g = fp8_expert_matmul(xs, w1, pd, out_dtype=dtype)
        # w3's own copy of the row operand: XLA:GPU's dot merger would otherwise fuse each K block's w1 and w3 dots
        # into one GEMM on concat(w1, w3) slices, which it can no longer read in place (it copies both slices)
        u = fp8_expert_matmul(jax.lax.optimization_barrier(xs), w3, pd, out_dtype=dtype)
        h = (swiglu(g, u, limit) * gate_w[..., None]).astype(dtype)  # [n, R, I']
        y = fp8_expert_matmul(quantize_rows(h, w2.fmt), w2, pd)
        return (y if partial else y.astype(dtype)).astype(jnp.float32)
    if isinstance(w1, QuantizedTensor):  # many rows: the dequant path on this rank's experts
        xs, act_q = dequantize_rows(xs, dtype), act_fake_quant
        w1, w3, w2 = (v.dequantize(dtype) for v in (w1, w3, w2))
    bd = lambda c: ((c, ((0,), (0,))))  # noqa: E731  batch over the local expert dim
    g = jax.lax.dot_general(xs, w1.astype(dtype), bd(((2,), (2,))), preferred_element_type=dot_out(dtype))
    u = jax.lax.dot_general(xs, w3.astype(dtype), bd(((2,), (2,))), preferred_element_type=dot_out(dtype))
    h = (swiglu(g, u, limit) * gate_w[..., None]).astype(dtype)  # [n, R, I']
    h = h if act_q is None else act_q(h)
    y = jax.lax.dot_general(h, w2.astype(dtype), bd(((2,), (2,))),
                            preferred_element_type=jnp.float32 if partial else dot_out(dtype))
    return y.astype(jnp.float32)


def expert_rows(x: jax.Array, w1, dtype):
    """The rows the expert FFN reads: x [Tl, D] in `dtype`, or for FP8 experts (w1 a `QuantizedTensor`) x in
    `dtype` quantised per 1 x 128 to w1's fp8 format (`Fp8Rows`: q [Tl, D], s [Tl, D / 128]), so the buffers and
    the all_to_all carry FP8 rows."""
    x = x.astype(dtype)
    return quantize_rows(x, w1.fmt) if isinstance(w1, QuantizedTensor) else x


def all_to_all_rows(a: jax.Array, axis_name) -> jax.Array:
    """`jax.lax.all_to_all` over `axis_name` (split and concat axis 0, tiled) of any array; fp8 moves as its bytes."""
    a2a = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True)
    if jnp.dtype(a.dtype).itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(a2a(jax.lax.bitcast_convert_type(a, jnp.uint8)), a.dtype)
    return a2a(a)


def padded_capacity(t_local: int, k: int, n_experts: int, capacity_factor: float | None) -> int:
    """Rows per (source rank, expert) of the padded backend: ceil(f * T_local * k / E) (f = `capacity_factor`,
    the mean load of an expert times f, GShard/Switch), at most T_local; None = T_local (dropless: a token sends an
    expert at most one row once repeated picks are merged, `merge_repeated_picks`, so T_local rows hold every
    routing: DeepEP's low-latency buffer bound)."""
    if capacity_factor is None:
        return t_local
    return min(t_local, max(1, math.ceil(capacity_factor * t_local * k / n_experts)))


def capacity_buckets(t_local: int, k: int, n_experts: int, f_max: float | None = None,
                     growth: float = 2.0) -> tuple[int, ...]:
    """The compiled capacities of the "sized" backend, ascending: the mean load ceil(T_local k / E), then x `growth`
    each, up to the top `padded_capacity(t_local, k, n_experts, f_max)` (T_local = dropless when f_max is None).
    E.g. Flash decode, 128 tokens per rank, k = 6, E = 256: (3, 6, 12, 24, 48, 96, 128)."""
    if not growth > 1:
        raise ValueError(f"capacity bucket growth must be > 1, got {growth!r}")
    top = padded_capacity(t_local, k, n_experts, f_max)
    caps, c = [], max(1, math.ceil(t_local * k / n_experts))
    while c < top:
        caps.append(c)
        c = max(c + 1, math.ceil(c * growth))
    return (*caps, top)


def _slots(ids, w, n_exp):
    """Merged picks sorted by expert: (w [N], order [N] pair index, counts [E], starts [E]) of one rank."""
    ids, w = merge_repeated_picks(ids, w)  # <= one row per (token, expert): C = T_local is dropless
    flat = ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, n_exp)  # skipped pairs sort last, outside every expert
    counts = jnp.bincount(key, length=n_exp).astype(jnp.int32)  # [E]
    return w.reshape(-1), jnp.argsort(key, stable=True), counts, exclusive_cumsum(counts)


def _compact_ffn(xs, gw, valid, w1, w3, w2, *, rows, **ffn_kw):
    """`padded_ffn` of each expert's valid rows only, moved to the front and cut to `rows`: xs [n, R, D] (or
    `Fp8Rows`), gw [n, R], valid [n, R] bool (at most `rows` per expert) -> [n, R, D] in place, 0 elsewhere (invalid
    rows carry routing weight 0: their output is 0 either way), in `return_dtype` (exact: the dots round to it)."""
    out = return_dtype(ffn_kw["dtype"], ffn_kw["partial"])
    n, r = gw.shape
    if rows >= r:
        return padded_ffn(xs, gw, w1, w3, w2, **ffn_kw).astype(out)
    idx = jnp.argsort(~valid, axis=1, stable=True)[:, :rows]  # [n, rows]: the valid rows first
    y = padded_ffn(jax.tree.map(lambda a: jnp.take_along_axis(a, idx[..., None], axis=1), xs),
                   jnp.take_along_axis(gw, idx, axis=1), w1, w3, w2, **ffn_kw)
    return jnp.zeros((n, r, y.shape[-1]), out).at[jnp.arange(n)[:, None], idx].set(y.astype(out))


def _buffers_ffn(x, w, order, counts, starts, w1, w3, w2, *, k, ep, n_local, capacity, expert_axis, limit, dtype,
                 partial, act_q, inner=None, token_axes=()):
    """The padded body at one capacity: slots -> all_to_all -> `padded_ffn` -> all_to_all -> combine -> ([Tl, D]
    f32, the FFN's rows per local expert). `inner` (ascending row counts): after the all_to_all each local expert's
    valid rows are compacted and the FFN runs on the smallest of `inner` (capped at ep * C) holding the largest
    expert's rows over `token_axes` (`_compact_ffn`, a second `lax.switch`). x: `expert_rows` ([Tl, D] or `Fp8Rows`)."""
    t_loc, d = jax.tree.leaves(x)[0].shape
    n_exp = ep * n_local
    slot = jnp.arange(capacity)
    valid = slot[None, :] < jnp.minimum(counts, capacity)[:, None]  # [E, C]
    pair = order[jnp.clip(starts[:, None] + slot[None, :], 0, t_loc * k - 1)]  # [E, C]
    tok = pair // k
    send_x = jax.tree.map(lambda a: jnp.where(valid[..., None], a[tok], jnp.zeros((), a.dtype)).reshape(
        ep, n_local, capacity, a.shape[-1]), x)  # [ep, n_local, C, D] (and [..., D / 128] scales)
    send_w = jnp.where(valid, w[pair], 0.0).reshape(ep, n_local, capacity)
    if ep > 1:
        a2a = functools.partial(all_to_all_rows, axis_name=expert_axis)
        send_x, send_w = jax.tree.map(a2a, send_x), a2a(send_w)  # now [source rank, n_local, C, ...]
    xs = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(n_local, ep * capacity, a.shape[-1]), send_x)
    gw = jnp.swapaxes(send_w, 0, 1).reshape(n_local, ep * capacity)
    ffn_kw = dict(limit=limit, dtype=dtype, partial=partial, act_q=act_q)
    if inner is None:
        rows = jnp.int32(ep * capacity)
        y = padded_ffn(xs, gw, w1, w3, w2, **ffn_kw)
    else:
        got = jnp.minimum(counts, capacity).reshape(ep, n_local).astype(jnp.int32)  # rows sent per (dst, expert)
        got = a2a(got) if ep > 1 else got  # rows received per (source rank, local expert)
        held = jnp.swapaxes(slot[None, None, :] < got[:, :, None], 0, 1).reshape(n_local, ep * capacity)
        peak = jnp.max(jnp.sum(got, axis=0))
        if token_axes:
            peak = jax.lax.pmax(peak, token_axes)  # the same on every rank: every rank runs the same branch
        caps = tuple(c for c in inner if c < ep * capacity) + (ep * capacity,)
        j = jnp.minimum(jnp.sum(jnp.asarray(caps) < peak), len(caps) - 1).astype(jnp.int32)
        rows = jnp.asarray(caps, jnp.int32)[j]
        y = jax.lax.switch(j, [functools.partial(_compact_ffn, rows=c, **ffn_kw) for c in caps], xs, gw, held, w1,
                           w3, w2)
    y = jnp.swapaxes(y.reshape(n_local, ep, capacity, d), 0, 1)  # [source rank, n_local, C, D]
    if ep > 1:  # back to [destination rank, n_local, C, D]
        y = jax.lax.all_to_all(y.astype(return_dtype(dtype, partial)), expert_axis, 0, 0, tiled=True)
    y = jnp.where(valid[..., None], y.reshape(n_exp, capacity, d), 0.0)
    return jnp.zeros((t_loc, d), jnp.float32).at[tok.reshape(-1)].add(y.reshape(-1, d).astype(jnp.float32)), rows


def local_stats(bucket, capacity, counts, rows=None):
    """This rank's `DispatchStats` (dropped / routed to be summed over the token ranks by the caller); rows: the
    expert FFN's rows (default `capacity`)."""
    dropped = jnp.sum(jnp.maximum(counts - capacity, 0))
    return DispatchStats(jnp.asarray(bucket, jnp.int32), jnp.asarray(capacity, jnp.int32), dropped.astype(jnp.int32),
                         jnp.sum(counts).astype(jnp.int32), jnp.asarray(capacity if rows is None else rows, jnp.int32))


def padded_body(x, ids, w, w1, w3, w2, *, ep, n_local, capacity, expert_axis, limit, dtype, partial, act_q=None):
    """One rank, padded backend at a fixed `capacity`. x [Tl, D], ids/w [Tl, k] -> ([Tl, D] float32 (partial over I
    if TP), local `DispatchStats`). Pairs past an expert's capacity are dropped (module docstring). w1, w3, w2:
    arrays, or local FP8 `QuantizedTensor`s (then the rows are quantised first, `expert_rows`; `padded_ffn`)."""
    w, order, counts, starts = _slots(ids, w, ep * n_local)
    y, rows = _buffers_ffn(expert_rows(x, w1, dtype), w, order, counts, starts, w1, w3, w2, k=ids.shape[1], ep=ep,
                           n_local=n_local, capacity=capacity, expert_axis=expert_axis, limit=limit, dtype=dtype,
                           partial=partial, act_q=act_q)
    return y, local_stats(0, capacity, counts, rows)


def sized_body(x, ids, w, w1, w3, w2, *, ep, n_local, buckets, expert_axis, token_axes, limit, dtype, partial,
               act_q=None, inner=None):
    """One rank, "sized" backend: the padded body at the smallest of `buckets` (ascending capacities) that holds
    the largest (source rank, expert) load of this call over `token_axes`, else the last (module docstring);
    `inner`: the compaction's row counts (`_buffers_ffn`), None = none.
    x [Tl, D], ids/w [Tl, k] -> ([Tl, D] float32 (partial over I if TP), local `DispatchStats`). w1, w3, w2: as
    `padded_body`."""
    w, order, counts, starts = _slots(ids, w, ep * n_local)
    x = expert_rows(x, w1, dtype)
    peak = jnp.max(counts)
    if token_axes:
        peak = jax.lax.pmax(peak, token_axes)  # the same on every rank: every rank runs the same branch
    caps = jnp.asarray(buckets, jnp.int32)
    index = jnp.minimum(jnp.sum(caps < peak), len(buckets) - 1).astype(jnp.int32)
    kw = dict(k=ids.shape[1], ep=ep, n_local=n_local, expert_axis=expert_axis, limit=limit, dtype=dtype,
              partial=partial, act_q=act_q, inner=inner, token_axes=token_axes)
    branches = [functools.partial(_buffers_ffn, capacity=c, **kw) for c in buckets]
    y, rows = jax.lax.switch(index, branches, x, w, order, counts, starts, w1, w3, w2)
    return y, local_stats(index, caps[index], counts, rows)
