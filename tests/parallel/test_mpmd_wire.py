"""The MPMD push's wire (`parallel/push/mpmd.py`) on one process: a RoleLayout whose single process is both the
actor and the rollout runs every step of `MpmdPusher.push` (actor-side staging and quantisation, the device_put onto
the rollout's tiling, acks, checksums through a channel) with an in-memory channel in place of the coordination
service; the cross-process run itself is tests/launch/test_mpmd_run.py (slow).

Checks: FP8 blocks + scales on the wire (wire bytes per parameter about half of bf16), the rollout's state after a
push bitwise equal to quantising the actor's params directly (`Sampler.update_weights`, the sampler's own
`quantize_rollout_fp8`), in the sampler's shardings; a corrupted arrival fails verification with one line naming
the tensor, and the rollout keeps its previous weights. The transfer layouts (`plan_transfer`): tiling identical to
the rollout's (the condition of jax's cross-process device_put), one line for a tensor the actor cannot serve."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import dsv4
from dsv4 import quant

from parallel.push.mpmd import MpmdPusher, MpmdPushVerificationError, plan_transfer
from parallel.push.protocol import Pusher, PushStats
from rl.rollout.engine import Sampler
from sharding.mesh import MeshSpecError, build_mesh_plan
from sharding.mpmd import RoleLayout

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import randomize  # noqa: E402

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
MESH = "actor:fsdp=2,expert=2/rollout:expert=2,tensor=2"


class LocalChannel:
    """HostChannel's interface in one process (publish / receive / ack / wait_acks)."""

    def __init__(self):
        self.values, self.acks = {}, set()

    def publish(self, tag, value):
        self.values[tag] = value

    def receive(self, tag, sender, what=""):
        return self.values[tag]

    def ack(self, tag):
        self.acks.add(tag)

    def wait_acks(self, tag, sender, what):
        assert tag in self.acks


@pytest.fixture(scope="module")
def setup():
    plan = build_mesh_plan(MESH, config=CFG)
    layout = RoleLayout(process=0, actor_processes=(0,), rollout_processes=(0,), split_roles=True)  # both roles here
    model = randomize(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), seed=5, scale=0.1)
    state = nnx.state(model)
    state = jax.device_put(state, plan.param_shardings("actor", state))
    abstract = dsv4.abstract_model(CFG)
    sampler = Sampler(abstract, mesh=plan.rollout, weights="fp8", max_prompt_len=16, compute_dtype=jnp.float32,
                      kv_cache_dtype="bf16")
    channel = LocalChannel()
    pusher = MpmdPusher(plan, layout, sampler, nnx.state(abstract), plan.param_shardings("actor", nnx.state(abstract)),
                        channel, chunk_bytes=64 * 1024, verify_every=1)
    return plan, state, sampler, pusher, channel


def _bits(x):
    return np.asarray(jax.device_get(x)).view(np.uint8)


def test_fp8_wire_equals_direct_quantisation(setup):
    plan, state, sampler, pusher, channel = setup
    stats = pusher.push(state, 1)
    assert isinstance(pusher, Pusher) and isinstance(stats, PushStats) and stats.verified
    assert stats.bytes == pusher.wire_bytes and set(stats.metrics()) == {"perf/weight_push_s", "perf/weight_push_gbps"}
    assert sampler.weight_version == 1 and len(pusher.chunks) > 1
    assert "verify/1/actor" in channel.values  # the first push is verified
    got = sampler.weight_state()
    ref_sampler = Sampler(dsv4.abstract_model(CFG), mesh=plan.rollout,
                          weights="fp8", max_prompt_len=16, compute_dtype=jnp.float32, kv_cache_dtype="bf16")
    ref_sampler.update_weights(state, 1)  # the actor's params quantised directly on the rollout mesh
    ref = ref_sampler.weight_state()
    assert set(got) == set(ref)
    n_fp8 = 0
    for k, r in ref.items():
        g = got[k]
        if isinstance(r, quant.QuantizedTensor):
            n_fp8 += 1
            assert isinstance(g, quant.QuantizedTensor) and (g.kind, g.fmt, g.block, g.shape) == \
                (r.kind, r.fmt, r.block, r.shape), k
            np.testing.assert_array_equal(_bits(g.q), _bits(r.q), err_msg=k)
            np.testing.assert_array_equal(_bits(g.scale), _bits(r.scale), err_msg=k)
            assert g.q.sharding.is_equivalent_to(r.q.sharding, g.q.ndim), k
            assert g.scale.sharding.is_equivalent_to(r.scale.sharding, g.scale.ndim), k
        else:
            assert g.dtype == r.dtype, k
            np.testing.assert_array_equal(_bits(g), _bits(r), err_msg=k)
            assert g.sharding.is_equivalent_to(r.sharding, g.ndim), k
    assert n_fp8 > 10
    # FP8 tensors cross as fp8 q + f32 scales: 1 B + 4 B per block instead of 2 B per parameter
    wire = sum(g.q.size + 4 * g.scale.size if isinstance(g, quant.QuantizedTensor) else g.size * g.dtype.itemsize
               for g in got.values())
    assert pusher.wire_bytes == wire
    bf16_wire = sum(2 * int(np.prod(g.shape)) if isinstance(g, quant.QuantizedTensor) else g.size * g.dtype.itemsize
                    for g in got.values())  # the FP8 tensors as bf16, the rest as stored
    fp8_params = sum(int(np.prod(g.shape)) for g in got.values() if isinstance(g, quant.QuantizedTensor))
    assert bf16_wire - pusher.wire_bytes > 0.45 * fp8_params  # about 1 B per FP8-stored parameter saved


def _flip_first_bit(x):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]

    def f(a):
        b = jax.lax.bitcast_convert_type(a, width)
        i = (0,) * a.ndim
        return jax.lax.bitcast_convert_type(b.at[i].set(b[i] ^ width(1)), a.dtype)

    return jax.jit(f, out_shardings=x.sharding)(x)


def test_corrupted_arrival_fails_verification_one_line(setup, monkeypatch):
    plan, state, sampler, pusher, channel = setup
    pusher.push(state, 2)
    live_version, live_state = sampler.weight_version, sampler.weight_state()
    bad_key = "layers/1/attn/wq_a/weight"  # stored FP8: its q is corrupted on arrival
    real = pusher._arrived

    def corrupt(chunk, out):
        out = list(real(chunk, out))
        i = 0
        for t in chunk:
            if t.key == bad_key:
                out[i] = _flip_first_bit(out[i])
            i += len(t.wires)
        return out

    monkeypatch.setattr(pusher, "_arrived", corrupt)
    with pytest.raises(MpmdPushVerificationError) as err:
        pusher.push(state, 3, verify=True)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and bad_key in msg and "checksum mismatch" in msg, msg
    assert [k for k, _ in err.value.failures] == [bad_key]
    assert sampler.weight_version == live_version and sampler.weight_state() is live_state
    assert not any(x.is_deleted() for x in jax.tree.leaves(live_state))


@pytest.mark.parametrize("actor_spec, rollout_spec", [
    (P("expert", "fsdp"), P("expert", None)),
    (P("fsdp", None), P(None, "expert")),
    (P(None, ("fsdp", "expert")), P()),  # replicated on the rollout: one copy per rollout device
    (P(("fsdp", "expert")), P("tensor")),
])
def test_transfer_tiling_is_the_rollouts(actor_spec, rollout_spec):
    devs = jax.devices()
    plan = build_mesh_plan("actor:fsdp=2,expert=2/rollout:expert=2,tensor=2", devices=devs[:8])
    shape = (8, 12) if len(actor_spec) > 1 or len(rollout_spec) > 1 else (8,)
    a_sh, r_sh = NamedSharding(plan.actor, actor_spec), NamedSharding(plan.rollout, rollout_spec)
    t = plan_transfer("w", shape, np.float32, a_sh, r_sh)
    assert t.transfer_sharding._to_xla_hlo_sharding(len(shape)) == r_sh._to_xla_hlo_sharding(len(shape))
    actor_devs = set(plan.actor.devices.flat)
    assert set(t.transfer_sharding.mesh.devices.flat) <= actor_devs
    assert len(set(t.transfer_sharding.mesh.devices.flat)) == r_sh.mesh.devices.size  # distinct devices
    # the staged copy, viewed on the transfer mesh, holds at each device the slice the rollout device at the same
    # position receives: the data path of the cross-process device_put, checked on one process
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    staged = jax.device_put(x, t.staged_sharding)
    local = {s.device: s.data for s in staged.addressable_shards}
    view = jax.make_array_from_single_device_arrays(shape, t.transfer_sharding,
                                                    [local[d] for d in t.transfer_sharding.mesh.devices.flat])
    np.testing.assert_array_equal(np.asarray(view), x)
    out = jax.device_put(view, r_sh)
    np.testing.assert_array_equal(np.asarray(out), x)


def test_transfer_layout_the_actor_cannot_serve():
    devs = jax.devices()
    plan = build_mesh_plan("actor:fsdp=3/rollout:expert=2", devices=devs[:5])
    with pytest.raises(MeshSpecError, match="cannot express"):
        plan_transfer("layers/0/w", (6, 4), np.float32, NamedSharding(plan.actor, P("fsdp")),
                      NamedSharding(plan.rollout, P("expert")))
    plan = build_mesh_plan("actor:fsdp=2/rollout:expert=4", devices=devs[:6])
    with pytest.raises(MeshSpecError, match="more copies of a slice"):
        plan_transfer("norm", (8,), np.float32, NamedSharding(plan.actor, P()), NamedSharding(plan.rollout, P()))
