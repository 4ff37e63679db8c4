"""Soak test: the tiny job for many steps, checked for growth of memory, live arrays, file descriptors, threads,
step time and the checkpoint directory (issue 42 "What to build" 9).

What runs:
  1. one process, `--steps` (default 500) steps of `launch/run.py`'s main: the default two-mesh layout (`--mesh
     auto`: actor and rollout meshes, a push every step), continuous batching (`--rollout-slots`), evaluation and
     a checkpoint every `--every` steps with retention (`--keep-checkpoints 2`), 4 prompts x 4 samples, 4 new tokens;
  2. unless `--mpmd-steps 0`: the 3-process MPMD layout (`--mesh actor:fsdp=2,expert=2/rollout:expert=2`, 2 CPU
     devices per process, as tests/launch/test_mpmd_run.py launches it) for `--mpmd-steps` (default 200) steps.
Each job runs in a child process `python benchmarks/soak.py --worker SAMPLES -- <run.py flags>`, which calls
`launch.run.main` with two wrappers installed: after every step's metrics (`rl.run.sinks.MetricsLogger.log`, actor
processes) and after every served request (`rl.rollout.mpmd.run_request`, the MPMD rollout process) it appends one
sample {step, t, rss (VmRSS, KiB), live (len(jax.live_arrays()) after gc.collect()), fds (/proc/self/fd), threads
(/proc/self/task: OS threads, XLA's included)} to SAMPLES (opened and closed per sample: no descriptor held).
Measured after warm-up (the first 10% of the steps): live arrays and fds: the value at the last sample minus the
value at the first sample after warm-up with the same phase modulo `--every` (eval and checkpoint steps compared with
their own kind; an asynchronous checkpoint save may hold arrays at its own phase); RSS: the median of the last 10% of
the samples minus the median of the 10% after warm-up; threads: the same windows' floors, TensorStore's on-demand I/O
pool left out and reported as its maximum (`figures` says why); step-time drift = median step time of
the last 10% of the steps / median of the 10% right after warm-up - 1; step_cpu_drift: the same on the process's CPU
seconds per step (`time.process_time`, all threads), which a shared machine's changing load does not move. ckpt_dir_mib: the checkpoint directory's
size at the end (bounded: `--keep-checkpoints` checkpoints).

Run:   .venv/bin/python benchmarks/soak.py                              (500 steps, then MPMD 200)
       .venv/bin/python benchmarks/soak.py --steps 100 --mpmd-steps 0
Last line: RESULT steps=.. rss_growth_mib=.. live_arrays_growth=.. fds_growth=.. threads_growth=..
step_time_drift=.. ckpt_dir_mib=.. (the one-process job; the MPMD job's figures prefixed mpmd_, per process).
Acceptance (issue 42): RSS growth <= 64 MiB, live arrays, fds and threads growth 0, step-time drift <= 10%,
checkpoint directory bounded.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MPMD_MESH = "actor:fsdp=2,expert=2/rollout:expert=2"


def _thread_names() -> dict[str, int]:
    """{OS thread name (/proc/self/task/*/comm, XLA's and Python's alike): count}: which kind of thread grows."""
    names: dict[str, int] = {}
    for t in os.listdir("/proc/self/task"):
        try:
            name = pathlib.Path(f"/proc/self/task/{t}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return names


def sample(path: pathlib.Path, step: int) -> None:
    """Append one sample of this process (see the module docstring) to `path`."""
    import jax

    gc.collect()
    rss = 0
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    rec = {"step": step, "t": time.monotonic(), "cpu": time.process_time(), "rss": rss, "live": len(jax.live_arrays()),
           "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
           "thread_names": _thread_names()}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def worker(out: str, argv: list[str]) -> int:
    """A job of the soak: launch/run.py's main(argv) with the per-step samplers installed."""
    from launch import run as launch_run

    n = launch_run.cpu_device_count(argv)  # as `python launch/run.py` does before the backend starts
    if n is not None:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}").strip()
    from rl.run import sinks
    from rl.rollout import mpmd as rollout_mpmd

    path = pathlib.Path(out)
    log_fn, serve_fn = sinks.MetricsLogger.log, rollout_mpmd.run_request
    served = {"n": 0}

    def log(self, step, metrics):
        log_fn(self, step, metrics)
        if "rollout/reward_mean" in metrics:  # a training step (not the eval-before-train record)
            sample(path, step)

    def run_request(*a, **kw):
        res = serve_fn(*a, **kw)
        served["n"] += 1
        sample(path, served["n"])
        return res

    sinks.MetricsLogger.log = log
    rollout_mpmd.run_request = run_request
    return launch_run.main(argv)


TS_POOL = "ts_pool_worker"  # TensorStore's on-demand I/O thread pool (its threads' /proc comm name)


def _floor(rows: list[dict]) -> int:
    """The fewest threads of `rows`' samples, TensorStore's pool left out."""
    return min(r["threads"] - r.get("thread_names", {}).get(TS_POOL, 0) for r in rows)


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def figures(rows: list[dict], every: int) -> dict:
    """Growth and drift figures of one process's samples (module docstring)."""
    rows = sorted(rows, key=lambda r: r["step"])
    n = len(rows)
    warm = max(1, n // 10)
    last = rows[-1]
    base = next(r for r in rows[warm:] if (r["step"] - last["step"]) % every == 0)
    dts = [b["t"] - a["t"] for a, b in zip(rows, rows[1:])]
    cpu = [b["cpu"] - a["cpu"] for a, b in zip(rows, rows[1:])] if "cpu" in last else []
    early, late = dts[warm:warm + max(1, n // 10)], dts[-max(1, n // 10):]
    early_rows, late_rows = rows[warm:warm + max(1, n // 10)], rows[-max(1, n // 10):]
    # RSS: the median of the last 10% of the samples against the median of the 10% after warm-up (one sample moves
    # +-100 MiB within a period: the allocator, an eval step's buffers, a save in flight)
    rss_mid = lambda rs: statistics.median(r["rss"] for r in rs) / 1024.0  # noqa: E731
    return {"samples": n, "rss_growth_mib": rss_mid(late_rows) - rss_mid(early_rows),
            "live_arrays_growth": last["live"] - base["live"], "fds_growth": last["fds"] - base["fds"],
            # threads: the floor of the last 10% of the samples against the floor of the 10% after warm-up, without
            # TensorStore's I/O pool. A sample can land while short-lived threads run (an asynchronous checkpoint
            # commit, a reward worker's pipe reader: 18-26 Python threads within one period), so two single samples
            # differ by those; a leak raises the floor. TensorStore's pool (`ts_pool_worker`) starts threads on
            # demand at each save and ends them when idle (1-6 seen between saves), so it is reported on its own
            # as its maximum over the run (`ts_pool_max`: bounded, not growing, is what to read there).
            "threads_growth": _floor(late_rows) - _floor(early_rows),
            "ts_pool_max": max(r.get("thread_names", {}).get(TS_POOL, 0) for r in rows),
            "thread_names": last.get("thread_names", {}),
            "step_time_drift": statistics.median(late) / statistics.median(early) - 1.0,
            # the same on the process's CPU seconds per step (all its threads: XLA's too): what the step costs,
            # independent of the machine's load, which moves the wall-clock drift on a shared machine
            "step_cpu_drift": (statistics.median(cpu[-max(1, n // 10):]) / statistics.median(cpu[warm:warm + max(1, n // 10)])
                               - 1.0) if cpu else float("nan"),
            "step_s": statistics.median(late), "rss_mib": last["rss"] / 1024.0, "live": last["live"],
            "fds": last["fds"], "threads": last["threads"],
            "rss_max_growth_mib": (max(r["rss"] for r in rows[warm:]) - base["rss"]) / 1024.0}


def dir_mib(d: pathlib.Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 2 ** 20 if d.exists() else 0.0


def job_flags(d: pathlib.Path, steps: int, every: int, slots: int) -> list[str]:
    return ["--steps", str(steps), "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4",
            "--eval-prompts", "8", "--eval-samples", "2", "--eval-every", str(every), "--ckpt-every", str(every),
            "--keep-checkpoints", "2", "--ckpt-dir", str(d / "ckpt"), "--metrics-jsonl", str(d / "metrics.jsonl"),
            "--tensorboard-dir", str(d / "tb"), "--rollout-slots", str(slots), "--no-progress"]


def run_single(d: pathlib.Path, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(d / "samples.p0.jsonl"), "--",
           *job_flags(d, a.steps, a.every, a.slots), *a.extra]
    t0 = time.monotonic()
    with open(d / "job.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    if rc != 0:
        raise SystemExit(f"error: the soak job exited {rc}; its log: {d / 'job.log'}")
    out = figures(_rows(d / "samples.p0.jsonl"), a.every)
    out.update(wall_s=time.monotonic() - t0, ckpt_dir_mib=dir_mib(d / "ckpt"),
               ckpts=len([p for p in (d / "ckpt").iterdir() if p.name.isdigit()]))
    return out


def run_mpmd(d: pathlib.Path, a) -> dict:
    import portpicker

    port = portpicker.pick_unused_port()
    procs = []
    t0 = time.monotonic()
    for i in range(3):
        flags = [*job_flags(d, a.mpmd_steps, a.every, 0), "--mesh", MPMD_MESH, "--coordinator",
                 f"127.0.0.1:{port}", "--num-processes", "3", "--process-id", str(i), "--cpu-devices-per-process",
                 "2", *a.extra]
        log = open(d / f"p{i}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(d / f"samples.p{i}.jsonl"), "--",
                                       *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    try:
        rcs = [p.wait(timeout=a.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(rcs):
        raise SystemExit(f"error: the MPMD soak exited {rcs}; logs: {d}/p*.log")
    out = {"wall_s": time.monotonic() - t0, "ckpt_dir_mib": dir_mib(d / "ckpt")}
    for i in range(3):
        out[f"p{i}"] = figures(_rows(d / f"samples.p{i}.jsonl"), a.every if i < 2 else 1)
    return out


# The test suite's XLA:CPU compile options (tests/conftest.py): the same programs compiled ~2.5x faster; a soak
# measures growth, not peak speed. --opt-xla leaves XLA's defaults.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500, help="0 = no one-process job")
    ap.add_argument("--mpmd-steps", type=int, default=200, help="0 = no MPMD job")
    ap.add_argument("--every", type=int, default=10, help="eval and checkpoint period (steps)")
    ap.add_argument("--slots", type=int, default=4, help="--rollout-slots of the one-process job")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per job")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("extra", nargs="*", help="more launch/run.py flags, after --")
    ap.add_argument("--opt-xla", action="store_true", help="XLA's default compile options (slower compiles)")
    a = ap.parse_args()
    d = pathlib.Path(a.dir or tempfile.mkdtemp(prefix="soak-"))
    d.mkdir(parents=True, exist_ok=True)
    if not a.opt_xla:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(d / "jax_cache"))  # the MPMD job reuses the first's
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    line = "RESULT"
    if a.steps:
        (d / "single").mkdir(exist_ok=True)
        res = run_single(d / "single", a)
        print("one process:", json.dumps(res, indent=1), flush=True)
        line += (f" steps={a.steps} rss_growth_mib={res['rss_growth_mib']:.1f} "
                 f"live_arrays_growth={res['live_arrays_growth']} fds_growth={res['fds_growth']} "
                 f"threads_growth={res['threads_growth']} step_time_drift={res['step_time_drift']:.3f} "
                 f"ckpt_dir_mib={res['ckpt_dir_mib']:.1f} ts_pool_max={res['ts_pool_max']} "
                 f"step_cpu_drift={res['step_cpu_drift']:.3f}")
    if a.mpmd_steps:
        (d / "mpmd").mkdir(exist_ok=True)
        m = run_mpmd(d / "mpmd", a)
        print("MPMD:", json.dumps(m, indent=1), flush=True)
        line += f" mpmd_steps={a.mpmd_steps} mpmd_ckpt_dir_mib={m['ckpt_dir_mib']:.1f}"
        for i in range(3):
            p = m[f"p{i}"]
            line += (f" mpmd_p{i}_rss_growth_mib={p['rss_growth_mib']:.1f} mpmd_p{i}_live_arrays_growth="
                     f"{p['live_arrays_growth']} mpmd_p{i}_fds_growth={p['fds_growth']} mpmd_p{i}_threads_growth="
                     f"{p['threads_growth']} mpmd_p{i}_step_time_drift={p['step_time_drift']:.3f}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
