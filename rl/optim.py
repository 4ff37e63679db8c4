"""Mixed-precision optimizer state (Megatron-style "distributed optimizer" split, without the distribution: that
is the sharding of the state, sharding/rules.py): low-precision params and grads on the device, fp32 masters and
fp32 Adam moments in the optimizer, optionally in host memory (`sharding.offload`).

`MasterState(master, inner)`: `master` maps the '/'-joined path of every *trained* parameter whose dtype is not
float32 (bf16 with `LearnerConfig.param_dtype="bfloat16"`) to its fp32 master [same shape]; `inner` is the optax
state, built over the fp32 "view" of the params (the master where there is one, else the param itself, cast to
fp32). One update: grads -> fp32; `inner.update(grads, inner, view)`; view + updates -> new masters; new params =
new view rounded to each param's dtype (round-to-nearest). So updates below bf16 resolution accumulate in the
master and reach the bf16 param once they add up (Micikevicius et al., arXiv 1710.03740 §3.1; loss scaling is not
needed with bf16). With fp32 params (the default) there is no master and the state is the plain optax state.

Source of the math: optax `GradientTransformation` contract (update(grads, state, params) -> (updates, state));
Megatron-LM `DistributedOptimizer` (fp32 main params + Adam state, bf16 model params).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct


@struct.dataclass
class MasterState:
    """master: {param path: fp32 master} (trained non-fp32 params only); inner: optax state over the fp32 view."""

    master: dict[str, jax.Array]
    inner: Any


def path_str(path) -> str:
    """Key path of a State leaf -> 'layers/1/ffn/gate/weight' (non-dict keys, e.g. a Variable's `.value`, dropped)."""
    return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _view(params, master: dict[str, jax.Array]):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: master.get(path_str(p), x.astype(jnp.float32)), params)


def init(tx: optax.GradientTransformation, params, trained: dict[str, bool]) -> Any:
    """Optimizer state for `params` (nnx.State). trained: {path: bool}. Plain optax state when every trained param
    is float32; else MasterState with fp32 masters of the trained low-precision params."""
    master = {path_str(p): x.astype(jnp.float32) for p, x in jax.tree_util.tree_leaves_with_path(params)
              if trained[path_str(p)] and x.dtype != jnp.float32}
    if not master:
        return tx.init(params)
    return MasterState(master=master, inner=tx.init(_view(params, master)))


def update(tx: optax.GradientTransformation, grads, opt_state, params) -> tuple[Any, Any]:
    """One step -> (new params (each in its own dtype), new opt_state). grads: like params (any float dtype)."""
    if not isinstance(opt_state, MasterState):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    view = _view(params, opt_state.master)
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, inner = tx.update(g32, opt_state.inner, view)
    new_view = optax.apply_updates(view, updates)
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(new_view)}
    new_params = jax.tree.map(lambda v, x: v.astype(x.dtype), new_view, params)
    return new_params, MasterState(master={k: flat[k] for k in opt_state.master}, inner=inner)


def offload_shardings(opt_shardings, param_paths: set[str], chosen: frozenset[str], memory_kind: str):
    """The optimizer state's shardings with every leaf that belongs to a `chosen` param (its master, its moments:
    the param path is the longest suffix of the leaf's dict-key path) moved to `memory_kind`; others unchanged."""

    def owner(path) -> str | None:
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        for i in range(len(keys)):
            cand = "/".join(keys[i:])
            if cand in param_paths:
                return cand
        return None

    return jax.tree_util.tree_map_with_path(
        lambda path, sh: sh.with_memory_kind(memory_kind) if owner(path) in chosen else sh, opt_shardings)
