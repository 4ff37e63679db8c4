"""The seeds' disaggregated layout with one-step-off overlap: the schedule, continuous batching on the rollout's own
processes (`--rollout-slots`), parity with one process, and recovery from crashes (async MPMD checkpoints and
resumes, issue 22 point 3).

Two local processes x 1 CPU device, `--mesh actor:data=1/rollout:data=1 --async-rollout` (K = 1; process 0 the actor,
process 1 the rollout, behind `rl.rollout.mpmd.ProcessRollout`; the layout of `benchmarks/async_overlap.py --mpmd`),
the tiny job with `--rollout-slots 3`, an evaluation every 2 steps and a checkpoint per step. One uninterrupted run
serves every check of the schedule:
- batch m is generated with P(max(0, m - K)), so every sample's version (per-sample, all equal within a batch) is
  max(0, m - 1) and the staleness is [0, 1, 1, ...] <= K;
- the overlap: the rollout process starts generating batch n + 1 before the actor's update of step n ends (the
  wall-clock timestamps the writer logs: both processes share the host's clock), and `perf/overlap_frac` > 0;
- the roles: the rollout never trains, the actor never generates, one metrics writer;
- continuous batching: every step logs the slots program's counters (`rollout/slots_refilled`,
  `rollout/decode_steps`, `rollout/slot_utilisation`), and the in-flight batch of each checkpoint is on disk.
Then:
1. parity with the one-process asynchronous run of the same mesh shapes (2 host devices: actor 1 + rollout 1, the
   same schedule): every step has equal rewards and pg_loss within 1e-5, and equal evaluations (the rollout process
   evaluates after the push);
2. the same command started and, at a seeded random moment after a new checkpoint, process 0 alone SIGKILLed (the
   actor; the coordination service lives in its sidecar, sharding/coordination.py): the survivor (process 1, the
   rollout) exits non-zero with exactly one `error:` line naming the actor side and process 0, and no Python, C++ or
   Gloo stack, and the sidecar is gone within its bound (`sharding.distributed.sidecar_grace_s`: the liveness
   timeout + 10 s, + polling); started again to
   the end: it resumes, and the final checkpoint and every per-step metric (but the rollout process's own counter,
   which restarts with it) equal the uninterrupted run's bitwise (`assert_same_run`). (Restarts of a restarted
   async run, and a whole lost node's SIGKILL, are tests/launch/test_resume.py's, in one process; the synchronous
   pipeline (K = 0) resumes through the MPMD rollout server in tests/rl/test_multiturn_resume.py; `--init` in MPMD
   is tests/launch/test_mpmd_run.py's.)

    .venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_async_resume.py
"""

from __future__ import annotations

import pathlib
import random
import re
import signal
import time

import pytest

STEPS = 6
EVAL_EVERY = 2
JOB = ["--steps", str(STEPS), "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4",
       "--eval-every", str(EVAL_EVERY), "--eval-prompts", "4", "--eval-samples", "2", "--ckpt-every", "1",
       "--keep-checkpoints", "2", "--no-progress", "--tensorboard-dir", "", "--mesh", "actor:data=1/rollout:data=1",
       "--async-rollout", "--rollout-slots", "3"]


PUSH_TIMEOUT = 15  # --push-timeout: the survivor of process 0's death finds it within this (+ a poll)
SIDECAR_BOUND_S = PUSH_TIMEOUT + 10 + 5  # sharding/coordination.py rule 2: the liveness timeout + margin, + slack
# what the survivor of a SIGKILL must not print: a Python, C++ (glog) or Gloo stack
STACK = re.compile(r"Traceback|Check failure|terminate called|^\*\*\* |^[FE]\d{4} |Gloo(?!\] Rank )",
                   re.M)


def _start(lt, run_dir, env, name):
    args = [*JOB, "--ckpt-dir", run_dir / "ckpt", "--metrics-jsonl", run_dir / "metrics.jsonl",
            "--cpu-devices-per-process", "1", "--push-timeout", str(PUSH_TIMEOUT)]
    return [lt.start([*args, *flags], env, run_dir / f"{name}.p{i}.log") for i, flags in enumerate(lt.processes(2))]


def _wait(procs, timeout=900):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _gone(pid):
    """No such process, or a zombie (a reparented orphan its new parent has not reaped)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.slow
def test_async_mpmd_schedule_slots_parity_and_kill_resume(tmp_path, run_env, lt):
    ref, got = tmp_path / "ref", tmp_path / "got"
    ref.mkdir()
    got.mkdir()
    rcs = _wait(_start(lt, ref, run_env, "run"))
    out = [(ref / f"run.p{i}.log").read_text(errors="replace") for i in range(2)]
    assert rcs == [0, 0], (out[0][-3000:], out[1][-3000:])
    evals = len(range(EVAL_EVERY - 1, STEPS, EVAL_EVERY))
    assert re.search(rf"role actor \(process 0\): generate calls 0, train steps {STEPS}\b", out[0]), out[0][-2000:]
    # one batch per step + (greedy + sampled) per evaluation
    assert re.search(rf"role rollout \(process 1\): generate calls {STEPS + 2 * evals}, train steps 0", out[1]), \
        out[1][-2000:]

    rows = lt.read_metrics(ref / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))  # one writer: each step once, in order
    for s, r in enumerate(rows):
        v = max(0, s - 1)  # batch s generated with P(max(0, s - K))
        assert r["weight_version/sample_min"] == r["weight_version/sample_max"] == float(v)
        assert r["weight_version/staleness_max"] == r["weight_version/staleness_mean"] == float(s - v) <= 1.0
        assert r["weight_version"] == s + 1
        assert r["mpmd/rollout_train_steps"] == 0.0
        assert {"perf/rollout_wait_s", "perf/train_wait_s", "perf/overlap_frac"} <= set(r)
        assert 0.0 <= r["perf/overlap_frac"] <= 1.0 + 1e-9
        # continuous batching on the rollout's processes: the slots program's counters
        assert r["rollout/slots_refilled"] >= 1 and r["rollout/decode_steps"] >= 1, r
        assert 0 < r["rollout/slot_utilisation"] <= 1
    for n in range(STEPS - 1):  # the rollout of batch n + 1 started before the update of step n ended
        assert rows[n]["perf/next_generate_start_t"] < rows[n]["perf/update_end_t"], rows[n]
    assert rows[1]["perf/overlap_frac"] > 0  # step 0's update waits for its compile: batch 1 may be done by then
    assert (ref / "ckpt" / "inflight" / f"{STEPS - 1}.npz").is_file()

    # 1. the one-process asynchronous run of the same mesh shapes (2 host devices: actor 1 + rollout 1), run beside
    # part 2 (whose waits for the survivor's verdict and the sidecar leave the cores idle), checked after it
    single = tmp_path / "single.jsonl"
    single_proc = lt.start([*JOB, "--ckpt-dir", "", "--metrics-jsonl", single], run_env, tmp_path / "single.log")
    try:
        _kill_resume(lt, ref, got, run_env)
        rc = single_proc.wait(timeout=900)
    finally:
        single_proc.kill()
    assert rc == 0, (tmp_path / "single.log").read_text()[-3000:]
    one = lt.read_metrics(single)
    for s in range(STEPS):
        for k in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean"):
            assert rows[s][k] == one[s][k], (s, k)
        assert abs(rows[s]["train/pg_loss"] - one[s]["train/pg_loss"]) <= 1e-5, s
        assert rows[s]["weight_version/staleness_max"] == one[s]["weight_version/staleness_max"]
    for s in range(EVAL_EVERY - 1, STEPS, EVAL_EVERY):
        assert {k: v for k, v in rows[s].items() if k.startswith("eval/")} == \
            {k: v for k, v in one[s].items() if k.startswith("eval/")} != {}, s


def _kill_resume(lt, ref, got, run_env):
    """Part 2 of the test (the module docstring)."""
    # 2. process 0 alone SIGKILLed at a seeded random moment, resumed to the end: the uninterrupted run bitwise
    procs = _start(lt, got, run_env, "start0")
    newest = lt.wait_for_checkpoint_after(procs[0], got / "ckpt", 0)
    assert all(p.poll() is None for p in procs) and newest < STEPS, (got / "start0.p0.log").read_text()[-3000:]
    time.sleep(random.Random(0).uniform(0.0, 0.5))  # a step takes ~1 s once compiled
    procs[0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    rcs = _wait(procs, timeout=PUSH_TIMEOUT + 90)
    log0 = (got / "start0.p0.log").read_text(errors="replace")
    sidecar = int(re.search(r"in sidecar process (\d+)", log0).group(1))
    text = (got / "start0.p1.log").read_text(errors="replace")  # the survivor names the side and the process
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert rcs[1] == 1 and len(errors) == 1, (rcs, text[-3000:])
    assert re.match(r"error: the actor side (lost process\(es\) \[0\]|\(processes \[0\]\))", errors[0]), errors
    assert not STACK.search(text.replace(errors[0], "")), text[-3000:]
    assert _wait(_start(lt, got, run_env, "final")) == [0, 0], (got / "final.p0.log").read_text()[-3000:]
    assert "resumed from" in (got / "final.p0.log").read_text()
    lt.assert_same_run(ref, got, STEPS, ignore=("mpmd/rollout_generate_calls",))
    while not _gone(sidecar) and time.monotonic() < killed + SIDECAR_BOUND_S:  # no sidecar outlives its bound
        time.sleep(0.5)
    assert _gone(sidecar), f"sidecar {sidecar} still alive {time.monotonic() - killed:.0f} s after its process 0 died"
