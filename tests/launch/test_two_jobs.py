"""The two-job layout (rl/rollout/two_job.py): the rollout as a JAX job of its own, on local processes with CPU devices,
mesh `actor:data=2/rollout:data=2` (the seed layout's shape in miniature). One launched set of jobs (the module fixture
`runs`) serves every assertion (A first, R beside A's last steps, B once R's programs are compiled):
- run A: an actor job of 2 processes x 1 device (one jax.distributed job: process 0 holds the link, both serve their
  shards of the weights) and its rollout job (1 process x 2 devices), 3 GRPO steps; the rollout job is SIGKILLed once
  the first step is logged and restarted by the test: the run completes, the actor logs one line for the loss,
  `rollout/restarts` counts it, and the per-step metrics equal run B's, the 1-process actor job of the same mesh
  shapes (rollout metrics bitwise; train metrics within 1e-5, as tests/launch/test_mpmd_run.py compares multi- to
  single-process);
- run B: a 1-process actor job (2 devices) and its rollout job, uninterrupted, started once R's first step is logged
  (without ray: when A's rollout is killed), so that both its programs load from the session's compilation cache
  (its rollout's are A's rollout job's, its actor's R's actor job's); the single-job layout's run of the same flags
  is bitwise equal too, checked by hand: benchmarks/README.md "Layouts checked by hand");
- run R (only with the [ray] extra): the same run (up to `R_STEPS`) under `--launcher ray` (launch/ray_run.py) on a
  local Ray cluster the launcher starts and stops, started when A's rollout is killed (its rollout job's programs are
  cached by then); the rollout's Ray actor is SIGKILLed (its pid, from the launcher's log) once the first step is
  logged: Ray restarts it, the actor job recovers in place; once the restarted rollout is started the launcher gets
  SIGTERM (issue 42): the actor job finishes the step it is in (the recovered one), saves it, the launcher exits 0,
  the metrics so far are B's (bitwise: the same shapes), and no process of the launcher (its jobs, its local Ray
  cluster) outlives it.
A rollout job that never comes back (the actor's one line naming it after --rollout-restart-timeout, and one that keeps
dying) is tests/rl/test_rollout_job.py's, on `JobRollout` with fake rollout jobs: a launched run of it cost two more
processes here; launch/run.py prints a `RolloutJobError` as its one `error:` line like every other run error.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import portpicker
import pytest

from launch import ray_guard, ray_run, run as launch_run

MESH = "actor:data=2/rollout:data=2"
STEPS = 3
# R's step budget: its SIGTERM stops it after the recovered step (~2); the headroom keeps the run alive until the test
# kills its rollout on a loaded machine (with 3 steps a run of ~1 s of steps could end first: seen at load ~4)
R_STEPS = 12
TIMEOUTS = ("--push-timeout", "20")
ONE = ["--cpu-devices-per-process", "1"]  # A's actor processes
TWO = ["--cpu-devices-per-process", "2"]  # the rollout jobs, the 1-process actor jobs
try:
    import ray  # the [ray] extra: `make test` installs it

    RAY = True
except ImportError:
    ray, RAY = None, False


def _flags(lt, metrics, *extra):
    return ["--mesh", MESH, "--steps", str(STEPS), *lt.TINY, "--eval-every", "0", "--ckpt-dir=", "--tensorboard-dir=",
            "--metrics-jsonl", str(metrics), *TIMEOUTS, *extra]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _in_session(sid: int) -> list[str]:
    """'pid command' of each live process of session `sid` (zombies left out)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{d}/stat").read()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # state, ppid, pgrp, session, ...
        if d.isdigit() and int(fields[3]) == sid and fields[0] != "Z":
            out.append(f"{d} {stat.split('(', 1)[1].rsplit(')', 1)[0]}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_env, lt):
    """Runs A, B (and R with ray) as the module docstring says -> {"rc", "out", "rows", "procs", "tmp"}."""
    tmp_path = tmp_path_factory.mktemp("two_jobs")
    pa = portpicker.pick_unused_port()
    ma, mb, mr = (tmp_path / f"{k}.jsonl" for k in "abR")
    logs = {k: tmp_path / f"{k}.log" for k in ("a", "a1", "r1", "r2", "b", "R")}
    rollout = lambda port, m: _flags(lt, m, *TWO, "--rollout-job", "--actor-address", f"127.0.0.1:{port}")  # noqa: E731
    cluster = lt.processes(2)
    actor_a = lambda i: _flags(lt, ma, *ONE, "--rollout-address", f"127.0.0.1:{pa}", *cluster[i])  # noqa: E731
    procs = {
        "a": lt.start(actor_a(0), run_env, logs["a"]),
        "a1": lt.start(actor_a(1), run_env, logs["a1"]),
        "r1": lt.start(rollout(pa, tmp_path / "r.jsonl"), run_env, logs["r1"]),
    }
    ray_env = {**run_env, "RAY_COLOR_PREFIX": "0"}
    ray_pid = None
    leftover = []

    def start_b():  # B: a 1-process actor job and its rollout job
        pb = portpicker.pick_unused_port()
        procs["b"] = lt.start(_flags(lt, mb, *TWO, "--rollout-address", f"127.0.0.1:{pb}"), run_env, logs["b"])
        procs["rb"] = lt.start(rollout(pb, tmp_path / "r.jsonl"), run_env, tmp_path / "rb.log")

    try:
        deadline = time.monotonic() + 900
        killed = False
        while not killed:
            assert time.monotonic() < deadline, "the rollout job was not killed in time"
            if _rows(ma):
                procs["r1"].send_signal(signal.SIGKILL)  # A's, mid-run: step 2's batch is being generated or soon
                procs["r1"].wait(timeout=60)
                procs["r2"] = lt.start(rollout(pa, tmp_path / "r.jsonl"), run_env, logs["r2"])  # as a supervisor would
                killed = True
                if not RAY:  # B now, beside A's last steps
                    start_b()
                else:  # R: its own session (the local Ray cluster's processes too), killed as a group if need be
                    with open(logs["R"], "ab") as f:
                        procs["R"] = subprocess.Popen(
                            [sys.executable, str(lt.RUN_PY), "--launcher", "ray", *_flags(lt, mr, *TWO),
                             "--steps", str(R_STEPS), "--ckpt-dir", str(tmp_path / "R_ckpt")], cwd=lt.REPO,
                            env=ray_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            for k in ("a", "a1"):  # alive
                assert procs[k].poll() is None, logs[k].read_text()[-3000:]
            time.sleep(0.05)
        rc = {k: procs[k].wait(timeout=max(1.0, deadline - time.monotonic())) for k in ("a", "a1", "r2")}
        if RAY:  # R: kill the rollout's Ray actor (its worker process) once R's first step is logged
            while ray_pid is None:
                assert time.monotonic() < deadline and procs["R"].poll() is None, logs["R"].read_text()[-3000:]
                m = re.search(r"the rollout job: Ray actor pid (\d+)", logs["R"].read_text())
                if m and _rows(mr):
                    ray_pid = int(m.group(1))
                    os.kill(ray_pid, signal.SIGKILL)
                    # B now: its actor programs are R's actor job's, compiled by now (started beside R, B compiled
                    # them a second time on the same two cores)
                    start_b()
                time.sleep(0.05)
            # SIGTERM to the launcher once Ray restarted the rollout: the actor job is in its step 1, waiting for it
            while len(re.findall(r"the rollout job: Ray actor pid", logs["R"].read_text())) < 2:
                assert time.monotonic() < deadline and procs["R"].poll() is None, logs["R"].read_text()[-3000:]
                time.sleep(0.05)
            procs["R"].send_signal(signal.SIGTERM)
            rc["R"] = procs["R"].wait(timeout=max(1.0, deadline - time.monotonic()))
            end = time.monotonic() + 30  # the launcher's processes (its jobs, its Ray cluster): all in its session
            while (leftover := _in_session(procs["R"].pid)) and time.monotonic() < end:
                time.sleep(0.2)
        rc["b"] = procs["b"].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for k, p in procs.items():
            if p.poll() is None:
                if k == "R":
                    os.killpg(p.pid, signal.SIGKILL)  # the launcher and the local Ray cluster it started
                else:
                    p.kill()
    out = {k: v.read_text() for k, v in logs.items() if v.exists()}
    return {"rc": rc, "out": out, "procs": procs, "tmp": tmp_path, "ray_pid": ray_pid, "leftover": leftover,
            "rows": {k: _rows(m) for k, m in (("a", ma), ("b", mb), ("R", mr))}}


def _same_metrics(lt, ra, rb, train_tol: float | None = None, steps: int = STEPS):
    """Every per-step metric of `ra` that is not a timing or the two-job layout's own equals `rb`'s (bitwise; with
    `train_tol`, the train/* ones within it, absolute: an actor job of other process counts), steps 0..steps-1."""
    new = {"rollout/restarts", "rollout/recovery_s"}  # the two-job layout's own metrics (the fault, a timing)
    rb = rb[:steps]
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(steps))  # nothing twice or skipped
    assert all(y["rollout/restarts"] == 0.0 for y in rb)
    for x, y in zip(ra, rb):
        assert set(x) == set(y)
        close = lambda k: (train_tol is not None and k.startswith("train/")  # noqa: E731
                           and abs(x[k] - y[k]) <= train_tol)
        bad = {k: (x[k], y[k]) for k in y if not k.startswith("perf/") and k not in new
               and not lt.same_value(x[k], y[k]) and not close(k)}
        assert not bad, (x["step"], bad)


def test_two_jobs_rollout_killed_and_restarted(runs, lt):
    rc, out, procs, tmp_path = runs["rc"], runs["out"], runs["procs"], runs["tmp"]
    assert rc["a"] == 0 and rc["b"] == 0 and rc["r2"] == 0, (out["a"][-3000:], out["r2"][-2000:])
    assert procs["r1"].returncode == -signal.SIGKILL

    # A: an actor job of 2 processes (process 0 listens, both serve weights); the loss logged once, the restarted
    # rollout served the rest; the metrics are the 1-process actor job's
    assert rc["a1"] == 0, out["a1"][-3000:]
    assert "an actor job of 2 process(es)" in out["a"] and "to register" not in out["a1"]
    lost = [x for x in out["a"].splitlines() if "waiting up to" in x and "for a rollout job to register (the run" in x]
    assert len(lost) == 1 and "the rollout job" in lost[0] and "closed the connection" in lost[0], out["a"][-3000:]
    assert "Traceback" not in out["a"] + out["a1"] and "recovered in" in out["a"]
    assert "registered with the actor" in out["r2"] and "weight version" in out["r2"]
    ra, rb = runs["rows"]["a"], runs["rows"]["b"]
    assert ra[0]["rollout/restarts"] == 0.0 and ra[-1]["rollout/restarts"] == 1.0 and ra[-1]["rollout/recovery_s"] > 0
    _same_metrics(lt, ra, rb, train_tol=1e-5)
    assert not (tmp_path / "r.jsonl").exists()  # rollout jobs write no metrics


@pytest.mark.skipif(not RAY, reason="the [ray] extra is not installed (pip install -e '.[ray]'; `make test` does)")
def test_ray_launcher_rollout_actor_killed_recovers_in_place(runs, lt):
    """R (module docstring): Ray placed both jobs, restarted the killed rollout actor, the run recovered in place;
    the launcher's SIGTERM reached the actor job, which finished its step, saved it and exited 0 (issue 42: it was
    rc -6, a C++ stack and only an orbax temp dir); nothing of the launcher is left running."""
    rc, out = runs["rc"], runs["out"]["R"]
    assert rc["R"] == 0, out[-4000:]
    assert "ray: SIGTERM: passed to the actor job as SIGTERM" in out, out[-4000:]
    assert "SIGTERM: finishing the current step, saving, exiting" in out, out[-4000:]
    rr = runs["rows"]["R"]
    k = len(rr)  # stopped after the step the signal came in: step 1 (the recovered one) or later
    assert 2 <= k < R_STEPS and f"done: {k} steps" in out, out[-4000:]
    ckpt = runs["tmp"] / "R_ckpt"
    assert lt.ckpt_steps(ckpt) == [k] and not [p for p in ckpt.iterdir() if "tmp" in p.name], sorted(ckpt.iterdir())
    assert runs["leftover"] == [], runs["leftover"]
    assert "placement groups of 2 bundles {'CPU': 1} (STRICT_PACK)" in out
    starts = re.findall(r"the rollout job: Ray actor pid (\d+) on \S+ started launch/run.py pid (\d+)", out)
    assert len(starts) == 2 and int(starts[0][0]) == runs["ray_pid"] != int(starts[1][0]), out[-4000:]  # restarted
    lost = [x for x in out.splitlines() if "closed the connection" in x and "for a rollout job to register" in x]
    assert len(lost) == 1 and f"pid {starts[0][1]} " in lost[0], out[-4000:]  # the killed actor's run.py died too
    assert "recovered in" in out and "Traceback" not in out and "Check failure" not in out
    assert rr[0]["rollout/restarts"] == 0.0 and rr[-1]["rollout/restarts"] == 1.0 and rr[-1]["rollout/recovery_s"] > 0
    _same_metrics(lt, rr[:STEPS], runs["rows"]["b"], steps=min(k, STEPS))
    pids = [int(p) for p in re.findall(r"started launch/run.py pid (\d+)", out)]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)  # no job process outlives the launcher


def test_ray_launcher_flags_are_checked(capsys):
    """--launcher ray: the seed layout's placement; a mesh without a rollout of its own or not in whole processes, a
    side's own flag: one line, exit 2, no Ray started."""
    seed = ray_run.placement("actor:fsdp=2,expert=8/rollout:expert=8")  # 3 nodes x 8: actor on 2, rollout on 1
    assert (seed.devices, seed.actor_processes, seed.bundles) == (8, 2, 24)
    assert ray_run.job_argv(["--launcher", "ray", "--ray-address=auto", "--steps", "3", "--ray-address", "h:1"]) == \
        ["--steps", "3"]
    for args, needle in ((["--launcher", "ray", "--mesh", "auto"], "--mesh needs a rollout section"),
                         (["--launcher", "ray", "--mesh", "actor:fsdp=3/rollout:expert=2"], "not whole processes"),
                         (["--launcher", "ray", "--mesh", MESH, "--rollout-address", "127.0.0.1:1"],
                          "--rollout-address: --launcher ray sets it")):
        assert launch_run.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (args, err)


@pytest.mark.skipif(not RAY, reason="the [ray] extra is not installed (pip install -e '.[ray]'; `make test` does)")
def test_ray_launcher_unreachable_address_is_one_line(capsys):
    """--ray-address with nothing there (a closed port, an unknown host, no port): one line naming the address,
    exit 2, before ray.init (which retries an unreachable GCS for about two minutes); no Ray started."""
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
        for addr, needle in ((closed, "no Ray cluster there (Connection refused)"),
                             ("no-such-host.invalid:6379", "unknown host 'no-such-host.invalid'"),
                             ("no-such-host", "expected auto or HOST:PORT")):
            args = ["--launcher", "ray", "--ray-address", addr, "--ray-connect-timeout", "5", "--mesh", MESH]
            assert launch_run.main(args) == 2, addr
            err = capsys.readouterr().err
            assert err.startswith(f"error: --ray-address {addr}: ") and err.count("\n") == 1 and needle in err, err
    assert not ray.is_initialized()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # restored


def test_ray_launcher_connect_watchdog_is_one_line(tmp_path):
    """A port that accepts but is no Ray GCS keeps ray.init retrying: the watchdog ends the launcher after
    --ray-connect-timeout with one line naming the address, exit 2 (here the watchdog alone, in a child process
    that sleeps as a hung ray.init would)."""
    code = ("import time; from launch.ray_guard import connect_watchdog; connect_watchdog('10.0.0.1:6379', 0.5); "
            "time.sleep(60)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ray_run.REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ray_run.REPO)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --ray-address 10.0.0.1:6379: no Ray cluster answered within 0.5 s")


def test_signal_relay_raises_before_the_jobs_then_passes_signals_on():
    """Before the jobs exist a signal interrupts the launcher (`Interrupted`); after, the first signal is passed on
    as it came and any later one as SIGINT (the job then exits at once); the old handlers come back."""
    before = signal.getsignal(signal.SIGTERM)
    relay = ray_guard.SignalRelay().install()
    try:
        with pytest.raises(ray_guard.Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode
        assert e.value.signum == signal.SIGTERM
        relay.arm()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert relay.take() == [(signal.SIGTERM, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)]
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert relay.take() == [(signal.SIGINT, signal.SIGINT)] and relay.first == signal.SIGTERM
    finally:
        relay.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_rollout_job_flags_are_checked(capsys):
    """Bad two-job flags: one line naming the flag, exit 2, before any model is built (in this process)."""
    for args, needle in ((["--rollout-job"], "--actor-address"),
                         (["--rollout-address", "nohostport"], "rollout.address (--rollout-address) must be HOST:PORT"),
                         (["--rollout-job", "--actor-address", "h:1", "--rollout-address", "h:2"], "--rollout-job and"),
                         (["--rollout-restart-timeout", "0"], "--rollout-restart-timeout")):
        assert launch_run.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (args, err)

