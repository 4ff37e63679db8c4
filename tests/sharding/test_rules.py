"""Tests for sharding/rules.py: the presets cover every logical axis, spec resolution (size-1 / absent axes
dropped, a mesh axis used once), parameter shardings with divisibility errors, and a small NNX model initialised
sharded (no host copy) and run on an actor mesh (fsdp=2, expert=2, tensor=2 on the 8 CPU devices) with
activation constraints, matching the unsharded forward."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding import axes as ax
from sharding.mesh import build_mesh_plan
from sharding.rules import (ACTOR_RULES, ROLLOUT_RULES, active_rules, activation_spec, check_rules, constrain,
                            logical_to_spec, param_shardings, rules_for, use_rules)

D, F, E, B = 16, 32, 4, 8


class TinyMoEMLP(nnx.Module):
    """x [B, D] -> dense MLP [D -> F -> D] + a softmax-weighted mix of E expert projections [E, D, F] -> [B, D]."""

    def __init__(self, rngs: nnx.Rngs):
        k1, k2, k3, k4 = (rngs.params() for _ in range(4))
        self.w1 = nnx.Param(jax.random.normal(k1, (D, F)) / 4, logical_axes=(ax.EMBED, ax.MLP))
        self.b1 = nnx.Param(jnp.zeros((F,)), logical_axes=(ax.MLP,))
        self.w2 = nnx.Param(jax.random.normal(k2, (F, D)) / 4, logical_axes=(ax.MLP, ax.EMBED))
        self.experts = nnx.Param(jax.random.normal(k3, (E, D, F)) / 4, logical_axes=(ax.EXPERT, ax.EMBED, ax.MLP))
        self.gate = nnx.Param(jax.random.normal(k4, (E, D)) / 4, logical_axes=(ax.EXPERT, ax.EMBED))
        self.scale = nnx.Param(jnp.full((D,), 1.5))  # no logical_axes: replicated

    def __call__(self, x_bd):
        x_bd = constrain(x_bd, (ax.ACT_BATCH, ax.ACT_EMBED))
        h_bf = jax.nn.gelu(x_bd @ self.w1[...] + self.b1[...])
        y_bd = h_bf @ self.w2[...]
        g_be = jax.nn.softmax(x_bd @ self.gate[...].T, axis=-1)
        u_bef = jnp.einsum("bd,edf->bef", x_bd, self.experts[...])
        u_bef = constrain(u_bef, (ax.ACT_BATCH, ax.ACT_EXPERT, None))  # expert already taken by act_batch
        y_bd = y_bd + jnp.einsum("be,bef,fd->bd", g_be, u_bef, self.w2[...])
        return constrain(y_bd * self.scale[...], (ax.ACT_BATCH, ax.ACT_EMBED))


def assert_sharded(arr, mesh, spec):
    """`arr` lives on `mesh` laid out as `spec` (trailing None entries do not matter)."""
    assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), (arr.sharding, spec)


@pytest.fixture(scope="module")
def actor_mesh():
    return build_mesh_plan("actor:fsdp=2,expert=2,tensor=2").actor


def test_presets_cover_all_axes():
    for role in ("actor", "rollout"):
        rules = rules_for(role)
        check_rules(rules)
        assert [name for name, _ in rules] == list(ax.ALL_AXES)
    assert rules_for("actor") is ACTOR_RULES and rules_for("rollout") is ROLLOUT_RULES
    # the rollout never splits weights over fsdp; only `embed` and the pipelined `layers` differ from the actor
    # among weights, and the rollout takes no context parallelism (a context axis is one more data axis of its batch)
    assert all("fsdp" not in np.atleast_1d(m) for n, m in ROLLOUT_RULES if n in ax.WEIGHT_AXES and m)
    assert [n for (n, a), (_, r) in zip(ACTOR_RULES, ROLLOUT_RULES) if a != r] == [ax.EMBED, ax.LAYERS, ax.ACT_BATCH,
                                                                                  ax.ACT_SEQ]
    assert dict(ACTOR_RULES)[ax.ACT_SEQ] == "context" and dict(ROLLOUT_RULES)[ax.ACT_SEQ] is None
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        rules_for("critic")


def test_check_rules_errors():
    with pytest.raises(ValueError, match=r"missing logical axes \['act_stage'\]"):
        check_rules(ACTOR_RULES[:-1])
    with pytest.raises(ValueError, match=r"duplicated logical axes \['vocab'\]"):
        check_rules(ACTOR_RULES + ((ax.VOCAB, None),))
    with pytest.raises(ValueError, match="unknown mesh axes"):
        check_rules(tuple((n, "pipe") if n == ax.MLP else (n, m) for n, m in ACTOR_RULES))


def test_logical_to_spec(actor_mesh):
    assert logical_to_spec((ax.EMBED, ax.MLP), ACTOR_RULES) == P(("fsdp", "context"), "tensor")  # FSDP x CP
    assert logical_to_spec((ax.EMBED, ax.MLP), ROLLOUT_RULES) == P(None, "tensor")
    assert logical_to_spec((ax.ACT_BATCH, None), ACTOR_RULES) == P(("data", "fsdp", "expert"), None)
    assert logical_to_spec((ax.LAYERS, ax.EMBED), ACTOR_RULES) == P("stage", ("fsdp", "context"))  # pipeline stages
    assert logical_to_spec((ax.ACT_STAGE, ax.ACT_BATCH), ACTOR_RULES) == P("stage", ("data", "fsdp", "expert"))
    # with a mesh: data (size 1) is dropped
    assert logical_to_spec((ax.ACT_BATCH, ax.ACT_SEQ), ACTOR_RULES, actor_mesh) == P(("fsdp", "expert"), None)
    # one mesh axis per spec: the first dim keeps it, later dims are replicated along it
    assert logical_to_spec((ax.HEADS, ax.MLP), ACTOR_RULES) == P("tensor", None)
    assert logical_to_spec((ax.ACT_BATCH, ax.ACT_EXPERT), ACTOR_RULES, actor_mesh) == P(("fsdp", "expert"), None)
    assert logical_to_spec((ax.ACT_EXPERT, ax.ACT_BATCH), ACTOR_RULES, actor_mesh) == P("expert", "fsdp")
    # absent from the rollout mesh -> dropped
    rollout = build_mesh_plan("actor:fsdp=4/rollout:expert=2,tensor=2").rollout
    assert logical_to_spec((ax.EXPERT, ax.EMBED, ax.MLP), ROLLOUT_RULES, rollout) == P("expert", None, "tensor")
    assert activation_spec(ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB, rules=ROLLOUT_RULES, mesh=rollout) == P(
        "expert", None, "tensor")
    with pytest.raises(ValueError, match="logical axis 'nope' has no rule"):
        logical_to_spec(("nope",), ACTOR_RULES)


def test_sharded_init_and_forward(actor_mesh):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TinyMoEMLP(nnx.Rngs(0))))
    shardings = param_shardings(abstract, actor_mesh, ACTOR_RULES)
    expected = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp"),
                "experts": P("expert", "fsdp", "tensor"), "gate": P("expert", "fsdp"), "scale": P()}
    assert {k: v.get_value().spec for k, v in shardings.items()} == expected

    init = jax.jit(lambda: nnx.state(TinyMoEMLP(nnx.Rngs(0))), out_shardings=shardings)
    with jax.transfer_guard("disallow"):  # created on the devices: no host copy of the weights
        state = init()
    for name, spec in expected.items():
        assert_sharded(state[name].get_value(), actor_mesh, spec)
        assert getattr(state[name], "logical_axes", None) == getattr(abstract[name], "logical_axes", None)

    x_bd = jax.random.normal(jax.random.key(1), (B, D))
    ref = TinyMoEMLP(nnx.Rngs(0))(x_bd)  # eager, unsharded, no rules context

    @jax.jit
    def forward(state, x_bd):
        return nnx.merge(graphdef, state)(x_bd)

    xs = jax.device_put(x_bd, NamedSharding(actor_mesh, activation_spec(ax.ACT_BATCH, ax.ACT_EMBED,
                                                                        rules=ACTOR_RULES, mesh=actor_mesh)))
    with jax.set_mesh(actor_mesh), use_rules(ACTOR_RULES, actor_mesh):
        y = forward(state, xs)
    assert_sharded(y, actor_mesh, P(("fsdp", "expert"), None))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)

    # the same abstract state on the rollout rules: no FSDP
    roll = param_shardings(abstract, actor_mesh, ROLLOUT_RULES)
    assert roll["w1"].get_value().spec == P(None, "tensor")
    assert roll["experts"].get_value().spec == P("expert", None, "tensor")


def test_param_shardings_errors(actor_mesh):
    bad = {"blocks": {"w": nnx.Param(jax.ShapeDtypeStruct((3, F), jnp.float32), logical_axes=(ax.EMBED, ax.MLP))}}
    with pytest.raises(ValueError) as e:
        param_shardings(bad, actor_mesh, ACTOR_RULES)
    assert "parameter blocks.w: dim 0 (logical 'embed') has size 3, not divisible by mesh axes fsdp=2" in str(e.value)
    wrong_rank = {"w": nnx.Param(jax.ShapeDtypeStruct((D,), jnp.float32), logical_axes=(ax.EMBED, ax.MLP))}
    with pytest.raises(ValueError, match=r"parameter w: logical_axes \('embed', 'mlp'\) has 2 entries"):
        param_shardings(wrong_rank, actor_mesh, ACTOR_RULES)
    # a bare array leaf is replicated
    out = param_shardings({"x": jax.ShapeDtypeStruct((D,), jnp.float32)}, actor_mesh, ACTOR_RULES)
    assert out["x"] == NamedSharding(actor_mesh, P())


def test_constrain_context(actor_mesh):
    x = jnp.ones((B, D))
    assert constrain(x, (ax.ACT_BATCH, ax.ACT_EMBED)) is x  # no context: identity
    assert active_rules() is None
    rollout = build_mesh_plan("actor:fsdp=4/rollout:expert=2,tensor=2").rollout
    with use_rules(ACTOR_RULES, actor_mesh):
        assert active_rules() == (ACTOR_RULES, actor_mesh)
        with use_rules(ROLLOUT_RULES, rollout):
            assert active_rules()[1] is rollout
            seen = []
            t = threading.Thread(target=lambda: seen.append(active_rules()))
            t.start()
            t.join()
            assert seen == [None]  # other threads do not inherit the context
        assert active_rules()[1] is actor_mesh
        with pytest.raises(ValueError, match="constrain: 1 logical axes"):
            constrain(x, (ax.ACT_BATCH,))
        y = jax.jit(lambda a: constrain(a * 2, (ax.ACT_BATCH, ax.ACT_EMBED)))(
            jax.device_put(x, NamedSharding(actor_mesh, P())))
        assert_sharded(y, actor_mesh, P(("fsdp", "expert"), None))
    assert active_rules() is None
