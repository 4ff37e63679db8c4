"""MPMD roles: the actor and the rollout on their own processes of one `jax.distributed` job.

    layout = role_layout(plan)                  # which processes are actor, which are rollout (whole processes)
    channel = HostChannel(layout, timeout_s=600)  # host messages + heartbeats; publish(tag, value) / receive(...)
    pusher = parallel.push.mpmd.MpmdPusher(plan, layout, sampler, abstract_state, actor_shardings, channel)
    pusher.push(params if layout.is_actor else None, version)       # called by every process, same order

A mesh spec with a disjoint rollout (`actor:fsdp=2,expert=8/rollout:expert=8`) on a multi-process job is MPMD when
every process holds devices of one role only: the seed layout (nodes 0-1 actor, node 2 rollout) in miniature is
three local processes x 2 CPU devices with `actor:fsdp=2,expert=2/rollout:expert=2`. Each process then runs only its
role's programs (the learner's jits on actor processes, `Sampler.generate` on rollout processes); the roles meet at

1. the weight push (`parallel/push/mpmd.py::MpmdPusher`): a cross-process `jax.device_put` per tensor from an
   actor-side staging in exactly the rollout's tiling (the only kind jax moves between processes, docs/jax-stack.md
   §2.4); the rollout acks each chunk before the actor frees its staged copies. A layout the transfer cannot serve
   is a `MeshSpecError` at start-up: a process holding devices of both roles or of none (`role_layout`), a tensor
   the actor mesh cannot cut as the rollout does (`parallel.push.mpmd.plan_transfer`).
2. host messages (`HostChannel`): pickled, chunked values in the coordination service's key-value store (rollout
   results: tokens, logprobs, routing, rewards, the rollout's metrics; the actor's push decisions; push receipts).
   Small next to the weights. Each process bumps a heartbeat key every second from a thread, so a wait tolerates
   long compiles and steps of a live peer and fails once the peer's heartbeat stopped for the liveness timeout
   (`liveness_s`: 20 s, or --push-timeout when shorter), with one line naming the dead process and its side
   (`PeerTimeoutError`); the heartbeat thread ends this process so wherever its main thread waits.

Transfer options (`configure_transfer`, before the backend starts): `jax_cross_host_transfer_socket_address` =
this process's `--transfer-address`, else the local address that routes to the coordinator's host with port
coordinator port + 1 + process id (distinct per process on one machine); `jax_cross_host_transport_addresses` on
the same host with port 0; `jax_cross_host_transfer_timeout_seconds` = the push timeout.

Sources: docs/jax-stack.md §2.4 and §8 (measured there), jax's `dispatch.py` and `xla_bridge.py` (the flags), the
coordination-service client (`key_value_set_bytes`, `blocking_key_value_get_bytes`, `key_value_try_get`).
Tests: `.venv/bin/python -m pytest -q tests/sharding/test_mpmd.py` (+ `-m slow tests/launch/test_mpmd_run.py`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
from jax._src import distributed  # private: the coordination service's client and this process's id

from sharding.job_link import local_host_towards
from sharding.mesh import MeshSpecError
from sharding.rules import ACTOR, ROLLOUT

log = logging.getLogger("dsv4rl")

PIECE_BYTES = 2 * 2**20  # key-value store values stay well under gRPC's default message limit
HEARTBEAT_S = 1.0  # a process bumps its heartbeat key this often, from a thread (it ticks through compiles and steps)
LIVENESS_S = 20.0  # a process whose heartbeat, once seen, stopped this long is dead (issue 42: seconds, not minutes)


def liveness_s(timeout_s: float) -> float:
    """Seconds a peer's heartbeat may stand still before the peer counts as dead: `LIVENESS_S`, or `timeout_s`
    (--push-timeout) when shorter. Dead, not slow: the heartbeat thread beats every `HEARTBEAT_S` while the main
    thread compiles, steps or waits, so only a killed, crashed or stopped process falls silent (a live peer is waited
    for as long as it beats); --push-timeout (default 600 s) stays the bound on a peer whose heartbeat was never seen
    (a slow start is no death) and on a weight transfer."""
    return min(float(timeout_s), LIVENESS_S)


def dead_peer_error(layout: RoleLayout, silent: Sequence[int], silence_s: float, when: str = "") -> PeerTimeoutError:
    """The PeerTimeoutError for processes `silent` of one side whose heartbeat stopped for `silence_s` seconds: one
    line naming the side and the process(es); `when`: what this process was doing (optional)."""
    side = ACTOR if silent[0] in layout.actor_processes else ROLLOUT
    during = f"; {when}" if when else ""
    return PeerTimeoutError(side, layout.processes(side), when, silence_s, message=(
        f"the {side} side lost process(es) {list(silent)} (no heartbeat for {silence_s:g} s{during}): "
        f"{'an' if side == ACTOR else 'a'} {side} process died or hung; rerun the same command to resume from the "
        "last checkpoint"))


class PeerTimeoutError(RuntimeError):
    """The other role did not answer within the timeout. `side`: "actor" | "rollout" (the side that did not)."""

    def __init__(self, side: str, processes: Sequence[int], what: str, timeout_s: float, cause: str = "",
                 message: str | None = None):
        self.side = side
        why = f" ({cause.splitlines()[0][:200]})" if cause else ""
        super().__init__(message or f"the {side} side (processes {list(processes)}) did not answer within "
                         f"{timeout_s:g} s: {what}{why}; did {'an' if side == ACTOR else 'a'} {side} process die? "
                         "(--push-timeout)")


FAILED_KEY = "dsv4/failed"


_FAILING = threading.Lock()  # one `error:` line per process, whichever thread finds the failure first


def exit_on_failure(error: PeerTimeoutError) -> None:
    """A dead or silent peer: print one `error:` line, post it for the others (`report_failure`), exit 1 at once
    (not sys.exit: jax's shutdown barrier would wait for the dead). Called by launch/run.py, by the heartbeat
    thread's watch (`HostChannel`) and by `HostChannel._at_exit`; when another thread already does it, this one
    returns (and ends soon with the process)."""
    if not _FAILING.acquire(blocking=False):
        return
    sys.stdout.flush()
    print(f"error: {error}", file=sys.stderr, flush=True)
    logging.shutdown()
    report_failure(error)
    os._exit(1)


def report_failure(error: PeerTimeoutError) -> None:
    """Before exiting on a PeerTimeoutError: post it for the other waiting processes (they raise it at their next
    poll). The coordination service lives in process 0's sidecar (sharding/coordination.py), which keeps serving
    for its grace after process 0 exits, so no process needs to wait for the others to read it."""
    try:
        _client().key_value_set(FAILED_KEY, f"{error.side}\n{error}", allow_overwrite=True)
    except Exception:  # noqa: BLE001 - best effort: the service may already be gone
        pass


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")


def lost_peer(layout: RoleLayout, cause: BaseException, wait_s: float = 3.0, prefix: str = "dsv4"
              ) -> PeerTimeoutError | None:
    """A runtime error of a multi-process MPMD run (a Gloo collective, a cross-process transfer) whose message says
    a connection to a peer closed (`PEER_LOST`) -> a PeerTimeoutError naming the side and the process(es) that died:
    those whose `HostChannel` heartbeat (bumped every second) did not move over `wait_s` seconds and that are not
    ending normally (`HostChannel._at_exit`: their exit posted, their heartbeat stopped). None when the
    message is another error or every process still beats (then it is not a death: the caller shows it as it is)."""
    text = str(cause)
    if not any(p in text for p in PEER_LOST) or not layout.split_roles:
        return None
    procs = sorted({*layout.actor_processes, *layout.rollout_processes} - {layout.process})
    client = _client()

    def beat(p):  # None: no heartbeat posted (yet)
        return _try_get(client, f"{prefix}/alive/{p}")

    try:
        first = {p: beat(p) for p in procs}
        time.sleep(wait_s)
        dead = [p for p in procs if beat(p) == first[p] and not _try_get(client, f"{prefix}/exit/{p}")]
    except jax.errors.JaxRuntimeError:  # the coordination service is gone (its sidecar died with process 0's host)
        dead = [0] if layout.process != 0 else []
    if not dead:
        return None
    side = ACTOR if dead[0] in layout.actor_processes else ROLLOUT
    cause_line = next((x for x in text.splitlines() if any(p in x for p in PEER_LOST)), text.splitlines()[0])
    return PeerTimeoutError(side, layout.processes(side), "", 0.0, message=(
        f"the {side} side lost process(es) {dead} (its heartbeat stopped; process {layout.process} saw: "
        f"{cause_line.strip()[:200]}): "
        f"{'an' if side == ACTOR else 'a'} {side} process died; rerun the same command to resume from the last "
        "checkpoint"))


# ------------------------------------------------------------------------------------------ roles


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleLayout:
    """Processes per role. `split_roles`: each process runs only its own role's programs: the MPMD layout (actor
    and rollout on disjoint processes) and the actor job of the two-job layout with several processes (its rollout
    lives in the other job); False: every process runs both roles' programs (single-process and colocated runs).
    `process`: this process's index."""

    process: int
    actor_processes: tuple[int, ...]
    rollout_processes: tuple[int, ...]
    split_roles: bool

    @property
    def is_actor(self) -> bool:
        return not self.split_roles or self.process in self.actor_processes

    @property
    def is_rollout(self) -> bool:
        return not self.split_roles or self.process in self.rollout_processes

    @property
    def role(self) -> str:
        return "both" if not self.split_roles else ACTOR if self.is_actor else ROLLOUT

    @property
    def writer(self) -> int:
        """The one process that writes metrics: the first actor process."""
        return min(self.actor_processes)

    def processes(self, role: str) -> tuple[int, ...]:
        return self.actor_processes if role == ACTOR else self.rollout_processes


def role_layout(plan, process_index: int | None = None, process_count: int | None = None,
                process_of=None) -> RoleLayout:
    """The RoleLayout of a MeshPlan. Single-process and colocated plans are not MPMD. A disjoint plan on several
    processes must give each process's devices to one role only, and every process a role. `process_of(device)`
    (default `device.process_index`) and the counts are overridable for tests.

    Raises MeshSpecError naming the process and the devices when a process holds devices of both roles or of none."""
    pid = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    proc = process_of or (lambda d: d.process_index)
    a = sorted({proc(d) for d in plan.actor.devices.flat})
    r = sorted({proc(d) for d in plan.rollout.devices.flat})
    if count == 1 or plan.colocated:
        return RoleLayout(process=pid, actor_processes=tuple(a), rollout_processes=tuple(r), split_roles=False)
    spec = str(plan.spec)
    both = sorted(set(a) & set(r))
    if both:
        p = both[0]
        ids = lambda m: [d.id for d in m.devices.flat if proc(d) == p]  # noqa: E731
        raise MeshSpecError(
            f"mesh spec {spec!r}: process {p} holds actor devices {ids(plan.actor)} and rollout devices "
            f"{ids(plan.rollout)}; a multi-process run with a separate rollout needs whole processes per role "
            f"(the actor's and the rollout's device counts multiples of the devices per process)")
    idle = sorted(set(range(count)) - set(a) - set(r))
    if idle:
        raise MeshSpecError(f"mesh spec {spec!r}: process {idle[0]} holds no device of either role (actor on "
                            f"processes {a}, rollout on {r}); size the meshes to use every process")
    return RoleLayout(process=pid, actor_processes=tuple(a), rollout_processes=tuple(r), split_roles=True)


def actor_job_layout(process_index: int | None = None, process_count: int | None = None) -> RoleLayout:
    """The RoleLayout of the actor job of the two-job layout (rl/rollout/two_job.py): every process of this job is an
    actor (the rollout is a job of its own). With several processes it has `split_roles`, as an MPMD run's actor
    side has: every process reads the one unsharded prompt stream, a HostChannel carries process 0's rollout results
    to the others, and a dead process is named (`lost_peer`, `HostChannel._at_exit`)."""
    pid = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    return RoleLayout(process=pid, actor_processes=tuple(range(count)), rollout_processes=(), split_roles=count > 1)


# ------------------------------------------------------------------------------------------ transfer options


def transfer_socket_address(coordinator: str, process_id: int, address: str | None = None) -> str:
    """`address` if given, else "<local address towards the coordinator>:<coordinator port + 1 + process_id>"."""
    if address:
        return address
    host, port = coordinator.rsplit(":", 1)
    return f"{local_host_towards(host.strip('[]'))}:{int(port) + 1 + int(process_id)}"


def configure_transfer(socket_address: str, timeout_s: float | None = None) -> None:
    """Set jax's cross-process transfer flags (before the backend is created, i.e. before `jax.devices()`)."""
    host = socket_address.rsplit(":", 1)[0]
    jax.config.update("jax_cross_host_transfer_socket_address", socket_address)
    jax.config.update("jax_cross_host_transport_addresses", f"{host}:0")
    if timeout_s is not None:
        jax.config.update("jax_cross_host_transfer_timeout_seconds", max(1, int(math.ceil(timeout_s))))


# ------------------------------------------------------------------------------------------ host messages


def _try_get(client, key: str):
    """The value of `key`, None when it is not set."""
    try:
        return client.key_value_try_get(key)
    except jax.errors.JaxRuntimeError as e:
        if "NOT_FOUND" in str(e):
            return None
        raise


def _client():
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("MPMD messages need jax.distributed (sharding.distributed.maybe_initialize_distributed)")
    return client


class HostChannel:
    """Pickled values between processes through the coordination service's key-value store, with liveness.

    `publish(tag, value)` once per tag (tags are unique per run: e.g. "rollout/<step>"); `receive(tag, sender)` on
    any number of processes waits for it. Every process runs a heartbeat thread (a counter in the store, bumped
    every `HEARTBEAT_S`; it ticks through long compiles and steps), so a wait fails only when a sender process's
    heartbeat, once seen, has not moved for `liveness_s` (`liveness_s(timeout_s)`: 20 s at the default
    --push-timeout), or was never seen within `timeout_s`: PeerTimeoutError naming that side. A publisher deletes
    its values `keep` publications later (by then every reader has them in the loop's order).

    The same thread watches the other processes (`_watch`): a peer whose heartbeat, once seen, has not moved for
    `liveness_s` while its exit is not posted, or a failure another process posted (`FAILED_KEY`), ends this
    process with one line naming the dead process (`exit_on_failure`) wherever its main thread is blocked: a
    barrier of orbax's checkpoint, a collective, a transfer, a wait for the other role's results. That comes long
    before jax's own heartbeat timeout (`--push-timeout` + 30 s, sharding/distributed.py), whose expiry would
    abort this process in C++ instead (issues 23, 42), and before the sidecar's grace (sharding/coordination.py)."""

    HEARTBEAT_S = HEARTBEAT_S

    def __init__(self, layout: RoleLayout, timeout_s: float, prefix: str = "dsv4", keep: int = 2):
        self.layout, self.timeout_s, self.prefix, self.keep = layout, float(timeout_s), prefix, int(keep)
        self.liveness_s = liveness_s(timeout_s)
        self._published: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="dsv4-mpmd-heartbeat", daemon=True)
        self._heartbeat_once(0)
        self._beat.start()
        atexit.register(self._at_exit)  # runs before jax's shutdown barrier (registered after jax's)

    def _heartbeat_once(self, n: int) -> None:
        _client().key_value_set(f"{self.prefix}/alive/{self.layout.process}", str(n), allow_overwrite=True)

    def _heartbeat(self) -> None:
        n, seen, changed = 0, {}, {}
        while not self._stop.wait(self.HEARTBEAT_S):
            n += 1
            try:
                self._heartbeat_once(n)
                lost = self._watch(seen, changed)
            except Exception:  # noqa: BLE001 - the service is gone (shutdown); the waits report it
                return
            if lost is not None and not self._stop.is_set():
                exit_on_failure(lost)
                return

    def _watch(self, seen: dict, changed: dict) -> PeerTimeoutError | None:
        """One look at the other processes (class docstring): the failure to exit on, else None. `seen` / `changed`:
        each peer's last heartbeat value and when it last moved (monotonic seconds), kept between calls."""
        client = _client()
        failed = _try_get(client, FAILED_KEY)
        if failed:
            side, message = failed.split("\n", 1)
            return PeerTimeoutError(side, self.layout.processes(side), "", self.timeout_s, message=message)
        now, silent = time.monotonic(), []
        for p in sorted({*self.layout.actor_processes, *self.layout.rollout_processes} - {self.layout.process}):
            beat = _try_get(client, f"{self.prefix}/alive/{p}")
            if beat is None:  # not started yet: the waits time it (a slow start is no death)
                continue
            if beat != seen.get(p):
                seen[p], changed[p] = beat, now
            elif now - changed[p] > self.liveness_s and not _try_get(client, f"{self.prefix}/exit/{p}"):
                silent.append(p)
        if not silent:
            return None
        return dead_peer_error(self.layout, [p for p in silent if self._side_of(p) == self._side_of(silent[0])],
                               self.liveness_s)

    def _side_of(self, p: int) -> str:
        return ACTOR if p in self.layout.actor_processes else ROLLOUT

    def _silent(self, procs, seen: dict, changed: dict, now: float) -> list[int]:
        """Of `procs`, those dead by the class docstring's rule: a heartbeat seen (`seen[p]` not None) that has not
        moved since `changed[p]` for `liveness_s`, or none seen since `changed[p]` (the wait's start) for
        `timeout_s`."""
        return [p for p in procs if now - changed[p] > (self.timeout_s if seen[p] is None else self.liveness_s)]

    def close(self) -> None:
        self._stop.set()

    def _at_exit(self) -> None:
        """A normal exit, before jax's shutdown barrier: post this process's exit, stop its heartbeat, wait until
        every process posted its exit (the roles end at different moments). A process that died meanwhile would
        hold jax's barrier until the coordinator's exit aborts this one (C++ stack, no project line); here, instead,
        its death is found (another process's report, `FAILED_KEY`, or its heartbeat silent for the timeout while
        its exit is not posted): one line, exit 1. This process stops beating first: one that exits early (an error
        of its own) is found silent by the others that still wait for it, rather than kept waiting by its beat."""
        try:
            client = _client()
            client.key_value_set(f"{self.prefix}/exit/{self.layout.process}", "1", allow_overwrite=True)
            self.close()
            pending = set(self.layout.actor_processes) | set(self.layout.rollout_processes)
            pending.discard(self.layout.process)
            seen = {p: None for p in pending}
            changed = {p: time.monotonic() for p in pending}
            while pending:
                pending = {p for p in pending if not _try_get(client, f"{self.prefix}/exit/{p}")}
                failed = _try_get(client, FAILED_KEY)
                if failed:
                    side, message = failed.split("\n", 1)
                    raise PeerTimeoutError(side, self.layout.processes(side), "", self.timeout_s, message=message)
                now = time.monotonic()
                for p in pending:
                    beat = _try_get(client, f"{self.prefix}/alive/{p}")
                    if beat != seen[p]:
                        seen[p], changed[p] = beat, now
                silent = sorted(self._silent(pending, seen, changed, now))
                if silent:
                    silent = [p for p in silent if self._side_of(p) == self._side_of(silent[0])]
                    raise dead_peer_error(self.layout, silent, self.liveness_s if seen[silent[0]] is not None
                                          else self.timeout_s, "at the run's end")
                time.sleep(0.2 if pending else 0)
        except PeerTimeoutError as e:
            exit_on_failure(e)
        except Exception:  # noqa: BLE001 - the service is gone already: nothing left to wait for
            pass
        finally:
            self.close()  # a dying process stops looking alive

    def publish(self, tag: str, value: Any) -> None:
        client = _client()
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        n = max(1, -(-len(data) // PIECE_BYTES))
        for i in range(n):
            client.key_value_set_bytes(f"{self.prefix}/{tag}/{i}", data[i * PIECE_BYTES:(i + 1) * PIECE_BYTES])
        client.key_value_set_bytes(f"{self.prefix}/{tag}/n", str(n).encode())
        self._published.append((tag, n))
        while len(self._published) > self.keep:
            old, m = self._published.pop(0)
            for i in [*range(m), "n"]:
                client.key_value_delete(f"{self.prefix}/{old}/{i}")

    def _wait_key(self, key: str, sender: str, what: str) -> bytes:
        """The value of `key`, polling while the sender side's heartbeats move; PeerTimeoutError naming the dead
        process(es) once one stopped (`_silent`)."""
        client = _client()
        procs = self.layout.processes(sender)
        seen: dict[int, Any] = {p: None for p in procs}
        changed = {p: time.monotonic() for p in procs}
        poll_ms = int(min(self.timeout_s, 2 * self.HEARTBEAT_S) * 1000)
        while True:
            try:
                return client.blocking_key_value_get_bytes(key, poll_ms)
            except jax.errors.JaxRuntimeError as e:
                # the coordination service is gone: its sidecar (sharding/coordination.py) went with process 0's host
                if "UNAVAILABLE" in str(e) and self.layout.process != 0:
                    side = ACTOR if 0 in self.layout.actor_processes else ROLLOUT
                    raise PeerTimeoutError(side, self.layout.processes(side), what, self.timeout_s, message=(
                        f"the {side} side lost process 0's coordination service (it stopped answering: "
                        f"{str(e).splitlines()[0][:160]}); rerun the same command to resume from the last "
                        "checkpoint")) from None
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise PeerTimeoutError(sender, procs, what, self.timeout_s, str(e)) from None
            try:
                failed = client.key_value_try_get(FAILED_KEY)  # another process already found a dead peer
            except jax.errors.JaxRuntimeError:
                failed = None
            if failed:
                side, message = failed.split("\n", 1)
                raise PeerTimeoutError(side, self.layout.processes(side), what, self.timeout_s, message=message)
            now = time.monotonic()
            for p in procs:
                try:
                    beat = client.key_value_try_get(f"{self.prefix}/alive/{p}")
                except jax.errors.JaxRuntimeError:
                    beat = None
                if beat is not None and beat != seen[p]:
                    seen[p], changed[p] = beat, now
            silent = self._silent(procs, seen, changed, now)
            if silent:
                if seen[silent[0]] is None:  # never seen beating within the timeout: it did not start
                    raise PeerTimeoutError(sender, procs, f"{what}; no heartbeat from process(es) {silent}",
                                           self.timeout_s)
                raise dead_peer_error(self.layout, silent, self.liveness_s, f"waiting for {what}")

    def receive(self, tag: str, sender: str, what: str = "") -> Any:
        what = what or f"message {tag!r}"
        n = int(self._wait_key(f"{self.prefix}/{tag}/n", sender, what))
        client = _client()
        parts = [client.key_value_try_get_bytes(f"{self.prefix}/{tag}/{i}") for i in range(n)]
        return pickle.loads(b"".join(parts))

    def post(self, tag: str, text: str) -> None:
        """Set a small string value under `tag` (kept: for flags and counters read with `peek`)."""
        _client().key_value_set(f"{self.prefix}/{tag}", str(text), allow_overwrite=True)

    def peek(self, tag: str) -> str | None:
        """The value `post`ed under `tag`, None when there is none (yet); does not wait."""
        return _try_get(_client(), f"{self.prefix}/{tag}")

    def ack(self, tag: str) -> None:
        """This process confirms `tag` (e.g. a received push chunk); see `wait_acks`."""
        _client().key_value_set(f"{self.prefix}/ack/{tag}/{self.layout.process}", "1")

    def wait_acks(self, tag: str, sender: str, what: str) -> None:
        """Wait until every process of `sender`'s side has called `ack(tag)`; then drop the acks."""
        for p in self.layout.processes(sender):
            self._wait_key(f"{self.prefix}/ack/{tag}/{p}", sender, what)
