"""Verification rows of the actor -> rollout push (every push: `local.py`, `mpmd.py`).

Per tensor and side, `_row` computes ROW_TERMS uint32 terms: the position-weighted 32-bit checksum pair of every
wire array, NaN/inf flags (of the actor weight, the rollout copy, FP8 after dequantisation), the all-zero check of
integer tables and the e4m3 rounding bound; `stored_row` computes the rollout side's terms from the stored state.
The checksums loop over slabs (`slab_loop`) so an integer reduction never materialises a whole large tensor.

Verification (`verify=True`, or every `verify_every`-th push): per tensor a row of 10 uint32 terms is computed on
the actor side (in the stage jit, from exactly the wire arrays it sends) and on the rollout side (for tensors
quantised on arrival: in the land jit, from the bf16 that arrived; for everything else: one program over the
stored new state), see `_row`. They must agree on the position-weighted 32-bit checksum pair of every wire array
(fp8 q and f32 scales bitwise; int hash tables and f32/bf16 tensors bitwise); nothing may be NaN/inf (the actor
weight, the rollout copy, FP8 after dequantisation); integer tables must not be all zero (an all-zero `tid2eid`
routes every token to expert 0: the failure of stacks that forget buffers); and every FP8 element must satisfy
the e4m3 rounding bound
    |q * s - w| <= (eps/2 + 2^-20) |w| + (1 + 2^-20) * (smallest_subnormal/2) * s + tiny_f32
where w is the bf16 weight that was quantised, s its block's scale, eps/smallest_subnormal from `jnp.finfo` of the
fp8 dtype (e4m3fn: eps = 2^-3, subnormal step 2^-9; e4m3fnuz: 2^-3, 2^-10). Derivation: y = fl(w / s) has
relative error 2^-24; clipping at +-fmax moves y by at most 2^-22 fmax because s >= amax/fmax up to rounding;
round-to-nearest-even to e4m3 errs by at most half a spacing, i.e. eps/2 |y| for normals and
smallest_subnormal/2 below the normal range; q * s adds another 2^-24 relative; tiny_f32 covers the FTZ of
f32-subnormal inputs on XLA:CPU. Failure raises `PushVerificationError` naming every bad tensor and the reason;
the new state is deleted and the old version stays live. The verdicts come to the host as one small
`device_get` (10 uint32 per tensor and side), the only device-to-host traffic of a push.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dsv4 import quant
from parallel.push.transfer import dim_splits, quantize_as

ROW_TERMS = 10  # uint32 verification terms per tensor and side (`_row`)


def _bits_u32(x):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[np.dtype(x.dtype).itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _digest_block(x, shape, dim: int = 0, offset=0):
    """Digest terms (`_digest_terms`) of the slab x of a tensor of global `shape` that starts at `offset` along
    `dim` (positions are those of the whole tensor)."""
    bits = _bits_u32(x)
    pos = jnp.ones(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        idx = jax.lax.broadcasted_iota(jnp.uint32, x.shape, d)
        if d == dim:
            idx = idx + jnp.asarray(offset, jnp.uint32)
        pos = pos + idx * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * pos, dtype=jnp.uint32),
                      jnp.any(_nonfinite_bits(bits, x.dtype)).astype(jnp.uint32),
                      jnp.any(_nonzero_bits(bits, x.dtype)).astype(jnp.uint32)])


def _nonfinite_bits(bits, dtype):
    """NaN/inf from the bit words (no float compare: XLA:CPU would upcast a whole bf16 tensor to f32 for it)."""
    dt = np.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        return jnp.zeros(bits.shape, bool)
    if dt == np.dtype(jnp.float8_e4m3fnuz):
        return bits == 0x80
    if dt == np.dtype(jnp.float8_e4m3fn):
        return (bits & 0x7F) == 0x7F
    fi = jnp.finfo(dt)
    exp_mask = ((1 << fi.nexp) - 1) << fi.nmant
    return (bits & jnp.uint32(exp_mask)) == jnp.uint32(exp_mask)


def _nonzero_bits(bits, dtype):
    """Any value != 0 (floats: -0 is zero)."""
    if jnp.issubdtype(np.dtype(dtype), jnp.floating):
        sign = jnp.uint32(1 << (8 * np.dtype(dtype).itemsize - 1))
        return (bits & ~sign) != 0
    return bits != 0


def _digest_terms(x, slab: tuple[int, int] | None = None):
    """x [...] -> uint32[4]: (sum of the bit words b_i, sum of b_i * (i + 1) with i the row-major position, any
    non-finite, any nonzero). Sums wrap mod 2^32, so the reduction order (and the sharding) does not matter; the
    position weight catches permuted blocks (swapping elements i, j changes the second sum by (b_i - b_j)(j - i)).
    slab=(dim, k): the same terms from a loop over k slabs along `dim` (an unsharded dim), so the program's
    temporaries are those of one slab (XLA:CPU materialises every integer reduction's input: ~12 B per element
    of a slab), not of the tensor. Each slab is cut inside a `lax.cond` on the loop index: XLA:CPU rewrites a
    bf16 / f8 dynamic slice as one of an f32 / f16 copy of the whole tensor, and would hoist that copy out of the
    loop (2-4 B per element of the tensor); inside the cond's branch the conversion fuses into the slab's copy."""
    if slab is None:
        return _digest_block(x, x.shape)
    dim, k = slab
    n = x.shape[dim] // k

    def cut(a, i):
        return jax.lax.dynamic_slice_in_dim(a, i * n, n, axis=dim)

    def body(i, acc):
        part = jax.lax.cond(i < 0, lambda a: jnp.zeros_like(cut(a, 0)), lambda a: cut(a, i), x)  # i < 0: never
        d = _digest_block(part, x.shape, dim, i * n)
        return jnp.concatenate([acc[:2] + d[:2], jnp.maximum(acc[2:], d[2:])])

    return jax.lax.fori_loop(0, k, body, jnp.zeros(4, jnp.uint32))


def slab_loop(shape: tuple[int, ...], sharding: NamedSharding, max_elems: int) -> tuple[int, int] | None:
    """(dim, k): cut the largest unsharded dim of `shape` into k equal slabs so that one slab holds at most
    `max_elems` elements per device; None when the whole tensor already does (or no dim can be cut)."""
    splits = dim_splits(sharding, len(shape))
    per_dev = math.prod(shape) // max(math.prod(splits), 1)
    dims = [d for d in range(len(shape)) if splits[d] == 1 and shape[d] > 1]
    if per_dev <= max_elems or not dims:
        return None
    d = max(dims, key=lambda d: shape[d])
    k = next((k for k in range(2, shape[d] + 1) if shape[d] % k == 0 and per_dev // k <= max_elems), shape[d])
    return d, k


def _quant_flags(w, q, scale, qmeta):
    """w [..., out, in] (the bf16 that was quantised), (q, scale) of it -> uint32[2]: any non-finite after
    dequantisation, any element over the e4m3 bound (module docstring; FP4: not checked, 0)."""
    kind, _, block, shape = qmeta
    deq = quant.QuantizedTensor(q=q, scale=scale, kind=kind, fmt=qmeta[1], block=block,
                                shape=shape).dequantize(jnp.float32)
    over = jnp.bool_(False)
    if kind == "fp8":
        fi = jnp.finfo(q.dtype)
        b0, b1 = block
        *_, rows, cols = q.shape
        s = jnp.repeat(jnp.repeat(scale, b0, axis=-2), b1, axis=-1)[..., :rows, :cols]  # -> [..., out, in]
        wf = w.astype(jnp.float32)
        bound = ((float(fi.eps) / 2 + 2**-20) * jnp.abs(wf) + (1 + 2**-20) * (float(fi.smallest_subnormal) / 2) * s
                 + float(jnp.finfo(jnp.float32).tiny))
        over = jnp.any(jnp.abs(deq - wf) > bound)
    return jnp.stack([jnp.any(~jnp.isfinite(deq)), over]).astype(jnp.uint32)


_ZEROS = functools.partial(jnp.zeros, dtype=jnp.uint32)


def _row(w=None, q=None, scale=None, qmeta=None):
    """Verification terms of one tensor -> uint32[ROW_TERMS]:
      [0:4] digest (`_digest_terms`) of the first wire array: the dense w, or q;
      [4:8] digest of the second (the scales), zeros for a dense wire;
      [8] any non-finite after dequantisation, [9] any FP8 element over the e4m3 bound (both 0 unless w and q given).
    With w and q (the side that quantised), term 2 is w's non-finite flag (the weight the quantisation read).
    Sides agree when terms 0, 1, 4, 5 match."""
    if q is None:  # dense wire (also a bf16 arrival before its quantisation)
        return jnp.concatenate([_digest_terms(w), _ZEROS(6)])
    dq, ds = _digest_terms(q), _digest_terms(scale)
    if w is None:  # stored (q, scale) on the rollout
        return jnp.concatenate([dq, ds, _ZEROS(2)])
    nonfinite_w = jnp.any(~jnp.isfinite(w)).astype(jnp.uint32)
    return jnp.concatenate([dq[:2], nonfinite_w[None], dq[3:], ds, _quant_flags(w, q, scale, qmeta)])


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def stage_wires(x, dense_dtype, qmeta, shardings, verify):
    """Actor side, one tensor: x (actor dtype, one-copy view) -> (wire arrays laid out as `shardings`, row | None).
    qmeta None (or quantisation on arrival: pass None): the dense wire x.astype(dense_dtype); else (q, scale) of
    the bf16 value (`quantize_as`)."""
    w = x.astype(dense_dtype)
    outs = (w,) if qmeta is None else quantize_as(w, qmeta)
    outs = tuple(jax.lax.with_sharding_constraint(o, s) for o, s in zip(outs, shardings))
    if not verify:
        return outs, None
    return outs, (_row(w) if qmeta is None else _row(w, *outs, qmeta=qmeta))


@jax.jit
def dense_row(x):
    """Actor side, a tensor sent as it is (no stage jit): its verification row."""
    return _row(x)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def land_quantize(w, qmeta, shardings, verify):
    """Rollout side, quantisation on arrival: w (bf16 as landed) -> ((q, scale) in the stored `shardings`,
    row of the arrival | None)."""
    q, scale = quantize_as(w, qmeta)
    outs = tuple(jax.lax.with_sharding_constraint(o, s) for o, s in zip((q, scale), shardings))
    if not verify:
        return outs, None
    d = _digest_terms(w)
    return outs, jnp.concatenate([d, _ZEROS(4), _quant_flags(w, q, scale, qmeta)])


@functools.partial(jax.jit, static_argnums=(1,))
def stored_row(arrays, slabs):
    """Rollout side, one tensor as stored: arrays (array,) | (q, scale) -> uint32[ROW_TERMS] (`_row` terms 0-7),
    each digest looping over its `slabs` entry (`slab_loop`)."""
    d = [_digest_terms(x, sl) for x, sl in zip(arrays, slabs)]
    return jnp.concatenate([d[0], d[1] if len(d) > 1 else _ZEROS(4), _ZEROS(2)])


# ------------------------------------------------------------------------------------------ the pusher


def row_failures(a, r, dense_dtype) -> list[str]:
    """The reasons a tensor fails verification, from its actor row `a` and rollout row `r` (uint32[ROW_TERMS] on the
    host, `_row` / `stored_row` / `land_quantize`); `dense_dtype` is what the actor sends dense (integer tables
    must not be all zero). [] = the tensor passed. Shared by the colocated and the MPMD push."""
    reasons = []
    if a[2] or r[2]:
        reasons.append("NaN/inf in the " + ("actor weight" if a[2] else "rollout copy"))
    if (a[0], a[1], a[4], a[5]) != (r[0], r[1], r[4], r[5]):
        reasons.append("rollout copy differs from the actor's wire value (checksum mismatch)")
    if np.issubdtype(np.dtype(dense_dtype), np.integer) and not r[3]:
        reasons.append("integer table is all zero (uninitialised hash table?)")
    if a[8] or r[8]:
        reasons.append("NaN/inf after FP8 dequantisation")
    if a[9] or r[9]:
        reasons.append("FP8 error above the e4m3 rounding bound")
    return reasons
