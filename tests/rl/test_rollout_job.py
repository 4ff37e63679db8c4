"""rl/rollout/two_job.py without processes or programs: `JobRollout` over a real socket with fake rollout jobs in threads
(the in-flight request sent again to the next rollout; one that never comes back -> one line naming it; a foreign
rollout job, of the same shapes but another model config, or of another mesh, refused in one line while the actor
waits for the right one, issue 42), and the restart policy of `JobRollout._recover` (a rollout that keeps dying
ends the run with one line naming its last log line). The launched two-job runs: tests/launch/test_two_jobs.py."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from types import SimpleNamespace

import portpicker
import pytest

from dsv4.config import DSV4Config
from parallel.push.job import JobPusher
from rl.rollout import two_job
from rl.config.run import RunConfig
from rl.rollout.job_identity import job_identity
from rl.rollout.two_job import JobRollout, RolloutJobError, RolloutJobServer, RolloutMismatchError
from rl.rollout.service import RolloutRequest
from rl.data.tasks import DigitTask
from sharding.job_link import JobListener, LinkLost, LinkRefused, authkey, connect

TILING = [("embed.weight", (8, 4), "float8_e4m3fn", (("data", 1),), "P()")]


class _FakePusher(JobPusher):
    """`JobPusher.push` (stage, then the rollout's `deliver`) over a fake staging: no mesh, no transfer server."""

    tiling = TILING
    holders = [[0]]
    tensors: list = []
    n_params = 0

    def __init__(self):
        self.deliver = None

    def start(self, host):
        return "127.0.0.1:1"

    def stage(self, params, version):
        return SimpleNamespace(version=version, nbytes=32)

    def offer(self, served, uuid):
        pass


def _fake_rollout(address: str, pid: int, die_on_generate: bool, identity=None) -> None:
    """A rollout job's ops without a sampler: acks pulls, answers requests with its pid (or dies at the first)."""
    link = connect(address, authkey(), timeout_s=10, deadline_s=10,
                   hello={"host": "h", "pid": pid, "tiling": TILING, "line": f"rollout {pid} up", "identity": identity})
    while True:
        cmd = link.get("cmd", "op")
        if cmd["op"] == "pull":
            link.send(f"ack/{cmd['uuid']}")
        elif cmd["op"] == "generate" and die_on_generate:
            link.close()  # SIGKILL: the socket closes
            return
        elif cmd["op"] == "generate":
            link.send(f"result/{cmd['request'].tag}", f"{cmd['request'].tag} by {pid}")
        else:
            link.send("bye")
            return


def _start(address, pid, die, identity=None):
    t = threading.Thread(target=_fake_rollout, args=(address, pid, die, identity), daemon=True)
    t.start()
    return t


def test_the_request_in_flight_is_sent_again_to_the_next_rollout():
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    _start(address, 1, True)
    r = JobRollout(address, _FakePusher(), dict, timeout_s=10, restart_timeout_s=10)
    try:
        assert set(r.load_weights(0)) == {"perf/weight_push_s", "perf/weight_push_gbps"}  # JobPusher.push's
        handle = r.submit(RolloutRequest(prompts=[[1, 2]], params=None, seed=0, tag="train/0/0"))
        second = _start(address, 2, False)  # as a supervisor would (it may register before the first one dies)
        assert r.collect(handle) == "train/0/0 by 2" and r.weight_version == 0
        assert r.stats()["rollout/restarts"] == 1.0 and r.stats()["rollout/recovery_s"] > 0
        assert r.rollout_name == "the rollout job h pid 2"
    finally:
        r.close()
    second.join(timeout=10)
    assert not second.is_alive()  # it got "stop"


def test_a_rollout_that_never_comes_back_is_named_in_one_line():
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    _start(address, 7, True)
    r = JobRollout(address, _FakePusher(), dict, timeout_s=10, restart_timeout_s=10)  # the first registration
    r.restart_timeout_s = 0.5  # the wait after the loss (the fake's first connect may retry past 0.5 s)
    try:
        r.load_weights(0)
        handle = r.submit(RolloutRequest(prompts=[[1]], params=None, seed=0, tag="train/0/0"))
        with pytest.raises(RolloutJobError) as e:
            r.collect(handle)
    finally:
        r.close()
    msg = str(e.value)
    assert msg.startswith(f"the rollout job h pid 7 is gone and no rollout job registered at {address} within 0.5 s "
                          "(--rollout-restart-timeout)")
    assert "its last log line: 'rollout 7 up'" in msg and "\n" not in msg


class _DyingLink:
    """A rollout that registers and dies at its first message."""

    def __init__(self, n):
        self.n, self.name, self.closed = n, f"the rollout job h pid {n}", None

    def send(self, key, payload=None):
        raise LinkLost(self.name, "closed the connection (EOFError)", last_line=f"out of memory on prompt {self.n}")

    def close(self):
        pass


def _service():
    r = JobRollout.__new__(JobRollout)  # no listener, no pusher: only the recovery's bookkeeping
    r.link, r.rollout_name, r.last_line, r._served = None, "the rollout job h pid 0", "", None
    r._pending = {"train/0/0": object()}
    r._losses, r.restarts, r.recovery_s, r.restart_timeout_s = collections.deque(), 0, 0.0, 5.0
    return r


def test_a_rollout_that_keeps_dying_ends_the_run_with_one_line(monkeypatch):
    r = _service()
    born = iter(range(1, 100))

    def register(deadline_s, first=False):
        r.link = _DyingLink(next(born))
        r.rollout_name = r.link.name

    monkeypatch.setattr(r, "_register", register)
    with pytest.raises(RolloutJobError) as e:
        r._recover(LinkLost("the rollout job h pid 0", "closed the connection (EOFError)"))
    msg = str(e.value)
    assert r.restarts == two_job.MAX_RESTARTS + 1  # the first loss + MAX_RESTARTS replacements that died
    assert f"died {two_job.MAX_RESTARTS + 1} times within" in msg and "\n" not in msg
    assert f"the rollout job h pid {two_job.MAX_RESTARTS}" in msg  # the last one, by host and pid
    assert f"its last log line: 'out of memory on prompt {two_job.MAX_RESTARTS}'" in msg


def test_losses_outside_the_window_are_forgiven(monkeypatch):
    r = _service()
    r._version = 3
    clock = iter(range(0, 10**6, 1000))  # every clock read 1000 s later: each loss outside the previous' window
    monkeypatch.setattr(two_job.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(two_job, "MAX_RESTARTS", 1)
    registered = []

    class _Live:
        name, closed = "the rollout job h pid 9", None

        def send(self, key, payload=None):
            pass

        def close(self):
            pass

    def register(deadline_s, first=False):
        registered.append(deadline_s)
        r.link = _Live()

    monkeypatch.setattr(r, "_register", register)
    for _ in range(3):
        r._recover(LinkLost("the rollout job h pid 9", "closed the connection (EOFError)"))
    assert r.restarts == 3 and registered == [5.0, 5.0, 5.0] and len(r._losses) == 1 and r.recovery_s > 0


def _identity(**model):
    tok = DigitTask(kind="copy", n_digits=3, seed=0).tokenizer
    return job_identity(RunConfig(), dataclasses.replace(DSV4Config.preset("tiny"), **model), tok, max_prompt_len=8)


def test_a_foreign_rollout_job_is_refused_while_the_actor_waits(caplog):
    """Issue 42, reproductions 2 and 7: a rollout job of the same shapes whose config.json differs in rope_theta, and
    one restarted with another --mesh (another tiling), are each refused in one line on their side (exit 2 in a
    run: RolloutMismatchError) and logged once by the actor, which keeps waiting: the right one registers next
    and serves."""
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    mine, errors, refused = _identity(), [], threading.Event()

    def foreign(pid, identity, tiling):
        try:
            connect(address, authkey(), timeout_s=10, deadline_s=10,
                    hello={"host": "h", "pid": pid, "tiling": tiling, "identity": identity})
        except LinkRefused as e:
            errors.append(str(e))
        if len(errors) == 2:
            refused.set()

    for pid, ident, tiling in ((3, _identity(rope_theta=20000.0), TILING), (4, mine, [*TILING, ("x", (1,))])):
        threading.Thread(target=foreign, args=(pid, ident, tiling), daemon=True).start()

    def right():
        assert refused.wait(30)
        _fake_rollout(address, 5, False, mine)

    t = threading.Thread(target=right, daemon=True)
    t.start()
    with caplog.at_level(logging.WARNING, logger="dsv4rl"):
        r = JobRollout(address, _FakePusher(), dict, timeout_s=10, restart_timeout_s=60, identity=mine)
    try:
        r.load_weights(0)
        assert r.collect(r.submit(RolloutRequest(prompts=[[1]], params=None, seed=0, tag="t"))) == "t by 5"
        assert r.rollout_name == "the rollout job h pid 5" and r.stats()["rollout/restarts"] == 0.0
    finally:
        r.close()
    t.join(timeout=10)
    errors.sort(reverse=True)  # the model config's, then the mesh's
    assert errors[0] == (f"the actor at {address} refused this rollout job: model config differs (rope_theta: "
                         "20000.0 in the rollout job, 10000.0 in the actor): " + two_job.IDENTITY_HINT)
    assert errors[1] == (f"the actor at {address} refused this rollout job: it cuts the weights differently from "
                         "the actor's plan of its mesh: " + two_job.TILING_HINT)
    lines = [m for m in caplog.messages if "refused" in m]
    assert len(lines) == 2 and all("\n" not in m and "still waiting" in m for m in lines), lines
    assert {m.split(":")[1].strip() for m in lines} == {"refused the rollout job h pid 3", "refused the rollout job h "
                                                                                           "pid 4"}


def test_a_refused_rollout_job_exits_2_with_the_actors_reason(monkeypatch):
    """The rollout job's side: the actor's refusal -> RolloutMismatchError (launch/run.py: its one line, exit 2)."""
    listener = JobListener("127.0.0.1:0", authkey(), hello={"tiling": TILING, "identity": _identity()},
                           check=lambda peer: two_job.peer_refusal({"tiling": TILING, "identity": _identity()},
                                                                       peer))
    monkeypatch.setattr(two_job, "tiling", lambda sampler: TILING)
    server = RolloutJobServer.__new__(RolloutJobServer)  # no sampler, no receiver: only the registration
    server.actor_address, server.key, server.timeout_s, server.connect_timeout_s = listener.address, authkey(), 10, 10
    server.identity, server._line = _identity(routed_scaling_factor=2.0), SimpleNamespace(line="")
    server.sampler = None
    try:
        with pytest.raises(RolloutMismatchError) as e:
            server.serve()
    finally:
        listener.close()
    assert e.value.status == 2 and "model config differs (routed_scaling_factor: 2.0 in the rollout job" in str(e.value)
    assert listener.accept(0.1, 10) is None and len(listener.refused) == 1  # never handed to the actor
