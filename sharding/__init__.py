"""Placement of the model on devices: logical axes, per-role rule tables, meshes, expert parallelism, planning.

    axes.py         logical axis names (the only place they are spelled)
    rules.py        ACTOR_RULES / ROLLOUT_RULES, param_shardings, use_rules / constrain
    mesh.py         mesh specs and MeshPlan (actor and rollout meshes)
    distributed.py  multi-process start-up (jax.distributed)
    expert.py       expert-parallel MoE dispatch (shard_map all-to-all): make_ep_dispatch
    plan.py         memory planner (`python -m sharding.plan`): plan(...) -> PlanReport

The names below are re-exported for convenience; `sharding.plan` stays a module (import its `plan` from there).
"""

from sharding.expert import make_ep_dispatch
from sharding.mesh import MeshPlan, MeshSpec, MeshSpecError, build_mesh_plan, parse_mesh_spec
from sharding.rules import ACTOR_RULES, ROLLOUT_RULES, constrain, param_shardings, use_rules

__all__ = [
    "ACTOR_RULES",
    "ROLLOUT_RULES",
    "MeshPlan",
    "MeshSpec",
    "MeshSpecError",
    "build_mesh_plan",
    "constrain",
    "make_ep_dispatch",
    "param_shardings",
    "parse_mesh_spec",
    "use_rules",
]
