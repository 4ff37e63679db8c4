"""The coordination service of a multi-process job in a process of its own (a sidecar that does nothing else).

    python -m sharding.coordination BIND_ADDRESS N --heartbeat-timeout S --shutdown-timeout S --grace S
    sidecar = start_sidecar("[::]:12355", 3, heartbeat_timeout_s=50, shutdown_timeout_s=300)   # on process 0
    ...; jax.distributed.shutdown(); sidecar.stop()                                           # its clean end

Why. `jax.distributed.initialize` starts the coordination service (the job's key-value store and heartbeat
monitor) inside process 0. A SIGKILL of process 0 took the service with it and every other process aborted within
~1 s in jaxlib C++ (glog "Check failure", "terminate called"), before any Python ran: the client's
`missed_heartbeat_callback` cannot help (jax 0.10.2 calls it with an absl::Status its binding cannot convert:
std::bad_cast). With the service in this process, process 0 is an ordinary client
(`sharding.distributed.maybe_initialize_distributed` connects it as one): its death is found by the project's own
heartbeats in the key-value store (`sharding.mpmd.HostChannel`, `lost_peer`) and reported in one line, like any
other process's, because the store outlives it.

Process 0 starts it (`start_sidecar`) before connecting its own client, with `sys.executable -m
sharding.coordination`, in a session of its own (a SIGKILL of process 0, a signal to its process group or a Ctrl-C
in its terminal does not reach it). Its stdin is a pipe from process 0; its stdout a pipe that carries one line,
`ready`, once the service listens; its stderr a pipe that a thread of process 0 copies to process 0's stderr (the
service's own log lines), /dev/null once process 0 died. It holds no file of process 0's open, so a `run.py ... |
tee log` ends with process 0, not with its sidecar. It imports no backend, holds no device and ignores SIGINT,
SIGTERM and SIGHUP.

Lifetime rules (`watch`, `main`):
1. Clean end: process 0 writes `shutdown` (`CLEAN_WORD`) on the stdin after its own `jax.distributed.shutdown()`
   returned (the shutdown barrier: every process has arrived); the service shuts down (at most `STOP_S` seconds)
   and the sidecar exits 0.
2. Process 0 died or exited without the word (its stdin reached end-of-file, or the sidecar's parent changed, which
   also covers a fork of process 0 holding the pipe open): the service keeps serving, silently, for `--grace` seconds
   (without the flag: the heartbeat timeout + `GRACE_MARGIN_S`; a run passes
   `sharding.distributed.sidecar_grace_s`: the project's liveness timeout, `sharding.mpmd.LIVENESS_S` = 20 s, +
   `GRACE_MARGIN_S`), long enough for the survivors' own detection (a heartbeat silent for the liveness timeout,
   or a failure posted in the store) to post its one-line failure and exit; then the sidecar exits 0. No sidecar
   outlives its process 0 by more than grace + `POLL_S` seconds (a run at the defaults: 20 + 10 = 30 s).
3. A SIGKILL of the sidecar itself ends the job as the death of jax's own in-process coordinator did: every client
   aborts in jaxlib C++. It is a do-nothing process (no devices, no allocation after start-up, no file): it only dies
   by a signal sent to it (SIGKILL, SIGSTOP/SIGQUIT) or its machine going down, as process 0's node would.

4. The same command rerun at once (a resume) binds the same port while the crashed run's sidecar may still linger
   (gRPC binds with SO_REUSEPORT: two services would share the port). So a lingering sidecar ends on SIGUSR1,
   which a serving one ignores, and `start_sidecar`, finding its port taken, sends SIGUSR1 to this host's
   sidecars of that port (`/proc`) and waits up to `FREE_S` for the port to be free: a lingering one is replaced at
   once; a serving one (another live job on that port) or any other listener is a `SidecarError` naming the
   address ("port in use"), as is a bind that fails in the sidecar (jaxlib segfaults there).
Source: jax's `jax/_src/distributed.py` (`State.initialize`: `_jax.get_distributed_runtime_service(...)` on
process 0). Tests: `.venv/bin/python -m pytest -q tests/sharding/test_coordination.py`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from jax._src.lib import _jax  # private: the coordination service, as jax/_src/distributed.py starts it

CLEAN_WORD = "shutdown"
GRACE_MARGIN_S = 10.0  # after the heartbeat timeout: the service has declared process 0 dead by then
POLL_S = 0.2  # how often the sidecar looks at its parent
STOP_S = 10.0  # the clean end's service shutdown, at most
READY_S = 60.0  # start_sidecar: the sidecar's `ready` line, at most
FREE_S = 5.0  # start_sidecar: a lingering sidecar of the same port gone, at most (rule 4)
ROOT = pathlib.Path(__file__).resolve().parents[1]  # the folder holding `sharding/`: `-m sharding.coordination`


class SidecarError(RuntimeError):
    """The coordination sidecar did not start (port in use, bad address): the message names the address."""


def grace_s(heartbeat_timeout_s: float) -> float:
    """Seconds the sidecar keeps serving after process 0 died (rule 2): heartbeat timeout + `GRACE_MARGIN_S`."""
    return float(heartbeat_timeout_s) + GRACE_MARGIN_S


def watch(stream: IO[str], parent_pid: int, poll_s: float = POLL_S, parent=os.getppid) -> str:
    """Block until process 0 ends. Returns "clean" when `stream` (the sidecar's stdin) delivered `CLEAN_WORD`,
    "lost" when it reached end-of-file without it or `parent()` is no longer `parent_pid` (rules 1-2)."""
    said, done = [], threading.Event()

    def read():
        try:
            for line in stream:
                if line.strip() == CLEAN_WORD:
                    said.append(True)
                    break
        except (OSError, ValueError):  # a closed or broken pipe: process 0 is gone
            pass
        done.set()

    threading.Thread(target=read, name="dsv4-sidecar-stdin", daemon=True).start()
    while not done.wait(poll_s):
        if parent() != parent_pid:
            return "lost"
    return "clean" if said else "lost"


def _quiet() -> None:
    """stderr -> /dev/null: process 0's log or terminal is not the sidecar's any more (its service may still log the
    missed heartbeats it sees while it lingers)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)


def _stop(service, timeout_s: float) -> None:
    """`service.shutdown()`, at most `timeout_s` seconds (it waits for in-flight calls)."""
    t = threading.Thread(target=service.shutdown, name="dsv4-sidecar-stop", daemon=True)
    t.start()
    t.join(timeout_s)


def main(argv: list[str] | None = None) -> int:
    """The sidecar process (rules in the module docstring). Exits 0 after either end; 2 on bad arguments."""
    p = argparse.ArgumentParser(prog="python -m sharding.coordination", description=__doc__.split("\n\n")[0])
    p.add_argument("bind_address", help="HOST:PORT the service listens on (jax's default: [::]:<coordinator port>)")
    p.add_argument("num_processes", type=int, help="the job's processes (clients)")
    p.add_argument("--heartbeat-timeout", type=float, required=True, help="seconds (jax's heartbeat_timeout)")
    p.add_argument("--shutdown-timeout", type=float, required=True, help="seconds (jax's shutdown_timeout)")
    p.add_argument("--grace", type=float, default=None, help="seconds served after process 0's death "
                                                             "(default: heartbeat timeout + 10)")
    args = p.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    service = _jax.get_distributed_runtime_service(
        args.bind_address, args.num_processes, heartbeat_timeout=int(args.heartbeat_timeout),
        shutdown_timeout=int(args.shutdown_timeout))
    print("ready", flush=True)
    if watch(sys.stdin, parent) == "clean":
        _stop(service, STOP_S)
    else:
        _quiet()
        signal.signal(signal.SIGUSR1, lambda *_: os._exit(0))  # rule 4: a rerun of the same command takes the port
        time.sleep(grace_s(args.heartbeat_timeout) if args.grace is None else args.grace)
    os._exit(0)  # no interpreter teardown: the service's threads may still hold calls of dead clients


class Sidecar:
    """Process 0's handle on its running sidecar (`start_sidecar`). `pid`: the sidecar's process id."""

    def __init__(self, proc: subprocess.Popen, address: str):
        self.proc, self.address, self.pid = proc, address, proc.pid

    def stop(self, timeout_s: float = STOP_S + 5.0) -> int | None:
        """Rule 1: tell the sidecar the job ended cleanly (call after `jax.distributed.shutdown()`) and wait up to
        `timeout_s` for it to exit (then kill it). Returns its exit status."""
        try:
            self.proc.stdin.write(CLEAN_WORD + "\n")
            self.proc.stdin.close()
        except (OSError, ValueError):  # it is gone already
            pass
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _taken(address: str) -> bool:
    """Whether something listens on `address`'s port (asked on loopback for a wildcard bind)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    host = "127.0.0.1" if host in ("", "::", "0.0.0.0") else host
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, _port(address))) == 0


def sidecars_of(port: int) -> list[int]:
    """Process ids of this host's sidecars serving `port` (their command lines, from /proc; [] elsewhere)."""
    out = []
    for d in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sharding.coordination" in argv:
            i = argv.index(b"sharding.coordination")
            if len(argv) > i + 1 and argv[i + 1].rsplit(b":", 1)[-1] == str(port).encode():
                out.append(int(d.name))
    return out


def _free(address: str, wait_s: float) -> bool:
    """Rule 4: True when `address`'s port is free, after asking this host's lingering sidecars of it to end."""
    if not _taken(address):
        return True
    for pid in sidecars_of(_port(address)):
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:  # gone meanwhile, or not ours
            pass
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        time.sleep(0.1)
        if not _taken(address):
            return True
    return False


def _copy(src: IO[str], dst: IO[str]) -> None:
    """The sidecar's log lines into process 0's stderr, until either side closes."""
    try:
        for line in src:
            dst.write(line)
            dst.flush()
    except (OSError, ValueError):
        pass


def start_sidecar(bind_address: str, num_processes: int, *, heartbeat_timeout_s: float, shutdown_timeout_s: float,
                  grace: float | None = None, ready_s: float = READY_S, free_s: float = FREE_S) -> Sidecar:
    """Start the coordination service for `num_processes` clients on `bind_address` (HOST:PORT) in a sidecar process
    of its own session and return once it listens. Raises SidecarError (naming the address) when the port stays
    taken for `free_s` seconds (rule 4), or the sidecar exits or stays silent for `ready_s` seconds before its
    `ready` line."""
    if not _free(bind_address, free_s):
        raise SidecarError(f"the coordination service cannot start on {bind_address}: the port is in use (another "
                           "job's coordinator? pick another --coordinator port)")
    cmd = [sys.executable, "-m", "sharding.coordination", bind_address, str(int(num_processes)),
           "--heartbeat-timeout", str(int(heartbeat_timeout_s)), "--shutdown-timeout", str(int(shutdown_timeout_s))]
    if grace is not None:
        cmd += ["--grace", str(float(grace))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    threading.Thread(target=_copy, args=(proc.stderr, sys.stderr), name="dsv4-sidecar-log", daemon=True).start()
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(ready_s)
    if not line or line[0].strip() != "ready":
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
        raise SidecarError(f"the coordination service did not start on {bind_address} (sidecar exit status {rc}"
                           f"{'' if line else f', no answer in {ready_s:g} s'}): is the port in use?")
    proc.stdout.close()  # it writes nothing more
    return Sidecar(proc, bind_address)


if __name__ == "__main__":
    sys.exit(main())
