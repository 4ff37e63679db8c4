"""Actor -> rollout weight push (`parallel/push/local.py`) on 8 CPU devices.

Config: `DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)` (a hash-routed
layer with `tid2eid`, a top-k layer with the selection `bias`, CSA + indexer and HCA; the MTP block is left out to
keep the XLA compiles affordable on two shared cores). Every tiny dim divides the meshes used.

Plans: disjoint `actor:fsdp=2,expert=2/rollout:expert=2,tensor=2` (FP8 and BF16 samplers) and colocated
`actor:fsdp=2,expert=2`. The actor state is the randomised fp32 model (`tests/dsv4/randomize.py`, with hash tables
shifted so that they differ from the sampler's version 0) placed with the actor rules, as `Learner.params_for_push()`
returns it. References are computed independently: the host copy of the actor weights cast to bf16, quantised by a
single-device jit of `dsv4.quant.quantize_fp8_blockwise` (the numpy path of that function differs from every jitted
one by an ulp on some scales: XLA rewrites `amax / 448` as `amax * (1/448)`).

Transfer guards around every push: `jax.transfer_guard("disallow")` (implicit transfers),
`transfer_guard_host_to_device("disallow_explicit")` (on CPU the only guard that sees a host round trip inside a
cross-mesh device_put) and `transfer_guard_device_to_host("disallow")` (never fires on CPU, see
parallel/push/transfer.py; kept for GPU runs); unverified pushes run under device-to-host "disallow_explicit".
"""

import gc
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import monitoring
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dsv4
from dsv4 import quant
from rl.rollout.engine import Sampler, SamplingParams
from parallel.push import transfer as transfer_lib
from sharding.mesh import build_mesh_plan
from parallel.push.local import WeightPusher
from parallel.push.protocol import Pusher, PushVerificationError

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import randomize  # noqa: E402

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
DISJOINT = "actor:fsdp=2,expert=2/rollout:expert=2,tensor=2"
COLOCATED = "actor:fsdp=2,expert=2"
CHUNK = 32 * 1024  # small chunks, so the tiny model travels in several
_COMPILES = [0]


def _count_compile(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


monitoring.register_event_duration_secs_listener(_count_compile)


def _actor_state(plan, seed):
    """Randomised fp32 model state (Params + Buffers) placed on the actor mesh with the actor rules."""
    model = randomize(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), seed=seed, scale=0.1)
    for layer in model.layers:
        gate = layer.ffn.gate
        if hasattr(gate, "tid2eid"):  # differ from the sampler's version-0 tables (same init), stay a valid table
            gate.tid2eid.set_value((gate.tid2eid.get_value() + 3) % CFG.n_routed_experts)
    state = nnx.state(model)
    return jax.device_put(state, plan.param_shardings("actor", state))


def _flat(state):
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def _guarded_push(pusher, state, sampler, version, verify=True):
    d2h = "disallow" if verify else "disallow_explicit"  # verification reads its verdict: one explicit device_get
    with (jax.transfer_guard("disallow"), jax.transfer_guard_host_to_device("disallow_explicit"),
          jax.transfer_guard_device_to_host(d2h)):
        return pusher.push(state, version, verify=verify)


def _quantize_ref(x_bf16, fmt, block):
    fn = jax.jit(lambda x: quant.quantize_fp8_blockwise(x.astype(jnp.float32), fmt=fmt, block=block))
    return jax.device_get(fn(jnp.asarray(x_bf16)))


def _assert_exact(sampler, actor_flat):
    """Every rollout tensor equals the independent reference bitwise and sits in the sampler's sharding."""
    shardings = sampler.rollout_shardings()
    n_fp8 = 0
    for k, w in sampler.weight_state().items():
        a = np.asarray(jax.device_get(actor_flat[k]))
        if isinstance(w, quant.QuantizedTensor):
            n_fp8 += 1
            q_ref, s_ref = _quantize_ref(a.astype(jnp.bfloat16), w.fmt, w.block)
            np.testing.assert_array_equal(np.asarray(w.q).view(np.uint8), np.asarray(q_ref).view(np.uint8), err_msg=k)
            np.testing.assert_array_equal(np.asarray(w.scale).view(np.uint32), np.asarray(s_ref).view(np.uint32),
                                          err_msg=k)
            assert w.q.sharding == shardings[k], k
        else:
            ref = a.astype(w.dtype)
            if np.issubdtype(a.dtype, np.integer):
                assert w.dtype == a.dtype, k
            np.testing.assert_array_equal(np.asarray(w).view(np.uint8), ref.view(np.uint8), err_msg=k)
            assert w.sharding == shardings[k], k
    return n_fp8


@pytest.fixture(scope="module")
def disjoint():
    """(plan, actor state, fp8 sampler at version 0, its version-0 weights on the host, warmed pusher)."""
    plan = build_mesh_plan(DISJOINT, config=CFG)
    state = _actor_state(plan, seed=3)
    sampler = Sampler(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(1)), mesh=plan.rollout, weights="fp8",
                      max_prompt_len=16, kv_cache_dtype="bf16")
    v0 = jax.device_get({k: v for k, v in sampler.weight_state().items() if not isinstance(v, quant.QuantizedTensor)})
    pusher = WeightPusher(plan, sampler, state, chunk_bytes=CHUNK)
    return plan, state, sampler, v0, pusher


def test_disjoint_fp8_push_is_exact(disjoint):
    plan, state, sampler, _, pusher = disjoint
    stats = _guarded_push(pusher, state, sampler, version=1)
    assert sampler.weight_version == 1 and stats.version == 1 and stats.verified and not stats.colocated
    flat = _flat(state)
    assert _assert_exact(sampler, flat) > 10
    # bytes on the wire: FP8 tensors quantised on the actor cross as fp8 q + f32 scales (bf16 when quantised on
    # arrival); bf16-stored tensors bf16, f32 for mHC / sinks / ape / bias, int32 tables
    assert pusher.quantize_on == "actor"
    ws = sampler.weight_state()
    wire = {k: (w.q.size + 4 * w.scale.size if isinstance(w, quant.QuantizedTensor) else w.size * w.dtype.itemsize)
            for k, w in ws.items()}
    assert stats.bytes == sum(wire.values()) and stats.n_params == sum(flat[k].size for k in flat)
    assert stats.wire_bytes_per_param < 1.8  # bf16 on the wire for the FP8 tensors would be about 2.2 here
    assert stats.n_chunks == len(pusher.chunks) > 1 and stats.n_tensors == len(flat)
    assert set(stats.metrics()) == {"perf/weight_push_s", "perf/weight_push_gbps"} and stats.gbps > 0
    assert isinstance(pusher, Pusher)


def test_hash_tables_and_bias_arrive(disjoint):
    plan, state, sampler, v0, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)
    flat, ws = _flat(state), sampler.weight_state()
    tables = [k for k in flat if k.endswith("gate/tid2eid")]
    biases = [k for k in flat if k.endswith("gate/bias")]
    assert tables and biases
    for k in tables + biases:
        got, want = np.asarray(ws[k]), np.asarray(flat[k])
        assert got.dtype == want.dtype  # int32 tables, f32 bias (never rounded to bf16: it decides the routing)
        np.testing.assert_array_equal(got, want, err_msg=k)
        assert np.count_nonzero(got) > 0, k
        assert not np.array_equal(got, v0[k]), f"{k} still holds the sampler's version-0 value"


def test_no_recompiles_and_flat_memory_over_five_pushes(disjoint):
    plan, state, sampler, _, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)  # both paths ran in the warm-up
    gc.collect()
    live0 = sum(x.nbytes for x in jax.live_arrays())
    compiles0, cache0 = _COMPILES[0], transfer_lib.cast_reshard._cache_size()
    for i in range(5):
        verify = i % 2 == 0
        stats = _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1, verify=verify)
        assert stats.verified == verify
    gc.collect()
    assert _COMPILES[0] == compiles0, "a push after the warm-up compiled something"
    assert transfer_lib.cast_reshard._cache_size() == cache0
    assert sum(x.nbytes for x in jax.live_arrays()) == live0, "live device memory grew over 5 pushes"


def test_verify_every_schedule(disjoint):
    plan, state, sampler, _, pusher = disjoint
    pusher.verify_every, pusher.n_pushes = 3, 0
    try:
        got = [pusher.push(state, sampler.weight_version + 1).verified for _ in range(4)]
    finally:
        pusher.verify_every = 1
    assert got == [True, False, False, True]


def _replace(flat, key, fn):
    x = flat[key]
    with jax.set_mesh(x.sharding.mesh):
        return {**flat, key: jax.jit(fn, out_shardings=x.sharding)(x)}


def test_corrupted_push_is_rejected_and_old_version_kept(disjoint):
    plan, state, sampler, _, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)
    live_version, live_state = sampler.weight_version, sampler.weight_state()
    flat = _flat(state)
    fp8_key, f32_key = "layers/1/attn/wq_a/weight", "layers/0/hc_attn_fn"
    bad = _replace(_replace(flat, fp8_key, lambda x: x.at[0, 1].set(jnp.nan)), f32_key,
                   lambda x: x.at[2, 3].set(jnp.inf))
    with pytest.raises(PushVerificationError) as err:
        _guarded_push(pusher, bad, sampler, version=live_version + 1)
    named = {k for k, _ in err.value.failures}
    assert named == {fp8_key, f32_key}, err.value.failures
    assert fp8_key in str(err.value) and "NaN/inf" in str(err.value)
    assert sampler.weight_version == live_version and sampler.weight_state() is live_state
    assert not any(x.is_deleted() for x in jax.tree.leaves(live_state))

    zero_key = "layers/0/ffn/gate/tid2eid"
    with pytest.raises(PushVerificationError, match="all zero") as err:
        _guarded_push(pusher, _replace(flat, zero_key, jnp.zeros_like), sampler, version=live_version + 1)
    assert {k for k, _ in err.value.failures} == {zero_key}
    assert sampler.weight_version == live_version


def _flip_sign(x, index):
    """x with the sign bit of element `index` flipped (any float dtype; never makes a NaN), same sharding."""
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    sign = np.array(1 << (8 * x.dtype.itemsize - 1)).astype(width)

    def fn(a):
        u = jax.lax.bitcast_convert_type(a, width)
        return jax.lax.bitcast_convert_type(u.at[index].set(u[index] ^ sign), a.dtype)

    with jax.set_mesh(x.sharding.mesh):
        return jax.jit(fn, out_shardings=x.sharding)(x)


def test_corruption_in_transit_is_caught_by_the_slabbed_checksums(disjoint, monkeypatch):
    """One element changed on the wire (the last element: the last slab of the rollout-side digest loop) of a
    bf16 tensor and of an FP8 q fails verification as a checksum mismatch; the old version stays live."""
    plan, state, sampler, _, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)
    live_version, live_state = sampler.weight_version, sampler.weight_state()
    keys = {"embed/weight": 0, "layers/1/attn/wq_b/weight": 0}  # key -> which wire array (0: dense / q)
    slabbed = {t.key: t.slabs(pusher.slab_elems)[0] for t in pusher.tensors if t.key in keys}
    assert all(sl is not None for sl in slabbed.values()), slabbed  # both digests run as slab loops
    move = pusher._transfer_chunk

    def corrupting(chunk, staged):
        landed = move(chunk, staged)
        for k, i in keys.items():
            if k in landed:
                arrays = list(landed[k])
                arrays[i] = _flip_sign(arrays[i], tuple(d - 1 for d in arrays[i].shape))
                landed[k] = tuple(arrays)
        return landed

    monkeypatch.setattr(pusher, "_transfer_chunk", corrupting)
    with pytest.raises(PushVerificationError, match="checksum mismatch") as err:
        _guarded_push(pusher, state, sampler, version=live_version + 1)
    assert {k for k, _ in err.value.failures} == set(keys), err.value.failures
    assert sampler.weight_version == live_version and sampler.weight_state() is live_state


def test_key_set_and_version_errors(disjoint):
    plan, state, sampler, _, pusher = disjoint
    flat = _flat(state)
    missing = {k: v for k, v in flat.items() if not k.endswith("tid2eid")}
    with pytest.raises(ValueError, match="1 missing.*layers/0/ffn/gate/tid2eid"):
        pusher.push(missing, sampler.weight_version + 1)
    with pytest.raises(ValueError, match="1 unexpected.*extra/table"):
        pusher.push({**flat, "extra/table": flat["layers/0/ffn/gate/tid2eid"]}, sampler.weight_version + 1)
    with pytest.raises(ValueError, match="must exceed"):
        pusher.push(flat, sampler.weight_version)
    # PRNG keys are not weights: dropped, not an unexpected key (the sampler seeds its own randomness)
    stats = pusher.push({**flat, "rngs/default/key": jax.random.key(0)}, sampler.weight_version + 1)
    assert stats.n_tensors == len(flat)
    wrong = {**flat, "embed/weight": jax.device_put(flat["embed/weight"], NamedSharding(plan.actor, P()))}
    with pytest.raises(ValueError, match="embed/weight has sharding"):
        pusher.push(wrong, sampler.weight_version + 1)


def test_generate_after_push_uses_new_version(disjoint):
    plan, state, sampler, _, pusher = disjoint
    version = sampler.weight_version + 1
    _guarded_push(pusher, state, sampler, version=version)
    batch = sampler.generate([[5, 6, 7], [9, 10]], SamplingParams(temperature=1.0, max_new_tokens=4), seed=0)
    assert batch.weight_version == version and batch.tokens.shape == (2, 4)


def test_colocated_fp8_push_is_exact():
    plan = build_mesh_plan(COLOCATED, config=CFG)
    assert plan.colocated
    state = _actor_state(plan, seed=4)
    sampler = Sampler(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(1)), mesh=plan.rollout, weights="fp8",
                      max_prompt_len=16, kv_cache_dtype="bf16")
    pusher = WeightPusher(plan, sampler, state, chunk_bytes=CHUNK)
    stats = _guarded_push(pusher, state, sampler, version=1)
    assert stats.colocated and sampler.weight_version == 1
    flat = _flat(state)
    assert _assert_exact(sampler, flat) > 10
    # the rollout holds its own buffers: the learner may donate (and so delete) its params after the push
    jax.tree.map(lambda x: x.delete(), state)
    assert not any(x.is_deleted() for x in jax.tree.leaves(sampler.weight_state()))


def test_bf16_rollout_equals_bf16_actor(disjoint):
    plan, state, _, _, _ = disjoint
    sampler = Sampler(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(1)), mesh=plan.rollout, weights="bf16",
                      max_prompt_len=16)
    pusher = WeightPusher(plan, sampler, state, chunk_bytes=CHUNK)
    _guarded_push(pusher, state, sampler, version=1)
    ws = sampler.weight_state()
    assert not any(isinstance(w, quant.QuantizedTensor) for w in ws.values())
    assert sum(w.dtype == jnp.bfloat16 for w in ws.values()) > 20
    _assert_exact(sampler, _flat(state))


def test_transfer_layout_when_the_actor_cannot_express_the_rollout_split():
    """actor fsdp=2 cannot cut [E, I, D] into the rollout's (expert=2) x (tensor=2) pieces: the push lands
    (2, 1, 1) pieces device to device and reshards on the rollout mesh. No host round trip either way."""
    plan = build_mesh_plan("actor:fsdp=2/rollout:expert=2,tensor=2", config=CFG)
    shape = (8, 32, 64)
    actor_sh = NamedSharding(plan.actor, P(None, None, "fsdp"))
    rollout_sh = NamedSharding(plan.rollout, P("expert", "tensor", None))
    transfer, landing = transfer_lib.transfer_layout(actor_sh, rollout_sh, 3)
    assert transfer_lib.dim_splits(transfer, 3) == transfer_lib.dim_splits(landing, 3) == (2, 1, 1)
    x = jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape), actor_sh)
    with jax.set_mesh(plan.actor):
        y = transfer_lib.cast_reshard(x, np.dtype(jnp.bfloat16), transfer)
    with jax.transfer_guard("disallow"), jax.transfer_guard_host_to_device("disallow_explicit"):
        landed = jax.device_put(y, landing)
        with jax.set_mesh(plan.rollout):
            out = transfer_lib.cast_reshard(landed, np.dtype(jnp.bfloat16), rollout_sh)
    assert out.sharding.is_equivalent_to(rollout_sh, 3)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x).astype(jnp.bfloat16))
    # and a tiling mismatch without the transfer layout does go through the host (why the layout exists)
    with pytest.raises(Exception, match="host-to-device"):
        with jax.transfer_guard_host_to_device("disallow_explicit"):
            jax.device_put(x, rollout_sh).block_until_ready()


def test_fresh_sampler_from_learner_params_equals_pushed(disjoint):
    """Issue 15 class 2: one function builds rollout weights (`Sampler.quantize_weights` ->
    `quant.quantize_rollout_fp8`): a sampler built fresh from the learner's fp32 params (version 0 of a run,
    a resumed run, a rebuilt rollout) holds bitwise the FP8 state a push of the same params produces, and
    samples the same greedy tokens."""
    plan, state, sampler, _, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)
    model = dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(1))
    nnx.update(model, jax.device_get(state))
    fresh = Sampler(model, mesh=plan.rollout, weights="fp8", max_prompt_len=16, kv_cache_dtype="bf16")
    pushed, built = sampler.weight_state(), fresh.weight_state()
    assert pushed.keys() == built.keys()
    for k, w in pushed.items():
        if isinstance(w, quant.QuantizedTensor):
            np.testing.assert_array_equal(np.asarray(built[k].q).view(np.uint8), np.asarray(w.q).view(np.uint8),
                                          err_msg=k)
            np.testing.assert_array_equal(np.asarray(built[k].scale).view(np.uint32),
                                          np.asarray(w.scale).view(np.uint32), err_msg=k)
        else:
            np.testing.assert_array_equal(np.asarray(built[k]).view(np.uint8), np.asarray(w).view(np.uint8),
                                          err_msg=k)
    rs = np.random.RandomState(11)
    prompts = [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in (3, 7, 5, 9, 4, 6, 8, 2)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    a, b = sampler.generate(prompts, sp, seed=0), fresh.generate(prompts, sp, seed=0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


def _device_bytes(tree, device):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def test_push_memory_bound_from_compiled_programs(disjoint):
    """The rollout side of a push holds at most the live and the new quantised state plus one chunk: from the
    layouts and XLA's memory_analysis() of every compiled rollout-side program of the push (`WeightPusher.memory`)."""
    plan, state, sampler, _, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)
    m = pusher.memory()
    dev = plan.rollout.devices.flat[0]
    assert m.state == _device_bytes(sampler.weight_state(), dev)  # the layouts' figure is what is stored
    assert m.peak == 2 * m.state + m.chunk <= 2 * m.state + m.chunk_wire, m
    assert m.peak_verified == 2 * m.state + max(m.chunk, m.check)
    # never a bf16 copy of the model on the rollout: what a push adds is far below one (bf16 of the FP8 tensors)
    bf16_fp8 = sum(2 * w.q.addressable_data(0).size for w in sampler.weight_state().values()
                   if isinstance(w, quant.QuantizedTensor))
    assert m.chunk < bf16_fp8 / 2, (m, bf16_fp8)
    assert m.check < m.state / 2, m  # verification: the largest tensor's digest temporaries, not a model copy
    # a verified push fits the same bound: its digests loop over slabs of 1/32 of a chunk
    assert m.peak_verified <= 2 * m.state + m.chunk_wire, m
    assert m.actor_chunk > 0


def test_ten_pushes_add_no_live_buffers(disjoint):
    plan, state, sampler, _, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)
    gc.collect()
    n0 = len(jax.live_arrays())
    for i in range(10):
        _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1, verify=i % 3 == 0)
    gc.collect()
    assert len(jax.live_arrays()) == n0, "a push left live buffers behind"


def test_quantize_on_arrival_equals_actor_side_and_direct_quantisation(disjoint):
    """quantize_on="rollout" (bf16 on the wire, quantised chunk by chunk on arrival) and the default actor-side
    quantisation store bitwise the state `Sampler.quantize_weights` makes from the actor's params directly, hash
    tables and biases included; the actor side moves fewer bytes."""
    plan, state, sampler, _, pusher = disjoint
    _guarded_push(pusher, state, sampler, version=sampler.weight_version + 1)
    by_actor = jax.device_get(sampler.weight_state())
    arrival = WeightPusher(plan, sampler, state, chunk_bytes=CHUNK, quantize_on="rollout")
    stats = _guarded_push(arrival, state, sampler, version=sampler.weight_version + 1)
    assert stats.quantize_on == "rollout" and stats.verified
    assert pusher.wire_bytes < 0.75 * arrival.wire_bytes
    by_arrival = jax.device_get(sampler.weight_state())
    flat = _flat(state)
    shardings = sampler.rollout_shardings()
    direct = jax.device_get(sampler.quantize_weights({k: jax.device_put(v, shardings[k]) for k, v in flat.items()}))
    for k, want in direct.items():
        for got in (by_actor[k], by_arrival[k]):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert a.dtype == b.dtype, k
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=k)
    m = arrival.memory()
    assert m.state == pusher.memory().state
    # bad corrupted input is caught on arrival as well
    bad = _replace(flat, "layers/1/attn/wq_a/weight", lambda x: x.at[0, 1].set(jnp.nan))
    with pytest.raises(PushVerificationError, match="NaN/inf"):
        _guarded_push(arrival, bad, sampler, version=sampler.weight_version + 1)
    with pytest.raises(ValueError, match="quantize_on"):
        WeightPusher(plan, sampler, state, quantize_on="host", warmup=False)


def test_sampler_and_push_take_explicit_axis_meshes(disjoint):
    """Meshes with Explicit axes (what `jax.make_mesh` gives by default) are accepted by the Sampler and the
    WeightPusher: both work on the Auto mesh of the same devices (`sharding.mesh.auto_axes`), and the push is
    exact and the sampler generates, as on the plan's meshes."""
    plan, state, _, _, _ = disjoint
    explicit = [jax.sharding.Mesh(m.devices, m.axis_names,
                                  axis_types=(jax.sharding.AxisType.Explicit,) * len(m.axis_names))
                for m in (plan.actor, plan.rollout)]
    sampler = Sampler(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(1)), mesh=explicit[1], weights="fp8",
                      max_prompt_len=16, kv_cache_dtype="bf16")
    assert sampler.mesh == plan.rollout
    pusher = WeightPusher(tuple(explicit), sampler, state, chunk_bytes=CHUNK)
    _guarded_push(pusher, state, sampler, version=1)
    assert _assert_exact(sampler, _flat(state)) > 10
    batch = sampler.generate([[5, 6, 7], [9, 10]], SamplingParams(temperature=1.0, max_new_tokens=4), seed=0)
    assert batch.weight_version == 1 and batch.tokens.shape == (2, 4)
