"""MPMD: the rollout on its own process. Three local processes x 2 CPU devices, `--mesh
actor:fsdp=2,expert=2/rollout:expert=2`: processes 0-1 run the actor, process 2 the rollout (sharding/mpmd.py,
rl/roles.py). One run covers the steps, the roles' counters, the single writer, parity with the single-process run
of the same meshes, and the fault: the rollout process killed mid-run -> the actor processes exit non-zero within
the push timeout naming the rollout side. A bad MPMD spec fails before step 1."""

import json
import pathlib
import re
import subprocess
import sys
import time

import portpicker
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = "actor:fsdp=2,expert=2/rollout:expert=2"
TIMEOUT = 20  # --push-timeout of the run


def _cmd(mesh, steps, metrics, extra=()):
    return [sys.executable, str(ROOT / "launch/run.py"), "--mesh", mesh, "--steps", str(steps),
            "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--ckpt-dir", "",
            "--tensorboard-dir", "", "--metrics-jsonl", str(metrics), "--no-progress", *extra]


def _launch(mesh, steps, metrics, tmp_path, env, n=3):
    port = portpicker.pick_unused_port()
    procs, logs = [], []
    for i in range(n):
        log = open(tmp_path / f"p{i}.log", "w")
        extra = ("--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i),
                 "--cpu-devices-per-process", "2", "--push-timeout", str(TIMEOUT))
        procs.append(subprocess.Popen(_cmd(mesh, steps, metrics, extra), env=env, stdout=log,
                                      stderr=subprocess.STDOUT, text=True))
        logs.append(log)
    return procs, logs


def _rows(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_mpmd_three_processes_steps_parity_and_rollout_killed(tmp_path, run_env):
    metrics = tmp_path / "m.jsonl"
    procs, logs = _launch(MESH, 10, metrics, tmp_path, run_env)
    try:
        deadline = time.monotonic() + 1500
        while len(_rows(metrics)) < 3:  # 3 GRPO steps completed (the writer logs after the step's push)
            assert time.monotonic() < deadline, "3 steps did not complete in time"
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-3000:]
            time.sleep(1)
        procs[2].kill()  # the rollout process dies mid-run
        killed = time.monotonic()
        for p in procs[:2]:
            p.wait(timeout=TIMEOUT + 90)  # push timeout + polling + the step in flight; never a hang
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
        for log in logs:
            log.close()
    out = [(tmp_path / f"p{i}.log").read_text() for i in range(3)]
    for i in (0, 1):
        assert procs[i].returncode not in (0, None), out[i][-2000:]
        assert "error: the rollout side (processes [2]) did not answer" in out[i], out[i][-2000:]
        # the actor processes never generated; they trained every step they finished
        m = re.search(r"role actor \(process %d\): generate calls (\d+), train steps (\d+)" % i, out[i])
        assert m and int(m.group(1)) == 0 and int(m.group(2)) >= 3, out[i][-2000:]
    assert elapsed < TIMEOUT + 90
    rows = _rows(metrics)
    steps = [r["step"] for r in rows]
    assert steps == list(range(len(steps))) and len(steps) >= 3  # one writer: each step once, in order
    assert "process 0 runs the actor" in out[0] and "process 2 runs the rollout" in out[2]
    for r in rows:  # the rollout process never trained; it generated once per step
        assert r["mpmd/rollout_train_steps"] == 0.0
        assert r["mpmd/rollout_generate_calls"] == r["step"] + 1
        assert r["weight_version"] == r["step"] + 1

    # the single-process run of the same mesh shapes: step-1 rewards equal, pg_loss within 1e-5
    single = tmp_path / "single.jsonl"
    res = subprocess.run(_cmd(MESH, 1, single, ("--cpu-devices-per-process", "6")), env=run_env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    s0, m0 = _rows(single)[0], rows[0]
    for k in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean"):
        assert m0[k] == s0[k], k
    assert abs(m0["train/pg_loss"] - s0["train/pg_loss"]) <= 1e-5


@pytest.mark.slow
def test_mpmd_bad_spec_fails_before_step_one(tmp_path, run_env):
    metrics = tmp_path / "m.jsonl"
    # process 0 would hold one actor and one rollout device (process 2 none): the transfer cannot serve it
    procs, logs = _launch("actor:fsdp=1/rollout:expert=2", 3, metrics, tmp_path, run_env)
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            p.kill()
        for log in logs:
            log.close()
    for i, p in enumerate(procs):
        out = (tmp_path / f"p{i}.log").read_text()
        assert p.returncode == 2, out[-2000:]
        assert "error: mesh spec 'actor:data=1/rollout:expert=2': process 0 holds actor devices [0] and " \
               "rollout devices [1]" in out, out[-2000:]
        assert "Traceback" not in out
    assert not metrics.exists()
