"""Multi-host: the main command with --coordinator/--num-processes/--process-id on two local processes x 2 CPU
devices (jax.distributed, gloo) runs 2 GRPO steps on one 4-device mesh spanning both processes (the colocated
layout: the rollout generates on the same mesh): data-parallel across the hosts, expert-parallel inside each.
(The actor's FSDP across processes is tests/launch/test_mpmd_run.py's.)"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_processes_run_two_steps(tmp_path, run_env, lt):
    env = run_env
    metrics = tmp_path / "m.jsonl"
    procs = []
    for cluster in lt.processes(2):
        cmd = [sys.executable, str(ROOT / "launch/run.py"), "--mesh", "actor:data=2,expert=2", "--steps", "2",
               "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--ckpt-dir", "",
               "--tensorboard-dir", "", "--metrics-jsonl", str(metrics), "--no-progress",
               *cluster, "--cpu-devices-per-process", "2"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=1200)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert "process %d of 2" % i in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # one writer (process 0)
    assert all(r["weight_version"] == r["step"] + 1 for r in rows)
    # both hosts' prompt shards form the global batch: 2 hosts x 2 prompts x 4 samples
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)
