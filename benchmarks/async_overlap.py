"""Synchronous vs one-step-off asynchronous GRPO (issue 14): same job, same steps, one invocation.

    .venv/bin/python benchmarks/async_overlap.py                # one process, the default run's 2 CPU devices
    .venv/bin/python benchmarks/async_overlap.py --steps 80     # + the learning criterion over the default length
    .venv/bin/python benchmarks/async_overlap.py --mpmd         # 2 processes: actor = process 0, rollout = process 1
    .venv/bin/python benchmarks/async_overlap.py --mpmd --steps 80   # the full measurement (~14 min quiet)
    .venv/bin/python benchmarks/async_overlap.py --partial-rollout --seeds 1 -- --prompts-per-step 4 --group-size 2
                                                                # + partial rollouts on a long tail (issue 23)
    .venv/bin/python benchmarks/async_overlap.py --mpmd --partial-rollout --seeds 1     # the same, 2 processes

Each mode runs `launch/run.py` as a real job twice (the default task and model; `--async-rollout` the second
time; no eval, no checkpoints), both sharing one JAX compilation cache, and reads the per-step metrics:
- step time = median `perf/step_s` over the steps after the first `--warmup` (compiles);
- overlap_frac = mean `perf/overlap_frac` of the async run over the same steps, the last step excluded (nothing
  is generated after it); rollout / update = median `perf/rollout_s` / `perf/train_s` (the ideal speedup is
  (rollout + update) / max(rollout, update));
- the async run's learning figures: reward mean of the first and last 10% of the steps (the default criterion:
  last >= 0.5 and >= 3x first, meaningful at the default 80 steps), for `--seeds N` async runs (seeds 0..N-1;
  seed 0 is the timed run). One 80-step trajectory of this toy task is chaotic: whether the policy learns to end
  with <eos> before step 80 (the posmul reward halves without it) flips on float-level differences, e.g. seed 0
  async learns in one process (last 10% 0.944) and stalls at 0.475 in the --mpmd layout, whose XLA is
  single-threaded (other reduction orders), with the same schedule and the same first 4 steps. So async_learns
  is the majority over the seeds, and async_first10 / async_last10 are the medians.

Layouts. Default: one process, `--mesh auto` on 2 forced host devices (actor 1 + rollout 1). The two meshes share
the process's XLA:CPU thread pool, so concurrency buys little there (reported, no target). `--mpmd`: the real
layout in miniature, 2 local processes (`--num-processes 2 --cpu-devices-per-process 1`, mesh
`actor:data=1/rollout:data=1`: device 0 on process 0 = actor, device 1 on process 1 = rollout), each pinned to its
own core (`sched_setaffinity` before exec: XLA:CPU sizes its thread pool from the affinity mask) with XLA
single-threaded (`XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`; jax 0.10.2 has no intra-op thread option of its
own, and the pool already has one core). The async side is the one loop's pipeline (rl/run/pipeline.py) over
`rl.rollout.mpmd.ProcessRollout` (the rollout process generates batch n + 1 while the actor process trains on
batch n).

Partial rollouts (`--partial-rollout`, issue 23 point 4): every run gets a length spread where a long tail holds the
synchronous step, `--max-new-tokens --tail-max-new-tokens` (64) with `--rollout.length_schedule --tail-schedule`
(0.1:8: 90% of the prompts' responses capped at 8 tokens, 10% at 64, i.e. 8x longer; rl/config/rollout.py), and a third
timed run, `--async-rollout --partial-rollout` (rl/run/partial.py: segments of ceil(64 / 2) = 32 decode steps, a batch
from the groups that finished, the long ones continued after the push). partial_speedup = the one-step-off
(async) run's mean step time / the partial run's, over the steps after the warm-up, compile steps (> 4x the median)
left out (`steady_mean`): a tail holds some steps, so the median would hide it; partial_speedup_median is the ratio
of the medians; partial_first10 / partial_last10 the partial run's reward curve. In every layout: with `--mpmd` the
actor process runs the partial producer and the rollout process generates its segments (rl/rollout/mpmd.py), the
regime the feature is for (a rollout slower than the update, on its own core).

Last line: `RESULT sync_step_s=.. async_step_s=.. speedup=.. overlap_frac=.. async_first10=.. async_last10=..
async_learns=0|1 async_learned=k/N` (target in the --mpmd layout: speedup >= 1.3 and async_learns=1 at 80 steps),
with `--partial-rollout` also `partial_step_s=.. partial_speedup=.. partial_speedup_median=.. partial_first10=..
partial_last10=..` (target:
partial_speedup >= 1.2). Timings are wall-clock on whatever else the machine runs: note the load next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RUN_PY = REPO / "launch" / "run.py"
SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false"  # + one core per process (`_pin`): one XLA pool thread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: str, xla_flags: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    return env


def _pin(core: int):
    def fn():
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[core % len(cores)]})
    return fn


def run_job(extra: list[str], out: pathlib.Path, cache: str, mpmd: bool, timeout: float) -> list[dict]:
    """One `launch/run.py` job (2 processes with --mpmd); returns its per-step metrics. Raises RuntimeError with the
    failing process's last lines."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    common = [sys.executable, str(RUN_PY), "--no-progress", "--eval-every", "0", "--ckpt-dir", "",
              "--tensorboard-dir", "", "--metrics-jsonl", str(metrics), *extra]
    if not mpmd:
        cmds = [(common, None, None)]
    else:
        port = _free_port()
        cmds = [([*common, "--mesh", "actor:data=1/rollout:data=1", "--coordinator", f"127.0.0.1:{port}",
                  "--num-processes", "2", "--process-id", str(i), "--cpu-devices-per-process", "1"],
                 SINGLE_THREAD, _pin(i)) for i in range(2)]
    procs = []
    for i, (cmd, flags, pin) in enumerate(cmds):
        log = open(out / f"process{i}.log", "wb")
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=_env(cache, flags), stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=pin), log))
    end = time.monotonic() + timeout
    failed = None
    for i, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        log.close()
        if rc != 0 and failed is None:
            failed = (i, rc)
    if failed is not None:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        i, rc = failed
        tail = (out / f"process{i}.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"process {i} of {' '.join(map(str, extra)) or 'sync'} ended with {rc}: " + " | ".join(tail))
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def steady_mean(rows: list[dict], warmup: int) -> tuple[float, int]:
    """(mean `perf/step_s` over the steps after `warmup`, steps left out): a step slower than 4x the median is
    left out as a compile (a new learner width or prompt bucket costs tens of seconds here, at any step). The mean,
    not the median: a long tail holds some steps, not the typical one."""
    body = rows[warmup:] or rows
    med = statistics.median(r["perf/step_s"] for r in body)
    kept = [r["perf/step_s"] for r in body if r["perf/step_s"] <= 4 * med]
    return sum(kept) / len(kept), len(body) - len(kept)


def summarize(rows: list[dict], warmup: int) -> dict:
    body = rows[warmup:] or rows
    n = max(1, len(rows) // 10)
    curve = [r["rollout/reward_mean"] for r in rows]
    out = {"step_s": statistics.median(r["perf/step_s"] for r in body),
           "rollout_s": statistics.median(r["perf/rollout_s"] for r in body),
           "train_s": statistics.median(r.get("perf/train_s", 0.0) for r in body),
           "first10": sum(curve[:n]) / n, "last10": sum(curve[-n:]) / n}
    ov = [r["perf/overlap_frac"] for r in body[:-1] if "perf/overlap_frac" in r]
    if ov:
        out["overlap_frac"] = sum(ov) / len(ov)
        out["train_wait_s"] = statistics.median(r["perf/train_wait_s"] for r in body)
        out["rollout_wait_s"] = statistics.median(r["perf/rollout_wait_s"] for r in body)
        out["staleness_max"] = max(r["weight_version/staleness_max"] for r in rows)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of each run (the default run has 80)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timings (compiles)")
    p.add_argument("--mpmd", action="store_true", help="actor = process 0, rollout = process 1, one core each")
    p.add_argument("--seeds", type=int, default=3, help="async runs for the learning criterion (seeds 0..N-1; "
                                                         "majority decides async_learns)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    p.add_argument("--out", default=None, help="directory of the jobs' logs and metrics (default: a temp dir)")
    p.add_argument("--partial-rollout", action="store_true", help="a long-tail length spread for every run and a "
                                                                    "third run with --partial-rollout")
    p.add_argument("--tail-max-new-tokens", type=int, default=64, help="with --partial-rollout: --max-new-tokens")
    p.add_argument("--tail-schedule", default="0.1:8", help="with --partial-rollout: --rollout.length_schedule "
                                                             "(FRAC:SHORT)")
    p.add_argument("extra", nargs="*", help="more launch/run.py flags for both runs (after --)")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="async_overlap_"))
    cache = str(out / "jax_cache")
    layout = "mpmd (2 processes, 1 core each, XLA single-threaded)" if args.mpmd else "one process, 2 host devices"
    print(f"layout: {layout}; {args.steps} steps each; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores; logs in {out}", flush=True)
    tail = (["--max-new-tokens", str(args.tail_max_new_tokens), "--rollout.length_schedule", args.tail_schedule]
            if args.partial_rollout else [])
    base = ["--steps", str(args.steps), *tail, *args.extra]
    res = {}
    runs = [("sync", []), ("async", ["--async-rollout"])]
    if args.partial_rollout:
        runs.append(("partial", ["--async-rollout", "--partial-rollout"]))
    for name, flags in runs:
        t0 = time.perf_counter()
        try:
            rows = run_job([*base, *flags], out / name, cache, args.mpmd, args.timeout)
        except RuntimeError as e:
            print(f"{name}: FAILED: {e}", flush=True)
            print(f"RESULT sync_step_s=nan async_step_s=nan speedup=nan overlap_frac=nan async_first10=nan "
                  f"async_last10=nan async_learns=0"
                  f"{' partial_step_s=nan partial_speedup=nan' if args.partial_rollout else ''} failed={name}")
            return 1
        res[name] = summarize(rows, args.warmup)
        res[name]["step_s_mean"], res[name]["compile_steps"] = steady_mean(rows, args.warmup)
        if name == "partial":
            body = rows[args.warmup:] or rows
            for k in ("rollout/partial/segments", "rollout/partial/deficit_segments", "rollout/token_staleness_mean"):
                res[name][k.split("/")[-1]] = statistics.mean(r[k] for r in body)
            res[name]["token_staleness_max"] = max(r["rollout/token_staleness_max"] for r in rows)
        print(f"{name}: {json.dumps({k: round(v, 4) for k, v in res[name].items()})} "
              f"(wall {time.perf_counter() - t0:.0f} s incl. start-up and compiles)", flush=True)
    s, a = res["sync"], res["async"]
    curves = [(a["first10"], a["last10"])]
    for seed in range(1, args.seeds):  # the learning criterion over more trajectories (untimed)
        try:
            rows = run_job([*base, "--async-rollout", "--seed", str(seed)], out / f"async_seed{seed}", cache,
                           args.mpmd, args.timeout)
        except RuntimeError as e:
            print(f"async seed {seed}: FAILED: {e}", flush=True)
            return 1
        r = summarize(rows, args.warmup)
        curves.append((r["first10"], r["last10"]))
        print(f"async seed {seed}: first 10% {r['first10']:.3f}, last 10% {r['last10']:.3f}", flush=True)
    learned = [last >= 0.5 and last >= 3 * first for first, last in curves]
    crit = 2 * sum(learned) > len(learned)
    first10 = statistics.median(f for f, _ in curves)
    last10 = statistics.median(x for _, x in curves)
    ideal = (a["rollout_s"] + a["train_s"]) / max(a["rollout_s"], a["train_s"], 1e-9)
    print(f"ideal speedup (rollout + update) / max = {ideal:.2f}; async learning, last 10% per seed: "
          f"{', '.join(f'{x:.3f}' for _, x in curves)} ({sum(learned)} of {len(learned)} meet the default "
          f"criterion); load average now {os.getloadavg()[0]:.1f}")
    partial = ""
    if "partial" in res:
        pr = res["partial"]
        partial = (f" partial_step_s={pr['step_s_mean']:.4f} partial_speedup={a['step_s_mean'] / pr['step_s_mean']:.3f}"
                   f" partial_speedup_median={a['step_s'] / pr['step_s']:.3f} partial_first10={pr['first10']:.4f}"
                   f" partial_last10={pr['last10']:.4f}")
    print(f"RESULT sync_step_s={s['step_s']:.4f} async_step_s={a['step_s']:.4f} "
          f"speedup={s['step_s'] / a['step_s']:.3f} overlap_frac={a.get('overlap_frac', float('nan')):.3f} "
          f"async_first10={first10:.4f} async_last10={last10:.4f} async_learns={int(crit)} "
          f"async_learned={sum(learned)}/{len(learned)}{partial}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
