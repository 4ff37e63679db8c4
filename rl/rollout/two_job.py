"""The two-job layout: the rollout as a JAX job of its own, which may die and come back while the actor keeps going.

    # the actor job (one process, or N processes of one jax.distributed job: --coordinator --num-processes
    # --process-id as the single-job layouts; every process gets the same --rollout-address) listens for its rollout:
    python launch/run.py --mesh actor:fsdp=2,expert=2/rollout:expert=2 --rollout-address 10.0.0.1:7100 ...
    # the rollout job (one process, its own devices, nothing shared with the actor; restart it after a death):
    python launch/run.py --mesh actor:fsdp=2,expert=2/rollout:expert=2 --rollout-job --actor-address 10.0.0.1:7100 ...

Both jobs take the run's flags (the rollout job reads the mesh's rollout section, the sampling and model knobs; it
writes no metrics, checkpoints or config file). `JobRollout` is the actor's side of the rollout service contract
(rl/rollout/service.py), `RolloutJobServer` the loop the rollout job runs. Messages (versions, requests, results,
acknowledgements, heartbeats) travel over `sharding.job_link` (a `multiprocessing.connection` socket with an HMAC
key); weights by `jax.experimental.transfer` (`parallel.push.job`: the actor stages the rollout's tiling, the rollout
pulls). Ops, actor -> rollout, in order: {"op": "generate", "request"} -> "result/<tag>"; {"op": "pull", "uuid",
"version", "addresses"} -> "ack/<uuid>"; {"op": "stop"}.

An actor job of N processes (the seed layout: 16 devices on 2 nodes) runs one SPMD program on all of them, each
process the same loop with the same batches (every process reads the one unsharded prompt stream, as the MPMD
layout's actor processes do: `sharding.mpmd.actor_job_layout`). Only process 0 holds the link (it listens at
--rollout-address, sends the requests and pull ops, receives results, acks and heartbeats); it shares each result
(and the restart counters) with the other actor processes through the actor job's coordination key-value store
(`sharding.mpmd.HostChannel`, "job/result/<tag>"), so every process feeds the same batch to the learner. Weights:
every actor process serves its own shards of the staged tiling through its own transfer server
(`parallel.push.job`, per-process servers: no host gathers the weights); their addresses are collected by process 0
at start ("job/transfer/<p>") and travel with every pull op. Process 0 asks the others to offer a version under a
pull's uuid through the store ("job/offer/<uuid>", answered by a thread on each of them once that version is staged
there, acknowledged with "job/offered/<uuid>"), so a recovery re-offers the served version with no help from the
loop, while the other processes wait for the result they need (their waits last while process 0's heartbeat moves).
The rollout job stays one process (`rl.run.wiring.build_rollout_job`). The death of an actor process ends the actor job
with one line naming it (`sharding.mpmd.lost_peer` / `PeerTimeoutError`, launch/run.py); process 0's exit closes the
link, so the rollout job exits 1 with one line naming the actor.

Recovery in place. When the rollout's connection closes (its process died) or its heartbeat is older than
`--push-timeout`, the actor logs one line and waits up to `--rollout-restart-timeout` for a rollout job to register
(the same command, restarted by a supervisor, a scheduler or a user). The learner, the data order and the pipeline
never notice: the new rollout pulls the served version from the actor's staged copy (`parallel.push.job`: the weights
the in-flight batches were being generated with, even if the learner has moved on), then every request submitted and
not yet answered is sent again under its tag. A request's randomness is a function of (seed, step, prompt index,
sample index) (rl/rollout/service.py), so the regenerated batch equals the lost one bitwise on CPU: nothing is
trained twice, nothing skipped, and the per-step metrics equal an uninterrupted run's. Metrics (each step, from
`stats`): `rollout/restarts` (rollout jobs lost so far), `rollout/recovery_s` (seconds spent recovering so far,
summed over the restarts: each from the loss noticed to the in-flight requests sent again; 0 before any).
Giving up, with one line naming the rollout (its host and pid, its last log line): no rollout registered within
`--rollout-restart-timeout` (`RolloutJobError`, exit 1), or a rollout that keeps dying: more than `MAX_RESTARTS`
losses within `RESTART_WINDOW_S` (a crash loop, e.g. an out-of-memory on a prompt, is not waited out).
The rollout job exits with one line when its actor is gone (closed connection or silent for --push-timeout).

Registration (issue 42). A rollout job must match its actor: the same weight tiling (the mesh's rollout section,
--config's shapes, --rollout-dtype) and the same identity (`rl.rollout.job_identity`: a digest of the model config,
every field, e.g. rope_theta; the tokenizer; the sampling knobs; the dtypes). The actor's listener compares both in its
accepting thread (`peer_refusal`): a rollout job that differs is refused there, before the actor ever sees it; the
rollout job exits 2 with one line naming what differs (`RolloutMismatchError`), the actor logs one line and keeps
waiting for a right one (up to --rollout-restart-timeout, its state kept: a wrong restart does not end the run).

Tests: `.venv/bin/python -m pytest -q tests/launch/test_two_jobs.py`; benchmark `benchmarks/rollout_fault.py`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import sys
import threading
import time

import jax

from parallel.push.job import JobPusher, WeightReceiver, tiling
from rl.rollout.service import RolloutRequest, RolloutResult, RolloutService, run_request
from rl.rollout.job_identity import identity_mismatch
from sharding.job_link import (JobListener, LinkLost, LinkRefused, authkey, connect, describe_peer, local_host_towards,
                               split_address)
from sharding.mpmd import HostChannel
from sharding.rules import ACTOR

log = logging.getLogger("dsv4rl")

MAX_RESTARTS = 5  # rollout losses tolerated within RESTART_WINDOW_S; one more ends the run
RESTART_WINDOW_S = 600.0


class RolloutJobError(RuntimeError):
    """The rollout job did not come back in time, kept dying, or cannot serve this actor (one line). `status`: the
    process's exit status (launch/run.py)."""

    status = 1


class RolloutMismatchError(RolloutJobError):
    """This rollout job does not match its actor (another tiling or identity: `peer_refusal`): a user error, exit 2."""

    status = 2


TILING_HINT = "start both jobs with the same --mesh, --config and --rollout-dtype"
IDENTITY_HINT = "start both jobs with the same --config, --tokenizer / task, sampling and dtype flags"


def peer_refusal(actor_hello: dict, rollout_hello: dict) -> str | None:
    """Why the actor (`actor_hello`) must refuse the rollout job (`rollout_hello`), in one line, or None when it
    matches: the same weight tiling (`parallel.push.job.tiling`) and the same identity (`rl.rollout.job_identity`: model
    config, tokenizer, sampling knobs, dtypes; issue 42)."""
    if rollout_hello.get("tiling") != actor_hello.get("tiling"):
        return f"it cuts the weights differently from the actor's plan of its mesh: {TILING_HINT}"
    why = identity_mismatch(actor_hello.get("identity"), rollout_hello.get("identity"))
    return None if why is None else f"{why}: {IDENTITY_HINT}"


class JobRollout(RolloutService):
    """The actor job's rollout service in the two-job layout (module docstring).

    Args:
      address: --rollout-address (HOST:PORT to listen on). pusher: the `parallel.push.job.JobPusher` (stand-in
      rollout mesh). params_fn: () -> the learner's current params. timeout_s: --push-timeout (heartbeat age that
      counts as dead). restart_timeout_s: --rollout-restart-timeout (waiting for a rollout to register).
      channel: an actor job of several processes: its HostChannel (`sharding.mpmd.actor_job_layout`); None: one
      process. identity: this job's `rl.rollout.job_identity.job_identity` (a rollout job whose identity or tiling
      differs is refused at registration, `peer_refusal`, and the actor keeps waiting).
    Raises (from any call): RolloutJobError (module docstring); PeerTimeoutError when an actor process stops answering.
    """

    def __init__(self, address: str, pusher: JobPusher, params_fn, *, timeout_s: float, restart_timeout_s: float,
                 channel: HostChannel | None = None, identity: dict | None = None):
        self.pusher, self.params_fn, self.channel = pusher, params_fn, channel
        self.timeout_s, self.restart_timeout_s = float(timeout_s), float(restart_timeout_s)
        self.process, n = jax.process_index(), jax.process_count()
        self.lead = self.process == 0  # holds the link
        host = split_address(address, "--rollout-address")[0]
        self.host = host if self.lead else local_host_towards(host)  # the transfer server's
        self.link = None
        self.rollout_name, self.last_line = "the rollout job", ""
        self._version = -1
        self._served = None  # parallel.push.job.Served: the staged copy of the version the rollout serves
        self._staged = threading.Condition()  # notified when _served changes (the offer thread waits on it)
        self._pending: dict[str, RolloutRequest] = {}  # submitted, not yet collected (in submit order)
        self._uuid = itertools.count(1)
        self._lock = threading.RLock()
        self.restarts, self.recovery_s = 0, 0.0
        self._losses: collections.deque = collections.deque()
        self._stop = threading.Event()
        pusher.deliver = self._deliver
        mine = pusher.start(self.host)
        if channel is not None:
            channel.publish(f"job/transfer/{self.process}", mine)
        if not self.lead:
            threading.Thread(target=self._offers, name="dsv4-job-offers", daemon=True).start()
            return
        self.addresses = [mine] if channel is None else [
            channel.receive(f"job/transfer/{p}", ACTOR, f"actor process {p}'s transfer server address")
            for p in range(n)]
        hello = {"tiling": pusher.tiling, "holders": pusher.holders, "identity": identity}
        self.listener = JobListener(address, authkey(host), hello=hello, check=lambda peer: peer_refusal(hello, peer))
        log.info("two-job layout: waiting up to %g s for a rollout job to register at %s (--rollout-restart-timeout; "
                 "an actor job of %d process(es))", self.restart_timeout_s, self.listener.address, n)
        self._register(self.restart_timeout_s, first=True)

    # ---------------------------------------------------------------- registration and recovery

    def _register(self, deadline_s: float, first: bool = False) -> None:
        """Accept the next rollout job that matches this actor (RolloutJobError when none registers within
        `deadline_s`). One that does not (`peer_refusal`) is refused by the listener's thread with one line on
        both sides, and this wait goes on (issue 42)."""
        link = self.listener.accept(deadline_s, self.timeout_s)
        if link is None:
            who = "" if first else f"{self.rollout_name} is gone and "
            last = f"; its last log line: {self.last_line!r}" if self.last_line else ""
            refused = self.listener.refused
            also = f"; {len(refused)} refused, the last: {refused[-1]}" if refused else ""
            raise RolloutJobError(f"{who}no rollout job registered at {self.listener.address} within {deadline_s:g} s "
                                  f"(--rollout-restart-timeout){last}{also}")
        self.link, self.rollout_name = link, describe_peer(link.hello)
        link.name = self.rollout_name
        log.info("two-job layout: %s registered", self.rollout_name)

    def _recover(self, lost: LinkLost) -> None:
        """The rollout is gone: one line, wait for another, give it the served weights, resend what was in
        flight (module docstring). Loops while the new one dies too, within the restart policy."""
        t0 = time.monotonic()
        while True:
            self.last_line = lost.last_line or self.last_line
            if self.link is not None:
                self.link.close()
            now = time.monotonic()
            self._losses.append(now)
            while self._losses and now - self._losses[0] > RESTART_WINDOW_S:
                self._losses.popleft()
            self.restarts += 1
            last = f"; its last log line: {self.last_line!r}" if self.last_line else ""
            if len(self._losses) > MAX_RESTARTS:
                raise RolloutJobError(f"{self.rollout_name} died {len(self._losses)} times within "
                                      f"{RESTART_WINDOW_S:g} s (more than {MAX_RESTARTS}); giving up{last}")
            log.warning("two-job layout: %s %s; waiting up to %g s (--rollout-restart-timeout) for a rollout job to "
                        "register (the run's state is kept)%s", self.rollout_name, lost.why, self.restart_timeout_s,
                        last)
            try:
                self._register(self.restart_timeout_s)
                if self._served is not None:
                    self._pull(self._served)
                for req in self._pending.values():
                    self.link.send("cmd", {"op": "generate", "request": req})
            except LinkLost as e:
                lost = e
                continue
            self.recovery_s += time.monotonic() - t0
            log.info("two-job layout: recovered in %.1f s (weight version %d, %d requests sent again)",
                     time.monotonic() - t0, self._version, len(self._pending))
            return

    def _retry(self, fn):
        """fn() against the current rollout; after a loss, recover and call it again."""
        with self._lock:
            while True:
                try:
                    return fn()
                except LinkLost as e:
                    self._recover(e)

    def _pull(self, served) -> None:
        """Process 0: every actor process offers its shards of `served` under a new uuid; the rollout pulls them and
        acknowledges (LinkLost if it dies; PeerTimeoutError if an actor process stops answering)."""
        uuid = next(self._uuid)
        if self.channel is not None:  # the other processes' offer threads (`_offers`)
            self.channel.post(f"job/offer/{uuid}", str(served.version))
        self.pusher.offer(served, uuid)
        if self.channel is not None:
            self.channel.ack(f"job/offered/{uuid}")
            self.channel.wait_acks(f"job/offered/{uuid}", ACTOR, f"the actor processes' offer of weight version "
                                                                 f"{served.version}")
        self.link.send("cmd", {"op": "pull", "uuid": uuid, "version": served.version, "addresses": self.addresses})
        self.link.get(f"ack/{uuid}", f"weight version {served.version}")

    def _offers(self) -> None:
        """Processes other than 0: offer this process's shards under each uuid process 0 announces, once the
        announced version is staged here, and confirm (`_pull`). Runs until `close`."""
        try:
            for uuid in itertools.count(1):
                while (version := self.channel.peek(f"job/offer/{uuid}")) is None:
                    if self._stop.wait(0.05):
                        return
                with self._staged:
                    while self._served is None or self._served.version != int(version):
                        if self._stop.is_set():
                            return
                        self._staged.wait(0.5)
                    served = self._served
                self.pusher.offer(served, uuid)
                self.channel.ack(f"job/offered/{uuid}")
        except Exception as e:  # noqa: BLE001 - process 0 would wait for this offer forever: end this process
            if self._stop.is_set():
                return  # shutting down
            print(f"error: actor process {self.process} could not offer its weight shards: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}", file=sys.stderr, flush=True)
            os._exit(1)

    # ---------------------------------------------------------------- the contract

    def submit(self, request: RolloutRequest) -> str:
        if not self.lead:
            return request.tag  # process 0 sends it; this process reads its result (`collect`)
        with self._lock:
            self._pending[request.tag] = request
            try:
                self.link.send("cmd", {"op": "generate", "request": request})
            except LinkLost as e:
                self._recover(e)  # sends every pending request again, this one included
        return request.tag

    def collect(self, handle: str) -> RolloutResult:
        if not self.lead:  # process 0's copy, with its counters: every process feeds the same batch
            pk = self.channel.receive(f"job/result/{handle}", ACTOR, f"the rollout results of {handle} (from actor "
                                                                     "process 0)")
            self.restarts, self.recovery_s = pk["stats"]
            return pk["result"]
        res = self._retry(lambda: self.link.get(f"result/{handle}", f"the rollout results of {handle}"))
        self._pending.pop(handle, None)
        if self.channel is not None:
            self.channel.publish(f"job/result/{handle}", {"result": res, "stats": (self.restarts, self.recovery_s)})
        return res

    @property
    def weight_version(self) -> int:
        return self._version

    def load_weights(self, version: int, source: str | None = None) -> dict:
        # `source` (--init): the rollout job cannot read the actor's checkpoint; the push carries the same weights
        stats = self.pusher.push(self.params_fn(), int(version))  # stages, then `_deliver`
        self._version = int(version)
        return stats.metrics()

    def _deliver(self, served) -> None:
        """The pusher's hand-off of a staged version (`JobPusher.deliver`): from now on a restarted rollout gets
        `served` (the old copy is dropped); process 0 has the rollout pull it (other processes' shards are offered
        by `_offers` when process 0 asks)."""
        with self._staged:
            self._served = served
            self._staged.notify_all()
        if not self.lead:
            return
        with self._lock:
            try:
                self._pull(served)
            except LinkLost as e:
                self._recover(e)  # the new rollout pulls `served`

    def stats(self) -> dict:
        return {"rollout/restarts": float(self.restarts), "rollout/recovery_s": float(self.recovery_s)}

    def close(self) -> None:
        if not self.lead:  # serve offers (process 0's last push, a recovery) until process 0 is done with the rollout;
            try:  # not when this process is failing (called from the loop's `finally`): its error goes first
                if sys.exc_info()[0] is None:
                    self.channel.receive("job/closed", ACTOR, "actor process 0's end of the run")
            finally:
                self._stop.set()
            return
        self._stop.set()
        failing = sys.exc_info()[0] is not None  # (the loop's `finally`) the rollout sees the link close: exits 1
        try:
            if self.link is not None and not failing:
                self.link.send("cmd", {"op": "stop"})
                self.link.get("bye", "the rollout's goodbye", timeout_s=30)
        except (LinkLost, TimeoutError):
            pass  # it is gone already: nothing to stop
        finally:
            if self.link is not None:
                self.link.close()
            self.listener.close()
            if self.channel is not None:
                self.channel.publish("job/closed", True)


class _LastLine(logging.Handler):
    """Remembers this process's last log line (sent with each heartbeat, so the actor can name it)."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.line = ""

    def emit(self, record) -> None:
        try:
            self.line = record.getMessage().splitlines()[0][:300] if record.getMessage() else self.line
        except Exception:  # noqa: BLE001 - a log line is a courtesy
            pass


class RolloutJobServer:
    """The loop of a rollout job (module docstring): register with the actor at `actor_address`, then serve its
    ops in order until "stop".

    Args:
      sampler: the rollout Sampler (abstract model on this job's rollout mesh; the weights arrive by pull).
      actor_address: --actor-address. timeout_s: --push-timeout. connect_timeout_s: how long to retry the first
      connection (--rollout-restart-timeout). identity: this job's `rl.rollout.job_identity.job_identity` (sent with the
      hello; the actor refuses a mismatch).
    """

    def __init__(self, sampler, actor_address: str, *, timeout_s: float, connect_timeout_s: float,
                 identity: dict | None = None):
        self.sampler, self.actor_address = sampler, actor_address
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.identity = identity
        self.generate_calls = 0
        host = split_address(actor_address, "--actor-address")[0]
        self.key = authkey(host)  # ValueError (one line) for a remote actor without $DSV4RL_ROLLOUT_AUTHKEY
        self.receiver = WeightReceiver(sampler, local_host_towards(host))
        self._line = _LastLine()
        logging.getLogger().addHandler(self._line)

    def serve(self) -> dict:
        """Serve until the actor's "stop"; returns {"generate": calls, "train_steps": 0}. Raises LinkLost naming
        the actor when it is gone; RolloutMismatchError (exit 2) when the actor refused this job or plans another
        tiling or identity (`peer_refusal`)."""
        hello = {"host": socket.gethostname(), "pid": os.getpid(), "tiling": tiling(self.sampler),
                 "identity": self.identity, "line": self._line.line}
        try:
            link = connect(self.actor_address, self.key, timeout_s=self.timeout_s, deadline_s=self.connect_timeout_s,
                           hello=hello, line_fn=lambda: self._line.line)
        except LinkRefused as e:
            raise RolloutMismatchError(str(e)) from None
        why = peer_refusal(link.hello, hello)  # the actor checked it too: a backstop
        if why is not None:
            link.close()
            raise RolloutMismatchError(f"{link.name} does not match this rollout job: {why}")
        log.info("two-job layout: registered with %s", link.name)
        try:
            while True:
                cmd = link.get("cmd", "the actor's next op")
                op = cmd["op"]
                if op == "generate":
                    req: RolloutRequest = cmd["request"]
                    self.generate_calls += 1
                    link.send(f"result/{req.tag}", run_request(self.sampler, req))
                elif op == "pull":
                    got = self.receiver.pull(cmd["addresses"], link.hello["holders"], cmd["uuid"], cmd["version"])
                    log.info("weight version %d pulled in %.2f s", cmd["version"], got.seconds)
                    link.send(f"ack/{cmd['uuid']}")
                elif op == "stop":
                    link.send("bye")
                    return {"generate": self.generate_calls, "train_steps": 0}
                else:
                    raise RuntimeError(f"rollout job: unknown op {op!r}")
        finally:
            link.close()
