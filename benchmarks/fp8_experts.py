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
Not timed: no GPU here (`benchmarks/gpu_check.sh` is where a lent device times things).

Run:   .venv/bin/python benchmarks/fp8_experts.py            (needs the CUDA plugin: pip install -e '.[gpu-aot]')
       .venv/bin/python benchmarks/fp8_experts.py --rows 96 --target mi308x
Last line: `RESULT fp8_dots=.. dots=.. dequant_fp8_dots=.. dequant_dots=.. fp8_mib=.. dequant_mib=.. bytes_ratio=..
fp8_us=.. dequant_us=.. kernel_mib=.. kernel_us=.. rows=.. target=..`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def compile_stats(target_name: str, n: int, rows: int, d: int, i: int) -> dict:
    """{path: launch.hlo_stats.HloStats} of the fp8 and dequant expert FFNs compiled for `target_name`."""
    devices = gt.topology_devices(gt.TARGETS[target_name], 1)
    rep = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), PartitionSpec())

    def expert(shape):  # the stored layout of a layer's routed experts: FP8 blocks + f32 scales
        qt = jax.eval_shape(lambda: quant.QuantizedTensor.from_fp8(jnp.zeros(shape, jnp.float32)))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), qt)

    ws = [expert((n, i, d)), expert((n, i, d)), expert((n, d, i))]
    x = jax.ShapeDtypeStruct((n, rows, d), jnp.bfloat16, sharding=rep)
    g = jax.ShapeDtypeStruct((n, rows), jnp.float32, sharding=rep)
    kw = dict(limit=10.0, dtype=jnp.bfloat16)
    paths = {
        "kernel": lambda x, g, *w: padded_ffn(quantize_rows(x), g, *(dataclasses.replace(v, matmul="pallas")
                                                                      for v in w), **kw),
        "fp8": lambda x, g, *w: padded_ffn(quantize_rows(x), g, *w, fp8_rows_max=None, **kw),
        "dequant": lambda x, g, *w: padded_ffn(quant.act_fake_quant(x), g, *(v.dequantize(jnp.bfloat16) for v in w),
                                               act_q=quant.act_fake_quant, **kw),
    }
    opts = gt.compile_options({"xla_gpu_disable_gpuasm_optimizations": True})  # the same HLO, faster ptxas
    return {name: hlo_stats.count(jax.jit(fn).lower(x, g, *ws).compile(opts).as_text()) for name, fn in paths.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h200", help="launch/gpu_target.py target (h100, h200, b200, mi300x, ...)")
    ap.add_argument("--experts", type=int, default=32, help="local experts of one rank")
    ap.add_argument("--rows", type=int, default=24, help="rows per local expert (the padded buffer)")
    ap.add_argument("--hidden", type=int, default=4096, help="D")
    ap.add_argument("--inter", type=int, default=2048, help="I (moe_intermediate_size, or its tensor-parallel slice)")
    args = ap.parse_args(argv)
    if min(args.experts, args.rows, args.hidden, args.inter) < 1 or args.hidden % 128 or args.inter % 128:
        ap.error("--experts/--rows >= 1; --hidden/--inter multiples of 128 (the FP8 block)")
    if args.target not in gt.TARGETS:
        ap.error(f"--target {args.target!r}: expected one of {', '.join(gt.TARGETS)}")
    err = gt.plugin_error()
    if err is not None:
        print(f"--target {args.target}: {err}", file=sys.stderr)
        return 2
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
          f"kernel_us={us['kernel']:.1f} rows={args.rows} target={t.label.replace(' ', '_')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
