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

`clip_by_global_norm_apart`: gradient clipping per group of leaves (the learner clips the MTP block's gradient
apart from the policy's). `lr_schedule`: the learning rate per applied update (LearnerConfig's warmup and decay).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from dsv4.names import tree_key
from sharding.offload import ROW_STEPS


@struct.dataclass
class MasterState:
    """master: {param path: fp32 master} (trained non-fp32 params only); inner: optax state over the fp32 view."""

    master: dict[str, jax.Array]
    inner: Any


def _view(params, master: dict[str, jax.Array]):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: master.get(tree_key(p), x.astype(jnp.float32)), params)


def init(tx: optax.GradientTransformation, params, trained: dict[str, bool]) -> Any:
    """Optimizer state for `params` (nnx.State). trained: {path: bool}. Plain optax state when every trained param
    is float32; else MasterState with fp32 masters of the trained low-precision params."""
    master = {tree_key(p): x.astype(jnp.float32) for p, x in jax.tree_util.tree_leaves_with_path(params)
              if trained[tree_key(p)] and x.dtype != jnp.float32}
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
    flat = {tree_key(p): x for p, x in jax.tree_util.tree_leaves_with_path(new_view)}
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


def param_owner(param_paths: set[str]):
    """Key path of an optimizer-state leaf -> the param path it belongs to (longest dict-key suffix), or None."""

    def owner(path) -> str | None:
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        for i in range(len(keys)):
            if (cand := "/".join(keys[i:])) in param_paths:
                return cand
        return None

    return owner


def update_streamed(tx: optax.GradientTransformation, grads, opt_state, params, streamed: Mapping[str, int], *,
                    finite: jax.Array, g_norm: jax.Array | None = None, max_norm: float | None = None,
                    apart_norm: jax.Array | None = None, to_device=None, to_host=None) -> tuple[Any, Any]:
    """`update` with the state of the `streamed` params updated one slice of their leading dim at a time.

    Same result as `update` with `optax.clip_by_global_norm(max_norm)` in front of `tx` followed by the
    non-finite guard (`jnp.where(finite, new, old)` on params and state), bit for bit: every optax transform used
    after the clip (Adam, decoupled weight decay, learning rate) is elementwise given the step count, and the clip
    is applied here, elementwise, from the global norm `g_norm` the caller computed over the same leaves
    (`optax.clip_by_global_norm`'s formula).

    Args:
      tx: the optimizer *without* its clip (`optax.identity()` in the clip's place, so the state has the same
        structure). grads, opt_state, params: as `update` (params an nnx.State; grads like it).
      streamed: {'/'-joined param path (trained, ndim >= 2): blocks} of the params whose master / moments are
        updated in a `lax.fori_loop` over their leading dim (the stacked layers with `scan_layers`; a 2-D leaf, the
        embedding or the head, in `ROW_STEPS` chunks of rows): per step only one slice of their optimizer state is
        in flight, moved in by `to_device(x)` and back by `to_host(x)` (`jax.device_put` to a memory space; None =
        no move). A leading dim split over the mesh in `blocks` > 1 (a pipelined group over `stage`,
        `rl.algo.learner_state.streamable`) is viewed as [blocks, R / blocks, ...] and looped over its second dim:
        each slice is every block's own row (rows), so no device reads another's. Without this the step
        materialises the whole offloaded state on the device (XLA's memory analysis of the Flash step:
        launch/aot.py).
      finite: bool scalar, the non-finite guard: False keeps old params and state.
      g_norm, max_norm: the global gradient norm and the clip threshold (max_norm None = no clip).
      apart_norm: with `train_tx`'s MTP clip apart (`mtp_loss_weight` > 0), the MTP head's gradient norm: its
        leaves (`is_mtp_key`) are clipped by it and the others by `g_norm` (then their norm alone), as
        `clip_by_global_norm_apart`. Before, the streamed update clipped every leaf by the one global norm.
    Returns:
      (new params, new opt_state), the guard applied.
    """
    f32 = jnp.float32
    move_in = to_device or (lambda x: x)
    move_out = to_host or (lambda x: x)

    def clip(t, name):
        t = t.astype(f32)
        norm = apart_norm if apart_norm is not None and is_mtp_key(name) else g_norm
        return t if max_norm is None else jax.lax.select(norm < max_norm, t, (t / norm.astype(f32)) * max_norm)

    def keep(new, old):
        return jnp.where(finite, new, old)

    p_flat, p_def = jax.tree_util.tree_flatten_with_path(params)
    p_paths = [tree_key(p) for p, _ in p_flat]
    g_leaves = jax.tree.leaves(grads)
    o_flat, o_def = jax.tree_util.tree_flatten_with_path(opt_state)
    owner = param_owner(set(p_paths))
    o_owner = [owner(p) for p, _ in o_flat]
    p_vals = [x for _, x in p_flat]
    o_vals = [x for _, x in o_flat]
    hole = lambda x: jnp.zeros((0,) * x.ndim, x.dtype)  # noqa: E731  zero-size stand-in: costs nothing

    def run(p_list, g_list, o_list):
        new_p, new_o = update(tx, jax.tree.unflatten(p_def, g_list), jax.tree.unflatten(o_def, o_list),
                              jax.tree.unflatten(p_def, p_list))
        return jax.tree.leaves(new_p), jax.tree.leaves(new_o)

    # every leaf not streamed, in one call (streamed ones as zero-size stand-ins)
    side = [pp in streamed for pp in p_paths]
    new_p, new_o = run([hole(x) if s else x for x, s in zip(p_vals, side)],
                       [hole(g) if s else clip(g, pp) for g, s, pp in zip(g_leaves, side, p_paths)],
                       [hole(x) if ow in streamed else x for x, ow in zip(o_vals, o_owner)])
    out_p = [x if s else keep(n, x) for n, x, s in zip(new_p, p_vals, side)]
    out_o = [x if ow in streamed else keep(n, x) for n, x, ow in zip(new_o, o_vals, o_owner)]

    for name in sorted(streamed):
        pi = p_paths.index(name)
        oi = [j for j, ow in enumerate(o_owner) if ow == name]
        blocks, shape = streamed[name], p_vals[pi].shape
        if len(shape) == 2:  # [rows, cols] -> [blocks, ROW_STEPS, rows / (blocks ROW_STEPS), cols]: a chunk of rows
            n, axis = ROW_STEPS, 1
            view = lambda x, shape=shape, blocks=blocks: x.reshape(  # noqa: E731
                blocks, ROW_STEPS, shape[0] // (blocks * ROW_STEPS), shape[1])
            unview = lambda x, shape=shape: x.reshape(shape)  # noqa: E731
        else:  # [R, ...] -> [blocks, R / blocks, ...]: one leading slice (a layer) of every block at a time
            n, axis = shape[0] // blocks, int(blocks > 1)
            view = (lambda x: x.reshape(blocks, n, *x.shape[1:])) if blocks > 1 else (lambda x: x)  # noqa: E731
            unview = (lambda x: x.reshape(blocks * n, *x.shape[2:])) if blocks > 1 else (lambda x: x)  # noqa: E731
        g_view = view(g_leaves[pi])

        def body(i, carry, pi=pi, oi=oi, axis=axis, g_view=g_view, name=name):
            p_full, o_full = carry
            take = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis, keepdims=False)  # noqa: E731
            p_i, g_i, o_i = take(p_full), clip(take(g_view), name), [move_in(take(x)) for x in o_full]
            p_list = [p_i if j == pi else hole(x) for j, x in enumerate(p_vals)]
            g_list = [g_i if j == pi else hole(g) for j, g in enumerate(g_leaves)]
            o_list = [hole(x) if ow is not None else x for x, ow in zip(o_vals, o_owner)]
            for j, x in zip(oi, o_i):
                o_list[j] = x
            np_, no_ = run(p_list, g_list, o_list)
            put = lambda full, v: jax.lax.dynamic_update_index_in_dim(full, v, i, axis)  # noqa: E731
            return (put(p_full, keep(np_[pi], p_i)),
                    [put(full, move_out(keep(no_[j], x))) for full, j, x in zip(o_full, oi, o_i)])

        p_new, o_new = jax.lax.fori_loop(0, n, body, (view(p_vals[pi]), [view(o_vals[j]) for j in oi]))
        out_p[pi] = unview(p_new)
        for j, x in zip(oi, o_new):
            out_o[j] = unview(x)
    return jax.tree.unflatten(p_def, out_p), jax.tree.unflatten(o_def, out_o)


def clip_by_global_norm_apart(max_norm: float, is_apart) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm(max_norm)` applied separately to the leaves whose key path satisfies `is_apart`
    (path -> bool; e.g. the MTP block's leaves) and to the rest, so that one group's gradient never rescales the
    other's. Any pytree of float arrays; the state is optax's EmptyState."""
    def update(updates, state, params=None):
        del params
        flags = jax.tree_util.tree_map_with_path(lambda p, _: is_apart(p), updates)
        out = updates
        for side in (True, False):
            part = [g for g, f in zip(jax.tree.leaves(updates), jax.tree.leaves(flags)) if f == side]
            norm = optax.tree.norm(part) if part else jnp.zeros((), jnp.float32)
            keep = norm < max_norm  # optax's formula, per group

            def clip(g, f, o, norm=norm, keep=keep, side=side):
                return jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm) if f == side else o

            out = jax.tree.map(clip, updates, flags, out)
        return out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def lr_schedule(cfg):
    """count (applied updates, int) -> learning rate: linear warmup, then constant or cosine (LearnerConfig)."""

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        lr = jnp.asarray(cfg.lr, jnp.float32)
        if cfg.warmup_steps > 0:
            lr = lr * jnp.minimum(1.0, (c + 1.0) / cfg.warmup_steps)
        if cfg.schedule == "cosine":
            frac = jnp.clip((c - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps), 0.0, 1.0)
            lr = lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * frac)))
        return lr

    return schedule


def is_mtp_key(name: str) -> bool:
    """Whether a '/'-joined param path is the MTP module's (`mtp/*`)."""
    return name.startswith("mtp")


def _is_mtp(path) -> bool:
    return is_mtp_key(tree_key(path))


def train_tx(cfg, matrix: dict[str, bool], clip: bool = True) -> optax.GradientTransformation:
    """The trained params' transformation of a `LearnerConfig` `cfg`: AdamW (`lr_schedule`, weight decay on the
    params whose `matrix[path]` is True: per-layer ndim >= 2, stacked leaves included) after the global-norm clip
    (`max_grad_norm`; with `mtp_loss_weight` > 0 the MTP head's gradient is clipped apart, so the policy update is
    its own). clip=False: `optax.identity()` in the clip's place, the same state structure, for `update_streamed`,
    which clips itself."""
    mask = lambda p: jax.tree_util.tree_map_with_path(lambda q, x: matrix[tree_key(q)], p)  # noqa: E731
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=mask)
    if cfg.max_grad_norm is None:
        return adamw
    if clip and cfg.mtp_loss_weight > 0:
        return optax.chain(clip_by_global_norm_apart(cfg.max_grad_norm, _is_mtp), adamw)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm) if clip else optax.identity(), adamw)
