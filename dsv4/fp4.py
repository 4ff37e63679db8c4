"""FP4 (e2m1, one e8m0 scale per 1x32 block) weights: pack / unpack, decode, round, quantise, dequantise.

The DeepSeek-V4 checkpoint stores its routed experts as `I8` [out, in/2]: two e2m1 codes per byte along the input
dim, low nibble = logical column 2k, high nibble = column 2k+1 (official `inference/convert.py`,
`cast_e2m1fn_to_e4m3fn`); one e8m0 scale per 32 consecutive inputs of a row, W[o, i] = val * 2^(b-127)
(docs/dsv4-architecture.md §9.2, §12 items 23-24). numpy in, numpy out; jax in (or traced), jax out.
Sources: OCP Microscaling Formats (MX) v1.0 (e2m1); DeepSeek-V4 `inference/convert.py` (nibble order).
Tests: tests/dsv4/test_fp4.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsv4.scales import array_module, bitcast, f32_to_e8m0, pow2_ceil, scale_to_f32

FP4_MAX = 6.0
FP4_BLOCK = 32
# e2m1 code -> value for codes 0..15 (bit 3 = sign), OCP MX spec §5.3.3.
FP4_E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
# Rounding to nearest e2m1 magnitude: the code is the number of midpoints below |x|, plus one at the
# midpoints whose lower neighbour has an odd code (ties to even, as IEEE and ml_dtypes do).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIES_UP = (0.75, 1.75, 3.5)


def unpack_fp4_e2m1(packed):
    """Packed fp4 bytes [..., n] (int8 as stored, or uint8) -> e2m1 codes uint8 [..., 2n].

    Byte k of a row holds logical column 2k in its low nibble (bits 0-3) and column 2k+1 in its high nibble
    (bits 4-7), as DeepSeek-V4 `inference/convert.py` unpacks it.
    """
    xp = array_module(packed)
    b = packed if np.dtype(packed.dtype) == np.uint8 else bitcast(packed, xp.uint8)
    codes = xp.stack([b & np.uint8(0x0F), b >> np.uint8(4)], axis=-1)  # -> [..., n, 2]
    return codes.reshape(*b.shape[:-1], 2 * b.shape[-1])


def pack_fp4_e2m1(codes):
    """Inverse of `unpack_fp4_e2m1`: codes [..., 2n] (values 0..15) -> int8 [..., n]."""
    xp = array_module(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4_e2m1 needs an even last dim, got shape {codes.shape}")
    c = codes.astype(xp.uint8)
    return bitcast((c[..., 0::2] & np.uint8(0x0F)) | (c[..., 1::2] << np.uint8(4)), xp.int8)


def fp4_codes_to_values(codes, dtype=jnp.float32):
    """e2m1 codes (0..15, bit 3 = sign) -> values 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives, in `dtype`.

    Built from bits, not a table gather (a gather is slow on XLA:CPU): exponent field e = bits 1-2, mantissa
    m = bit 0; e > 0 gives the f32 2^(e-1) * (1 + m/2), e = 0 gives m * 0.5 (OCP MX spec §5.3.3); sign = bit 3.
    """
    xp = array_module(codes)
    c = codes.astype(xp.uint32)
    e, m = (c >> np.uint32(1)) & np.uint32(3), c & np.uint32(1)
    bits = xp.where(e == 0, m * np.uint32(126 << 23), ((e + np.uint32(126)) << np.uint32(23)) | (m << np.uint32(22)))
    bits = bits | ((c >> np.uint32(3)) << np.uint32(31))
    return bitcast(bits.astype(xp.uint32), xp.float32).astype(dtype)


def dequantize_fp4(packed, scale, dtype=jnp.float32, *, block: int = FP4_BLOCK):
    """FP4 expert weight -> dense: packed [..., out, in/2] int8, scale [..., out, in/block] -> [..., out, in].

    W[o, i] = e2m1(code[o, i]) * S[o, i // block]. scale: e8m0 bytes (uint8 or float8_e8m0fnu, value
    2^(b-127)) or float powers of two. Jittable, so the sampler can keep experts packed and dequantise
    inside the jit. ValueError if the scale shape does not match.
    """
    xp = array_module(packed, scale)
    b = packed if np.dtype(packed.dtype) == np.uint8 else bitcast(packed, xp.uint8)
    *lead, rows, n = b.shape
    cols = 2 * n
    if block % 2 or cols % block or tuple(scale.shape) != (*lead, rows, cols // block):
        raise ValueError(f"fp4 scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
                         f"(logical [..., {rows}, {cols}], block {block})")
    # nibbles by a broadcast shift ([..., groups, block/2, 1] >> [0, 4]): low nibble = even column, and the
    # trailing reshape is free (no stack/interleave copy; 3-4x faster on XLA:CPU than unpack_fp4_e2m1 + gather)
    g = block // 2
    codes = (b.reshape(*lead, rows, n // g, g, 1) >> xp.asarray([0, 4], dtype=xp.uint8)) & np.uint8(0x0F)
    vals = fp4_codes_to_values(codes, xp.float32) * scale_to_f32(scale)[..., None, None]
    return vals.reshape(*lead, rows, cols).astype(dtype)


def fp4_round_codes(x):
    """Round values already in [-6, 6] to the nearest e2m1 code (ties to even). The sign bit is x's, as an IEEE cast
    (the release's `T.Cast` / torch `.to(float4_e2m1fn_x2)`) writes it: -0 and negatives that round to zero give
    code 8 (-0)."""
    xp = array_module(x)
    a = xp.abs(x)
    mag = sum((a > t).astype(xp.uint8) for t in _FP4_MIDPOINTS) + sum((a == t).astype(xp.uint8) for t in _FP4_TIES_UP)
    sign = xp.signbit(x).astype(xp.uint8)
    return (mag | (sign << np.uint8(3))).astype(xp.uint8)


def quantize_fp4(w, *, block: int = FP4_BLOCK):
    """Dense w [..., out, in] -> (packed int8 [..., out, in/2], scale e8m0 uint8 [..., out, in/block]).

    Per `block` consecutive inputs: s = 2^ceil(log2(amax / 6)) (1 for an all-zero block), codes = nearest
    e2m1 value of w / s (ties to even). Exact round trip for w already of the form e2m1 * 2^k per block
    with its amax at 6 * s. Zeros keep their sign (code 8 for -0 and for negatives that round to 0, as an IEEE
    cast writes them). An all-zero block keeps s = 1: the release's FP4 rule (`fp4_act_quant`) would floor it at
    2^-126, which its FP4 -> FP8 conversion turns into a tile scale of 2^-132, below e8m0's range.
    ValueError if `in` is not a multiple of `block` (or the numpy w is non-finite).
    """
    xp = array_module(w)
    w = w.astype(xp.float32)
    *lead, rows, cols = w.shape
    if cols % block:
        raise ValueError(f"quantize_fp4: last dim {cols} is not a multiple of the block {block}")
    if xp is np and not np.isfinite(w).all():
        raise ValueError("quantize_fp4: w has NaN or inf values")
    wb = w.reshape(*lead, rows, cols // block, block)
    amax = xp.max(xp.abs(wb), axis=-1)  # -> [..., out, in/block]
    scale = xp.where(amax > 0, pow2_ceil(xp, amax / FP4_MAX), 1.0).astype(xp.float32)
    codes = fp4_round_codes(xp.clip(wb / scale[..., None], -FP4_MAX, FP4_MAX))
    return pack_fp4_e2m1(codes.reshape(*lead, rows, cols)), f32_to_e8m0(scale)
