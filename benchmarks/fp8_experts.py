"""FP8 expert GEMMs vs the dequant path: one rank's routed-expert FFN of the padded EP dispatch, compiled by XLA:GPU.

What is compiled (deviceless, `--target` of launch/gpu_target.py, default the H200 spec; no GPU needed), for one
rank's local experts at Flash's decode shapes (`--experts` 32 = 256 / ep 8, D = 4096, I = 2048; `--rows` per local
expert: default 24 = the routed rows at 128 tokens per rank (8 x 128 x 6 / 256), what an exact dispatch at the
routed cost runs (issue 37 item 2); today's "sized" dispatch pads random routing to C = 12 per source rank: 96 rows):
- fp8: `parallel.padded.padded_ffn` on FP8 rows (1 x 128 ue8m0 blocks) and the layer's FP8 128 x 128 expert blocks
  (`dsv4.fp8_gemm.fp8_expert_matmul`: one dot per K block batched over the experts, f32 partials), forced at any
  row count (`fp8_rows_max=None`; the dispatch itself takes it up to `parallel.padded.fp8_rows_limit` rows: 128
  in bf16), the K blocks' partial sums in bf16;
- kernel: the same FFN with the experts' `matmul` "pallas": the block-scaled FP8 GEMM kernel (`dsv4.fp8_kernel`,
  a Triton custom call applying both operands' scales inside; no K-block partials, no row limit);
- dequant: today's path for quantised experts (`dsv4.moe.MoE` before this change, and still `--rollout.matmul
  dequant` / CPU `auto`): the layer's experts dequantised to bf16, fake-quantised rows and w2 input, bf16 dots.
Counted from the optimized HLO (launch/hlo_stats.py, per program run): dots and dots with an f8 operand, GFLOP, MiB
read + written by the kernels; roofline us = max(bytes / HBM bandwidth, flops / the target's dense BF16 peak) (the
BF16 peak for both: FP8's is 2x on H100 / H200, so the FP8 figure is conservative where flop-bound).
`--device`: on the machine's own GPU instead (benchmarks/gpu_check.sh, where a device is lent): each path compiled
for it, run on random FP8 experts and timed (median of `--iters` calls), the kernel's and XLA's FP8 outputs
compared with the dequant path's (max error relative to its largest output), beside the same counts and roofline.

Run:   .venv/bin/python benchmarks/fp8_experts.py            (needs the CUDA plugin: pip install -e '.[gpu-aot]')
       .venv/bin/python benchmarks/fp8_experts.py --rows 96 --target mi308x
       .venv/bin/python benchmarks/fp8_experts.py --device       (on a GPU)
Last line: `RESULT fp8_dots=.. dots=.. dequant_fp8_dots=.. dequant_dots=.. fp8_mib=.. dequant_mib=.. bytes_ratio=..
fp8_us=.. dequant_us=.. kernel_mib=.. kernel_us=.. rows=.. target=..`; with `--device` also `kernel_us_measured=..
fp8_us_measured=.. dequant_us_measured=.. kernel_err=.. fp8_err=..`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--device" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless compiles: the CUDA plugin's device check is skipped

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from dsv4 import quant  # noqa: E402
from dsv4.fp8_gemm import quantize_rows  # noqa: E402
from launch import gpu_target as gt  # noqa: E402
from launch import hlo_stats  # noqa: E402
from parallel.padded import fp8_rows_limit, padded_ffn  # noqa: E402


def _paths() -> dict:
    kw = dict(limit=10.0, dtype=jnp.bfloat16)
    return {
        "kernel": lambda x, g, *w: padded_ffn(quantize_rows(x), g, *(dataclasses.replace(v, matmul="pallas")
                                                                      for v in w), **kw),
        "fp8": lambda x, g, *w: padded_ffn(quantize_rows(x), g, *w, fp8_rows_max=None, **kw),
        "dequant": lambda x, g, *w: padded_ffn(quant.act_fake_quant(x), g, *(v.dequantize(jnp.bfloat16) for v in w),
                                               act_q=quant.act_fake_quant, **kw),
    }


def compile_stats(target_name: str, n: int, rows: int, d: int, i: int) -> dict:
    """{path: launch.hlo_stats.HloStats} of the kernel, fp8 and dequant expert FFNs compiled for `target_name`."""
    devices = gt.topology_devices(gt.TARGETS[target_name], 1)
    rep = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), PartitionSpec())

    def expert(shape):  # the stored layout of a layer's routed experts: FP8 blocks + f32 scales
        qt = jax.eval_shape(lambda: quant.QuantizedTensor.from_fp8(jnp.zeros(shape, jnp.float32)))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), qt)

    ws = [expert((n, i, d)), expert((n, i, d)), expert((n, d, i))]
    x = jax.ShapeDtypeStruct((n, rows, d), jnp.bfloat16, sharding=rep)
    g = jax.ShapeDtypeStruct((n, rows), jnp.float32, sharding=rep)
    opts = gt.compile_options({"xla_gpu_disable_gpuasm_optimizations": True})  # the same HLO, faster ptxas
    return {name: hlo_stats.count(jax.jit(fn).lower(x, g, *ws).compile(opts).as_text())
            for name, fn in _paths().items()}


def device_run(n: int, rows: int, d: int, i: int, iters: int) -> tuple[dict, dict, dict]:
    """On jax.devices()[0]: ({path: HloStats of its own compile}, {path: median us}, {path: max |y - y_dequant| /
    max |y_dequant|}) for random FP8 experts (0.02 x N(0, 1) before quantisation) and rows N(0, 1)."""
    k = jax.random.split(jax.random.key(0), 5)
    w = [jax.jit(quant.QuantizedTensor.from_fp8)(0.02 * jax.random.normal(kk, s, jnp.float32))
         for kk, s in zip(k[:3], ((n, i, d), (n, i, d), (n, d, i)))]
    x = jax.random.normal(k[3], (n, rows, d), jnp.bfloat16)
    g = jax.random.uniform(k[4], (n, rows), jnp.float32)
    st, us, out = {}, {}, {}
    for name, fn in _paths().items():
        compiled = jax.jit(fn).lower(x, g, *w).compile()
        st[name] = hlo_stats.count(compiled.as_text())
        out[name] = np.asarray(jax.block_until_ready(compiled(x, g, *w)), np.float32)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(x, g, *w))
            times.append(time.perf_counter() - t0)
        us[name] = 1e6 * float(np.median(times))
    ref = np.abs(out["dequant"]).max()
    err = {name: float(np.abs(out[name] - out["dequant"]).max() / ref) for name in ("kernel", "fp8")}
    return st, us, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="launch/gpu_target.py target (h100, h200, b200, mi300x, ...); "
                                                  "default h200, or with --device the device's own kind where known")
    ap.add_argument("--experts", type=int, default=32, help="local experts of one rank")
    ap.add_argument("--rows", type=int, default=24, help="rows per local expert (the padded buffer)")
    ap.add_argument("--hidden", type=int, default=4096, help="D")
    ap.add_argument("--inter", type=int, default=2048, help="I (moe_intermediate_size, or its tensor-parallel slice)")
    ap.add_argument("--device", action="store_true", help="compile, run and time on this machine's GPU")
    ap.add_argument("--iters", type=int, default=20, help="--device: timed calls per path (median)")
    args = ap.parse_args(argv)
    if min(args.experts, args.rows, args.hidden, args.inter) < 1 or args.hidden % 128 or args.inter % 128:
        ap.error("--experts/--rows >= 1; --hidden/--inter multiples of 128 (the FP8 block)")
    if args.target is not None and args.target not in gt.TARGETS:
        ap.error(f"--target {args.target!r}: expected one of {', '.join(gt.TARGETS)}")
    measured = ""
    if args.device:
        if jax.devices()[0].platform != "gpu":
            print(f"--device: no GPU here ({jax.devices()[0].platform})", file=sys.stderr)
            return 2
        kind = jax.devices()[0].device_kind.lower()
        t = gt.TARGETS[args.target or next((n for n in ("h100", "h200", "b200") if n in kind), "h200")]
        st, us_m, err_m = device_run(args.experts, args.rows, args.hidden, args.inter, args.iters)
        for name in st:
            print(f"  {name:<8s} measured {us_m[name]:9.1f} us on {jax.devices()[0].device_kind}"
                  + (f"  (max error vs dequant {err_m[name]:.2e} of its largest output)" if name in err_m else ""))
        measured = (f" kernel_us_measured={us_m['kernel']:.1f} fp8_us_measured={us_m['fp8']:.1f} "
                    f"dequant_us_measured={us_m['dequant']:.1f} kernel_err={err_m['kernel']:.2e} "
                    f"fp8_err={err_m['fp8']:.2e}")
    else:
        err = gt.plugin_error()
        if err is not None:
            print(f"--target {args.target}: {err}", file=sys.stderr)
            return 2
        args.target = args.target or "h200"
        t = gt.TARGETS[args.target]
        st = compile_stats(args.target, args.experts, args.rows, args.hidden, args.inter)
    us = {}
    for name, s in st.items():
        us[name] = 1e6 * max(s.bytes / t.hbm_bw, s.flops / t.peak_flops)
        print(f"  {name:<8s} dots {s.dots:4d} (f8 {s.fp8_dots:4d})  {s.flops / 1e9:8.2f} GFLOP  "
              f"{s.bytes / 2**20:9.1f} MiB  roofline {us[name]:8.1f} us", flush=True)
    f, q, kn = st["fp8"], st["dequant"], st["kernel"]
    lim = fp8_rows_limit(jnp.bfloat16)
    print(f"  the dispatch's choice at {args.rows} rows per expert: kernel (--rollout.matmul auto on a GPU); with "
          f"--rollout.matmul fp8: {'fp8' if args.rows <= lim else 'dequant'} (fp8_rows_limit(bf16) = {lim})")
    print(f"RESULT fp8_dots={f.fp8_dots} dots={f.dots} dequant_fp8_dots={q.fp8_dots} dequant_dots={q.dots} "
          f"fp8_mib={f.bytes / 2**20:.1f} dequant_mib={q.bytes / 2**20:.1f} bytes_ratio={q.bytes / f.bytes:.2f} "
          f"fp8_us={us['fp8']:.1f} dequant_us={us['dequant']:.1f} kernel_mib={kn.bytes / 2**20:.1f} "
          f"kernel_us={us['kernel']:.1f} rows={args.rows} target={t.label.replace(' ', '_')}{measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
