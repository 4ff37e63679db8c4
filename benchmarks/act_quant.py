"""Activation quantisation: the DeepSeek-V4 release's rule (ue8m0) vs exact f32 scales, on random data.

What it measures (numpy, CPU, seconds), for x [T, K] Gaussian (and x * a per-row log-uniform gain, so blocks span
magnitudes) and W [O, K] Gaussian:
- per element: max |fq_ue8m0(x) - fq_f32(x)| / max |x| (fq = quantise then dequantise per 1 x 128 block), where
  ue8m0 is the release's rule (`dsv4.quant.act_quant`, default) and f32 the exact-scale rule (amax / 448: V3's
  `act_quant`, this project's rule before issue 26);
- per GEMM: max |y_ue8m0 - y_f32| / max |y| with y = fq(x) @ W^T;
- error against the unquantised product, RMS relative, for each rule: what the f32 option is better for (it uses
  the whole e4m3 range, so it rounds less; the release's power-of-two scales waste up to one binade).

    .venv/bin/python benchmarks/act_quant.py [--t 256] [--k 4096] [--o 1024]

Last line: RESULT elem_max_rel_diff=.. gemm_max_rel_diff=.. elem_rms_err_ue8m0=.. elem_rms_err_f32=..
gemm_rms_err_ue8m0=.. gemm_rms_err_f32=..
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from dsv4 import quant


def fq_f32_exact(x: np.ndarray) -> np.ndarray:
    """The exact-f32 rule (V3 `act_quant`; this project's `fp8_linear` before issue 26): s = amax / 448 per 1 x 128
    block (1 for an all-zero block), q = e4m3(x / s), back to q * s."""
    t, k = x.shape
    xb = x.reshape(t, k // 128, 128)
    amax = np.abs(xb).max(-1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(xb / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * s).reshape(t, k)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", type=int, default=256)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--o", type=int, default=1024)
    args = ap.parse_args(argv)
    rs = np.random.default_rng(0)
    gain = np.exp(rs.uniform(np.log(1e-3), np.log(1e2), (args.t, 1))).astype(np.float32)
    x = (rs.standard_normal((args.t, args.k)).astype(np.float32) * gain).astype(ml_dtypes.bfloat16).astype(np.float32)
    w = (rs.standard_normal((args.o, args.k)) / np.sqrt(args.k)).astype(np.float32)
    xr = quant.act_fake_quant(x)  # the release's rule (ue8m0)
    xf = fq_f32_exact(x)
    y, yr, yf = x @ w.T, xr @ w.T, xf @ w.T
    rowmax = lambda a: np.abs(a).max(-1, keepdims=True)  # noqa: E731  per-row normaliser (rows span 5 decades)
    out = {
        "elem_max_rel_diff": float((np.abs(xr - xf) / rowmax(x)).max()),
        "gemm_max_rel_diff": float((np.abs(yr - yf) / rowmax(y)).max()),
        "elem_rms_err_ue8m0": float(np.sqrt(np.mean(((xr - x) / rowmax(x)) ** 2))),
        "elem_rms_err_f32": float(np.sqrt(np.mean(((xf - x) / rowmax(x)) ** 2))),
        "gemm_rms_err_ue8m0": float(np.sqrt(np.mean(((yr - y) / rowmax(y)) ** 2))),
        "gemm_rms_err_f32": float(np.sqrt(np.mean(((yf - y) / rowmax(y)) ** 2))),
    }
    print(f"x [{args.t}, {args.k}] (bf16 values, per-row gains 1e-3..1e2), W [{args.o}, {args.k}]; "
          "errors relative to each row's max |.|")
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
