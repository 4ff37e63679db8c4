"""The rollout job killed mid-run and restarted (issue 23): steps lost, recovery time, metrics vs an uninterrupted run.

    .venv/bin/python benchmarks/rollout_fault.py                  # 10 steps, 3 kills (~10 min on 2 busy cores)
    .venv/bin/python benchmarks/rollout_fault.py --steps 20 --kills 5 --seed 1

The default task and model (launch/run.py's defaults, no eval, no checkpoints) in the two-job layout on local
processes (rl/rollout/two_job.py): an actor job (`--rollout-address`) and a rollout job (`--rollout-job
--actor-address`), one CPU device each (`--mesh actor:data=1/rollout:data=1 --cpu-devices-per-process 1`). Two runs,
one after the other, sharing one JAX compilation cache:
1. uninterrupted: the reference per-step metrics (and the warm cache, so the faulted run's restarts do not pay the
   first compile);
2. faulted: the rollout job is SIGKILLed at `--kills` distinct random steps (seeded: `--seed`), at a random moment
   within the step (0 .. half the reference's median step time after the previous step was logged), and restarted
   at once with the same command, as a supervisor would; the next kill waits until the actor logged its recovery.
Figures: restarts = the actor's final `rollout/restarts`; steps_lost = steps of the reference missing from the
faulted run's log plus steps logged twice (target 0); recovery_s_mean = the final `rollout/recovery_s` (seconds
spent recovering, summed) / restarts (each from the loss noticed to the in-flight requests sent again: the new
process's start-up, registration and weight pull; its first generate compiles after that, from the cache); metrics_equal = 1 when every per-step
metric that is not a timing (`perf/*`, `rollout/recovery_s`) or the fault counter (`rollout/restarts`) is bitwise
equal between the two runs (target 1).

Last line: `RESULT restarts=.. steps_lost=.. recovery_s_mean=.. metrics_equal=0|1`. Timings are wall-clock on
whatever else the machine runs: note the load next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import portpicker

ROOT = pathlib.Path(__file__).resolve().parents[1]
IGNORED = ("rollout/restarts", "rollout/recovery_s")


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


class Run:
    """One two-job run: the actor job and (re)starts of its rollout job, logs under `d`."""

    def __init__(self, d: pathlib.Path, steps: int, env: dict, extra: list[str]):
        self.d, self.env, self.port = d, env, portpicker.pick_unused_port()
        self.metrics = d / "metrics.jsonl"
        self.common = ["--mesh", "actor:data=1/rollout:data=1", "--cpu-devices-per-process", "1", "--steps",
                       str(steps), "--eval-every", "0", "--ckpt-dir=", "--tensorboard-dir=", "--no-progress", *extra]
        self.actor = self._start(["--metrics-jsonl", str(self.metrics), "--rollout-address",
                                  f"127.0.0.1:{self.port}"], d / "actor.log")
        self.rollouts = [self.start_rollout()]

    def _start(self, args: list[str], log: pathlib.Path) -> subprocess.Popen:
        with open(log, "ab") as f:
            return subprocess.Popen([sys.executable, str(ROOT / "launch/run.py"), *self.common, *args], cwd=ROOT,
                                    env=self.env, stdout=f, stderr=subprocess.STDOUT)

    def start_rollout(self) -> subprocess.Popen:
        n = len(getattr(self, "rollouts", []))
        return self._start(["--metrics-jsonl", str(self.d / "rollout_unused.jsonl"), "--rollout-job",
                            "--actor-address", f"127.0.0.1:{self.port}"], self.d / f"rollout{n}.log")

    def actor_log(self) -> str:
        return (self.d / "actor.log").read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            rc = self.actor.wait(timeout=timeout)
            self.rollouts[-1].wait(timeout=60)
            return rc
        finally:
            for p in [self.actor, *self.rollouts]:
                if p.poll() is None:
                    p.kill()


def _wait_until(cond, what: str, run: Run, timeout: float = 1800) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if run.actor.poll() is not None:
            raise RuntimeError(f"the actor ended while waiting for {what}: {run.actor_log()[-2000:]}")
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    p.add_argument("--kills", type=int, default=3, help="rollout kills in the faulted run (distinct steps)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    p.add_argument("--workdir", default=None, help="logs and metrics here (default: a temp dir, kept)")
    p.add_argument("extra", nargs="*", help="more launch/run.py flags for both runs (after --)")
    a = p.parse_args(argv)
    if not 1 <= a.kills <= a.steps - 2:
        print(f"error: --kills must be in 1..{a.steps - 2} (steps 1 .. steps - 2 may be killed)", file=sys.stderr)
        return 2
    work = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="rollout_fault_"))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(work / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    extra = ["--push-timeout", "120", *a.extra]
    print(f"workdir {work}", flush=True)

    (work / "ref").mkdir(parents=True, exist_ok=True)
    ref = Run(work / "ref", a.steps, env, extra)
    if ref.wait(timeout=7200) != 0:
        print(f"error: the uninterrupted run failed: {ref.actor_log()[-2000:]}", file=sys.stderr)
        return 1
    r_rows = _rows(ref.metrics)
    step_s = statistics.median(r["perf/step_s"] for r in r_rows[1:]) if len(r_rows) > 1 else 1.0
    print(f"uninterrupted: {len(r_rows)} steps, median step {step_s:.2f} s", flush=True)

    rng = random.Random(a.seed)
    kill_steps = sorted(rng.sample(range(1, a.steps - 1), a.kills))
    (work / "fault").mkdir(exist_ok=True)
    run = Run(work / "fault", a.steps, env, extra)
    for n, s in enumerate(kill_steps):
        _wait_until(lambda: len(_rows(run.metrics)) >= s, f"step {s - 1} logged", run)
        time.sleep(rng.uniform(0.0, 0.5 * step_s))
        run.rollouts[-1].send_signal(signal.SIGKILL)
        run.rollouts[-1].wait(timeout=60)
        print(f"kill {n + 1}: rollout job killed during step {len(_rows(run.metrics))}", flush=True)
        run.rollouts.append(run.start_rollout())  # as a supervisor would
        _wait_until(lambda: run.actor_log().count("recovered in") > n, f"recovery {n + 1}", run)
    rc = run.wait(timeout=7200)
    if rc != 0:
        print(f"error: the faulted run failed (exit {rc}): {run.actor_log()[-2000:]}", file=sys.stderr)
        return 1
    f_rows = _rows(run.metrics)
    logged = [r["step"] for r in f_rows]
    steps_lost = len(set(range(a.steps)) - set(logged)) + (len(logged) - len(set(logged)))
    equal = len(f_rows) == len(r_rows) and all(
        set(x) == set(y) and all(json.dumps(x[k]) == json.dumps(y[k]) for k in x
                                 if not k.startswith("perf/") and k not in IGNORED)
        for x, y in zip(f_rows, r_rows))
    restarts = int(f_rows[-1].get("rollout/restarts", 0)) if f_rows else 0
    total = f_rows[-1].get("rollout/recovery_s", 0.0) if f_rows else 0.0
    print(f"kill steps {kill_steps}; recovery {total:.2f} s in all", flush=True)
    print(f"RESULT restarts={restarts} steps_lost={steps_lost} "
          f"recovery_s_mean={total / restarts if restarts else float('nan'):.2f} metrics_equal={int(equal)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
