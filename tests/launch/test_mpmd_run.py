"""MPMD: the rollout on its own process. Three local processes x 2 CPU devices, `--mesh
actor:fsdp=2,expert=2/rollout:expert=2`: processes 0-1 run the actor, process 2 the rollout (sharding/mpmd.py,
rl/rollout/mpmd.py). One run, one step off with partial rollouts (`--max-staleness 1 --partial-rollout` on a length
spread where half the prompts' samples span two segments, rl/run/partial.py: both actor processes run the partial
producer in lock-step, the writer sends the segments), covers the steps, the roles' counters, the single writer,
the token versions, parity of every completed step with the single-process run of the same meshes and flags,
`--init` in MPMD (the run starts from an official-format tiny checkpoint, conftest's `hf_tiny16_checkpoint`: the
actor processes load their shards of it, the rollout process reads its version 0 from the file's FP8 blocks, logged),
and the fault at the default settings (--push-timeout 600): the rollout process SIGKILLed mid-run -> each actor process
exits non-zero within 60 s (the liveness timeout, `sharding.mpmd.LIVENESS_S`, far ahead of jax's heartbeat abort at
630 s) with one line naming the rollout process and no Python or C++ stack, and process 0's coordination sidecar is
gone within its grace (issue 42). A bad MPMD spec fails before step 1."""

import json
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = "actor:fsdp=2,expert=2/rollout:expert=2"
DEAD_S = 60  # a dead process is noticed by every survivor within this at the default --push-timeout (issue 42)
SIDECAR_S = 30 + 5  # sharding.distributed.sidecar_grace_s at the defaults, + polling
# what a survivor must not print: a Python, C++ (glog) or Gloo stack (XLA's "Very slow compile?" alarm, an E line of a
# loaded machine, is not one; nor are gloo's "[Gloo] Rank N is connected" lines, which two threads may interleave
# mid-line: "[Gloo] Rank [Gloo] Rank 0 is connected ...", seen 2026-12-05)
STACK = re.compile(r"Traceback|Check failure|terminate called|^\*\*\* |^[FE]\d{4} (?!.*slow_operation_alarm)"
                   r"|Gloo(?!\] Rank )", re.M)
# one step off, partial rollouts: 4 new tokens in segments of 2, every other prompt capped at 3 (a length spread
# whose samples all span two segments unless they stop; 3 rather than 2 keeps every batch's trimmed learner width
# at the 4-token one: one learner compile per run)
PARTIAL = ("--max-staleness", "1", "--partial-rollout", "--rollout.length_schedule", "0.5:3")


def _cmd(mesh, steps, metrics, extra=()):
    return [sys.executable, str(ROOT / "launch/run.py"), "--mesh", mesh, "--steps", str(steps),
            "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--ckpt-dir", "",
            "--tensorboard-dir", "", "--metrics-jsonl", str(metrics), "--no-progress", *extra]


def _launch(lt, mesh, steps, metrics, tmp_path, env, n=3, flags=()):
    procs, logs = [], []
    for i, cluster in enumerate(lt.processes(n)):
        log = open(tmp_path / f"p{i}.log", "w")
        extra = (*flags, *cluster, "--cpu-devices-per-process", "2")
        procs.append(subprocess.Popen(_cmd(mesh, steps, metrics, extra), env=env, stdout=log,
                                      stderr=subprocess.STDOUT, text=True))
        logs.append(log)
    return procs, logs


def _gone(pid):
    """No such process, or a zombie (a reparented orphan its new parent has not reaped)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _rows(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_mpmd_three_processes_steps_parity_and_rollout_killed(tmp_path, run_env, lt, hf_tiny16_checkpoint):
    metrics = tmp_path / "m.jsonl"
    flags = (*PARTIAL, "--init", str(hf_tiny16_checkpoint))
    procs, logs = _launch(lt, MESH, 10, metrics, tmp_path, run_env, flags=flags)
    single, single_log, single_proc = tmp_path / "single.jsonl", tmp_path / "single.log", None
    try:
        deadline = time.monotonic() + 1500
        while len(_rows(metrics)) < 3:  # 3 GRPO steps completed (the writer logs after the step's push)
            assert time.monotonic() < deadline, "3 steps did not complete in time"
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-3000:]
            time.sleep(1)
        procs[2].kill()  # the rollout process dies mid-run
        killed = time.monotonic()
        for p in procs[:2]:
            p.wait(timeout=DEAD_S + 60)  # never a hang (the bound itself is asserted below)
        elapsed = time.monotonic() - killed
        # the single-process run of the same flags, as many steps (parity, below), beside the sidecar's grace
        with open(single_log, "w") as f:
            single_proc = subprocess.Popen(_cmd(MESH, len(_rows(metrics)), single,
                                                (*flags, "--cpu-devices-per-process", "6")),
                                           env=run_env, stdout=f, stderr=subprocess.STDOUT, text=True)
        sidecar = int(re.search(r"in sidecar process (\d+)", (tmp_path / "p0.log").read_text()).group(1))
        while not _gone(sidecar) and time.monotonic() < killed + elapsed + SIDECAR_S:
            time.sleep(0.5)
    finally:
        for p in procs:
            p.kill()
        for log in logs:
            log.close()
    out = [(tmp_path / f"p{i}.log").read_text() for i in range(3)]
    rows = _rows(metrics)
    # a step without learning signal (all groups zero-std) makes no update and keeps the version (rl/run/stages.py)
    assert sum(r["train/skipped_no_signal"] == 0.0 for r in rows) >= 1
    for i in (0, 1):  # one line each (the heartbeat watch or a wait, whichever comes first; sharding/mpmd.py)
        assert procs[i].returncode == 1, out[i][-2000:]
        errors = [x for x in out[i].splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: the rollout side lost process(es) [2] "), \
            out[i][-2000:]
        assert not STACK.search(out[i].replace(errors[0], "")), out[i][-3000:]
    # (the roles' counters line, "role actor (process 0): generate calls 0, ...", is printed by a clean exit:
    # tests/launch/test_mpmd_async_resume.py reads it; here the rollout did every generate, counted below)
    assert elapsed < DEAD_S, elapsed  # seconds, not --push-timeout's ten minutes (a wall-clock bound of the issue)
    assert _gone(sidecar), f"sidecar {sidecar} outlived the run by more than {SIDECAR_S} s"
    steps = [r["step"] for r in rows]
    assert steps == list(range(len(steps))) and len(steps) >= 3  # one writer: each step once, in order
    assert "process 0 runs the actor" in out[0] and "process 2 runs the rollout" in out[2]
    assert "rollout weights version 0 read from" in out[2], out[2][-2000:]  # --init: from the file, not a push
    segments = version = 0
    for r in rows:  # the rollout process never trained; it ran every segment (one request each) of every batch
        segments += r["rollout/partial/segments"]
        assert r["mpmd/rollout_train_steps"] == 0.0
        assert r["mpmd/rollout_generate_calls"] == segments
        # batch m is generated with P(max(0, m - 1)) and older versions (P(j): the version after step j - 1)
        newest = rows[r["step"] - 2]["weight_version"] if r["step"] >= 2 else 0
        assert r["weight_version/sample_max"] <= newest
        version += r["train/skipped_no_signal"] == 0.0
        assert r["weight_version"] == version
        shares = [v for k, v in r.items() if k.startswith("rollout/token_staleness_") and k[-1].isdigit()]
        assert abs(sum(shares) - 1.0) < 1e-9  # token versions recorded, every response token counted once
    assert any(r["rollout/token_staleness_1"] > 0 for r in rows)  # tokens of the version before the learner's
    assert any(r["rollout/partial/continued_rows"] > 0 for r in rows)  # samples spanning two segments

    # the single-process run of the same mesh shapes and flags (started once the actors had exited), as many steps:
    # rollout metrics equal (bitwise), pg_loss within 1e-5, every completed step
    try:
        rc = single_proc.wait(timeout=900)
    finally:
        single_proc.kill()
    assert rc == 0, single_log.read_text()[-3000:]
    srows = _rows(single)
    assert len(srows) == len(rows)
    for m, s in zip(rows, srows):
        keys = {k for k in s if k.startswith(("rollout/", "weight_version"))}
        assert keys == {k for k in m if k.startswith(("rollout/", "weight_version"))}, m["step"]
        assert {k: m[k] for k in keys} == {k: s[k] for k in keys}, m["step"]
        assert ("train/pg_loss" in m) == ("train/pg_loss" in s), m["step"]
        if "train/pg_loss" in m:
            assert abs(m["train/pg_loss"] - s["train/pg_loss"]) <= 1e-5, m["step"]
    assert sum("train/pg_loss" in m for m in rows) >= 1


@pytest.mark.slow
def test_mpmd_bad_spec_fails_before_step_one(tmp_path, run_env, lt):
    metrics = tmp_path / "m.jsonl"
    # process 0 would hold one actor and one rollout device (process 2 none): the transfer cannot serve it
    procs, logs = _launch(lt, "actor:fsdp=1/rollout:expert=2", 3, metrics, tmp_path, run_env)
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
