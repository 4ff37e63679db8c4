"""The DeepSeek-V4 tiny model sharded on the 8 CPU devices equals the single-device model (fp32).

Config: `DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)`: a CSA layer
(m=4, indexer top-3 of 4 entries, sliding window 8 inside it; hash-routed MoE) and an HCA layer (m=8; top-k
MoE). tiny() minus its sliding-only layer, second CSA layer and MTP block, which keeps this file's six XLA
compiles affordable on two shared cores. Every tiny dim divides the meshes used (hidden 64, heads*head_dim 128,
o_groups*o_lora 32, vocab 256, experts 8, mlp 32).

* actor mesh `actor:fsdp=2,expert=2,tensor=2` (all 8 devices), actor rules: sharded init under
  `jax.jit(..., out_shardings=)` with transfer guards on (weights are born on the devices), parameter specs
  asserted; forward without EP; a donated training step (SGD) with the EP dispatch returning loss, logits,
  routing and gradients of the mean next-token NLL w.r.t. every nnx.Param.
* rollout mesh `rollout:expert=2,tensor=2` (devices 4-7 of `actor:fsdp=2,expert=2/rollout:expert=2,tensor=2`),
  rollout rules (no FSDP): forward with and without EP.
Logits must match to 1e-5 and routing ids exactly; gradient tolerance: see `test_train_step_matches_unsharded`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import dsv4
from sharding import axes as ax
from parallel.expert import make_ep_dispatch
from sharding.mesh import build_mesh_plan
from sharding.rules import activation_spec

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
B, S = 4, 16
LR = 0.1
TOL = dict(rtol=1e-5, atol=1e-5)
# LLVM -O0 for XLA:CPU: compiles ~2.5x faster on the shared cores; the HLO (and so every sharding) is unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _call(jitted, *args):
    """Lower, compile with FAST_COMPILE and run `jitted(*args)` (under the caller's mesh / rules context)."""
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _make():
    return dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0))


def _nll(params, rest, graphdef, ids, dispatch_fn):
    """Mean next-token NLL [] and (logits [B, S, V], routing [B, S, L, k])."""
    out = nnx.merge(graphdef, params, rest)(ids, dispatch_fn=dispatch_fn)
    logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))
    return nll, (out.logits, out.routing)


def _spec(state, path, sharding_tree=False):
    """PartitionSpec of the array at dotted `path` of an nnx.State (or of the NamedSharding in a sharding tree)."""
    node = state
    for key in path.split("."):
        node = node[int(key)] if key.isdigit() else node[key]
    value = node.get_value()
    return value.spec if sharding_tree else value.sharding.spec


@pytest.fixture(scope="module")
def setup():
    """Abstract model split into (graphdef, params, rest = buffers), host copy of the weights, input ids."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(_make), nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, jnp.int32)
    return graphdef, params, rest, ids


@pytest.fixture(scope="module")
def actor(setup):
    """Sharded init on the actor mesh: returns (plan, init fn, param shardings, rest shardings, params, rest)."""
    graphdef, aparams, arest, _ = setup
    plan = build_mesh_plan("actor:fsdp=2,expert=2,tensor=2", config=CFG)
    psh, rsh = plan.param_shardings("actor", aparams), plan.param_shardings("actor", arest)
    with jax.set_mesh(plan.actor):
        init = jax.jit(lambda: nnx.split(_make(), nnx.Param, ...)[1:], out_shardings=(psh, rsh)).lower().compile(
            compiler_options=FAST_COMPILE)
    with jax.transfer_guard("disallow"):  # weights never exist on the host
        params, rest = init()
    return plan, init, psh, rsh, params, rest


@pytest.fixture(scope="module")
def reference(setup, actor):
    """The same weights on one device (a host round trip, test only) and the unsharded loss/logits/grads."""
    graphdef, _, _, ids = setup
    params, rest = jax.device_get((actor[4], actor[5]))
    grad_fn = jax.jit(jax.value_and_grad(lambda p, r, i: _nll(p, r, graphdef, i, None), has_aux=True))
    (loss, (logits, routing)), grads = _call(grad_fn, params, rest, ids)
    return dict(params=params, rest=rest, loss=loss, logits=logits, routing=routing, grads=grads)


def test_sharded_init_param_specs(actor):
    plan, _, psh, _, params, rest = actor
    mesh = plan.actor
    expected = {
        "embed.weight": P("tensor", "fsdp"),
        "head.weight": P("tensor", "fsdp"),
        "layers.1.ffn.experts.w1": P("expert", "tensor", "fsdp"),
        "layers.1.ffn.experts.w2": P("expert", "fsdp", "tensor"),
        "layers.1.ffn.gate.weight": P("expert", "fsdp"),
        "layers.0.attn.indexer.weights_proj.weight": P(None, "fsdp"),
        "layers.1.attn.wq_b.weight": P("tensor", None),
        "layers.1.attn.wo_b.weight": P("fsdp", "tensor"),
        "layers.0.hc_attn_fn": P(None, None),
    }
    for path, spec in expected.items():
        assert _spec(params, path) == spec, path
        assert _spec(psh, path, sharding_tree=True) == spec, path
    assert _spec(rest, "layers.0.ffn.gate.tid2eid") == P("tensor", None)
    assert _spec(rest, "layers.1.ffn.gate.bias") == P("expert")
    leaf = params["layers"][1]["ffn"]["experts"]["w1"]
    assert leaf.logical_axes == (ax.EXPERT, ax.MLP, ax.EMBED)  # metadata survives the jit
    assert leaf.get_value().sharding.mesh == mesh
    # each device holds 1/8 of the experts' w1: 4 experts x 16 of 32 x 32 of 64
    assert leaf.get_value().addressable_shards[0].data.shape == (4, 16, 32)


def _ids_sharding(mesh, rules):
    return NamedSharding(mesh, activation_spec(ax.ACT_BATCH, ax.ACT_SEQ, rules=rules, mesh=mesh))


def _out_shardings(mesh, rules):
    logits = NamedSharding(mesh, activation_spec(ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB, rules=rules, mesh=mesh))
    routing = NamedSharding(mesh, activation_spec(ax.ACT_BATCH, None, None, None, rules=rules, mesh=mesh))
    return logits, routing


def _check_forward(logits, routing, ref, mesh, rules):
    lsh, rsh = _out_shardings(mesh, rules)
    assert logits.sharding.is_equivalent_to(lsh, 3) and routing.sharding.is_equivalent_to(rsh, 4)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref["logits"]), **TOL)
    np.testing.assert_array_equal(np.asarray(routing), np.asarray(ref["routing"]))


def test_actor_forward_without_ep(setup, actor, reference):
    graphdef, _, _, ids = setup
    plan, _, psh, rsh, params, rest = actor
    mesh, rules = plan.actor, plan.rules("actor")

    def forward(p, r, i):
        return _nll(p, r, graphdef, i, None)[1]

    fwd = jax.jit(forward, in_shardings=(psh, rsh, _ids_sharding(mesh, rules)),
                  out_shardings=_out_shardings(mesh, rules))
    with plan.activate("actor"):
        logits, routing = _call(fwd, params, rest, jax.device_put(ids, _ids_sharding(mesh, rules)))
    _check_forward(logits, routing, reference, mesh, rules)


def test_train_step_matches_unsharded(setup, actor, reference):
    """Donated SGD step with the EP dispatch: loss/logits/routing equal, gradients equal, update applied.

    Gradient tolerance: (1) the relative L2 error over all gradients is <= 1e-5; (2) per entry
    |g - g_ref| <= 1e-5 |g_ref| + 1e-5 G, G = the largest |g_ref| over all parameters. Why G and not each
    leaf's own scale: the sharded gradient is the same fp32 math with its sums split differently
    (reduce-scatter over fsdp, tensor-parallel partial sums, psum over token shards, EP scatter-add order), so
    its error is rounding of the *terms* summed, and some leaves are sums over all B*S tokens that cancel to far
    below their terms: `hc_head_{base,scale,fn}` gradients are ~5e-4 G and differ by 2.6e-5 of their own
    maximum, 7e-7 G (measured); every other leaf is within 7e-6 of its own maximum.
    """
    graphdef, _, _, ids = setup
    plan, init, psh, rsh, _, _ = actor
    mesh, rules = plan.actor, plan.rules("actor")
    with jax.set_mesh(mesh):
        params, rest = init()  # compiled already; a fresh copy: this step consumes (donates) its parameters
    ep = make_ep_dispatch(mesh, rules=rules)

    def step(p, r, i):
        (loss, (logits, routing)), g = jax.value_and_grad(
            lambda p_: _nll(p_, r, graphdef, i, ep), has_aux=True)(p)
        new = jax.tree.map(lambda w, gw: w - LR * gw, p, g)
        return new, g, loss, logits, routing

    scalar = NamedSharding(mesh, P())
    jstep = jax.jit(step, in_shardings=(psh, rsh, _ids_sharding(mesh, rules)),
                    out_shardings=(psh, psh, scalar, *_out_shardings(mesh, rules)), donate_argnums=0)
    w_before = np.asarray(params["layers"][1]["ffn"]["experts"]["w1"].get_value())
    with plan.activate("actor"):
        new, grads, loss, logits, routing = _call(jstep, params, rest, jax.device_put(ids, _ids_sharding(mesh, rules)))
    assert params["layers"][1]["ffn"]["experts"]["w1"].get_value().is_deleted()  # donated
    _check_forward(logits, routing, reference, mesh, rules)
    np.testing.assert_allclose(float(loss), float(reference["loss"]), **TOL)

    flat_ref = dict(nnx.to_flat_state(reference["grads"]))
    flat_got = dict(nnx.to_flat_state(grads))
    assert flat_got.keys() == flat_ref.keys()
    g_max = max(float(np.abs(np.asarray(v.get_value())).max()) for v in flat_ref.values())
    err2 = ref2 = 0.0
    for path, g in flat_got.items():
        r = np.asarray(flat_ref[path].get_value())
        g = g.get_value()
        assert g.sharding.spec == _spec(psh, ".".join(map(str, path)), sharding_tree=True), path  # param layout
        g = np.asarray(g)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * g_max, err_msg=str(path))
        err2, ref2 = err2 + float(np.sum((g - r) ** 2)), ref2 + float(np.sum(r**2))
    assert np.sqrt(err2 / ref2) <= 1e-5
    assert float(np.abs(np.asarray(flat_got[("layers", 1, "ffn", "experts", "w1")].get_value())).max()) > 0
    w_after = new["layers"][1]["ffn"]["experts"]["w1"].get_value()
    g_w1 = np.asarray(flat_ref[("layers", 1, "ffn", "experts", "w1")].get_value())
    np.testing.assert_allclose(np.asarray(w_after), w_before - LR * g_w1, **TOL)
    assert w_after.sharding.spec == P("expert", "tensor", "fsdp")


@pytest.mark.parametrize("use_ep", [False, True], ids=["ragged_local", "ep_capacity"])
def test_rollout_forward(setup, reference, use_ep):
    graphdef, aparams, arest, ids = setup
    plan = build_mesh_plan("actor:fsdp=2,expert=2/rollout:expert=2,tensor=2", config=CFG)
    mesh, rules = plan.rollout, plan.rules("rollout")
    psh, rsh = plan.param_shardings("rollout", aparams), plan.param_shardings("rollout", arest)
    params, rest = jax.device_put((reference["params"], reference["rest"]), (psh, rsh))
    assert _spec(params, "layers.1.ffn.experts.w1") == P("expert", "tensor", None)  # no FSDP on the rollout
    assert _spec(params, "embed.weight") == P("tensor", None)
    assert [d.id for d in mesh.devices.flat] == [4, 5, 6, 7]
    ep = make_ep_dispatch(mesh, rules=rules) if use_ep else None

    def forward(p, r, i):
        return _nll(p, r, graphdef, i, ep)[1]

    fwd = jax.jit(forward, in_shardings=(psh, rsh, _ids_sharding(mesh, rules)),
                  out_shardings=_out_shardings(mesh, rules))
    with plan.activate("rollout"):
        logits, routing = _call(fwd, params, rest, jax.device_put(ids, _ids_sharding(mesh, rules)))
    _check_forward(logits, routing, reference, mesh, rules)
