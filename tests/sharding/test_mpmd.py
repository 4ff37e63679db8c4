"""sharding/mpmd.py on one process: role layouts (whole processes per role, clear errors otherwise), transfer
socket addresses (the push's transfer layouts: tests/parallel/test_mpmd_wire.py). The multi-process run itself: tests/launch/test_mpmd_run.py (slow)."""

import jax
from jax._src import distributed
import pytest

from sharding.mesh import MeshSpecError, build_mesh_plan
from sharding.distributed import heartbeat_timeout, sidecar_grace_s
from sharding.mpmd import (HostChannel, PeerTimeoutError, RoleLayout, actor_job_layout, liveness_s, lost_peer,
                           role_layout, transfer_socket_address)


def _two_per_process(d):
    return d.id // 2  # pretend: 2 devices per process


def test_role_layout_whole_processes():
    plan = build_mesh_plan("actor:fsdp=2,expert=2/rollout:expert=2", devices=jax.devices()[:6])
    lay = role_layout(plan, process_index=2, process_count=3, process_of=_two_per_process)
    assert lay.split_roles and lay.actor_processes == (0, 1) and lay.rollout_processes == (2,)
    assert lay.role == "rollout" and lay.is_rollout and not lay.is_actor and lay.writer == 0
    one = role_layout(plan, process_index=0, process_count=1)
    assert not one.split_roles and one.is_actor and one.is_rollout  # single process: both roles, as before
    colo = role_layout(build_mesh_plan("actor:fsdp=2", devices=jax.devices()[:2]), process_index=0,
                       process_count=2, process_of=lambda d: d.id)
    assert not colo.split_roles


def test_actor_job_layout_every_process_an_actor():
    """The two-job layout's actor job (rl/rollout/two_job.py): all its processes are actors; several -> the MPMD actor
    side's treatment (one prompt stream, results over the channel, a dead process named), process 0 the writer."""
    lay = actor_job_layout(process_index=1, process_count=2)
    assert lay.split_roles and lay.actor_processes == (0, 1) and lay.rollout_processes == ()
    assert lay.is_actor and not lay.is_rollout and lay.role == "actor" and lay.writer == 0
    assert not actor_job_layout(process_index=0, process_count=1).split_roles


@pytest.mark.parametrize("spec, message", [
    ("actor:fsdp=3/rollout:expert=3", "process 1 holds actor devices [2] and rollout devices [3]"),
    ("actor:fsdp=2/rollout:expert=2", "process 2 holds no device of either role"),
])
def test_role_layout_rejects_split_processes(spec, message):
    plan = build_mesh_plan(spec, devices=jax.devices()[:6])
    with pytest.raises(MeshSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        role_layout(plan, process_index=0, process_count=3, process_of=_two_per_process)


def test_transfer_socket_address():
    assert transfer_socket_address("127.0.0.1:1234", 2) == "127.0.0.1:1237"
    assert transfer_socket_address("127.0.0.1:1234", 2, "10.0.0.5:9000") == "10.0.0.5:9000"


class _Beats:
    """A stand-in coordination client: process 1's heartbeat is frozen (dead), the others' move at every read; no
    process posted its exit but those in `exiting`."""

    def __init__(self, exiting=()):
        self.n, self.exiting = 0, exiting

    def key_value_try_get(self, key):
        self.n += 1
        if "/exit/" in key:  # a process ending normally posted its exit (and stopped beating)
            return "1" if int(key.rsplit("/", 1)[1]) in self.exiting else None
        return "7" if key.endswith("/1") else str(self.n)


def test_lost_peer_names_the_dead_process_and_its_side(monkeypatch):
    """A Gloo error from a closed connection -> the side and process whose heartbeat stopped; other errors -> None."""
    monkeypatch.setattr(distributed.global_state, "client", _Beats())
    layout = RoleLayout(process=0, actor_processes=(0, 1), rollout_processes=(2,), split_roles=True)
    gloo = RuntimeError("UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:933")
    e = lost_peer(layout, gloo, wait_s=0.0)
    assert e is not None and e.side == "actor"
    assert str(e).startswith("the actor side lost process(es) [1] (its heartbeat stopped; process 0 saw: UNKNOWN: "
                             "Gloo AllGather failed") and "an actor process died; rerun the same command" in str(e)
    assert lost_peer(layout, RuntimeError("RESOURCE_EXHAUSTED: out of memory"), wait_s=0.0) is None  # not a death
    monkeypatch.setattr(distributed.global_state, "client", _Beats(exiting=(1,)))
    assert lost_peer(layout, gloo, wait_s=0.0) is None  # process 1 is ending normally, not dead
    colocated = RoleLayout(process=0, actor_processes=(0, 1), rollout_processes=(0, 1), split_roles=False)
    assert lost_peer(colocated, gloo, wait_s=0.0) is None  # no heartbeats to tell who died


def test_jax_heartbeat_outlasts_the_push_timeout():
    """jax's heartbeat timeout stays behind --push-timeout (our one-line detection and its report come first); a dead
    process is found in seconds at the default --push-timeout (600 s: 20 s of silence), and the sidecar lingers only
    that + 10 s after process 0's death (issue 42)."""
    assert heartbeat_timeout(600.0) == 630.0 and heartbeat_timeout(20.0) == 50.0
    assert liveness_s(600.0) == 20.0 and liveness_s(5.0) == 5.0
    assert sidecar_grace_s(heartbeat_timeout(600.0)) == 30.0 and sidecar_grace_s(15.0) == 25.0


class _Store:
    """A stand-in coordination client over a dict (missing keys: None)."""

    def __init__(self, values):
        self.values = values

    def key_value_try_get(self, key):
        return self.values.get(key)


def test_heartbeat_watch_names_a_silent_peer_or_a_posted_failure(monkeypatch):
    """The heartbeat thread's watch: a peer whose beat stopped (once seen) for the timeout and that posted no exit ->
    its side and process; a peer not started yet is no death; a failure another process posted comes first."""
    store = {"dsv4/alive/0": "5", "dsv4/alive/1": "9"}  # process 2 (the rollout) has not beaten yet
    monkeypatch.setattr(distributed.global_state, "client", _Store(store))
    channel = HostChannel.__new__(HostChannel)  # no thread, no store writes: only the watch's reads
    channel.layout = RoleLayout(process=1, actor_processes=(0, 1), rollout_processes=(2,), split_roles=True)
    channel.timeout_s, channel.liveness_s, channel.prefix = 600.0, 0.0, "dsv4"  # dead after 0 s of silence
    seen, changed = {}, {}
    assert channel._watch(seen, changed) is None and seen == {0: "5"}  # first sight of process 0's beat
    e = channel._watch(seen, changed)  # process 0's beat did not move for the (zero) liveness timeout
    assert e is not None and e.side == "actor"
    assert str(e) == ("the actor side lost process(es) [0] (no heartbeat for 0 s): an actor process died or hung; "
                      "rerun the same command to resume from the last checkpoint")
    store["dsv4/exit/0"] = "1"  # process 0 ended normally: silent, not dead
    assert channel._watch(seen, changed) is None
    store["dsv4/failed"] = "rollout\nthe rollout side lost process(es) [2] (...)"
    e = channel._watch(seen, changed)
    assert e.side == "rollout" and str(e) == "the rollout side lost process(es) [2] (...)"


def test_a_wait_names_a_dead_sender_after_the_liveness_timeout_a_slow_start_after_the_push_timeout(monkeypatch):
    """`_wait_key` on the rollout's result: its process beats and then stops -> dead after the liveness timeout (not
    --push-timeout), one line naming it; a process never seen beating is given the push timeout (a slow start)."""
    store = {"dsv4/alive/2": "1"}

    class Client(_Store):
        def blocking_key_value_get_bytes(self, key, ms):
            raise jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED: not yet")

    monkeypatch.setattr(distributed.global_state, "client", Client(store))
    channel = HostChannel.__new__(HostChannel)
    channel.layout = RoleLayout(process=0, actor_processes=(0, 1), rollout_processes=(2,), split_roles=True)
    channel.timeout_s, channel.liveness_s, channel.prefix, channel.HEARTBEAT_S = 600.0, 0.05, "dsv4", 0.01
    with pytest.raises(PeerTimeoutError) as e:
        channel._wait_key("dsv4/rollout/3/n", "rollout", "the rollout results of train/3")
    assert e.value.side == "rollout" and str(e.value).startswith(
        "the rollout side lost process(es) [2] (no heartbeat for 0.05 s; waiting for the rollout results of train/3)")
    now = 100.0
    assert channel._silent([2], {2: None}, {2: now - 599.0}, now) == []  # never seen: not dead before 600 s
    assert channel._silent([2], {2: "1"}, {2: now - 1.0}, now) == [2]  # seen, then silent for the liveness timeout
