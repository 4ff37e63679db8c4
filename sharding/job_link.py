"""The host channel between two independent JAX jobs (the actor job and a rollout job of its own): a socket.

    listener = JobListener("10.0.0.1:7100", authkey)      # the actor: accepts rollout jobs as they (re)register
    link = listener.accept(deadline_s=1800, timeout_s=600)  # -> Link, or None when nobody registered in time
    link = connect("10.0.0.1:7100", authkey, timeout_s=600, deadline_s=1800, hello={...})  # the rollout job
    link.send("cmd", {...}); msg = link.get("result/train/3/0", "the rollout results of train/3/0")

The transport is the standard library's `multiprocessing.connection` (`Listener` / `Client`, with an HMAC challenge
on the `authkey` before anything is unpickled, so only a peer holding the key is heard; pickled messages, length-
prefixed). Only the two jobs of one run talk here: run it on a trusted network, the way the coordination service of
`jax.distributed` is. The key: `$DSV4RL_ROLLOUT_AUTHKEY`, else (loopback only) a fixed default (`authkey()`).

Liveness. Each side runs a heartbeat thread that sends {"beat", last log line} every `HEARTBEAT_S` (it ticks through
long compiles and steps) and a reader thread that files every message under its key (a FIFO per key). A `get` fails
with `LinkLost` when the connection closed (the peer process died: the kernel closes its socket) or when the peer's
heartbeat is older than `timeout_s` (a hung peer); the error names the peer and says which, with the peer's last
log line when it sent one. The hello exchanged on connect carries the peer's description (host, pid, ...).

Refusal. The listener's `check(peer_hello)` (the actor's: the same tiling and identity, rl/rollout/two_job.py) runs in
its accepting thread, before the peer is queued: a peer it refuses gets ("refused", reason) instead of the
listener's hello and is closed, the listener logs one line and goes on listening (the actor, busy or waiting in
`accept`, never sees it); `connect` raises `LinkRefused` with the reason on the peer's side.

Tests: `.venv/bin/python -m pytest -q tests/launch/test_two_jobs.py` (through the launched jobs).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger("dsv4rl")

HEARTBEAT_S = 1.0
WAITING_TIMEOUT_S = 600.0  # a queued peer's Link before `JobListener.accept` sets the run's timeout (unused: no get)
ENV_AUTHKEY = "DSV4RL_ROLLOUT_AUTHKEY"


class LinkLost(RuntimeError):
    """The peer job is gone: its connection closed, or its heartbeat stopped for the timeout. `peer`: its
    description; `last_line`: the last log line it reported ("" if none)."""

    def __init__(self, peer: str, why: str, what: str = "", last_line: str = ""):
        self.peer, self.why, self.last_line = peer, why, last_line
        super().__init__(f"{peer} {why}" + (f" ({what})" if what else ""))


class LinkRefused(RuntimeError):
    """The listener refused this peer at registration (its `check`): the message says why, in one line."""


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def authkey(host: str = "127.0.0.1") -> bytes:
    """The channel's key: `$DSV4RL_ROLLOUT_AUTHKEY` (both jobs must agree), else, for a loopback `host` only, the
    project's default. The channel unpickles what it receives, so a key anyone can read must not guard a port other
    hosts reach: ValueError (naming the variable) for a non-loopback `host` without it."""
    key = os.environ.get(ENV_AUTHKEY)
    if key:
        return key.encode()
    if host.strip("[]") in LOOPBACK:
        return b"dsv4-rl-rollout"
    raise ValueError(f"the two-job layout on {host} needs a secret key: set ${ENV_AUTHKEY} to the same value for the "
                     "actor job and the rollout job (the channel unpickles what it receives; the default key is public)")


def split_address(address: str, flag: str) -> tuple[str, int]:
    """"HOST:PORT" -> (host, port). ValueError naming `flag` otherwise."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def local_host_towards(host: str) -> str:
    """The local address this host uses to reach `host` (no packet is sent); 127.0.0.1 for loopback."""
    if host in LOOPBACK:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def describe_peer(hello: dict) -> str:
    """How logs and errors name a rollout job from its hello: its "name", else "the rollout job HOST pid PID"."""
    return str(hello.get("name") or f"the rollout job {hello.get('host', '?')} pid {hello.get('pid', '?')}")


class Link:
    """One live connection to the peer job (module docstring). `hello`: the peer's description (a dict: "name"
    is how errors name it). `line_fn`: () -> this side's last log line, sent with each heartbeat."""

    def __init__(self, conn: Connection, hello: dict, timeout_s: float, line_fn=lambda: ""):
        self.conn, self.hello, self.timeout_s, self.line_fn = conn, dict(hello), float(timeout_s), line_fn
        self.name = str(hello.get("name", "the peer"))
        self.last_line = str(hello.get("line", ""))
        self.last_beat = time.monotonic()
        self.closed: str | None = None  # why the connection ended
        self._inbox: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._read, name="dsv4-link-read", daemon=True).start()
        threading.Thread(target=self._beat, name="dsv4-link-beat", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                key, payload = self.conn.recv()
            except (EOFError, OSError, TypeError) as e:  # TypeError: this side closed the handle meanwhile
                with self._cond:
                    self.closed = self.closed or f"closed the connection ({type(e).__name__})"
                    self._cond.notify_all()
                return
            with self._cond:
                self.last_beat = time.monotonic()
                if key == "beat":
                    self.last_line = payload or self.last_line
                else:
                    self._inbox[key].append(payload)
                self._cond.notify_all()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.send("beat", self.line_fn())
            except LinkLost:
                return

    def send(self, key: str, payload: Any = None) -> None:
        """Send one message (pickled). Raises LinkLost when the connection is gone."""
        try:
            with self._send_lock:
                self.conn.send((key, payload))
        except (OSError, ValueError, TypeError) as e:
            with self._cond:
                self.closed = self.closed or f"closed the connection ({type(e).__name__})"
            raise LinkLost(self.name, self.closed, last_line=self.last_line) from None

    def get(self, key: str, what: str, timeout_s: float | None = None) -> Any:
        """The next message filed under `key`, waiting while the peer lives. Raises LinkLost when the connection
        closed or the peer's heartbeat is older than the link's timeout; TimeoutError after `timeout_s` (None:
        no limit of its own)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._inbox[key]:
                    return self._inbox[key].popleft()
                if self.closed:
                    raise LinkLost(self.name, self.closed, what, self.last_line)
                silent = time.monotonic() - self.last_beat
                if silent > self.timeout_s:
                    raise LinkLost(self.name, f"sent no heartbeat for {silent:.0f} s (--push-timeout "
                                              f"{self.timeout_s:g})", what, self.last_line)
                if end is not None and time.monotonic() > end:
                    raise TimeoutError(what)
                self._cond.wait(timeout=min(HEARTBEAT_S, self.timeout_s))

    def pending(self, key: str) -> list:
        """Every message filed under `key` now (taken)."""
        with self._cond:
            out = list(self._inbox[key])
            self._inbox[key].clear()
            return out

    def close(self) -> None:
        self._stop.set()
        try:
            self.conn.close()
        except OSError:
            pass


class JobListener:
    """The actor job's side: listens on `address` ("HOST:PORT", flag `flag` in errors) and hands over rollout jobs
    as they connect (`accept`). Peers are accepted by a thread (the HMAC challenge, then the peer's hello), so a
    rollout may register at any time; a peer with a wrong key is logged and dropped. An accepted peer is a Link at
    once, heartbeats both ways, before the actor takes it (`accept`): a rollout job restarted while the actor is busy
    (a compile, a step) before it noticed the old one's loss waits for it alive instead of finding the actor silent
    and giving up after --push-timeout. `check(peer_hello) -> None | str`: a reason (one line) refuses the peer
    (module docstring); None: none refused."""

    def __init__(self, address: str, key: bytes, *, flag: str = "--rollout-address", hello: dict | None = None,
                 check=None):
        host, port = split_address(address, flag)
        try:
            self.listener = Listener((host, port), authkey=key)
        except OSError as e:
            raise ValueError(f"{flag} {address}: cannot listen there ({e.strerror})") from None
        self.address, self.hello, self.check = f"{host}:{self.listener.address[1]}", dict(hello or {}), check
        self.refused: list[str] = []  # "<peer>: <reason>" of every peer refused so far
        self._ready: queue.Queue = queue.Queue()
        threading.Thread(target=self._accept, name="dsv4-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (AuthenticationError, EOFError, ConnectionError) as e:
                log.warning("rollout channel: a connection to %s was refused (%s: wrong %s?)", self.address,
                            type(e).__name__, ENV_AUTHKEY)
                continue
            except OSError:
                return  # closed
            try:
                if not conn.poll(60):
                    raise EOFError("no hello")
                key, hello = conn.recv()
                why = self.check(hello) if self.check is not None else None
                if why is not None:
                    log.warning("rollout channel: refused %s: %s (still waiting for one that matches)",
                                describe_peer(hello), why)
                    self.refused.append(f"{describe_peer(hello)}: {why}")
                    conn.send(("refused", why))
                    conn.close()
                    continue
                conn.send(("hello", self.hello))
            except (EOFError, OSError, ValueError):
                conn.close()
                continue
            self._ready.put(Link(conn, hello, WAITING_TIMEOUT_S, lambda: "the actor: busy, the rollout job queued"))

    def accept(self, deadline_s: float, timeout_s: float, line_fn=lambda: "") -> Link | None:
        """The next rollout job to register within `deadline_s` seconds as a Link (heartbeat timeout
        `timeout_s`), None if none did. A queued peer that died meanwhile comes out closed (its first `get` raises
        LinkLost: the caller's recovery takes the next)."""
        try:
            link = self._ready.get(timeout=max(deadline_s, 0.0))
        except queue.Empty:
            return None
        link.timeout_s, link.line_fn = float(timeout_s), line_fn
        return link

    def close(self) -> None:
        self.listener.close()


def connect(address: str, key: bytes, *, timeout_s: float, deadline_s: float, hello: dict, line_fn=lambda: "",
            flag: str = "--actor-address") -> Link:
    """The rollout job's side: connect to the actor at `address`, retrying while it is not listening yet, for up
    to `deadline_s` seconds; send `hello`, read the actor's. Raises LinkLost naming the address when nothing
    answered in time; ValueError naming `flag` for a malformed address or a refused key; LinkRefused (the actor's
    reason) when the actor's check refused `hello`."""
    host, port = split_address(address, flag)
    end = time.monotonic() + deadline_s
    while True:
        try:
            conn = Client((host, port), authkey=key)
            break
        except AuthenticationError:
            raise ValueError(f"{flag} {address}: the actor refused this job's key (${ENV_AUTHKEY} differs)") from None
        except OSError as e:
            if time.monotonic() > end:
                raise LinkLost(f"the actor at {address}", f"did not answer within {deadline_s:g} s "
                                                          f"({e.strerror or e})") from None
            time.sleep(0.5)
    conn.send(("hello", hello))
    if not conn.poll(timeout_s):
        raise LinkLost(f"the actor at {address}", "did not answer the hello")
    try:
        kind, peer = conn.recv()
    except (EOFError, OSError) as e:
        raise LinkLost(f"the actor at {address}", f"closed the connection at registration ({type(e).__name__})"
                       ) from None
    if kind == "refused":
        conn.close()
        raise LinkRefused(f"the actor at {address} refused this rollout job: {peer}")
    peer = {"name": f"the actor at {address}", **peer}
    return Link(conn, peer, timeout_s, line_fn)
