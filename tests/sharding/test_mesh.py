"""Tests for sharding/mesh.py: spec grammar, every error message, `auto`, colocation, device disjointness, and
the table-driven divisibility check against a duck-typed model config (8 forced CPU devices)."""

from types import SimpleNamespace

import jax
import pytest
from jax.sharding import AxisType

from sharding import axes as ax
from sharding.mesh import (DIM_SOURCES, MeshSpec, MeshSpecError, auto_mesh_spec, build_job_plan, build_mesh_plan,
                           divisibility_problems, parse_mesh_spec)
from sharding.rules import MESH_AXES

# Small model dims (like DSV4Config.tiny()).
CFG = SimpleNamespace(n_routed_experts=8, num_attention_heads=4, hidden_size=64, moe_intermediate_size=32,
                      o_groups=2, vocab_size=256, q_lora_rank=32, index_n_heads=16, head_dim=32)


def test_parse_two_roles():
    s = parse_mesh_spec(" actor:fsdp=2, expert=2 / rollout:expert=2,tensor=2 ")
    assert s.actor == {"stage": 1, "data": 1, "fsdp": 2, "context": 1, "expert": 2, "tensor": 1}
    assert s.shape("rollout") == (1, 1, 1, 1, 2, 2)
    assert not s.colocated and s.n_devices == 8
    assert str(s) == "actor:fsdp=2,expert=2/rollout:expert=2,tensor=2"
    assert parse_mesh_spec(str(s)) == s


def test_parse_colocated():
    s = parse_mesh_spec("actor:data=2,tensor=4")
    assert s.colocated and s.rollout is None and s.n_devices == 8
    assert s.axes("rollout") == s.axes("actor") == {"stage": 1, "data": 2, "fsdp": 1, "context": 1, "expert": 1,
                                                    "tensor": 4}


@pytest.mark.parametrize("n, text", [
    (1, "actor:data=1"),
    (2, "actor:data=1/rollout:data=1"),
    (4, "actor:expert=2/rollout:expert=2"),
    (6, "actor:fsdp=2,expert=2/rollout:expert=2"),
    (8, "actor:fsdp=2,expert=2/rollout:expert=2,tensor=2"),
    (16, "actor:fsdp=2,expert=4/rollout:expert=4,tensor=2"),
    (256, "actor:fsdp=8,expert=16/rollout:expert=16,tensor=8"),
])
def test_auto_rule(n, text):
    assert str(auto_mesh_spec(n)) == text
    assert str(parse_mesh_spec("auto", n_devices=n)) == text
    assert auto_mesh_spec(n).n_devices <= n


def test_auto_uses_present_devices():
    plan = build_mesh_plan("auto")
    assert str(plan.spec) == "actor:fsdp=2,expert=2/rollout:expert=2,tensor=2"
    assert plan.actor.size + plan.rollout.size == jax.device_count() == 8


@pytest.mark.parametrize("spec, msg", [
    ("", "mesh spec is empty"),
    ("   ", "mesh spec is empty"),
    ("trainer:fsdp=2", "unknown role 'trainer'"),
    ("actor:fsdp=2/sampler:tensor=2", "unknown role 'sampler'"),
    ("actor:fdsp=2", "unknown axis 'fdsp' in role actor"),
    ("actor:fsdp=two", "size 'two' of actor:fsdp is not an integer"),
    ("actor:fsdp=2.5", "size '2.5' of actor:fsdp is not an integer"),
    ("actor:fsdp=0", "size 0 of actor:fsdp must be >= 1"),
    ("actor:fsdp=-2", "size -2 of actor:fsdp must be >= 1"),
    ("actor:fsdp=2,fsdp=2", "axis 'fsdp' given twice in role actor"),
    ("actor:fsdp=2/actor:tensor=2", "role actor given twice"),
    ("rollout:tensor=2", "'rollout:' given without 'actor:'"),
    ("actor:fsdp2", "axis entry 'fsdp2' of role actor is not AXIS=SIZE"),
    ("actor:", "role actor has no axes"),
    ("fsdp=2", "section 'fsdp=2' has no ':'"),
    ("actor:fsdp=2/", "empty role section"),
])
def test_invalid_specs(spec, msg):
    with pytest.raises(MeshSpecError) as e:
        parse_mesh_spec(spec)
    assert msg in str(e.value)
    assert isinstance(e.value, ValueError)


def test_too_many_devices():
    with pytest.raises(MeshSpecError, match="actor needs 8 devices and rollout 4, but only 8 are present"):
        build_mesh_plan("actor:fsdp=8/rollout:tensor=4")
    with pytest.raises(MeshSpecError, match=r"actor \(colocated with rollout\) needs 16 devices, but only 8"):
        build_mesh_plan("actor:fsdp=16")
    with pytest.raises(MeshSpecError, match="unknown axis 'pipeline'"):
        MeshSpec(actor={"pipeline": 2})


def test_plan_disjoint_and_auto_axes():
    devs = jax.devices()
    plan = build_mesh_plan("actor:fsdp=2,expert=2/rollout:expert=2,tensor=2", devices=devs)
    assert not plan.colocated
    assert plan.actor.axis_names == plan.rollout.axis_names == MESH_AXES
    assert plan.actor.axis_types == (AxisType.Auto,) * len(MESH_AXES)
    assert dict(plan.actor.shape) == {"stage": 1, "data": 1, "fsdp": 2, "context": 1, "expert": 2, "tensor": 1}
    assert dict(plan.rollout.shape) == {"stage": 1, "data": 1, "fsdp": 1, "context": 1, "expert": 2, "tensor": 2}
    actor_ids = [d.id for d in plan.actor.devices.flat]
    rollout_ids = [d.id for d in plan.rollout.devices.flat]
    assert actor_ids == [d.id for d in devs[:4]] and rollout_ids == [d.id for d in devs[4:]]
    assert not set(actor_ids) & set(rollout_ids)
    assert "rollout: data=1 fsdp=1 expert=2 tensor=2" in plan.describe()
    assert hash(plan) == hash(build_mesh_plan(str(plan.spec)))  # usable as a static jit argument


def test_plan_leftover_devices_and_colocated():
    plan = build_mesh_plan("actor:fsdp=2/rollout:tensor=2")
    assert plan.actor.size == 2 and plan.rollout.size == 2  # devices 4..7 unused
    plan = build_mesh_plan("actor:fsdp=2,tensor=2")
    assert plan.colocated and plan.rollout is plan.actor
    assert plan.mesh("rollout") is plan.mesh("actor")
    assert plan.rules("rollout") != plan.rules("actor")


def test_divisibility_table_covers_every_axis():
    assert set(DIM_SOURCES) == set(ax.ALL_AXES)
    for source in DIM_SOURCES.values():
        assert source is None or hasattr(CFG, source[0])


def test_divisibility_ok():
    spec = parse_mesh_spec("actor:fsdp=2,expert=2/rollout:expert=2,tensor=2")
    assert spec.validate(8, CFG) is None  # no MeshSpecError
    for role in ("actor", "rollout"):  # every sharded config dim divides: no problem reported
        assert divisibility_problems(role, spec.axes(role), CFG) == []
    plan = build_mesh_plan("auto", config=CFG)
    assert plan.actor.size + plan.rollout.size == 8 and not plan.colocated
    assert str(plan.spec) == str(auto_mesh_spec(8))


def test_divisibility_errors():
    with pytest.raises(MeshSpecError) as e:
        parse_mesh_spec("actor:expert=3/rollout:tensor=2").validate(8, CFG)
    assert ("mesh actor: expert=3 does not divide n_routed_experts=8 (parameter layers.*.ffn.experts.w1, dim 0)"
            in str(e.value))
    with pytest.raises(MeshSpecError) as e:
        build_mesh_plan("actor:fsdp=2/rollout:tensor=4", config=CFG)
    msg = str(e.value)
    assert "mesh rollout: tensor=4 does not divide o_groups=2 (parameter layers.*.attn.wo_a.weight, dim 0)" in msg
    assert "mesh rollout: tensor=4 does not divide num_attention_heads=4" not in msg  # 4 | 4
    # hidden_size 64 is split over fsdp on the actor only (the rollout has no FSDP)
    with pytest.raises(MeshSpecError) as e:
        parse_mesh_spec("actor:fsdp=3/rollout:data=3").validate(8, CFG)
    assert "mesh actor: fsdp=3 does not divide hidden_size=64 (parameter embed.weight, dim 1)" in str(e.value)
    assert "mesh rollout" not in str(e.value)


def test_divisibility_needs_config_fields():
    with pytest.raises(MeshSpecError, match="has no attribute 'n_routed_experts'"):
        parse_mesh_spec("actor:expert=2").validate(8, SimpleNamespace())


def test_job_plan_own_role_and_stand_in():
    """The two-job layout (sharding.mesh.build_job_plan): each job's own mesh on its devices, the other role's a
    stand-in of its shape over the same devices; a colocated spec or too few devices is refused."""
    devs = jax.devices()[:4]
    actor = build_job_plan("actor:fsdp=4/rollout:expert=2", "actor", devs)
    assert dict(actor.actor.shape)["fsdp"] == 4 and dict(actor.rollout.shape)["expert"] == 2
    assert list(actor.rollout.devices.flat) == devs[:2] and not actor.colocated  # the stand-in: actor devices
    rollout = build_job_plan("actor:fsdp=4/rollout:expert=2", "rollout", devs[:2])
    assert dict(rollout.rollout.shape)["expert"] == 2 and list(rollout.rollout.devices.flat) == devs[:2]
    with pytest.raises(MeshSpecError, match="needs a rollout section"):
        build_job_plan("actor:fsdp=2", "actor", devs)
    with pytest.raises(MeshSpecError, match="the actor at least as many as the rollout"):
        build_job_plan("actor:fsdp=1/rollout:expert=2", "actor", devs[:1])
