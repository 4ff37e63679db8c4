"""The two-job layout (rl/rollout_job.py): the rollout as a JAX job of its own, on local processes with one CPU device
each. One launched set of jobs serves every assertion (A and C side by side, then B):
- run A: an actor job and its rollout job, 3 GRPO steps; the rollout job is SIGKILLed once the first step is logged
  and restarted by the test: the run completes, the actor logs one line for the loss, `rollout/restarts` counts it,
  and every per-step metric that is not a timing equals the uninterrupted run's (bitwise on CPU; run B);
- run B: the same two jobs uninterrupted, started once A is done (its programs then load from the session's
  compilation cache: ~15 s instead of a second compile; the single-job layout's run of the same flags is bitwise
  equal too, checked by hand: README);
- run C: an actor job whose rollout job is SIGKILLed once registered and never restarted: the actor exits non-zero
  after its short --rollout-restart-timeout with one line naming the rollout job (killed before its first step, to
  keep the test cheap: the loss is noticed in the first push's wait, the same `JobRollout._recover` path).
"""

from __future__ import annotations

import json
import signal
import time

import portpicker

from launch import run as launch_run

MESH = "actor:data=1/rollout:data=1"
STEPS = 3
TIMEOUTS = ("--push-timeout", "20")


def _flags(lt, metrics, *extra):
    return ["--mesh", MESH, "--steps", str(STEPS), *lt.TINY, "--eval-every", "0", "--ckpt-dir=", "--tensorboard-dir=",
            "--metrics-jsonl", str(metrics), *TIMEOUTS, *extra]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_two_jobs_rollout_killed_restarted_and_lost(tmp_path, run_env, lt):
    pa, pc = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    ma, mb, mc = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    logs = {k: tmp_path / f"{k}.log" for k in ("a", "r1", "r2", "b", "c", "r3")}
    one = ["--cpu-devices-per-process", "1"]
    rollout = lambda port, m: _flags(lt, m, *one, "--rollout-job", "--actor-address", f"127.0.0.1:{port}")  # noqa: E731
    procs = {
        "a": lt.start(_flags(lt, ma, *one, "--rollout-address", f"127.0.0.1:{pa}"), run_env, logs["a"]),
        "r1": lt.start(rollout(pa, tmp_path / "r.jsonl"), run_env, logs["r1"]),
        "c": lt.start(_flags(lt, mc, *one, "--rollout-address", f"127.0.0.1:{pc}", "--rollout-restart-timeout", "3"),
                      run_env, logs["c"]),
        "r3": lt.start(rollout(pc, tmp_path / "r.jsonl"), run_env, logs["r3"]),
    }
    try:
        deadline = time.monotonic() + 900
        killed = set()
        while len(killed) < 2:  # each kill when its moment comes (either run may get there first)
            assert time.monotonic() < deadline, "the rollout jobs were not killed in time"
            if "r3" not in killed and "registered with the actor" in logs["r3"].read_text():
                procs["r3"].send_signal(signal.SIGKILL)  # C's rollout job, once registered; never restarted
                killed.add("r3")
            if "r1" not in killed and _rows(ma):
                procs["r1"].send_signal(signal.SIGKILL)  # A's, mid-run: step 2's batch is being generated or soon
                procs["r1"].wait(timeout=60)
                procs["r2"] = lt.start(rollout(pa, tmp_path / "r.jsonl"), run_env, logs["r2"])  # as a supervisor would
                killed.add("r1")
            for k in ("a", *(() if "r3" in killed else ("c",))):  # alive
                assert procs[k].poll() is None, logs[k].read_text()[-3000:]
            time.sleep(0.05)
        rc = {k: procs[k].wait(timeout=max(1.0, deadline - time.monotonic())) for k in ("a", "r2", "c")}
        # the reference after A: its programs are A's and R's (same shapes), loaded from the session's cache
        pb = portpicker.pick_unused_port()
        procs["b"] = lt.start(_flags(lt, mb, *one, "--rollout-address", f"127.0.0.1:{pb}"), run_env, logs["b"])
        procs["rb"] = lt.start(rollout(pb, tmp_path / "r.jsonl"), run_env, tmp_path / "rb.log")
        rc["b"] = procs["b"].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    out = {k: v.read_text() for k, v in logs.items() if v.exists()}
    assert rc["a"] == 0 and rc["b"] == 0 and rc["r2"] == 0, (out["a"][-3000:], out["r2"][-2000:])
    assert procs["r1"].returncode == -signal.SIGKILL

    # A: the loss logged once, the restarted rollout served the rest; the metrics are the single-job run's
    lost = [x for x in out["a"].splitlines() if "waiting up to" in x and "for a rollout job to register (the run" in x]
    assert len(lost) == 1 and "the rollout job" in lost[0] and "closed the connection" in lost[0], out["a"][-3000:]
    assert "Traceback" not in out["a"] and "recovered in" in out["a"]
    assert "registered with the actor" in out["r2"] and "weight version" in out["r2"]
    ra, rb = _rows(ma), _rows(mb)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(STEPS))  # nothing twice or skipped
    assert ra[0]["rollout/restarts"] == 0.0 and ra[-1]["rollout/restarts"] == 1.0 and ra[-1]["rollout/recovery_s"] > 0
    new = {"rollout/restarts", "rollout/recovery_s"}  # the two-job layout's own metrics (the fault, a timing)
    assert all(y["rollout/restarts"] == 0.0 for y in rb)
    for x, y in zip(ra, rb):
        assert set(x) == set(y)
        bad = {k: (x[k], y[k]) for k in y if not k.startswith("perf/") and k not in new
               and not lt.same_value(x[k], y[k])}
        assert not bad, (x["step"], bad)

    # C: never restarted -> non-zero after the restart timeout, one error line naming the rollout job
    assert rc["c"] != 0, out["c"][-3000:]
    errors = [x for x in out["c"].splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "the rollout job" in errors[0] and "pid" in errors[0], out["c"][-3000:]
    assert "is gone and no rollout job registered at 127.0.0.1:" in errors[0] and "Traceback" not in out["c"]
    assert "within 3 s (--rollout-restart-timeout)" in errors[0]
    assert not (tmp_path / "r.jsonl").exists()  # rollout jobs write no metrics


def test_rollout_job_flags_are_checked(capsys):
    """Bad two-job flags: one line naming the flag, exit 2, before any model is built (in this process)."""
    for args, needle in ((["--rollout-job"], "--actor-address"),
                         (["--rollout-address", "nohostport"], "rollout.address (--rollout-address) must be HOST:PORT"),
                         (["--rollout-job", "--actor-address", "h:1", "--rollout-address", "h:2"], "--rollout-job and"),
                         (["--rollout-restart-timeout", "0"], "--rollout-restart-timeout")):
        assert launch_run.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (args, err)
