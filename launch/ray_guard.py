"""The Ray launcher's guards (launch/ray_run.py): reaching `--ray-address` in a bounded time, and SIGTERM / SIGINT
to the launcher passed on to the actor job as a plain run gets them (issue 42). Standard library only: the launcher
imports `ray` on first use.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time


class LaunchError(ValueError):
    """Bad launcher input (one line, exit 2)."""


def probe_address(address: str, timeout_s: float) -> None:
    """--ray-address HOST:PORT (or ray://HOST:PORT): resolve HOST and open a TCP connection to PORT, all within
    `timeout_s` seconds, before `ray.init` (which retries an unreachable GCS for about two minutes, silently).
    `auto` and `local` are left to `ray.init` (bounded by `launch`'s watchdog).
    Raises LaunchError (one line naming the address): not HOST:PORT, an unknown host, nothing listening there, no
    answer in time."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")  # [IPv6]:PORT
    if not sep or not host or not port.isdigit():
        raise LaunchError(f"--ray-address {address}: expected auto or HOST:PORT (a Ray head's GCS port, e.g. "
                          "node0:6379)")
    deadline = time.monotonic() + timeout_s
    found: dict = {}

    def resolve() -> None:  # in a thread: a resolver without an answer can block for its own timeouts
        try:
            found["addrs"] = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as e:
            found["error"] = e

    t = threading.Thread(target=resolve, name="dsv4-ray-resolve", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise LaunchError(f"--ray-address {address}: the name {host} did not resolve within {timeout_s:g} s "
                          "(--ray-connect-timeout)")
    if "error" in found:
        why = getattr(found["error"], "strerror", None) or found["error"]
        raise LaunchError(f"--ray-address {address}: unknown host {host!r} ({why})")
    family, kind, proto, _, sockaddr = found["addrs"][0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect(sockaddr)
    except OSError as e:
        why = "no answer within %g s (--ray-connect-timeout)" % timeout_s if isinstance(e, TimeoutError) else (
            e.strerror or str(e))
        raise LaunchError(f"--ray-address {address}: no Ray cluster there ({why}); is one running (`ray start "
                          f"--head --port {port}` on {host})?") from None


def connect_watchdog(address: str, timeout_s: float) -> threading.Timer:
    """A timer that ends the launcher (one line, exit 2) when `ray.init(address)` has not returned within
    `timeout_s` seconds (a port that answers but is no Ray GCS, a stale `auto`): cancel it once connected."""
    def fire() -> None:
        sys.stderr.write(f"error: --ray-address {address}: no Ray cluster answered within {timeout_s:g} s "
                         "(--ray-connect-timeout; is a cluster running there, `ray start --head`?)\n")
        sys.stderr.flush()
        os._exit(2)  # ray.init holds the main thread in its own retries; nothing of ours is started yet

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    return timer


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGINT to the launcher before the jobs were started (`SignalRelay`); `signum` names it. A
    KeyboardInterrupt: what Ray lets out of a blocking `ray.get` (it may raise a plain one: `SignalRelay.first`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalRelay:
    """SIGTERM and SIGINT (Ctrl-C) to the launcher, passed to the actor job's processes as a plain run gets them
    (rl/run/loop.py: finish the step, save, exit 0 for SIGTERM, 130 for SIGINT). The first signal goes on as it came;
    any later one as SIGINT, which makes a job that is already stopping exit at once (the newest complete
    checkpoint kept). Before the jobs are started (`armed` False) a signal raises `Interrupted` in the main thread
    (out of a blocking `ray.get` too: Ray checks for signals while it waits).

    Handlers run in the main thread between bytecodes; they only record: `take()` (the launcher's wait loop) hands
    out the signals to send, as (received, sent) pairs."""

    def __init__(self):
        self.armed = False  # True once the jobs exist: record instead of raise
        self.received: list[int] = []
        self._sent = self._before = 0
        self._old: dict = {}

    def arm(self) -> None:
        """The jobs exist: from now on signals are recorded for `take` (none from before is passed on)."""
        self.armed, self._before = True, len(self.received)

    def install(self) -> "SignalRelay":
        """Replace SIGTERM's and SIGINT's handlers (Ray's driver makes SIGTERM a sys.exit) with the relay's (in
        the main thread only: elsewhere Python has no handlers to set)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in (signal.SIGTERM, signal.SIGINT):
            old = signal.signal(s, self._on)
            self._old.setdefault(s, old)  # installed again after ray.init: keep the first (the process's own)
        return self

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _on(self, signum, frame) -> None:
        self.received.append(signum)
        if not self.armed:
            raise Interrupted(signum)

    def take(self) -> list[tuple[int, int]]:
        out = []
        self._sent = max(self._sent, self._before)
        for sig in self.received[self._sent:]:
            out.append((sig, sig if self._sent == self._before else signal.SIGINT))
            self._sent += 1
        return out

    @property
    def first(self) -> int | None:
        """The first signal since `arm` (the one passed on as it came), or None."""
        return self.received[self._before] if len(self.received) > self._before else None
