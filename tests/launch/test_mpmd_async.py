"""One-step-off asynchronous rollout across MPMD processes (rl/async_mpmd.py): two local processes x 1 CPU device,
`--mesh actor:data=1/rollout:data=1 --async-rollout` (K = 1): process 0 runs the actor, process 1 the rollout, the
same layout as `benchmarks/async_overlap.py --mpmd`. One run of 3 steps covers:
- the schedule: batch m is generated with P(max(0, m - K)), so every sample's version (per-sample, all equal
  within a batch) is max(0, m - 1) and the staleness is [0, 1, 1] <= K;
- the overlap: the rollout process starts generating batch n + 1 before the actor's update of step n ends (the
  wall-clock timestamps the writer logs: both processes share the host's clock), and `perf/overlap_frac` > 0;
- the roles: the rollout never trains, the actor never generates, one metrics writer;
- parity with the one-process asynchronous run of the same mesh shapes (the same schedule): every step has equal
  rewards and pg_loss within 1e-5 (steps 0-1 sampled with P(0), step 2 with P(1) pushed across processes), and
  equal evaluations (steps 1 and 2, on P(2) and P(3): the rollout process evaluates after the push).

Runtime: 4.5-10.5 min on 2 cores at load 13-16 (3 jobs, compiles), hence `slow`.

    .venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_async.py
"""

from __future__ import annotations

import re

import portpicker
import pytest

STEPS = 3
MESH = "actor:data=1/rollout:data=1"
JOB = ["--steps", str(STEPS), "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "2",
       "--eval-prompts", "4", "--eval-samples", "2", "--ckpt-dir", "", "--tensorboard-dir", "", "--no-progress",
       "--mesh", MESH, "--async-rollout"]


@pytest.mark.slow
def test_mpmd_async_one_step_off_overlaps_and_matches_one_process(tmp_path, run_env, lt):
    metrics = tmp_path / "mpmd.jsonl"
    port = portpicker.pick_unused_port()
    procs = []
    for i in range(2):
        extra = ["--metrics-jsonl", metrics, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                 "--process-id", i, "--cpu-devices-per-process", "1", "--push-timeout", "60"]
        procs.append(lt.start([*JOB, *extra], run_env, tmp_path / f"p{i}.log"))
    try:
        rcs = [p.wait(timeout=1200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = [(tmp_path / f"p{i}.log").read_text(errors="replace") for i in range(2)]
    assert rcs == [0, 0], (out[0][-3000:], out[1][-3000:])
    assert re.search(r"role actor \(process 0\): generate calls 0, train steps 3", out[0]), out[0][-2000:]
    # 3 batches + 2 evaluations (greedy + sampled each)
    assert re.search(r"role rollout \(process 1\): generate calls 7, train steps 0", out[1]), out[1][-2000:]

    rows = lt.read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(STEPS))  # one writer: each step once, in order
    for s, r in enumerate(rows):
        v = max(0, s - 1)  # batch s generated with P(max(0, s - K))
        assert r["weight_version/sample_min"] == r["weight_version/sample_max"] == float(v)
        assert r["weight_version/staleness_max"] == r["weight_version/staleness_mean"] == float(s - v) <= 1.0
        assert r["weight_version"] == s + 1
        assert r["mpmd/rollout_train_steps"] == 0.0
        assert {"perf/rollout_wait_s", "perf/train_wait_s", "perf/overlap_frac"} <= set(r)
        assert 0.0 <= r["perf/overlap_frac"] <= 1.0 + 1e-9
    for n in range(STEPS - 1):  # the rollout of batch n + 1 started before the update of step n ended
        assert rows[n]["perf/next_generate_start_t"] < rows[n]["perf/update_end_t"], rows[n]
    assert rows[1]["perf/overlap_frac"] > 0  # step 0's update waits for its compile: batch 1 may be done by then

    # the one-process asynchronous run of the same mesh shapes (2 host devices: actor 1 + rollout 1)
    single = tmp_path / "single.jsonl"
    rc, text = lt.launch([*JOB, "--metrics-jsonl", single], run_env, tmp_path / "single.log", timeout=900)
    assert rc == 0, text[-3000:]
    ref = lt.read_metrics(single)
    for s in range(STEPS):
        for k in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean"):
            assert rows[s][k] == ref[s][k], (s, k)
        assert abs(rows[s]["train/pg_loss"] - ref[s]["train/pg_loss"]) <= 1e-5, s
        assert rows[s]["weight_version/staleness_max"] == ref[s]["weight_version/staleness_max"]
    for s in (1, 2):
        assert {k: v for k, v in rows[s].items() if k.startswith("eval/")} == \
            {k: v for k, v in ref[s].items() if k.startswith("eval/")} != {}, s
