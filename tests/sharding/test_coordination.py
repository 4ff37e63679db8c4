"""Tests for sharding/coordination.py (the coordination service's sidecar) and the private jax it relies on.

- `watch`, in-process over a pipe: the clean word -> "clean"; end-of-file without it, or a new parent -> "lost";
- the sidecar as a process (no model, no backend): a clean stop exits 0 at once; a SIGKILL of the process that
  started it leaves the service listening for its grace, then the sidecar is gone; the rerun of the same command
  replaces a lingering sidecar of its port at once, which held none of process 0's output open; a port in use by a
  serving sidecar -> SidecarError;
- what `sharding.distributed._connect_client` mirrors of jax's `State.initialize` is still what jax does (fails
  loudly on a jax that changed it), and the cluster detection it calls keeps its signature.
The clean end with real clients is covered by tests/sharding/test_distributed.py's two-process forward; process 0's
SIGKILL in a run by tests/launch/test_mpmd_async_resume.py.

    .venv/bin/python -m pytest -q tests/sharding/test_coordination.py
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import select
import signal
import socket
import subprocess
import sys
import time

import portpicker
import pytest
from jax._src import clusters
from jax._src import distributed as jd

from sharding import coordination as co
from sharding import distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pipe():
    r, w = os.pipe()
    return os.fdopen(r, "r"), os.fdopen(w, "w")


def test_watch_clean_word_eof_and_new_parent():
    r, w = _pipe()
    w.write("noise\n" + co.CLEAN_WORD + "\n")
    w.flush()
    assert co.watch(r, parent_pid=os.getppid(), poll_s=0.01) == "clean"
    w.close()
    r, w = _pipe()
    w.write("noise\n")
    w.close()  # process 0 died: its end of the pipe closed without the word
    assert co.watch(r, parent_pid=os.getppid(), poll_s=0.01) == "lost"
    r, w = _pipe()  # the pipe stays open (a fork of process 0 holds it) but the parent changed
    assert co.watch(r, parent_pid=os.getppid(), poll_s=0.01, parent=lambda: 1) == "lost"
    w.close()
    assert co.grace_s(50) == 50 + co.GRACE_MARGIN_S


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _gone(pid: int) -> bool:
    """No such process, or a zombie (reparented to an init that does not reap it)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_sidecar_clean_stop_and_port_in_use():
    port = portpicker.pick_unused_port()
    sidecar = co.start_sidecar(f"127.0.0.1:{port}", 2, heartbeat_timeout_s=5, shutdown_timeout_s=5)
    assert _listening(port) and not _gone(sidecar.pid)
    assert os.getsid(sidecar.pid) == sidecar.pid != os.getsid(0)  # a session of its own: process 0's signals miss it
    assert co.sidecars_of(port) == [sidecar.pid]
    # rule 4: a serving sidecar ignores the rerun's SIGUSR1: its port stays taken
    with pytest.raises(co.SidecarError, match=rf"cannot start on 127.0.0.1:{port}: the port is in use"):
        co.start_sidecar(f"127.0.0.1:{port}", 2, heartbeat_timeout_s=5, shutdown_timeout_s=5, free_s=0.5)
    assert not _gone(sidecar.pid)
    assert sidecar.stop() == 0  # rule 1: the clean word -> the service stops, exit 0
    assert not _listening(port)


PARENT = """
import sys, time
sys.path.insert(0, {root!r})
from sharding.coordination import start_sidecar
s = start_sidecar("127.0.0.1:{port}", 2, heartbeat_timeout_s=5, shutdown_timeout_s=5, grace={grace})
print(s.pid, flush=True)
time.sleep(120)
"""


def test_sidecar_outlives_a_killed_process0_by_its_grace_only():
    port, grace = portpicker.pick_unused_port(), 2.0
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(root=str(ROOT), port=port, grace=grace)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)  # process 0 dies without a word
        parent.wait()
        killed = time.monotonic()
        assert _listening(port) and not _gone(pid)  # rule 2: the survivors still reach the key-value store
        while not _gone(pid) and time.monotonic() - killed < 60:
            time.sleep(0.1)
        assert _gone(pid)  # then it ends by itself (after `grace` s): no orphan
        assert time.monotonic() - killed >= grace * 0.9  # it did serve for its grace first
    finally:
        if parent.poll() is None:
            parent.kill()


def test_rerun_replaces_a_lingering_sidecar_of_its_port():
    port = portpicker.pick_unused_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(root=str(ROOT), port=port, grace=60.0)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        old = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # the lingering sidecar holds none of process 0's output open: a `run.py | tee` ends with process 0
        assert select.select([parent.stdout, parent.stderr], [], [], 10.0)[0] == [parent.stdout, parent.stderr]
        assert parent.stdout.read() == "" and parent.stderr.read() == ""
        time.sleep(3 * co.POLL_S)  # it has seen its parent die: lingering for 60 s
        new = co.start_sidecar(f"127.0.0.1:{port}", 2, heartbeat_timeout_s=5, shutdown_timeout_s=5)  # the rerun
        assert _gone(old) and co.sidecars_of(port) == [new.pid]
        assert new.stop() == 0
    finally:
        if parent.poll() is None:
            parent.kill()


def _assigned(src: str) -> set[str]:
    return set(re.findall(r"self\.(\w+)\s*=", src))


def test_connect_client_mirrors_jax_state_initialize():
    """If this fails, jax changed `State.initialize`: update `sharding.distributed._connect_client` (and
    STATE_FIELDS) to do what it now does, less the service."""
    src = inspect.getsource(jd.State.initialize)
    assert _assigned(src) == set(dist.STATE_FIELDS), _assigned(src) ^ set(dist.STATE_FIELDS)
    # the service is process 0's, started right there; the client's keywords are those _connect_client passes
    assert re.search(r"if process_id == 0:.*?self\.service = _jax\.get_distributed_runtime_service\(", src, re.S)
    m = re.search(r"self\.client = _jax\.get_distributed_runtime_client\((.*?)\)\n", src, re.S)
    assert m and re.findall(r"(\w+)=", m.group(1)) == ["init_timeout", "use_compression", "heartbeat_timeout"]
    assert "self.initialize_preemption_sync_manager()" in src and "JAX_PARTITION_INDEX" in src
    assert [*inspect.signature(clusters.ClusterEnv.auto_detect_unset_distributed_params).parameters] == [
        "coordinator_address", "num_processes", "process_id", "local_device_ids", "cluster_detection_method",
        "initialization_timeout"]
    assert dist._jax_default("heartbeat_timeout_seconds") == 100
    assert dist._jax_default("shutdown_timeout_seconds") == dist.SHUTDOWN_TIMEOUT_S
