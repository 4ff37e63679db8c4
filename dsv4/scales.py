"""Power-of-two (e8m0) block scales and the array helpers the FP8 / FP4 code shares, pure functions.

e8m0 (OCP MX spec): an unsigned exponent byte b with value 2^(b-127); b = 255 is NaN; no zero. The DeepSeek-V4
checkpoint stores its FP8 tile scales and FP4 1x32 scales as `F8_E8M0` (docs/dsv4-architecture.md §9.2).
Every function takes numpy arrays (eager, returns numpy) or jax arrays and tracers (jittable, returns jax arrays),
as `dsv4.quant` and `dsv4.fp4` do. Power-of-two scales are computed exactly with `frexp` (never `ceil(log2(x))` in
floating point) and their exponents are clamped to [-126, 127] so every scale is a *normal* f32 (XLA:CPU flushes
subnormals to zero). Source: OCP Microscaling Formats (MX) v1.0. Tests: tests/dsv4/test_scales.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def array_module(*arrays):
    """numpy when every input is a numpy array (eager loader path), else jax.numpy (jit path)."""
    return np if all(isinstance(a, (np.ndarray, np.generic)) for a in arrays) else jnp


def bitcast(x, dtype):
    """Reinterpret the bits of `x` as the same-width `dtype` (numpy view or lax.bitcast_convert_type)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x).view(dtype)
    return jax.lax.bitcast_convert_type(x, dtype)


def pow2_ceil(xp, x):
    """Exact 2^ceil(log2 x) for x > 0 (f32), exponent clamped to [-126, 127]; x = 0 gives 1 (callers mask it)."""
    mant, exp = xp.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    exp = xp.where(mant == 0.5, exp - 1, exp)  # x is already a power of two
    exp = xp.clip(exp, -126, 127).astype(xp.int32)
    return bitcast(((exp + 127).astype(xp.uint32) << 23).astype(xp.uint32), xp.float32)


def e8m0_to_f32(b):
    """e8m0 exponent bytes -> float32 2^(b-127); b = 255 -> NaN.

    b: uint8 (or float8_e8m0fnu, reinterpreted) array of any shape. Built from bits (exponent field = b),
    so it is exact; b = 0 gives the subnormal 2^-127, which XLA:CPU arithmetic may later flush to zero.
    """
    xp = array_module(b)
    if np.dtype(b.dtype) != np.uint8:
        if np.dtype(b.dtype) != np.dtype(jnp.float8_e8m0fnu):
            raise ValueError(f"e8m0_to_f32 expects uint8 or float8_e8m0fnu, got {b.dtype}")
        b = bitcast(b, xp.uint8)
    bits = b.astype(xp.uint32) << 23
    bits = xp.where(b == 0, np.uint32(0x00400000), bits)  # 2^-127 is the subnormal with mantissa 0b10...
    bits = xp.where(b == 255, np.uint32(0x7FC00000), bits)  # quiet NaN
    return bitcast(bits.astype(xp.uint32), xp.float32)


def f32_to_e8m0(x):
    """Positive power-of-two floats -> uint8 e8m0 bytes b with x = 2^(b-127); NaN -> 255.

    numpy path: ValueError if any value is not a power of two in [2^-127, 2^127] (or NaN).
    jnp path: no check; exponents are clamped to [0, 254] and non-powers of two are rounded down.
    """
    xp = array_module(x)
    x = x.astype(xp.float32)
    mant, exp = xp.frexp(x)
    b = exp.astype(xp.int32) - 1 + 127
    if xp is np:
        bad = ~np.isnan(x) & ((mant != 0.5) | (b < 0) | (b > 254))
        if bad.any():
            raise ValueError(f"f32_to_e8m0: {int(bad.sum())} value(s) are not powers of two in [2^-127, 2^127], "
                             f"e.g. {x[bad].flat[0]!r}")
    return xp.where(xp.isnan(x), 255, xp.clip(b, 0, 254)).astype(xp.uint8)


def scale_to_f32(scale):
    """Scale tensor (e8m0 bytes as uint8 / float8_e8m0fnu, or float powers of two) -> float32."""
    dt = np.dtype(scale.dtype)
    if dt == np.uint8 or dt == np.dtype(jnp.float8_e8m0fnu):
        return e8m0_to_f32(scale)
    return scale.astype(array_module(scale).float32)


def scale_times_pow2(scale, up: bool):
    """scale * 2 (up) or scale / 2, keeping its dtype; e8m0 scales change their exponent byte by one."""
    xp = array_module(scale)
    dt = np.dtype(scale.dtype)
    if dt == np.uint8 or dt == np.dtype(jnp.float8_e8m0fnu):
        b = scale if dt == np.uint8 else bitcast(scale, xp.uint8)
        if xp is np and ((b >= 254) if up else (b == 0) | (b == 255)).any():
            raise ValueError("e8m0 scale out of range (or NaN) after the fp8 format conversion")
        b = (b.astype(xp.int32) + (1 if up else -1)).astype(xp.uint8)
        return b if dt == np.uint8 else bitcast(b, scale.dtype)
    return scale * 2 if up else scale / 2
