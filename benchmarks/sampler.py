"""Rollout sampler decode speed: ours (`rl.rollout.engine.Sampler`, jitted) vs transformers 5.23 `generate`, same
weights, same CPU, same run; plus the memory-bandwidth roofline and the resident weight bytes of FP8 vs BF16.

What is measured, per config (tiny, small) and batch B (1, 8, 32), prompts of P = 32 random tokens, greedy:
- ours: `Sampler(model, weights=..., max_prompt_len=P, dequant=..., compute_dtype=...)`, weight modes
    bf16          bf16 weights and matmuls
    fp8           FP8 e4m3 128x128-block weights, each layer dequantised to bf16 right before it runs, in the
                  prefill and every decode step (dequant="per_layer", the sampler's default)
    fp8_call      (optional) the same dequantised once per `generate` (dequant="per_call", the old default)
    fp8_step      the same with dequant="per_step" (timed at --per-step-batches only)
    fp8_f32       (optional) FP8 weights dequantised to f32 (`compute_dtype=float32`)
    fp32          (optional) f32 weights
    *_ragged      (optional, diagnostic) the same with the model's stock `ragged_dot` routed experts instead of
                  the sampler's CPU default (`dsv4.moe.routed_experts_cpu`): what XLA:CPU's ragged_dot
                  fallback costs.
  `SamplingParams(temperature=0, max_new_tokens=N)` without stop ids: every row runs to N (checked).
  The first call compiles (warm-up); then timed calls at N = 33, 48, 64 (one compiled bucket, t_cap = 64).
- transformers: `DeepseekV4ForCausalLM` (eager attention; fp32 by default, `--hf-dtypes fp32 bf16` for both),
  `generate(do_sample=False, use_cache=True, max_new_tokens=8, min_new_tokens=8, eos_token_id=None)`, one
  warm-up call, then timed calls, at `torch.set_num_threads(2)` and at 1 thread (`--hf-threads`): in this
  process (XLA's thread pool alongside) torch's 2-thread pool sometimes runs 10-50x slower than 1 thread, so
  both are timed and the faster is transformers' figure.
- decode tok/s (prefill EXCLUDED on both sides):
    ours: B / s-per-step, s-per-step = the median of the pairwise slopes of (N, best wall time of a whole
      `generate` call at N) over N = 33, 48, 64 (a call = one prefill + N decode steps, so the slope is the
      decode step; the prefill and the per-call dequantisation cancel);
    transformers: B / mean decode step, the steps timed inside `generate` by a logits processor (called once
      per token right after its forward: the intervals are whole decode steps), best round.
  Both include the sampling head (greedy). Rounds interleave all engines of one (config, B), so a load change
  of the shared machine hits them alike; the best round because other jobs only add time.
  e2e tok/s (prefill INCLUDED) = B * N / best wall time of a call (ours N = 64, transformers N = 8).
- roofline: bytes a decode step reads / memory bandwidth; roofline tok/s = B * bandwidth / bytes, roof % = ours
  decode tok/s / roofline tok/s. The bytes are counted from the model ('model') and from the compiled decode
  step's matmul operands ('HLO'); both counts and the bandwidth are defined in benchmarks/sampler_bytes.py.
- memory: resident weight bytes of the sampler = sum of nbytes over `sampler.weight_state()` leaves (q and
  scale for FP8); `--rss` also runs one child process per mode (small, B = 8) and reports its RSS after the
  model is dropped and one warm-up `generate`, and the peak RSS of a second `generate`.
- `--breakdown B..`: ms per decode step of variants of a jitted `decode_step` loop (routed experts by ragged_dot /
  by `routed_experts_cpu` / zeroed, bf16 / f32, sampling head alone) on small at those batches.
- compiled memory (`--memory-only` runs just this): XLA's `memory_analysis()` of the generate program per weight
  mode, as fractions of the fp32 program's argument bytes: `<mode>_temp_excess` = (temp - fp32 temp) / fp32 args
  and `<mode>_args_frac` = args / fp32 args (benchmarks/sampler_bytes.py).

Run:   .venv/bin/python benchmarks/sampler.py                 (defaults; see --help)
       .venv/bin/python benchmarks/sampler.py --configs small --batches 8 --modes bf16 fp8 --rounds 3
       .venv/bin/python benchmarks/sampler.py --configs --breakdown 1 8 --rss     (diagnostics only)
Compilation is not timed; a persistent jax compilation cache (--compile-cache, default in the temp dir) makes
reruns start faster.
The last line is `RESULT ours_tok_s=.. hf_tok_s=.. ratio_vs_hf=.. roofline_frac=.. roofline_frac_model_bytes=..`
followed by the memory fields
for small, B = 8 (else the last config and first batch run), bf16 weights (`--hf-dtypes` with no value: no
transformers run, hf fields nan; what benchmarks/gpu_check.sh does on a GPU, where the roofline's bandwidth is
the jitted on-device copy's, i.e. HBM): ours decode tok/s, transformers decode tok/s (its fastest --hf-dtypes x
--hf-threads row), their ratio, and ours as a fraction of the roofline from the HLO bytes and from the model's
bf16 bytes.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sampler_bytes import (CONFIGS, MODES, PROMPT_LEN, T_CAP, compiled_memory,  # noqa: E402
                                      decode_step_hlo_bytes, make_sampler, memcpy_bandwidth, memory_result,
                                      ours_fn, resident_weight_bytes, step_bytes)
from dsv4 import DSV4Config, load_hf_checkpoint  # noqa: E402
from dsv4.moe import routed_experts_cpu, routed_experts_ragged  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "dsv4"))
from hf_ref import hf_model  # noqa: E402


# ------------------------------------------------------------------------------------------ models
def build_hf(cfg: DSV4Config, seed: int = 0):
    """transformers `DeepseekV4ForCausalLM` for `cfg` with every parameter/buffer randomised
    (`tests/dsv4/hf_ref.py`'s `hf_model`, matrices scaled by 1/sqrt(fan_in) so the 512-wide `small` stays finite)."""
    return hf_model(cfg, seed=seed, weight_std=None)


# ------------------------------------------------------------------------------------------ timing
def theil_sen_slope(t_of_n: dict) -> float:
    """Seconds per decode step: the median of the pairwise slopes of (N, best time of a call) - robust to one
    disturbed point, and with two points simply the difference quotient."""
    ns = sorted(t_of_n)
    return float(np.median([(t_of_n[b] - t_of_n[a]) / (b - a) for i, a in enumerate(ns) for b in ns[i + 1:]]))


def hf_fn(model, prompts, n: int, threads: int):
    """A blocking transformers `generate` of n tokens; returns (wall s, [wall s of each decode step]). The decode
    steps are timed by a logits processor, which runs once per generated token right after that token's forward:
    the intervals between its calls are whole decode steps (forward + greedy pick), the prefill excluded."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    def run():
        torch.set_num_threads(threads)
        stamp = Stamp()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 use_cache=True, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                                 logits_processor=LogitsProcessorList([stamp]))
        wall = time.perf_counter() - t0
        if out.shape[1] != ids.shape[1] + n or len(stamp.t) != n:
            raise RuntimeError(f"transformers: {out.shape[1] - ids.shape[1]} new tokens, {len(stamp.t)} steps != {n}")
        return wall, list(np.diff(stamp.t))

    return run


def bench_config(name: str, args) -> list[dict]:
    import torch

    cfg = CONFIGS[name](torch_dtype="float32")
    hf = build_hf(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_hf_checkpoint(d, dtype=jnp.float32)
    hf_models = {}
    for dt in args.hf_dtypes:
        for th in args.hf_threads:
            hf_models[f"hf_{dt}_t{th}"] = (hf if dt == "fp32" else _bf16_copy(hf), th)
    samplers = {m: make_sampler(ours, m) for m in args.modes}
    del ours
    gc.collect()
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"[{name}] {n_params / 1e6:.1f}M params; resident weight bytes: "
          + ", ".join(f"{m} {resident_weight_bytes(s) / 2**20:.1f} MiB" for m, s in samplers.items()), flush=True)
    rows = []
    rs = np.random.RandomState(0)
    rounds = args.rounds or (7 if name == "tiny" else 2)
    for b in args.batches:
        prompts = [list(map(int, rs.randint(2, cfg.vocab_size, PROMPT_LEN))) for _ in range(b)]
        args.bw_samples.append(memcpy_bandwidth())
        fns, compile_s, hlo_bytes = {}, {}, {}
        for m, s in samplers.items():
            if MODES[m][1] == "per_step" and b not in args.per_step_batches:
                continue
            for n in args.ns:
                fns[(m, n)] = ours_fn(s, prompts, n)
            t = time.perf_counter()
            fns[(m, max(args.ns))]()
            compile_s[m] = time.perf_counter() - t  # compile + first call: the warm-up (all ns share it)
            hlo_bytes[m] = decode_step_hlo_bytes(s, prompts, max(args.ns))
        hf_runs = {}
        for eng, (model, th) in hf_models.items():
            hf_runs[eng] = hf_fn(model, prompts, args.hf_new, th)
            hf_runs[eng]()  # warm-up
        # rounds: every engine in turn, so a load change hits all of them alike
        times = {k: [] for k in fns}
        hf_res = {k: [] for k in hf_runs}
        for _ in range(rounds):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
            for k, fn in hf_runs.items():
                hf_res[k].append(fn())
        torch.set_num_threads(2)
        for eng in dict.fromkeys(e for e, _ in fns):
            best = {n: min(times[(eng, n)]) for n in args.ns}
            dt_step = theil_sen_slope(best)
            sb = step_bytes(samplers[eng], eng, b, PROMPT_LEN + T_CAP)
            n_max = max(args.ns)
            row = {"config": name, "B": b, "engine": eng, "step_ms": 1e3 * dt_step,
                   "decode_tok_s": b / dt_step if dt_step > 0 else float("nan"), "e2e_tok_s": b * n_max / best[n_max],
                   "compile_s": compile_s[eng], "bytes": sb, "hlo_bytes": hlo_bytes[eng],
                   "resident": resident_weight_bytes(samplers[eng])}
            rows.append(row)
            print(f"  {name} B={b:<3d} {eng:<12s} " + " ".join(f"t({n})={best[n]:.3f}s" for n in args.ns)
                  + f" step {row['step_ms']:.2f} ms decode {row['decode_tok_s']:.1f} tok/s "
                  f"(compile + first call {row['compile_s']:.1f}s)", flush=True)
        for eng, res in hf_res.items():
            step = min(float(np.mean(steps)) for _, steps in res)  # the best round's mean decode step
            med = float(np.median([x for _, steps in res for x in steps]))
            row = {"config": name, "B": b, "engine": eng, "step_ms": 1e3 * step, "decode_tok_s": b / step,
                   "e2e_tok_s": b * args.hf_new / min(w for w, _ in res), "median_step_ms": 1e3 * med}
            rows.append(row)
            print(f"  {name} B={b:<3d} {eng:<12s} t({args.hf_new})={min(w for w, _ in res):.3f}s step "
                  f"{row['step_ms']:.2f} ms (median step {row['median_step_ms']:.2f} ms) decode "
                  f"{row['decode_tok_s']:.1f} tok/s", flush=True)
    return rows


def _bf16_copy(model):
    import copy

    import torch

    return copy.deepcopy(model).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ step breakdown
def _zero_dispatch(x, ids, weights, w1, w3, w2, *, limit, dtype):
    """Routed experts replaced by zeros (router still runs): the rest of the step."""
    return jnp.zeros(x.shape, jnp.float32)


def step_breakdown(name: str, batch: int, n_hi: int = 24, n_lo: int = 8) -> list[tuple]:
    """ms per decode step of `dsv4.cache.decode_step` + greedy argmax run in a jitted `fori_loop` (weights loop-
    invariant, as in the sampler's while loop), on random weights, for variants that isolate the routed experts,
    the matmul dtype and the sampling head: (t(n_hi) - t(n_lo)) / (n_hi - n_lo), wall and process CPU time
    (the best of 2)."""
    from flax import nnx

    from dsv4 import DSV4ForCausalLM
    from dsv4.cache import decode_step, prefill
    from rl.rollout.sampling import sample_tokens

    cfg = CONFIGS[name]()
    cache_len = PROMPT_LEN + T_CAP
    ids = jnp.asarray(np.random.RandomState(0).randint(2, cfg.vocab_size, (batch, PROMPT_LEN)), jnp.int32)
    lens = jnp.full((batch,), PROMPT_LEN, jnp.int32)
    variants = [("bf16 ragged_dot experts", jnp.bfloat16, routed_experts_ragged),
                ("bf16 small-batch experts", jnp.bfloat16, routed_experts_cpu),
                ("bf16 routed experts -> 0", jnp.bfloat16, _zero_dispatch),
                ("fp32 ragged_dot experts", jnp.float32, routed_experts_ragged),
                ("fp32 small-batch experts", jnp.float32, routed_experts_cpu),
                ("fp32 routed experts -> 0", jnp.float32, _zero_dispatch),
                ("sampling head only (greedy)", None, None)]
    out = []
    models = {}
    for label, dt, fn in variants:
        if dt is None:
            logits0 = jax.random.normal(jax.random.key(0), (batch, cfg.vocab_size), jnp.float32)
            keys = jax.random.split(jax.random.key(1), batch)

            def loop(st, tok, c, n):
                def body(i, carry):
                    tok, c = carry
                    lg = logits0 + tok[:, None].astype(jnp.float32) * 1e-3
                    return sample_tokens(lg, keys, jnp.float32(0.0), jnp.float32(1.0), jnp.int32(0))[0], c
                return jax.lax.fori_loop(0, n, body, (tok, c))

            st = caches = None
        else:
            if dt not in models:
                models[dt] = nnx.split(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=dt, dtype=dt))
            gd, st = models[dt]
            caches = jax.jit(lambda st, gd=gd: prefill(nnx.merge(gd, st), ids, lens, cache_len)[2])(st)

            def loop(st, tok, c, n, gd=gd, fn=fn):
                m = nnx.merge(gd, st)

                def body(i, carry):
                    tok, c = carry
                    logits, _, c = decode_step(m, tok, lens + i, c, dispatch_fn=fn)
                    return jnp.argmax(logits, -1).astype(jnp.int32), c
                return jax.lax.fori_loop(0, n, body, (tok, c))

        f = jax.jit(loop)
        tok = ids[:, -1]
        jax.block_until_ready(f(st, tok, caches, n_lo))  # compile
        best = {}
        for _ in range(2):
            for n in (n_hi, n_lo):
                t, c = time.perf_counter(), time.process_time()
                jax.block_until_ready(f(st, tok, caches, n))
                w, cp = time.perf_counter() - t, time.process_time() - c
                best[n] = (min(best.get(n, (w, cp))[0], w), min(best.get(n, (w, cp))[1], cp))
        k = n_hi - n_lo
        out.append((label, 1e3 * (best[n_hi][0] - best[n_lo][0]) / k, 1e3 * (best[n_hi][1] - best[n_lo][1]) / k))
        print(f"  breakdown {name} B={batch:<3d} {label:<28s} wall {out[-1][1]:8.2f} ms/step  cpu {out[-1][2]:8.2f} "
              "ms/step", flush=True)
    return out


# ------------------------------------------------------------------------------------------ RSS probe
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def rss_child(mode: str) -> None:
    """Build small in bf16 params, make the sampler, drop the model, warm up, reset the peak, generate once."""
    from flax import nnx

    from dsv4 import DSV4ForCausalLM

    base = DSV4Config.small()  # without the MTP block, like the transformers-loaded model of the main table
    cfg = DSV4Config.small(num_nextn_predict_layers=0, compress_ratios=base.compress_ratios[:base.num_hidden_layers])
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    s = make_sampler(model, mode)
    del model
    gc.collect()
    prompts = [list(range(2, 2 + PROMPT_LEN))] * 8
    run = ours_fn(s, prompts, T_CAP)
    run()
    gc.collect()
    rss_idle = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    run()
    print(json.dumps({"mode": mode, "resident": resident_weight_bytes(s), "rss_kib": rss_idle,
                      "peak_kib": _status_kib("VmHWM"), "peak_reset": reset}))


def rss_probe(modes) -> dict:
    out = {}
    for m in modes:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", m], capture_output=True,
                           text=True, timeout=600)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        out[m] = json.loads(lines[-1]) if lines else {"error": r.stderr[-500:]}
    return out


# ------------------------------------------------------------------------------------------ main
def machine_context() -> str:
    import flax
    import torch
    import transformers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"date {time.strftime('%Y-%m-%d %H:%M')} | machine: {cpu} | usable cores {cores} | load average {load}\n"
            f"versions: python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, "
            f"torch {torch.__version__} (threads {torch.get_num_threads()}), transformers {transformers.__version__}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="*", default=["tiny", "small"], choices=sorted(CONFIGS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--modes", nargs="+", default=["bf16", "fp8", "fp8_step"], choices=list(MODES))
    ap.add_argument("--per-step-batches", nargs="+", type=int, default=[8],
                    help="batches at which the fp8_step mode is timed")
    ap.add_argument("--hf-dtypes", nargs="*", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--hf-threads", nargs="+", type=int, default=[2, 1],
                    help="torch thread counts to time transformers at (the fastest is its figure)")
    ap.add_argument("--ns", nargs="+", type=int, default=[33, 48, 64],
                    help="ours max_new_tokens values (all in (32, 64]: one compiled bucket); the step time is the "
                         "robust slope of the best call time over them")
    ap.add_argument("--hf-new", type=int, default=8, help="transformers new tokens (N - 1 timed decode steps)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds; the best is used (default: 7 tiny, 2 small)")
    ap.add_argument("--breakdown", nargs="*", type=int, default=None, metavar="B",
                    help="also time variants of one small decode step at these batches (default 8)")
    ap.add_argument("--rss", action="store_true", help="child processes: RSS / peak RSS per mode (small, B=8)")
    ap.add_argument("--compile-cache", default=os.path.join(tempfile.gettempdir(), "dsv4_rl_bench_jax_cache"),
                    help="jax persistent compilation cache dir: compiling is not timed, the cache only makes "
                         "reruns faster ('' = off)")
    ap.add_argument("--memory-only", action="store_true",
                    help="only XLA's compiled memory of the generate program per mode (small, B=8); last line "
                         "RESULT fp8_temp_excess=.. fp8_args_frac=.. (fractions of the fp32 program's argument bytes)")
    ap.add_argument("--memory-config", default="small", choices=sorted(CONFIGS),
                    help="config of the compiled-memory figures (default small; tiny for smoke runs)")
    ap.add_argument("--skip-memory", action="store_true",
                    help="no compiled-memory figures at the end (the RESULT line then has no memory fields)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    if args.rss_child:
        rss_child(args.rss_child)
        return 0
    if args.memory_only:
        print(f"XLA memory_analysis of the generate program ({args.memory_config}, B=8, P={PROMPT_LEN}, N={T_CAP}, "
              "abstract weights):")
        print("RESULT " + memory_result(compiled_memory(args.memory_config)))
        return 0
    if len(set(args.ns)) < 2 or not all(T_CAP // 2 < n <= T_CAP for n in args.ns):
        ap.error(f"--ns: at least two distinct values in ({T_CAP // 2}, {T_CAP}] (one compiled bucket)")

    import torch

    torch.set_num_threads(2)
    t_start = time.perf_counter()
    print(machine_context(), flush=True)
    args.bw_samples = [memcpy_bandwidth()]
    rows = []
    for name in args.configs:
        rows += bench_config(name, args)
    args.bw_samples.append(memcpy_bandwidth())
    bw_np = max(x["numpy"] for x in args.bw_samples)
    bw_jax = max(x["jax"] for x in args.bw_samples)
    bw = max(bw_np, bw_jax)
    print(f"\nmemcpy 512 MB, best of {len(args.bw_samples)} measurements spread over the run: numpy {bw_np / 1e9:.2f} "
          f"GB/s, jitted jnp {bw_jax / 1e9:.2f} GB/s -> roofline uses {bw / 1e9:.2f} GB/s (per measurement, "
          "numpy/jnp GB/s: " + ", ".join(f"{x['numpy'] / 1e9:.1f}/{x['jax'] / 1e9:.1f}" for x in args.bw_samples)
          + ")")
    for r in rows:
        if "bytes" in r:
            r["roof_tok_s"] = r["B"] * bw / r["bytes"]["total"]
            r["roof_frac"] = r["decode_tok_s"] / r["roof_tok_s"]
            # 0 at B = 1: XLA rewrites matrix-vector dots as multiply + reduce, leaving no dot to count
            hb = r["hlo_bytes"]["total"] or float("nan")
            r["hlo_roof_tok_s"] = r["B"] * bw / hb
            r["hlo_roof_frac"] = r["decode_tok_s"] / r["hlo_roof_tok_s"]

    print()
    print(f"decode tok/s, prefill excluded: ours B / slope of the best generate time over N = {args.ns}; "
          f"transformers B / mean decode step of its {args.hf_new}-token generate (timed per step), best round. "
          f"e2e: prefill included (ours N = {max(args.ns)}, transformers N = {args.hf_new}).")
    print("MB/step: bytes a decode step reads, counted from the model in the dtype the step computes in ('model') "
          "and from the compiled decode step's matmul operands ('HLO': what XLA really reads); roof = B x memcpy "
          "bandwidth / MB/step. 'HLO' is nan at B = 1: XLA rewrites matrix-vector dots as multiply + reduce, so "
          "there is no dot to count.")
    hdr = (f"{'config':<6} {'B':>3} {'engine':<12} {'step ms':>9} {'decode tok/s':>13} {'e2e tok/s':>10} "
           f"{'vs HF':>7} {'MB model':>8} {'roof %':>7} {'MB HLO':>8} {'roof %':>7} {'weights MiB':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        hf_best = max((x["decode_tok_s"] for x in rows if x["config"] == r["config"] and x["B"] == r["B"]
                       and x["engine"].startswith("hf_")), default=float("nan"))
        if r["engine"].startswith("hf_"):
            print(f"{r['config']:<6} {r['B']:>3} {r['engine']:<12} {r['step_ms']:>9.2f} {r['decode_tok_s']:>13.1f} "
                  f"{r['e2e_tok_s']:>10.1f}")
        else:
            print(f"{r['config']:<6} {r['B']:>3} {r['engine']:<12} {r['step_ms']:>9.2f} {r['decode_tok_s']:>13.1f} "
                  f"{r['e2e_tok_s']:>10.1f} {r['decode_tok_s'] / hf_best:>7.2f} {r['bytes']['total'] / 1e6:>8.2f} "
                  f"{100 * r['roof_frac']:>6.1f}% {r['hlo_bytes']['total'] / 1e6:>8.2f} "
                  f"{100 * r['hlo_roof_frac']:>6.1f}% {r['resident'] / 2**20:>11.2f}")
    for r in rows:
        if "hlo_bytes" in r and r["config"] == "small" and r["B"] == 8:
            print(f"  HLO matmul operand bytes of the small B=8 {r['engine']} decode step by dtype: "
                  + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["hlo_bytes"].items() if k != "total"))
    if args.breakdown is not None:
        print("\nDecode-step breakdown (small, random weights; decode_step + argmax in a jitted fori_loop):")
        for b in args.breakdown or [8]:
            step_breakdown("small", b)
    if args.rss:
        print("\nRSS probe (small, B=8, child process per mode; model dropped before measuring):")
        for m, r in rss_probe(args.modes).items():
            if "error" in r:
                print(f"  {m}: failed: {r['error']}")
            else:
                print(f"  {m:<10s} resident weights {r['resident'] / 2**20:7.1f} MiB | RSS after warm-up "
                      f"{r['rss_kib'] / 1024:7.1f} MiB | peak RSS during generate {r['peak_kib'] / 1024:7.1f} MiB"
                      + ("" if r["peak_reset"] else " (peak not reset: includes model build)"))
    print(f"\nwall time of the benchmark: {time.perf_counter() - t_start:.0f} s; load average now "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"\nXLA memory_analysis of the generate program ({args.memory_config}, B=8, abstract weights):")
    mem_line = "" if args.skip_memory else memory_result(compiled_memory(args.memory_config))
    # the headline row: small at B = 8 (or the last config and first batch run, e.g. a smoke run)
    head_cfg = "small" if "small" in args.configs else args.configs[-1]
    head_b = 8 if 8 in args.batches else args.batches[0]
    pick = {r["engine"]: r for r in rows if r["config"] == head_cfg and r["B"] == head_b}
    if "bf16" in pick:
        ours = pick["bf16"]
        hf_best = max((r["decode_tok_s"] for e, r in pick.items() if e.startswith("hf_")), default=float("nan"))
        print(f"RESULT ours_tok_s={ours['decode_tok_s']:.1f} hf_tok_s={hf_best:.1f} "
              f"ratio_vs_hf={ours['decode_tok_s'] / hf_best:.2f} roofline_frac={ours['hlo_roof_frac']:.3f} "
              f"roofline_frac_model_bytes={ours['roof_frac']:.3f} {mem_line}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
