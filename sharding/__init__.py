"""Placement on devices, the ground layer (knows no model): logical axes, per-role rule tables, meshes.

    axes.py         logical axis names (the only place they are spelled)
    rules.py        ACTOR_RULES / ROLLOUT_RULES, param_shardings, use_rules / constrain
    mesh.py         mesh specs and MeshPlan (actor and rollout meshes)
    distributed.py  multi-process start-up (jax.distributed)
    coordination.py the coordination service in a sidecar process of its own (started by process 0)
    offload.py      which optimizer state lives in host memory (pinned_host)
    backends.py     backend start-up where the CUDA plugin is installed for deviceless compiles only

The names below are re-exported for convenience. Expert parallelism, the push and the planner live one layer up,
in `parallel/` (they need the model).
"""

from sharding.backends import quiet_cuda_plugin_without_driver
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
    "param_shardings",
    "parse_mesh_spec",
    "use_rules",
]

quiet_cuda_plugin_without_driver()  # before any backend starts: no cuDNN traceback on CPU machines (backends.py)
