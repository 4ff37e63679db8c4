"""Tests for dsv4/scales.py: e8m0 bytes <-> float32 over all 256 bytes, on the numpy and the jax path.

Run: .venv/bin/python -m pytest -q tests/dsv4/test_scales.py
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4 import scales as S


def test_e8m0_conversions():
    b = np.arange(256, dtype=np.uint8)
    expect = np.array([2.0 ** (int(i) - 127) for i in range(255)] + [np.nan], np.float64)
    for arr in (b, b.view(ml_dtypes.float8_e8m0fnu)):
        np.testing.assert_array_equal(S.e8m0_to_f32(arr).astype(np.float64), expect)
    np.testing.assert_array_equal(np.asarray(S.e8m0_to_f32(jnp.asarray(b[1:])), np.float64), expect[1:])
    np.testing.assert_array_equal(S.f32_to_e8m0(expect.astype(np.float32)), b)
    np.testing.assert_array_equal(np.asarray(S.f32_to_e8m0(jnp.asarray(expect[1:], jnp.float32))), b[1:])
    for bad in (3.0, 0.0, -2.0):
        with pytest.raises(ValueError, match="not powers of two"):
            S.f32_to_e8m0(np.array([1.0, bad], np.float32))
