"""Tests for dsv4/fp4.py: FP4 e2m1 packing and nibble order, rounding, quantise / dequantise, signs of zero.

References are written independently of the code under test (bit-level Python decoders, ml_dtypes casts).
Run: .venv/bin/python -m pytest -q tests/dsv4/test_fp4.py
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4 import fp4 as F
from dsv4.quant import fp4_to_fp8_blockwise
from dsv4.scales import e8m0_to_f32


def _ref_decode_e2m1(code: int) -> float:
    """Bit-level e2m1 decoder (OCP MX): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 0b1
    if exp == 0:  # subnormal: 2^(1 - bias) * (man / 2)
        return sign * 0.5 * man
    return sign * 2.0 ** (exp - 1) * (1 + man / 2)


def _ref_dequantize_fp4(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    rows, half = packed.shape
    out = np.zeros((rows, 2 * half), np.float64)
    for o in range(rows):
        for k in range(half):
            byte = int(packed[o, k]) & 0xFF
            for j, code in enumerate((byte & 0xF, byte >> 4)):  # column 2k from the low nibble
                i = 2 * k + j
                out[o, i] = _ref_decode_e2m1(code) * 2.0 ** (int(scale_bytes[o, i // 32]) - 127)
    return out


def test_fp4_dequantize_matches_bit_level_reference():
    rng = np.random.default_rng(3)
    packed = rng.integers(-128, 128, size=(3, 32), dtype=np.int8)  # logical [3, 64]
    sb = rng.integers(117, 138, size=(3, 2), dtype=np.uint8)
    ref = _ref_dequantize_fp4(packed, sb)
    for scale in (sb, sb.view(ml_dtypes.float8_e8m0fnu), 2.0 ** (sb.astype(np.float32) - 127)):
        np.testing.assert_array_equal(F.dequantize_fp4(packed, scale).astype(np.float64), ref)
    got = jax.jit(F.dequantize_fp4)(jnp.asarray(packed), jnp.asarray(sb))
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)
    stacked = F.dequantize_fp4(np.stack([packed, packed]), np.stack([sb, sb]), np.float32)  # [E, out, in]
    np.testing.assert_array_equal(stacked[1], ref)
    with pytest.raises(ValueError, match="does not match"):
        F.dequantize_fp4(packed, sb[:, :1])


def test_fp4_nibble_order():
    packed = np.array([[0x71, 0x9A]], np.uint8).view(np.int8)  # 0x71: lo 1 (0.5), hi 7 (6); 0x9A: lo -1, hi -0.5
    np.testing.assert_array_equal(F.unpack_fp4_e2m1(packed), [[1, 7, 10, 9]])
    np.testing.assert_array_equal(F.fp4_codes_to_values(F.unpack_fp4_e2m1(packed)), [[0.5, 6.0, -1.0, -0.5]])
    np.testing.assert_array_equal(F.pack_fp4_e2m1(np.array([[1, 7, 10, 9]])), packed)


def test_fp4_rounding_matches_ml_dtypes():
    grid = np.concatenate([np.linspace(-6, 6, 481), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0]])
    x = grid.astype(np.float32)
    ours = F.fp4_codes_to_values(F.fp4_round_codes(x))
    np.testing.assert_array_equal(ours, x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(F.fp4_round_codes(jnp.asarray(x))), F.fp4_round_codes(x))


def test_fp4_quantize_roundtrip_exact_on_representable_values():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(4, 64)).astype(np.uint8)
    codes[:, ::32] = 7  # every 32-block has amax 6 * 2^k, so its scale is exactly 2^k
    k = rng.integers(-8, 8, size=(4, 2))
    w = (F.FP4_E2M1_VALUES[codes] * np.repeat(2.0 ** k, 32, axis=1)).astype(np.float32)
    packed, sb = F.quantize_fp4(w)
    assert packed.dtype == np.int8 and packed.shape == (4, 32) and sb.dtype == np.uint8 and sb.shape == (4, 2)
    np.testing.assert_array_equal(sb, k + 127)
    np.testing.assert_array_equal(F.dequantize_fp4(packed, sb), w)
    np.testing.assert_array_equal(_ref_dequantize_fp4(packed, sb), w)
    pj, sj = jax.jit(F.quantize_fp4)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(pj), packed)
    np.testing.assert_array_equal(np.asarray(sj), sb)
    # Random weights: power-of-two scales with amax / 6 <= s < 2 amax / 6; all-zero blocks get s = 1.
    w = rng.normal(size=(8, 96)).astype(np.float32)
    w[0, :32] = 0
    _, sb = F.quantize_fp4(w)
    s, amax = e8m0_to_f32(sb), np.abs(w).reshape(8, 3, 32).max(-1)
    assert s[0, 0] == 1.0 and (s[1:] >= amax[1:] / 6).all() and (s[1:] < amax[1:] / 3).all()


def test_fp4_signs_of_zero_as_an_ieee_cast():
    # quantisation: -0 and a negative below the smallest e2m1 step (0.25 of the scale) -> code 8 (-0)
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [6.0, -0.0, -0.1, 0.1]  # amax 6 -> s = 1; -0.1 rounds to -0, 0.1 to +0
    packed, _ = F.quantize_fp4(w)
    codes = F.unpack_fp4_e2m1(packed)[0]
    assert list(codes[:4]) == [7, 8, 8, 0]
    # FP4 -> FP8: the release's e2m1 table maps code 8 to +0.0, so the FP8 byte is 0x00, never 0x80
    w8 = np.zeros((128, 128), np.float32)
    w8[0, 0], w8[0, 1] = 6.0, -0.0
    packed, scale = F.quantize_fp4(w8)
    assert F.unpack_fp4_e2m1(packed)[0, 1] == 8
    q, tile = fp4_to_fp8_blockwise(packed, scale)
    b = np.asarray(q).view(np.uint8)
    assert tile[0, 0] == 1.0 / 64 and float(np.asarray(q, np.float32)[0, 0]) == 384.0
    assert not (b == 0x80).any()
