"""Async mode (`--async-rollout`, the producer thread of rl/pipeline.py): a run killed at random moments and restarted reproduces the
uninterrupted async run bitwise (issue 14 point 3), as tests/launch/test_resume.py checks for the synchronous loop.

The default job in miniature (tiny model, digit task, 2 host devices: actor 1 + rollout 1, FP8 rollout, the real
pusher) runs as `python launch/run.py --async-rollout` once uninterrupted and once interrupted (SIGKILL, then
SIGTERM, at seeded random moments after a checkpoint) and restarted with the same command until it completes. The
in-flight batch (generated with the previous weights) travels with each checkpoint (`ckpt/inflight/<step>.npz`).
Then every array of the final checkpoint and every per-step metric except `perf/*` must be bitwise equal, and
the metrics file holds each step once, with the staleness metrics.

Runtime: 2.4 min wall in a full-suite run on 2 cores with 5 processes (now 4; the first compiles), hence `slow`.
(Two kills in a row, the restart of a restarted async run, are tests/launch/test_mpmd_async_resume.py's.)

    .venv/bin/python -m pytest -q -m slow tests/launch/test_async_resume.py
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

STEPS = 8
JOB = ["--steps", str(STEPS), "--ckpt-every", "1", "--keep-checkpoints", "2", "--eval-every", "4", "--async-rollout"]


@pytest.mark.slow
def test_interrupted_async_run_reproduces_uninterrupted_async_run(tmp_path, run_env, lt):
    args = [*lt.TINY, *JOB]
    ref, got = tmp_path / "ref", tmp_path / "interrupted"
    log = tmp_path / "interrupted.log"

    rc, out = lt.launch([*args, *lt.outputs(ref)], run_env, tmp_path / "ref.log")
    assert rc == 0, out[-3000:]
    ma = lt.read_metrics(ref / "metrics.jsonl")
    assert [r["weight_version/staleness_max"] for r in ma] == [0.0] + [1.0] * (STEPS - 1)  # one step off
    assert all(0.0 <= r["perf/overlap_frac"] <= 1.0 for r in ma)

    step_s = float(np.median([r["perf/step_s"] for r in ma]))
    cmd = [*args, *lt.outputs(got)]
    signals = (signal.SIGKILL, signal.SIGTERM)
    for _, newest in lt.interrupted_starts(cmd, run_env, log, got / "ckpt", STEPS, step_s, 20261201, signals):
        assert (got / "ckpt" / "inflight" / f"{newest}.npz").is_file()  # the in-flight batch of that checkpoint
    rc, text = lt.launch(cmd, run_env, log)
    assert rc == 0 and "resumed from" in text, text[-3000:]

    lt.assert_same_run(ref, got, STEPS)
    assert "eval/pass@1" in ma[3] and "eval/pass@1" in ma[-1]
