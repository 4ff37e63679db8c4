"""FP8 vs BF16 matmul speed on the default device: what the rollout's FP8 GEMM path (`dsv4.fp8_gemm`) can gain.

What is measured, for square problems M = N = K = n (`--sizes`, default 8192) on `jax.devices()[0]`:
- bf16: `jnp.dot` of bf16 [n, n] x [n, n] with f32 accumulation (`preferred_element_type=float32`), bf16 out;
- fp8: `lax.dot_general` of float8_e4m3fn operands (the weight transposed, [N, K], as the rollout stores it) with
  `preferred_element_type=float32`: the form XLA lowers to an FP8 GEMM where the backend has one (CUDA sm90+:
  cuBLASLt; ROCm gfx942 / gfx950: hipBLASLt); on CPU XLA upcasts the operands (no speed-up expected);
- fp8_linear (reported, not in the ratio): `dsv4.fp8_gemm.fp8_linear`, the rollout's own path (activation quantised
  per 1 x 128 tile, weight 128 x 128 block scales, per-K-block partial sums); its extra work is the activation
  quantisation and the [K/128, M, N] f32 partials, so it is slower than the raw FP8 dot at large M.
TFLOP/s = 2 n^3 / median seconds of `--iters` calls (each `block_until_ready`, after one warm-up call that compiles).
ratio = fp8 / bf16 TFLOP/s (H100 / H200 datasheet peaks: 989 bf16, 1,979 fp8 dense TFLOP/s, so ~2 at best).
`fp8_gemm_available()` (the sampler's `matmul="auto"` choice) is printed with its reason.

Run:   .venv/bin/python benchmarks/fp8_matmul.py                     (JAX_PLATFORMS=cuda on a GPU host)
       .venv/bin/python benchmarks/fp8_matmul.py --sizes 256 --iters 2      (CPU smoke)
Last line: `RESULT fp8_tflops=.. bf16_tflops=.. ratio=.. fp8_linear_tflops=.. n=.. backend=..` (the largest size).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv4 import quant  # noqa: E402
from dsv4.fp8_gemm import fp8_gemm_available, fp8_linear  # noqa: E402


def _median_s(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + first call
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench(n: int, iters: int) -> dict:
    """TFLOP/s of the bf16 dot, the raw FP8 dot and `fp8_linear` for an n x n x n problem."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), jnp.float32)
    w = jax.random.normal(kw, (n, n), jnp.float32) / n ** 0.5  # [N, K], as the rollout stores a Linear
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    x8 = quant.saturating_cast_fp8(x, "e4m3fn")
    w8 = quant.saturating_cast_fp8(w * 16, "e4m3fn")
    wq = quant.QuantizedTensor.from_fp8(w, fmt="e4m3fn")
    bf16 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    fp8 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    lin = jax.jit(lambda a, q: fp8_linear(a, q, jnp.bfloat16))
    flops = 2.0 * n ** 3
    out = {"n": n}
    for name, fn, args in (("bf16", bf16, (xb, wb)), ("fp8", fp8, (x8, w8)), ("fp8_linear", lin, (xb, wq))):
        s = _median_s(fn, args, iters)
        out[name] = flops / s / 1e12
        print(f"  n={n:<6d} {name:<10s} {1e3 * s:9.3f} ms  {out[name]:8.2f} TFLOP/s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[8192], help="square problem sizes n (multiples of 128)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per engine and size (median)")
    args = ap.parse_args(argv)
    if any(n < 128 or n % 128 for n in args.sizes) or args.iters < 1:
        ap.error("--sizes: multiples of 128 (the FP8 block); --iters >= 1")
    dev = jax.devices()[0]
    ok, why = fp8_gemm_available()
    print(f"jax {jax.__version__}, device {dev.platform} {dev.device_kind}; fp8_gemm_available: {ok} ({why})",
          flush=True)
    rows = [bench(n, args.iters) for n in args.sizes]
    r = rows[-1]
    print(f"RESULT fp8_tflops={r['fp8']:.4g} bf16_tflops={r['bf16']:.4g} ratio={r['fp8'] / r['bf16']:.2f} "
          f"fp8_linear_tflops={r['fp8_linear']:.4g} n={r['n']} backend={dev.platform}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
