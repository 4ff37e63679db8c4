"""The seeds' disaggregated layout with one-step-off overlap, recovered from crashes: async MPMD checkpoints and
resumes (issue 22 point 3), and continuous batching on the rollout's own processes (`--rollout-slots`).

Two local processes x 1 CPU device, `--mesh actor:data=1/rollout:data=1 --async-rollout` (process 0 the actor,
process 1 the rollout, behind `rl.rollout_mpmd.ProcessRollout`), the tiny job with `--rollout-slots 3`:
1. an uninterrupted run of STEPS steps with a checkpoint per step: every step logs the rollout's continuous-batching
   counters (`rollout/slots_refilled`, `rollout/decode_steps`, `rollout/slot_utilisation`), which only the slots
   program reports, and the in-flight batch of each checkpoint is on disk;
2. the same command started, SIGKILLed (both processes: a lost node) at a seeded random moment after a new
   checkpoint, started again, killed again, and started once more to the end: it resumes each time, and the final
   checkpoint and every per-step metric (but the rollout process's own counter, which restarts with it) equal the
   uninterrupted run's bitwise (`assert_same_run`).

    .venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_async_resume.py
"""

from __future__ import annotations

import random
import signal
import time

import portpicker
import pytest

STEPS = 8
JOB = ["--steps", str(STEPS), "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4",
       "--eval-every", "0", "--ckpt-every", "1", "--keep-checkpoints", "2", "--no-progress", "--tensorboard-dir", "",
       "--mesh", "actor:data=1/rollout:data=1", "--async-rollout", "--rollout-slots", "3"]


def _start(lt, run_dir, env, name):
    port = portpicker.pick_unused_port()
    args = [*JOB, "--ckpt-dir", run_dir / "ckpt", "--metrics-jsonl", run_dir / "metrics.jsonl",
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--cpu-devices-per-process", "1",
            "--push-timeout", "60"]
    return [lt.start([*args, "--process-id", i], env, run_dir / f"{name}.p{i}.log") for i in range(2)]


def _wait(procs, timeout=900):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_async_mpmd_killed_and_resumed_equals_uninterrupted_with_slots(tmp_path, run_env, lt):
    ref, got = tmp_path / "ref", tmp_path / "got"
    ref.mkdir()
    got.mkdir()
    assert _wait(_start(lt, ref, run_env, "run")) == [0, 0], (ref / "run.p0.log").read_text()[-3000:]
    rows = lt.read_metrics(ref / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:  # continuous batching on the rollout's processes: the slots program's counters
        assert r["rollout/slots_refilled"] >= 1 and r["rollout/decode_steps"] >= 1, r
        assert 0 < r["rollout/slot_utilisation"] <= 1
        assert r["weight_version/staleness_max"] == (1.0 if r["step"] else 0.0)
    assert (ref / "ckpt" / "inflight" / f"{STEPS - 1}.npz").is_file()

    rng, newest = random.Random(0), 0
    for start in range(2):
        procs = _start(lt, got, run_env, f"start{start}")
        newest = lt.wait_for_checkpoint_after(procs[0], got / "ckpt", newest)
        assert all(p.poll() is None for p in procs) and newest < STEPS, (got / f"start{start}.p0.log").read_text()[-3000:]
        time.sleep(rng.uniform(0.0, 0.5))  # a step takes ~1 s once compiled
        for p in procs:
            p.send_signal(signal.SIGKILL)
        _wait(procs)
        newest = max(lt.ckpt_steps(got / "ckpt"))
        if start:
            assert "resumed from" in (got / f"start{start}.p0.log").read_text()
    assert _wait(_start(lt, got, run_env, "final")) == [0, 0], (got / "final.p0.log").read_text()[-3000:]
    assert "resumed from" in (got / "final.p0.log").read_text()
    lt.assert_same_run(ref, got, STEPS, ignore=("mpmd/rollout_generate_calls",))
