"""rl/run/run_lock.py: one run at a time on a --ckpt-dir (issue 28 §1).

A second process really holds the lock (a small Python child), so the refusal, the owner named in it and the
take-over of a dead owner's lock are the kernel's flock semantics, not a simulation.

    .venv/bin/python -m pytest -q tests/rl/test_run_lock.py
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rl.run import run_lock
from rl.run.run_lock import LOCK_NAME, RunDirLockedError

HOLDER = textwrap.dedent("""
    import sys, time
    from rl.run import run_lock
    run_lock.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(directory):
    """A child process that takes the lock of `directory` and sleeps; returns once it holds it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"held"
    return proc


def test_second_process_is_refused_naming_the_owner_and_a_dead_owner_is_taken_over(tmp_path, caplog):
    proc = _holder(tmp_path)
    try:
        owner = json.loads((tmp_path / LOCK_NAME).read_text())
        assert owner["pid"] == proc.pid
        with pytest.raises(RunDirLockedError) as e:
            run_lock.acquire(tmp_path)
        msg = str(e.value)
        assert "\n" not in msg and "--ckpt-dir" in msg and str(tmp_path) in msg and "in use by another run" in msg
        assert f"pid {proc.pid}" in msg and f"host {owner['host']}" in msg
    finally:
        proc.send_signal(signal.SIGKILL)  # dies without releasing: the file still names it
        proc.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == proc.pid
    with caplog.at_level(logging.WARNING, logger="rl.run.run_lock"):
        handle = run_lock.acquire(tmp_path)
    assert any("took over the run lock" in r.getMessage() and f"pid {proc.pid}" in r.getMessage()
               for r in caplog.records)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    run_lock.release(handle)
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released cleanly: the next run takes it over silently


def test_one_process_shares_its_lock_and_the_last_release_frees_it(tmp_path):
    a = run_lock.acquire(tmp_path)
    b = run_lock.acquire(tmp_path)  # a notebook building a second job on the same directory
    run_lock.release(a)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()  # still held (b)
    run_lock.release(b)
    proc = _holder(tmp_path)  # free now: another process can take it
    proc.kill()
    proc.wait()


def test_checkpointer_takes_the_lock_and_a_second_run_refuses_before_touching_the_directory(tmp_path, capsys):
    """The Checkpointer locks before orbax cleans temp dirs; launch/run.py prints one line and exits 2."""
    from launch.run import main
    from rl.run.checkpoint import Checkpointer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    proc = _holder(ckpt)
    try:
        unfinished = ckpt / "3.orbax-checkpoint-tmp"  # the other run's save in progress
        unfinished.mkdir()
        with pytest.raises(RunDirLockedError):
            Checkpointer(ckpt, fingerprint={})
        assert unfinished.is_dir()
        rc = main(["--steps", "1", "--ckpt-dir", str(ckpt), "--metrics-jsonl", "", "--tensorboard-dir", ""])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert f"pid {proc.pid}" in lines[0] and str(ckpt) in lines[0]
    finally:
        proc.kill()
        proc.wait()
    ck = Checkpointer(ckpt, fingerprint={})
    assert json.loads((ckpt / LOCK_NAME).read_text())["pid"] == os.getpid()
    ck.close()
    assert (ckpt / LOCK_NAME).read_text() == ""


PEER = textwrap.dedent("""
    import sys
    from sharding.distributed import maybe_initialize_distributed
    maybe_initialize_distributed(sys.argv[1], 2, int(sys.argv[2]), cpu_devices_per_process=1)
    from rl.run import run_lock
    try:
        handle = run_lock.acquire(sys.argv[3])
        print("ok", handle is not None, flush=True)
    except run_lock.RunDirLockedError as e:
        print("refused", e, flush=True)
""")


def _two_processes(directory) -> list[str]:
    """The first output line of each of 2 jax.distributed processes calling `acquire(directory)`."""
    import portpicker

    port = portpicker.pick_unused_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ["DSV4RL_TEST_XLA_FLAGS"]}  # no forced 8 devices
    procs = [subprocess.Popen([sys.executable, "-c", PEER, f"127.0.0.1:{port}", str(i), str(directory)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for i in range(2)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        outs.append(out.decode(errors="replace"))
    return [next((ln for ln in o.splitlines() if ln.startswith(("ok", "refused"))), o[-2000:]) for o in outs]


def test_multi_process_run_takes_the_lock_once_and_every_process_refuses_alike(tmp_path):
    """Process 0 takes the lock, process 1 only receives the verdict; a lock held by another run makes both
    processes refuse with the same line."""
    assert _two_processes(tmp_path) == ["ok True", "ok False"]
    holder = _holder(tmp_path)
    try:
        got = _two_processes(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert got[0] == got[1] and got[0].startswith("refused") and f"pid {holder.pid}" in got[0], got
