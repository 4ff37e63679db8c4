"""Learner at scale: compiled temp memory vs sequence length, compile time vs depth, dense vs blocked attention.

What is measured (CPU, XLA's own figures; the step is the real learner update, lowered by
`rl.algo.learner.Learner.lower`: forward, `rl.algo.logprobs.token_logprobs` with sequence chunks of 256, GRPO loss,
backward, clipping, AdamW; one row):
1. temp memory: `jax.jit(step).lower(state, batch).compile().memory_analysis().temp_size_in_bytes` of one train
   step of `DSV4Config.small()` (6 layers: sliding, CSA m=4 top-16, HCA m=16; window 64; fp32 compute; remat
   `block`) at S = 1K, 2K, 4K, 8K with the blocked attention, and with the dense reference at 1K and 2K (compile
   only; dense at 4K would need ~15 GB of temp). temp_ratio_8k_1k = temp(8K) / temp(1K), blocked (linear: 8,
   quadratic: 64). Sections 1 and 3 run the run's default learner path too (scanned layers).
2. compile time: `lower(...).compile()` wall time of the train step of a tiny-dimension model with 4, 12, 24 and 43
   layers (the Flash schedule of layer kinds: 2 sliding, then CSA/HCA alternating; S = 256), on the run's default
   path: layers under `lax.scan` per group of identical layers (`LearnerConfig.scan_layers`, the run's default
   `rl.config.run.DEFAULT_LEARNER`; dsv4/scan.py: 3 traced layer bodies at 4 layers, 4 at 12-43), state stacked.
   compile_ratio_43_4 = t(43) / t(4) scanned, t = this process's CPU seconds in `compile()` (XLA compiles on one
   thread; CPU time is robust to a loaded machine, wall time is not). Also (`--layers both`, default) the Python
   layer loop (`--no-scan-layers`), whose compile time grows with depth: compile_ratio_43_4_unrolled.
3. step time: median wall time of the compiled train step (`block_until_ready`, after a warm-up call) with dense
   and blocked attention at S = 1K and 4K, on a 3-layer `small` (one sliding, one CSA, one HCA layer: the 6-layer
   dense step at 4K does not fit the shared 24 GB machine). blocked_vs_dense_step_4k = dense time / blocked time
   at 4K (> 1: blocked faster).
4. MFU (`--sections mfu`): the median step time of the same train step on `--mfu-config` (default small, all
   6 layers) with `--mfu-batch` rows x `--mfu-seq` tokens, compute dtype bf16 on accelerators (f32 on CPU), and
   model FLOP utilisation mfu = model FLOPs / step s / peak FLOP/s (peak: `--peak-tflops`, default the datasheet
   dense bf16 figure of the device kind in PEAK_BF16_TFLOPS, nan when unknown, e.g. on CPU). Model FLOPs
   (`train_flops_per_token`, per token, x tokens = rows x seq; forward + backward = 3 x forward; rematerialised
   recompute NOT counted, as MFU is defined):
     matmul: 6 x (parameters of every float matrix a token goes through: attention and compressor / indexer
       projections, mHC, shared experts, router, lm head; routed experts x k / E; the embedding is a gather and
       the MTP block does not run in the RL step, so neither counts),
     attention: 6 x per layer 2 x heads x head_dim x ctx (QK^T and PV, one kv head), ctx = the entries a token
       attends: window + (CSA: index_topk; HCA: seq / (2 m), the mean over positions), plus CSA's indexer
       scoring 6 x index_heads x index_head_dim x seq / (2 m).
   XLA's own count of the compiled step (`cost_analysis()["flops"]`, remat and the loss included) is printed next
   to it as hfu (hardware FLOP utilisation).
5. context parallelism (`--context`, alone): temp memory per device of the same `small` train step at S = 8K,
   16K, 32K, 64K on meshes `actor:context=C`, C = 1, 2, 4 (4 forced CPU devices; the sequence split over C,
   dsv4/context.py), and the step time at 8K with C = 2 vs 1 (CPU collectives are slow: reported, no target).
   Last line instead: `RESULT cp_temp_ratio_64k_cp4_vs_16k_cp1=.. cp_step_ratio_cp2_vs_cp1=.. cp_step_s_cp1=..
   cp_step_s_cp2=..` (target of the first: <= 1.3).
XLA:CPU upcasts bf16 dots to f32, hence fp32 compute here. The machine may be shared and loaded: timings are noisy.

Run:   .venv/bin/python benchmarks/learner_scale.py              (about 5-10 minutes on 2 busy cores)
       .venv/bin/python benchmarks/learner_scale.py --quick      (fewer points; a smoke run)
       .venv/bin/python benchmarks/learner_scale.py --sections compile               (compile times only)
       .venv/bin/python benchmarks/learner_scale.py --sections compile --layers scan (scanned only; `--scan` too)
       .venv/bin/python benchmarks/learner_scale.py --sections mfu --mfu-batch 8 --mfu-seq 2048   (on a GPU)
       .venv/bin/python benchmarks/learner_scale.py --context          (section 5 alone, 4 CPU devices)
Last line: `RESULT temp_ratio_8k_1k=.. compile_ratio_43_4=.. blocked_vs_dense_step_4k=.. compile_ratio_43_4_unrolled=..
mfu=.. train_tflops=.. mfu_step_s=..` (fields of sections or layer paths not run are nan).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--context" in sys.argv:  # section 5 needs 4 host devices (one per context shard); before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from dsv4 import DSV4Config, DSV4ForCausalLM  # noqa: E402
from parallel.flops import train_flops_per_token  # noqa: E402
from rl.config.algo import LearnerConfig  # noqa: E402
from rl.config.run import DEFAULT_LEARNER  # noqa: E402
from rl.algo.batch import TrainBatch  # noqa: E402
from rl.algo.learner import Learner  # noqa: E402
from sharding.mesh import build_mesh_plan  # noqa: E402

MIB = 1 << 20
# Datasheet dense bf16 TFLOP/s per device kind (lower-case substring of `device_kind`), for the MFU section.
PEAK_BF16_TFLOPS = {"h200": 989.4, "h100": 989.4, "h800": 989.4, "a100": 312.0, "mi300x": 1307.4, "mi308x": 1307.4,
                    "mi355x": 2516.6}
MAX_RUN_TEMP_MIB = 8192  # do not execute a step whose temp exceeds this (the machine is shared, 24 GB)


def make_learner(cfg: DSV4Config, impl: str, remat: str = "block",
                 scan_layers: bool = DEFAULT_LEARNER.scan_layers, compute_dtype: str = "float32",
                 mesh=None) -> Learner:
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, attention_impl=impl)
    return Learner(model, LearnerConfig(lr=1e-5, compute_dtype=compute_dtype, logprob_chunk_size=256, remat=remat,
                                        scan_layers=scan_layers), mesh=mesh)


def make_batch(s: int, vocab: int, rows: int = 1) -> TrainBatch:
    ids = jax.random.randint(jax.random.key(s), (rows, s), 0, vocab, jnp.int32)
    resp = jnp.broadcast_to((jnp.arange(s) >= s // 2).astype(jnp.int32)[None], (rows, s))
    return TrainBatch(input_ids=ids, attention_mask=jnp.ones((rows, s), jnp.int32), response_mask=resp,
                      rollout_logprobs=jnp.zeros((rows, s), jnp.float32), advantages=jnp.ones((rows,), jnp.float32))


def peak_tflops(flag: float | None) -> float:
    """`--peak-tflops`, else PEAK_BF16_TFLOPS of the first device's kind, else nan."""
    if flag:
        return float(flag)
    kind = jax.devices()[0].device_kind.lower().replace(" ", "")
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), float("nan"))


def mfu_section(args) -> dict:
    """Train-step MFU (module docstring, item 4) -> {"mfu", "train_tflops", "step_s", "hfu"}."""
    cfg = getattr(DSV4Config, args.mfu_config)(torch_dtype="float32")
    dtype = args.mfu_dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    learner = make_learner(cfg, "blocked", compute_dtype=dtype)
    batch = make_batch(args.mfu_seq, cfg.vocab_size, rows=args.mfu_batch)
    compiled, comp_s, temp = compile_step(learner, batch)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_flops = float((cost or {}).get("flops", float("nan")))
    del compiled
    step_s = time_step(learner, batch, args.runs)
    per_tok = train_flops_per_token(cfg, args.mfu_seq)
    tokens = args.mfu_batch * args.mfu_seq
    flops = per_tok["total"] * tokens
    peak = peak_tflops(args.peak_tflops) * 1e12
    out = {"mfu": flops / step_s / peak, "train_tflops": flops / step_s / 1e12, "step_s": step_s,
           "hfu": xla_flops / step_s / peak}
    print(f"\nMFU: {args.mfu_config} {cfg.num_hidden_layers} layers, {args.mfu_batch} x {args.mfu_seq} tokens, "
          f"compute {dtype}, device {jax.devices()[0].device_kind}, peak {peak / 1e12:.1f} TFLOP/s\n"
          f"  compile {comp_s:.1f} s, temp {temp:.1f} MiB, step {step_s:.4f} s (median of {args.runs})\n"
          f"  model FLOPs {flops / 1e12:.3f} T (matmul {per_tok['matmul'] * tokens / 1e12:.3f} T, attention "
          f"{per_tok['attention'] * tokens / 1e12:.3f} T) -> {out['train_tflops']:.2f} TFLOP/s, mfu {out['mfu']:.4f}\n"
          f"  XLA cost_analysis FLOPs {xla_flops / 1e12:.3f} T -> hfu {out['hfu']:.4f}", flush=True)
    return out


def compile_step(learner: Learner, batch: TrainBatch, cpu_time: bool = False):
    """-> (compiled step, compile seconds, temp MiB): `Learner.lower`, the train step exactly as `update` runs it.
    Seconds are wall time, or with `cpu_time` this process's CPU time (`time.process_time`: what XLA's compile
    costs, robust to other processes loading the machine)."""
    lowered = learner.lower(batch)
    clock = time.process_time if cpu_time else time.perf_counter
    t0 = clock()
    compiled = lowered.compile()
    dt = clock() - t0
    return compiled, dt, compiled.memory_analysis().temp_size_in_bytes / MIB


def flash_like(n_layers: int) -> DSV4Config:
    """Tiny dims with the Flash schedule: 2 sliding layers, then CSA (m=4) / HCA (m=8) alternating, hash layers 3."""
    ratios = tuple([0, 0] + [(4, 8)[i % 2] for i in range(n_layers - 2)])[:n_layers] + (0,)
    return DSV4Config.tiny(num_hidden_layers=n_layers, compress_ratios=ratios, num_hash_layers=min(3, n_layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="S up to 2K, depths 4/12, step time at 1K only")
    ap.add_argument("--runs", type=int, default=2, help="timed step calls per point (median)")
    ap.add_argument("--sections", default="memory,compile",
                    help="comma list of memory (temp + step time), compile, mfu")
    ap.add_argument("--depths", default=None, help="comma-separated layer counts of the compile section "
                                                   "(default 4,12,24,43; must include 4)")
    ap.add_argument("--layers", choices=("both", "scan", "unrolled"), default="both",
                    help="compile section: scanned layers (the run's default; the headline), the Python loop, or both")
    ap.add_argument("--scan", action="store_true", help="the same as --layers scan (earlier name)")
    ap.add_argument("--context", action="store_true", help="section 5 only: temp memory and step time under "
                                                               "context parallelism (4 CPU devices)")
    ap.add_argument("--context-seqs", default="8192,16384,32768,65536", help="section 5: sequence lengths")
    ap.add_argument("--context-step-seq", type=int, default=8192, help="section 5: S of the step-time ratio")
    ap.add_argument("--mfu-config", default="small", choices=["tiny", "small"], help="mfu section: model config")
    ap.add_argument("--mfu-batch", type=int, default=8, help="mfu section: rows per train step")
    ap.add_argument("--mfu-seq", type=int, default=2048, help="mfu section: tokens per row")
    ap.add_argument("--mfu-dtype", default=None, help="mfu section: compute dtype (default bfloat16 on "
                                                       "accelerators, float32 on CPU)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="mfu section: peak TFLOP/s of one device "
                                                                     "(default: PEAK_BF16_TFLOPS by device kind)")
    args = ap.parse_args()
    if args.context:
        context_section(args)
        return
    sections = set(args.sections.split(","))
    seqs = (1024, 2048) if args.quick else (1024, 2048, 4096, 8192)
    depths = (4, 12) if args.quick else (4, 12, 24, 43)
    if args.depths:
        depths = tuple(int(d) for d in args.depths.split(","))
    step_seqs = (1024,) if args.quick else (1024, 4096)
    small = DSV4Config.small(torch_dtype="float32")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")

    temp: dict[tuple[str, int], float] = {}
    steps: dict[tuple[str, int], float] = {}
    comp: dict[tuple[bool, int], float] = {}  # (scanned, layers) -> compile s
    if "memory" in sections:
        memory_and_steps(small, seqs, step_seqs, args.runs, temp, steps)
    if "compile" in sections:
        layer_paths = {"both": (True, False), "scan": (True,), "unrolled": (False,)}["scan" if args.scan else args.layers]
        for scanned in layer_paths:
            print(f"\n{'scanned (default)' if scanned else 'Python-loop'} layers\n| layers | compile CPU s | "
                  f"temp MiB |\n|---|---|---|")
            for n in depths:
                cfg = flash_like(n)
                lr = make_learner(cfg, "blocked", scan_layers=scanned)
                _, comp[scanned, n], t = compile_step(lr, make_batch(256, cfg.vocab_size), cpu_time=True)
                print(f"| {n} | {comp[scanned, n]:.1f} | {t:.1f} |", flush=True)
                del lr
    nan = float("nan")
    mfu = mfu_section(args) if "mfu" in sections else {}
    s_hi, t_hi, d_hi = seqs[-1], step_seqs[-1], depths[-1]
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    temp_ratio = temp.get(("blocked", s_hi), nan) / temp.get(("blocked", 1024), nan)
    comp_ratio = {sc: comp.get((sc, d_hi), nan) / comp.get((sc, 4), nan) for sc in (True, False)}
    step_ratio = steps.get(("dense", t_hi), nan) / steps.get(("blocked", t_hi), nan)
    print(f"RESULT temp_ratio_{s_hi // 1024}k_1k={temp_ratio:.2f} compile_ratio_{d_hi}_4={comp_ratio[True]:.2f} "
          f"blocked_vs_dense_step_{t_hi // 1024}k={step_ratio:.2f} "
          f"compile_ratio_{d_hi}_4_unrolled={comp_ratio[False]:.2f} mfu={mfu.get('mfu', nan):.4f} "
          f"train_tflops={mfu.get('train_tflops', nan):.4g} mfu_step_s={mfu.get('step_s', nan):.4f}")


def context_section(args) -> None:
    """Section 5 (`--context`): temp MiB per device of the `small` train step (one row, fp32, remat block, scanned
    layers) at S in `--context-seqs` on meshes `actor:context=C`, C = 1, 2, 4 (compile only), and the step time
    at `--context-step-seq` with C = 1 and 2 (median of `--runs`). Prints the table and the RESULT line
    `cp_temp_ratio_64k_cp4_vs_16k_cp1` = temp(64K, C=4) / temp(16K, C=1) (four times the tokens on four times the
    devices; target <= 1.3) and `cp_step_ratio_cp2_vs_cp1` = step(C=2) / step(C=1) at the same S."""
    small = DSV4Config.small(torch_dtype="float32")
    seqs = [int(x) for x in args.context_seqs.split(",")]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices, {os.cpu_count()} "
          f"CPUs, load average {os.getloadavg()[0]:.1f}")
    learners = {c: make_learner(small, "blocked", mesh=build_mesh_plan(f"actor:context={c}", config=small).actor)
                for c in (1, 2, 4)}
    temp: dict[tuple[int, int], float] = {}
    print("\n| S | context=1 temp MiB | context=2 | context=4 |\n|---|---|---|---|")
    for s in seqs:
        for c, lr in learners.items():
            _, _, temp[c, s] = compile_step(lr, make_batch(s, small.vocab_size))
        print(f"| {s} | " + " | ".join(f"{temp[c, s]:.1f}" for c in learners) + " |", flush=True)
    step = {}
    for c in (1, 2):
        step[c] = time_step(learners[c], make_batch(args.context_step_seq, small.vocab_size), args.runs)
        print(f"step S={args.context_step_seq} context={c}: {step[c]:.3f} s (median of {args.runs})", flush=True)
    nan = float("nan")
    ratio = temp.get((4, 65536), nan) / temp.get((1, 16384), nan)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print(f"RESULT cp_temp_ratio_64k_cp4_vs_16k_cp1={ratio:.3f} cp_step_ratio_cp2_vs_cp1={step[2] / step[1]:.3f} "
          f"cp_step_s_cp1={step[1]:.3f} cp_step_s_cp2={step[2]:.3f}")


def time_step(learner: Learner, batch: TrainBatch, runs: int) -> float:
    """Median seconds of `runs` `Learner.update` calls after one warm-up call (which compiles)."""
    jax.block_until_ready(learner.update(batch))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(learner.update(batch))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def memory_and_steps(small, seqs, step_seqs, runs, temp, steps) -> None:
    """Fill temp[(impl, S)] (MiB, 6-layer small, compile only) and steps[(impl, S)] (s, 3-layer small); print."""
    learners = {impl: make_learner(small, impl) for impl in ("blocked", "dense")}
    print("\n| S | blocked temp MiB | dense temp MiB |\n|---|---|---|")
    for s in seqs:
        batch = make_batch(s, small.vocab_size)
        for impl in ("blocked", "dense"):
            if impl == "dense" and s > 2048:
                continue  # dense at 4K / 8K: GiBs of scores (quadratic), skipped
            _, _, temp[impl, s] = compile_step(learners[impl], batch)
        fmt = lambda d, k: f"{d[k]:.1f}" if k in d else "-"  # noqa: E731
        print(f"| {s} | {fmt(temp, ('blocked', s))} | {fmt(temp, ('dense', s))} |", flush=True)
    del learners
    three = DSV4Config.small(torch_dtype="float32", num_hidden_layers=3, compress_ratios=(0, 4, 16, 0))
    learners = {impl: make_learner(three, impl) for impl in ("blocked", "dense")}
    print("\n3-layer small (sliding, CSA, HCA): train step\n| S | impl | temp MiB | step s |\n|---|---|---|---|")
    for s in step_seqs:
        batch = make_batch(s, three.vocab_size)
        for impl in ("dense", "blocked"):
            compiled, _, t = compile_step(learners[impl], batch)
            if t > MAX_RUN_TEMP_MIB:
                print(f"| {s} | {impl} | {t:.1f} | not run (temp > {MAX_RUN_TEMP_MIB} MiB) |", flush=True)
                continue
            steps[impl, s] = time_step(learners[impl], batch, runs)
            print(f"| {s} | {impl} | {t:.1f} | {steps[impl, s]:.3f} |", flush=True)
            del compiled


if __name__ == "__main__":
    main()
