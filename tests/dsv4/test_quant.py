"""Tests for dsv4/quant.py: FP8 block quantisation bounds, fn<->fnuz byte conversion, activation quantisation,
format selection, QuantizedTensor (FP4: tests/dsv4/test_fp4.py; e8m0 scales: tests/dsv4/test_scales.py).

References are written independently of the code under test (bit-level Python decoders, ml_dtypes casts,
hand-computed numbers). Run: .venv/bin/python -m pytest -q tests/dsv4/test_quant.py
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4 import quant as Q
from dsv4.fp4 import dequantize_fp4

FN, FNUZ = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz


def _weights(rows=200, cols=300, seed=0):
    """Gaussian weights whose 64-row bands span 8 orders of magnitude (exercises fp8 subnormals)."""
    w = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    return w * np.repeat(10.0 ** np.arange(-4, 4, 2), 64)[:rows, None].astype(np.float32)


# ------------------------------------------------------------------------------------------------ FP8


@pytest.mark.parametrize("scale_fmt", ["f32", "ue8m0"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_fp8_roundtrip_error_bound(fmt, scale_fmt):
    w = _weights()  # 200 x 300: not a multiple of 128 in either dim
    q, scale = Q.quantize_fp8_blockwise(w, fmt=fmt, scale_fmt=scale_fmt)
    assert q.dtype == np.dtype(Q.FP8_FORMATS[fmt]) and q.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == (2, 3)
    deq = Q.dequantize_fp8_blockwise(q, scale)
    assert deq.shape == w.shape and np.isfinite(deq).all()
    s = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :300]
    # Bound, in units of x = w / s with |x| <= fmax: e4m3 has 3 mantissa bits, so for a normal x in
    # [2^e, 2^(e+1)) the spacing is 2^(e-3) and round-to-nearest errs by <= 2^(e-4) <= 2^-4 |x|. Below the
    # smallest normal the spacing is the smallest subnormal (2^-9 fn, 2^-10 fnuz), so the error is <= half
    # of it. The f32 division/multiplication add <= 2 ulp relative (exact for ue8m0 power-of-two scales).
    half_sub = float(ml_dtypes.finfo(Q.FP8_FORMATS[fmt]).smallest_subnormal) / 2
    bound = np.maximum(2.0**-4 * np.abs(w), half_sub * s) * (1 + 2.0**-21)
    err = np.abs(deq - w)
    assert (err <= bound).all(), float((err / bound).max())
    assert (err / bound).max() > 0.5  # the bound is nearly attained, so it is not vacuous


def test_fp8_scales_hand_computed():
    w = np.zeros((256, 130), np.float32)  # blocks: 2 x 2; block (1, 1) stays all-zero
    w[0, 0], w[1, 1] = 896.0, 3.0  # block (0, 0): amax 896 -> f32 scale 896/448 = 2, q = 448, 1.5
    w[200, 5] = -100.0  # block (1, 0): amax 100 -> ue8m0 scale 2^ceil(log2(100/448)) = 2^-2
    w[10, 129] = 0.001  # block (0, 1): amax 0.001 -> ue8m0 2^ceil(log2(2.23e-6)) = 2^-18
    q, s = Q.quantize_fp8_blockwise(w, scale_fmt="f32")
    assert s[0, 0] == 2.0 and s[1, 1] == 1.0 and s[1, 0] == np.float32(100.0) / np.float32(448.0)
    assert float(q[0, 0]) == 448.0 and float(q[1, 1]) == 1.5 and float(q[200, 5]) == -448.0
    q, s = Q.quantize_fp8_blockwise(w, scale_fmt="ue8m0")
    np.testing.assert_array_equal(s, [[2.0, 2.0**-18], [2.0**-2, 1.0]])
    # -100 / 2^-2 = -400: a tie between -384 (mantissa 100) and -416 (101) in [256, 512) -> even: -384
    assert float(q[200, 5]) == -384.0 and not np.asarray(q[128:, 128:], np.float32).any()
    np.testing.assert_array_equal(Q.dequantize_fp8_blockwise(q, s)[128:, 128:], 0.0)


def test_fp8_ue8m0_scales_are_powers_of_two():
    w = _weights(seed=1)
    _, s = Q.quantize_fp8_blockwise(w, scale_fmt="ue8m0", block=(64, 64))
    mant, _ = np.frexp(s)
    np.testing.assert_array_equal(mant, 0.5)
    amax = np.abs(np.pad(w, ((0, 56), (0, 20)))).reshape(4, 64, 5, 64).max(axis=(1, 3))
    assert (s >= amax / 448).all() and (s < 2 * amax / 448).all()


def test_fp8_overflow_saturates_instead_of_nan():
    x = np.array([1000.0, -1e6, 448.0, 100.0], np.float32)
    with np.errstate(invalid="ignore"):
        assert np.isnan(x.astype(FN).astype(np.float32)[:2]).all()  # what an unclipped cast would do
        assert np.isnan(np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn), np.float32)[:2]).all()
    np.testing.assert_array_equal(Q.saturating_cast_fp8(x).astype(np.float32), [448, -448, 448, 96])
    np.testing.assert_array_equal(np.asarray(Q.saturating_cast_fp8(jnp.asarray(x), "e4m3fnuz"), np.float32),
                                  [240, -240, 240, 96])
    w = np.ones((4, 8), np.float32)
    w[0, 0], w[1, 1] = 3e38, -3e38  # f32 scale = 3e38 / 448; w / s lands at +-448 up to rounding
    q, s = Q.quantize_fp8_blockwise(w, block=(4, 8))
    deq = Q.dequantize_fp8_blockwise(q, s)
    assert np.isfinite(deq).all() and abs(float(q[0, 0])) == 448.0 and float(q[1, 1]) == -448.0
    assert deq[0, 0] == np.float32(448.0) * s[0, 0]


def test_fp8_leading_dims_and_jit_match_numpy():
    w = _weights(rows=130, cols=70, seed=2)
    w3 = np.stack([w, -2 * w, w[::-1]])  # [3, 130, 70], blocks of 64 x 32 -> scale [3, 3, 3]
    q, s = Q.quantize_fp8_blockwise(w3, block=(64, 32), scale_fmt="ue8m0")
    assert s.shape == (3, 3, 3)
    for i in range(3):
        qi, si = Q.quantize_fp8_blockwise(w3[i], block=(64, 32), scale_fmt="ue8m0")
        np.testing.assert_array_equal(q[i].view(np.uint8), qi.view(np.uint8))
        np.testing.assert_array_equal(s[i], si)
    qz = jax.jit(lambda x: Q.quantize_fp8_blockwise(x, block=(64, 32), scale_fmt="ue8m0"))(jnp.asarray(w3))
    np.testing.assert_array_equal(np.asarray(qz[0]).view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qz[1]), s)
    deq = jax.jit(lambda a, b: Q.dequantize_fp8_blockwise(a, b, block=(64, 32)))(*qz)
    np.testing.assert_array_equal(np.asarray(deq), Q.dequantize_fp8_blockwise(q, s, block=(64, 32)))
    # f32 scales: XLA divides by 448 as a multiply by 1/448, so scales may differ by 1 ulp from numpy.
    _, sf = Q.quantize_fp8_blockwise(w3, block=(64, 32))
    _, sfj = jax.jit(lambda x: Q.quantize_fp8_blockwise(x, block=(64, 32)))(jnp.asarray(w3))
    np.testing.assert_allclose(np.asarray(sfj), sf, rtol=2.0**-23, atol=0)


def test_fp8_errors():
    with pytest.raises(ValueError, match="does not match"):
        Q.dequantize_fp8_blockwise(np.zeros((256, 256), FN), np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match="unknown fp8 format 'e5m2'"):
        Q.quantize_fp8_blockwise(np.ones((2, 2), np.float32), fmt="e5m2")
    with pytest.raises(ValueError, match="NaN or inf"):
        Q.quantize_fp8_blockwise(np.full((2, 2), np.inf, np.float32))


# ------------------------------------------------------------------------------------ fn <-> fnuz


def test_fn_to_fnuz_exact_over_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    finite = ~np.isin(b, [0x7F, 0xFF])  # 0x7f/0xff are NaN in e4m3fn
    q_fn, scale = b[finite].view(FN), np.float32(0.375)
    q_nuz, scale2 = Q.fp8_fn_to_fnuz(q_fn, scale)
    assert q_nuz.dtype == FNUZ and scale2 == np.float32(0.75)
    v_fn, v_nuz = q_fn.astype(np.float64) * 0.375, q_nuz.astype(np.float64) * 0.75
    assert np.isfinite(v_nuz).all() and len(v_nuz) == 254
    np.testing.assert_array_equal(v_nuz, v_fn)
    assert q_nuz.view(np.uint8)[b[finite] == 0x80] == 0x00  # -0 (fn) -> +0, never fnuz's NaN
    both_finite = np.isfinite(b.view(FN).astype(np.float32)) & np.isfinite(b.view(FNUZ).astype(np.float32))
    assert both_finite.sum() == 253
    np.testing.assert_array_equal(b.view(FN)[both_finite].astype(np.float32),
                                  2 * b.view(FNUZ)[both_finite].astype(np.float32))
    back, scale3 = Q.fp8_fnuz_to_fn(q_nuz, scale2)  # round trip: identical bytes except -0 -> +0
    expect = np.where(b[finite] == 0x80, 0, b[finite])
    np.testing.assert_array_equal(back.view(np.uint8), expect)
    assert back.dtype == FN and scale3 == np.float32(0.375)
    qj, sj = jax.jit(Q.fp8_fn_to_fnuz)(jnp.asarray(q_fn), jnp.float32(0.375))  # jnp path, same bytes
    np.testing.assert_array_equal(np.asarray(qj).view(np.uint8), q_nuz.view(np.uint8))
    assert float(sj) == 0.75


def test_fp8_conversion_nan_and_unrepresentable_bytes():
    q = np.array([[0x10, 0x7F]], np.uint8).view(FN)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight: 1 NaN byte"):
        Q.fp8_fn_to_fnuz(q, np.float32(1), name="layers.0.attn.wq_a.weight")
    with pytest.raises(ValueError, match="w1: 1 NaN byte"):
        Q.check_fp8_finite(np.array([0x80], np.uint8).view(FNUZ), name="w1")
    Q.check_fp8_finite(np.array([0x80], np.uint8).view(FN))  # -0 is fine in fn
    qn = np.array([0x7F, 0xFF, 0x7E], np.uint8).view(FNUZ)  # +-240 fnuz = +-480 in fn units > 448
    with pytest.raises(ValueError, match="not representable"):
        Q.fp8_fnuz_to_fn(qn, np.float32(2))
    qf, sf = Q.fp8_fnuz_to_fn(jnp.asarray(qn), jnp.float32(2))  # jnp path saturates (documented)
    np.testing.assert_array_equal(np.asarray(qf, np.float32), [448, -448, 448])
    e8 = np.array([127, 130], np.uint8)  # e8m0 byte scales move by one exponent step
    np.testing.assert_array_equal(Q.fp8_fn_to_fnuz(np.zeros(2, FN), e8)[1], [128, 131])
    np.testing.assert_array_equal(Q.fp8_fnuz_to_fn(np.zeros(2, FNUZ), e8)[1], [126, 129])


# ---------------------------------------------------------------------------------- format selection


@pytest.mark.parametrize(
    "platform,kind,expect",
    [
        ("rocm", "AMD Instinct MI300X", "e4m3fnuz"),
        ("gpu", "AMD Instinct MI308X", "e4m3fnuz"),
        ("gpu", "AMD Instinct MI300A", "e4m3fnuz"),
        ("rocm", "gfx942", "e4m3fnuz"),
        ("rocm", "AMD Instinct MI355X", "e4m3fn"),
        ("rocm", "gfx950", "e4m3fn"),
        ("gpu", "NVIDIA H200", "e4m3fn"),
        ("cpu", "cpu", "e4m3fn"),
    ],
)
def test_fp8_format_for_device_kind(platform, kind, expect):
    assert Q.fp8_format_for_device_kind(platform, kind) == expect


def test_select_fp8_format(caplog):
    class FakeDevice:
        platform, device_kind = "rocm", "AMD Instinct MI300X"

    with caplog.at_level("INFO", logger="dsv4.quant"):
        assert Q.select_fp8_format("auto", devices=[FakeDevice()]) == "e4m3fnuz"
    assert "e4m3fnuz" in caplog.text and "MI300X" in caplog.text
    assert Q.select_fp8_format("auto") == "e4m3fn"  # the CPU test devices
    explicit = {"fp8": "e4m3fn", "e4m3fn": "e4m3fn", "fp8_e4m3fnuz": "e4m3fnuz", "e4m3fnuz": "e4m3fnuz"}
    for name, expect in explicit.items():
        assert Q.select_fp8_format(name) == expect
    for bad in ("e5m2", "FP8", "", None):
        with pytest.raises(ValueError, match="accepted: 'auto', 'fp8'"):
            Q.select_fp8_format(bad)


# ---------------------------------------------------------------------------------- QuantizedTensor


def test_quantized_tensor_pytree_and_dequantize():
    w = _weights(rows=130, cols=64, seed=5)
    t8 = Q.QuantizedTensor.from_fp8(jnp.asarray(w), block=(64, 64))
    t4 = Q.QuantizedTensor.from_fp4(jnp.asarray(w))
    assert len(jax.tree.leaves(t8)) == 2 and t8.shape == (130, 64) and t4.q.shape == (130, 32)
    f = jax.jit(lambda t: t.dequantize(jnp.float32))
    ref8 = Q.dequantize_fp8_blockwise(np.asarray(t8.q), np.asarray(t8.scale), block=(64, 64))
    np.testing.assert_array_equal(np.asarray(f(t8)), ref8)
    np.testing.assert_array_equal(np.asarray(f(t4)), dequantize_fp4(np.asarray(t4.q), np.asarray(t4.scale)))
    t8u = t8.to_fp8_format("e4m3fnuz")
    assert t8u.fmt == "e4m3fnuz" and t8u.q.dtype == jnp.float8_e4m3fnuz
    np.testing.assert_array_equal(np.asarray(f(t8u)), np.asarray(f(t8)))
    with pytest.raises(ValueError, match="kind must be"):
        Q.QuantizedTensor(q=t8.q, scale=t8.scale, kind="int8", fmt="e4m3fn", block=(1, 1), shape=w.shape)


# ------------------------------------------------------------------------- activations (release act_quant)
# Golden numbers from the rule of DeepSeek-V4 `inference/kernel.py::act_quant` (ModelArgs.scale_fmt = "ue8m0"):
# per 1 x 128 block amax = max(max|x|, 1e-4), s = 2^ceil(log2(amax * f32(1/448))), q = e4m3(x / s), RNE.


def test_act_quant_ue8m0_golden():
    x = np.zeros((3, 160), np.float32)  # two blocks per row: 128 + 32 (the second zero-padded)
    x[0, :4] = [1.0, -3.5, 0.3, 0.1]  # amax 3.5: 3.5/448 = 2^-7 exactly -> s = 2^-7, q = 128 x
    x[0, 128] = 1.0  # block (0, 1): amax 1: 1/448 = 2.23e-3 in (2^-9, 2^-8] -> s = 2^-8, q = 256
    x[1, 0] = -0.0  # row 1, block 0: all zero (one -0): amax floored at 1e-4 -> 2.23e-7 in (2^-23, 2^-22] -> 2^-22
    x[2, :2] = [0.1, -1e-9]  # amax 0.1: 2.23e-4 in (2^-13, 2^-12] -> s = 2^-12
    q, s = Q.act_quant(x)
    assert q.shape == (3, 160) and q.dtype == np.dtype(FN) and s.shape == (3, 2) and s.dtype == np.float32
    np.testing.assert_array_equal(s, [[2.0**-7, 2.0**-8], [2.0**-22, 2.0**-22], [2.0**-12, 2.0**-22]])
    qf = np.asarray(q, np.float32)
    # 128 * (1, -3.5, 0.3, 0.1) = 128, -448, 38.4 -> 40 (spacing 4 in [32, 64)), 12.8 -> 13 (spacing 1 in [8, 16))
    np.testing.assert_array_equal(qf[0, :4], [128.0, -448.0, 40.0, 13.0])
    assert qf[0, 128] == 256.0
    # 0.1 * 2^12 = 409.6 -> 416 (spacing 32 in [256, 512)); -1e-9 * 2^12 underflows e4m3 to -0
    assert qf[2, 0] == 416.0
    b = np.asarray(q).view(np.uint8)
    # bytes: 40 = 1.25 * 2^5 -> exponent field 5 + 7 = 12, mantissa 0b010: 0x62; 448 = 1.75 * 2^8 -> 0x7e | sign
    assert b[0, 2] == 0x62 and b[0, 1] == 0xFE
    assert b[1, 0] == 0x80 and b[2, 1] == 0x80  # -0 and negative underflow keep the sign (IEEE cast)
    assert b[1, 1] == 0x00 and (b[1, 1:] == 0).all()


def test_act_quant_f32_option_and_jit():
    x = np.zeros((1, 128), np.float32)
    x[0, :2] = [1.0, 0.1]
    q, s = Q.act_quant(x, scale_fmt="f32")  # s = 1 * f32(1/448); q = 448 and 0.1 * 448 = 44.8 -> 44 (spacing 4)
    assert s[0, 0] == np.float32(1.0 / 448.0)
    np.testing.assert_array_equal(np.asarray(q, np.float32)[0, :2], [448.0, 44.0])
    qj, sj = jax.jit(lambda a: Q.act_quant(a))(jnp.asarray(x))  # the jnp path gives the same bytes
    qn, sn = Q.act_quant(x)
    np.testing.assert_array_equal(np.asarray(qj).view(np.uint8), np.asarray(qn).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sj), sn)
    # fake quant: q * s, exact in bf16: 1.0 -> 256 * 2^-8, 0.1 -> 26 * 2^-8 (25.6 -> 26, spacing 2 in [16, 32))
    y = Q.act_fake_quant(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32)[0, :2], [1.0, 26 / 256])
    with pytest.raises(ValueError, match="scale_fmt"):
        Q.act_quant(x, scale_fmt="e8m0")
