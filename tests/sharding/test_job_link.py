"""sharding/job_link.py: the socket between two jobs, in one process (two threads' worth of peers): messages by
key in order, the peer's hello and last log line, a closed peer -> LinkLost naming it, a wrong key refused."""

from __future__ import annotations

from multiprocessing.connection import Client

import pytest

from sharding.job_link import ENV_AUTHKEY, JobListener, LinkLost, authkey, connect, split_address


def test_messages_hello_and_a_closed_peer():
    listener = JobListener("127.0.0.1:0", b"k", hello={"tiling": [1, 2]})
    try:
        rollout = connect(listener.address, b"k", timeout_s=30, deadline_s=10,
                          hello={"name": "the rollout job h pid 1", "line": "compiling"})
        actor = listener.accept(10, 30)
        assert rollout.hello["tiling"] == [1, 2] and rollout.name == f"the actor at {listener.address}"
        assert actor.name == "the rollout job h pid 1" and actor.last_line == "compiling"
        actor.send("cmd", {"op": 1})
        actor.send("cmd", {"op": 2})
        rollout.send("result/a", "x")
        assert [rollout.get("cmd", "op")["op"] for _ in range(2)] == [1, 2] and actor.get("result/a", "") == "x"
        rollout.close()  # the rollout process dies: its socket closes
        with pytest.raises(LinkLost) as e:
            actor.get("result/b", "the rollout results of b")
        assert str(e.value).startswith("the rollout job h pid 1 closed the connection")
    finally:
        listener.close()


def test_wrong_key_and_bad_address():
    listener = JobListener("127.0.0.1:0", b"k")
    try:
        with pytest.raises(ValueError, match="--actor-address .* refused this job's key"):
            connect(listener.address, b"other", timeout_s=5, deadline_s=5, hello={})
    finally:
        listener.close()
    with pytest.raises(ValueError, match="--rollout-address must be HOST:PORT"):
        split_address("nohost", "--rollout-address")


def test_a_silent_peer_is_lost_after_the_timeout():
    """A peer that stops answering (hung, SIGSTOPped) while its socket stays open: LinkLost after `timeout_s`."""
    listener = JobListener("127.0.0.1:0", b"k")
    try:
        host, port = split_address(listener.address, "address")
        raw = Client((host, port), authkey=b"k")  # no Link: it never sends a heartbeat
        raw.send(("hello", {"name": "the rollout job h pid 2", "line": "decoding"}))
        actor = listener.accept(10, timeout_s=0.5)
        with pytest.raises(LinkLost) as e:
            actor.get("result/a", "the rollout results of a")
        assert "the rollout job h pid 2 sent no heartbeat for" in str(e.value) and e.value.last_line == "decoding"
        raw.close()
    finally:
        listener.close()


def test_a_queued_rollout_hears_the_busy_actor(monkeypatch):
    """A rollout job that registers while the actor is busy elsewhere (it has not called `accept` yet) gets the
    actor's heartbeats from the listener at once: it does not give up after its timeout while it waits."""
    import sharding.job_link as jl

    monkeypatch.setattr(jl, "HEARTBEAT_S", 0.1)
    listener = JobListener("127.0.0.1:0", b"k")
    try:
        rollout = connect(listener.address, b"k", timeout_s=0.5, deadline_s=10, hello={"name": "the rollout job"})
        with pytest.raises(TimeoutError):  # 1.5 s = 3x its heartbeat timeout without the actor taking it: alive
            rollout.get("cmd", "the actor's next op", timeout_s=1.5)
        actor = listener.accept(10, 30, line_fn=lambda: "step 3")
        actor.send("cmd", {"op": "push"})
        assert rollout.get("cmd", "op") == {"op": "push"}
    finally:
        listener.close()


def test_a_remote_address_needs_a_secret_key(monkeypatch):
    """The channel unpickles what it receives: the public default key guards loopback only."""
    monkeypatch.delenv(ENV_AUTHKEY, raising=False)
    assert authkey("127.0.0.1") == authkey("localhost") == authkey("[::1]") == b"dsv4-rl-rollout"
    with pytest.raises(ValueError, match=ENV_AUTHKEY):
        authkey("10.0.0.7")
    monkeypatch.setenv(ENV_AUTHKEY, "s3cret")
    assert authkey("10.0.0.7") == authkey("127.0.0.1") == b"s3cret"
