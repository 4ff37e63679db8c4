"""MPMD checkpoints, resume and --init (rl/roles.py): two local processes x 2 CPU devices, `--mesh
actor:expert=2/rollout:expert=2` (process 0 the actor, process 1 the rollout), the tiny job from an official-format
tiny checkpoint (`--init`, conftest's `hf_tiny_checkpoint`), every push verified across the processes.

1. An uninterrupted 3-step run with a checkpoint per step (the actor saves them alone; the last step is saved and
   2 are kept: [2, 3]).
2. Its step-2 checkpoint and metrics copied to a fresh run directory, then the same command with `--steps 3` there:
   it resumes at step 2 (the actor restores, the rollout gets the resume point and the pushed weights) and the
   final checkpoint and every per-step metric equal the uninterrupted run's bitwise (`assert_same_run`). (A
   checkpoint does not depend on the run that wrote it going on: the fingerprint holds no `--steps` and no paths.
   Copying it spares a third 2-process launch; the kill/resume tests cover a run that stops and saves.)
3. --init: the rollout's version 0 is read from the file's FP8 blocks on the rollout process (logged). (That load
   equals the dense rollout in one process: tests/dsv4/test_load_sharded.py; the MPMD run's steps equal the
   one-process run's: tests/launch/test_mpmd_run.py and test_mpmd_async_resume.py. The one-process --init run this
   test also made, 2 steps with its own compiles, was dropped for the suite's time.)

Runtime: ~2 min in a full-suite run on 2 cores (2 launches of 2 processes; the second loads the compile cache),
hence slow.

    .venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_resume.py
"""

from __future__ import annotations

import pathlib
import shutil
import signal
import subprocess
import time

import pytest

MESH = "actor:expert=2/rollout:expert=2"


def _launch_mpmd(lt, args, env, log_dir: pathlib.Path, name: str, timeout: float = 900) -> list[str]:
    """`launch/run.py *args` as 2 processes of one jax.distributed job -> their outputs; both must exit 0."""
    logs = [log_dir / f"{name}.p{i}.log" for i in range(2)]
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    procs = [lt.start([*args, *flags, "--cpu-devices-per-process", "2", "--push-timeout", "120"], env, logs[i])
             for i, flags in enumerate(lt.processes(2))]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:  # PYTHONFAULTHANDLER: every thread's stack into the logs, for the report
            p.send_signal(signal.SIGABRT)
        time.sleep(5)
        raise
    finally:
        for p in procs:
            p.kill()
    outs = [log.read_text() for log in logs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.slow
def test_mpmd_checkpoint_resume_and_init(tmp_path, run_env, lt, hf_tiny_checkpoint):
    args = [*lt.TINY, "--mesh", MESH, "--init", hf_tiny_checkpoint, "--eval-every", "0", "--ckpt-every", "1",
            "--rollout.push_verify_every", "1"]
    ref, got = tmp_path / "ref", tmp_path / "got"
    out = _launch_mpmd(lt, [*args, "--steps", "3", *lt.outputs(ref)], run_env, tmp_path, "ref")
    assert "process 1 runs the rollout" in out[1] and "rollout weights version 0 read from" in out[1]
    assert lt.ckpt_steps(ref / "ckpt") == [2, 3]  # saved by the actor process alone

    (got / "ckpt").mkdir(parents=True)  # the run stopped after step 2: its checkpoint and its metrics
    shutil.copytree(ref / "ckpt" / "2", got / "ckpt" / "2")
    (got / "metrics.jsonl").write_text("".join(line + "\n" for line in (ref / "metrics.jsonl").read_text().splitlines()[:2]))
    assert lt.ckpt_steps(got / "ckpt") == [2] and len(lt.read_metrics(got / "metrics.jsonl")) == 2
    out = _launch_mpmd(lt, [*args, "--steps", "3", *lt.outputs(got)], run_env, tmp_path, "resumed")
    # every metric but the rollout process's own counter of its generate calls (it restarts with the process)
    _, rows = lt.assert_same_run(ref, got, 3, ignore=("mpmd/rollout_generate_calls",))
    resumed = lt.read_metrics(got / "metrics.jsonl")[-1]
    assert resumed["mpmd/rollout_generate_calls"] == 1.0 and resumed["mpmd/rollout_train_steps"] == 0.0
    version = rows[1]["weight_version"]  # after step 2
    assert f"resumed from {got / 'ckpt'} at step 2 (weight version {version})" in out[0], out[0][-3000:]
    # the restored version arrives by the push (version 0 would be read from --init's file again)
    assert ("rollout weights version 0 read from" in out[1]) == (version == 0)
    assert version > 0 and rows[-1]["weight_version"] > 0  # the learner did update before and after the resume
