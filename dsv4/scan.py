"""Decoder layers under `jax.lax.scan`, grouped by layer kind: compile time that does not grow with depth.

Learner-side stacking. The model keeps its per-layer NNX tree (`layers/3/attn/wq_a/weight` = official key
`layers.3.attn.wq_a.weight`), so the checkpoint table, the parity tests and the sampler are untouched. A caller
that wants scanned layers (the learner) holds the `layers` subtree *stacked*: per group of structurally identical
layers, one leading axis of size = repetitions. `stack_params` / `unstack_params` convert between the two forms
(pure pytree functions: concrete arrays, `jax.ShapeDtypeStruct`s or `NamedSharding`s as leaves), and
`merge_stacked` rebuilds a callable model for the stacked form.

Groups (`layer_groups`). Two main layers are structurally identical when they have the same attention kind
(sliding / CSA / HCA) and compress ratio and the same routing (hash or learned top-k): then their NNX graphs and
parameter shapes are equal (checked again when stacking). A group is a *period* of `period` consecutive layers
repeated `repeats` times: one scan step runs the `period` sub-layers in order. A period is needed because the
DeepSeek-V4 schedule alternates CSA and HCA, so runs of identical layers have length 1 and a scan over them alone
gives nothing. The grouping minimises the number of layer bodies traced (the sum of the periods; ties: fewer
groups), by dynamic programming over the schedule. DeepSeek-V4-Flash (43 layers, 3 hash layers, ratios
0 0 4 128 4 ... 128 4) -> (start 0, period 1, x2: the sliding hash layers), (2, 1, x1: the CSA hash layer),
(3, 2, x20: HCA, CSA): 4 traced bodies instead of 43. A group with one repetition runs its body inline (a
length-1 loop only adds compile work).

Stacked form: `stack_layers(state_of_layers, groups)` -> `nnx.State({g: {j: sub-layer j of group g}})`, each
leaf [repeats, *per-layer shape]; `stacked[g][j]` stacks layers start + j, start + period + j, ... Variable
types (`nnx.Param`, `Buffer`) and metadata are kept; `logical_axes` gets a leading None, so
`sharding.rules.param_shardings` gives a stacked leaf its per-layer PartitionSpec with an unsharded leading dim.

Use in a learner (the learner holds the stacked form; everything else keeps the per-layer one):
    sdef = stack_def(abstract_model)                        # once; static and hashable (a jit static argument)
    params = stack_params(params, sdef.groups)              # init: nnx.State of Params (and the Buffers, alike)
    shardings = param_shardings(stack_params(abstract_params, sdef.groups), mesh, rules)  # or stack the
        # per-layer shardings: stack_params(param_shardings(abstract_params, ...), groups) is the same tree
    mask = stack_params(jax.tree.map(lambda x: x.ndim >= 2, per_layer_params), sdef.groups)   # weight decay:
        # compute labels / masks per layer, then stack (a stacked leaf has one more dim)
    shell, stack = merge_stacked(sdef, params, buffers, remat="block")   # inside the loss (traced)
    out = shell(ids, attention_mask=m, routing_replay=r, dispatch_fn=f, layer_stack=stack)
    per_layer = unstack_params(nnx.merge_state(params, buffers), sdef.groups)   # push, official checkpoint
        # names, and path-based lookups such as `parallel.expert.default_dispatch(devices, shardings)`
        # (expert axis = dim 0)
Sources (ideas, not code): MaxText's `scan_layers` (`nn.scan` over a decoder block, params with a leading layer
axis); Flax NNX's "scan over layers" guide (`nnx.split` a layer, `jax.lax.scan` over its stacked state).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from dsv4.block_remat import run_period, scan_block_remat, take
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM, block_step

REMAT_POLICIES = ("none", "block", "dots")


class LayerGroup(NamedTuple):
    """Main layers start, start + 1, ..., stop - 1 (stop = start + period * repeats): `period` consecutive layers
    (one scan step) repeated `repeats` times; layer start + r * period + j is sub-layer j of repetition r."""

    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def layer(self, rep: int, j: int) -> int:
        """Index of sub-layer j of repetition `rep`."""
        return self.start + rep * self.period + j


def layer_signature(cfg: DSV4Config, i: int) -> tuple:
    """What decides layer i's structure: (attention kind, compress ratio, hash routing)."""
    return (cfg.layer_kind(i), cfg.compress_ratios[i], cfg.is_hash_layer(i))


def layer_groups(cfg: DSV4Config) -> tuple[LayerGroup, ...]:
    """Cover the main layers 0..L-1 with periodic groups, in order, each layer exactly once.

    A group [start, stop) with period p is valid when every layer's signature (`layer_signature`) equals that of
    the layer p before it inside the group. Among all covers, the one with the fewest traced layer bodies
    (sum of periods) is returned, then the one with the fewest groups (dynamic programming, O(L^2 log L)).
    Returns:
      tuple of `LayerGroup(start, period, repeats)` sorted by start.
    """
    sig = [layer_signature(cfg, i) for i in range(cfg.num_hidden_layers)]
    n = len(sig)
    inf = (n + 1, n + 1)
    best: list[tuple[int, int]] = [(0, 0)] + [inf] * n
    how: list[LayerGroup | None] = [None] * (n + 1)
    for i in range(n):
        if best[i] == inf:
            continue
        for p in range(1, n - i + 1):
            end = i + p  # extend while sig[k] == sig[k - p]
            while end < n and sig[end] == sig[end - p]:
                end += 1
            for r in range(1, (end - i) // p + 1):
                j, cost = i + p * r, (best[i][0] + p, best[i][1] + 1)
                if cost < best[j]:
                    best[j], how[j] = cost, LayerGroup(i, p, r)
    groups, j = [], n
    while j > 0:
        groups.append(how[j])
        j = how[j].start
    return tuple(reversed(groups))


# ---------------------------------------------------------------------------------------------- leaf stacking
_LABELS = (str, bool, int, float)  # Python leaves: labels and masks, kept as they are (equal within a group)


def _stack_value(vals: Sequence[Any], where: str) -> Any:
    first = vals[0]
    if isinstance(first, NamedSharding):
        if any(v != first for v in vals):
            raise ValueError(f"stack_layers: {where}: the layers' shardings differ ({first} vs others)")
        return NamedSharding(first.mesh, PartitionSpec(None, *first.spec))
    if isinstance(first, _LABELS):  # per-leaf labels / masks (optax): one value for the whole group
        if any(v != first for v in vals):
            raise ValueError(f"stack_layers: {where}: the layers' labels differ ({sorted(set(map(str, vals)))})")
        return first
    shapes = {(tuple(v.shape), jnp.dtype(v.dtype)) for v in vals}
    if len(shapes) != 1:
        raise ValueError(f"stack_layers: {where}: the layers' shapes/dtypes differ: {sorted(map(str, shapes))}")
    if isinstance(first, jax.ShapeDtypeStruct):
        sh = first.sharding
        if isinstance(sh, NamedSharding):
            sh = NamedSharding(sh.mesh, PartitionSpec(None, *sh.spec))
        else:
            sh = None
        return jax.ShapeDtypeStruct((len(vals), *first.shape), first.dtype, sharding=sh)
    return jnp.stack([jnp.asarray(v) for v in vals])


def _slice_value(val: Any, r: int, where: str) -> Any:
    if isinstance(val, NamedSharding):
        return NamedSharding(val.mesh, PartitionSpec(*tuple(val.spec)[1:]))
    if isinstance(val, _LABELS):
        return val
    if not val.shape:
        raise ValueError(f"unstack_layers: {where}: a scalar leaf has no leading layer axis")
    if isinstance(val, jax.ShapeDtypeStruct):
        sh = val.sharding
        sh = NamedSharding(sh.mesh, PartitionSpec(*tuple(sh.spec)[1:])) if isinstance(sh, NamedSharding) else None
        return jax.ShapeDtypeStruct(val.shape[1:], val.dtype, sharding=sh)
    return val[r]


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _raw(tree: Any) -> Any:
    """An nnx.State's nested plain-dict mapping (what `nnx.split` builds), so structures round-trip exactly."""
    return tree.raw_mapping if isinstance(tree, nnx.State) else tree


def _stack_trees(trees: Sequence[Any], where: str) -> Any:
    structs = {jax.tree_util.tree_structure(t, is_leaf=_is_var) for t in trees}
    if len(structs) != 1:
        raise ValueError(f"stack_layers: {where}: the layers' parameter trees differ")

    def one(*vs):
        if not _is_var(vs[0]):
            return _stack_value(vs, where)
        v0 = vs[0]
        meta = {}
        la = v0.get_metadata().get("logical_axes")
        if la is not None:
            meta["logical_axes"] = (None, *tuple(la))
        return v0.replace(_stack_value([v.get_raw_value() for v in vs], where), **meta)

    return jax.tree.map(one, *trees, is_leaf=_is_var)


def _slice_tree(tree: Any, r: int, where: str) -> Any:
    def one(v):
        if not _is_var(v):
            return _slice_value(v, r, where)
        meta = {}
        la = v.get_metadata().get("logical_axes")
        if la is not None:
            meta["logical_axes"] = tuple(la)[1:]
        return v.replace(_slice_value(v.get_raw_value(), r, where), **meta)

    return jax.tree.map(one, tree, is_leaf=_is_var)


def stack_layers(layers_state: Any, groups: Sequence[LayerGroup]) -> nnx.State:
    """Per-layer state -> stacked state.

    Args:
      layers_state: `nnx.State` (or mapping) keyed by main-layer index 0..L-1, e.g. `nnx.state(model.layers)`,
        `nnx.state(model, nnx.Param)["layers"]` or `param_shardings(...)["layers"]`. Leaves: Variables or bare
        values holding arrays, `jax.ShapeDtypeStruct`s or `NamedSharding`s; or Python str/bool/int/float leaves
        (optimizer labels, weight-decay masks computed per layer), which must be equal within a group and are
        kept as they are. Keys other than 0..L-1 are an error.
      groups: `layer_groups(cfg)`.
    Returns:
      `nnx.State({g: {j: tree}})` where `tree` has the layout of one layer and each leaf a leading axis of size
      `groups[g].repeats` (row r = layer `groups[g].layer(r, j)`); `logical_axes` metadata gets a leading None,
      ShapeDtypeStruct/NamedSharding specs a leading None.
    Raises:
      ValueError: a layer missing or extra, or layers of one group whose trees, shapes or dtypes differ.
    """
    layers_state = _raw(layers_state)
    keys = sorted(int(k) for k in layers_state.keys())
    want = list(range(groups[-1].stop if groups else 0))
    if keys != want:
        raise ValueError(f"stack_layers: the state holds layers {keys}; the groups cover {want}")
    out = {}
    for g, grp in enumerate(groups):
        out[g] = {j: _stack_trees([_raw(layers_state[grp.layer(r, j)]) for r in range(grp.repeats)],
                                  f"group {g} (layers {grp.start}..{grp.stop - 1}), sub-layer {j}")
                  for j in range(grp.period)}
    return nnx.State(out)


def unstack_layers(stacked: Any, groups: Sequence[LayerGroup]) -> nnx.State:
    """Inverse of `stack_layers`: stacked state -> `nnx.State({i: layer i's tree})` for i = 0..L-1 (bitwise)."""
    stacked = _raw(stacked)
    if sorted(int(k) for k in stacked.keys()) != list(range(len(groups))):
        raise ValueError(f"unstack_layers: the stacked state has groups {sorted(stacked.keys())}; expected "
                         f"{len(groups)} groups")
    out = {}
    for g, grp in enumerate(groups):
        for j in range(grp.period):
            for r in range(grp.repeats):
                out[grp.layer(r, j)] = _slice_tree(_raw(_raw(stacked[g])[j]), r, f"group {g}, sub-layer {j}")
    return nnx.State(dict(sorted(out.items())))


def stack_params(state: Any, groups: Sequence[LayerGroup]) -> nnx.State:
    """A model-level state (`nnx.state(model)`, its Param / Buffer parts, abstract states, shardings) with its
    `layers` subtree replaced by `stack_layers(state["layers"], groups)`; every other path is unchanged."""
    d = dict(_raw(state))
    if "layers" in d:
        d["layers"] = stack_layers(d["layers"], groups).raw_mapping
    return nnx.State(d)


def unstack_params(state: Any, groups: Sequence[LayerGroup]) -> nnx.State:
    """Inverse of `stack_params`: the per-layer state, whose paths are the official checkpoint names again
    (`nnx.update(model, unstack_params(...))`, `dsv4.io.convert`, the sampler push)."""
    d = dict(_raw(state))
    if "layers" in d:
        d["layers"] = unstack_layers(d["layers"], groups).raw_mapping
    return nnx.State(d)


# ---------------------------------------------------------------------------------------------- the scan
def _policy(remat: str | Callable | None):
    if remat is None or remat == "none":
        return None
    if callable(remat):
        return remat
    if remat == "block":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"remat policy {remat!r}; expected one of {', '.join(REMAT_POLICIES)} or a jax.checkpoint "
                     f"policy")


def is_block_remat(remat: str | Callable | None) -> bool:
    """Whether `remat` is the "block" policy (each layer recomputed from its saved input: `dsv4.block_remat`)."""
    return _policy(remat) is jax.checkpoint_policies.nothing_saveable


def group_steps(graphdefs: Sequence[Any], dispatch_fn: Callable | None = None) -> list[Callable]:
    """One group's sub-layer steps `step(state, x, forced, positions, ids) -> (x, (routes [B, S, k], drops [2]))`
    (`dsv4.model.block_step` of the layer `nnx.merge`d from its graphdef and one layer's `state`)."""
    def make(gdef):
        def step(state, x, forced, positions, ids):
            return block_step(nnx.merge(gdef, state), x, positions, ids, forced, dispatch_fn)
        return step
    return [make(gdef) for gdef in graphdefs]


def run_group(steps: Sequence[Callable], states: Sequence[Any], x: jax.Array, forced: Any, positions: jax.Array,
              ids: jax.Array, *, repeats: int, remat: str | Callable | None = None):
    """`repeats` repetitions of the sub-layer `steps` (`group_steps`, or those steps `jax.vmap`ped: the pipeline
    runs every stage's layer at once, parallel/pipeline.py) over `states` (per sub-layer, stacked on a leading axis
    of `repeats`), `remat` as `run_layers`': one `lax.scan` ("block": `block_remat.scan_block_remat`), the body inline
    for one repetition. forced: [repeats, period, ...] or None. Returns (x, (routes [repeats, period, ...], drops
    [repeats, period, ..., 2]))."""
    policy = _policy(remat)
    if repeats > 1 and is_block_remat(remat):
        return scan_block_remat(steps, repeats)(states, x, forced, positions, ids)
    # prevent_cse=False is only safe inside lax.scan; a group run inline (one repetition) needs the CSE guard, else
    # XLA merges the backward's recomputation with the forward and keeps the whole layer's activations alive until
    # its backward (the remat silently undone)
    inline = repeats == 1
    steps = [st if policy is None else jax.checkpoint(st, policy=policy, prevent_cse=inline) for st in steps]
    if inline:  # one repetition: the body inline (a length-1 loop only adds compile work)
        x, r = run_period(steps, *jax.tree.map(lambda a: a[0], (states, forced)), x, positions, ids)
        return x, jax.tree.map(lambda a: a[None], r)
    return jax.lax.scan(lambda x, i: run_period(steps, *take((states, forced), i), x, positions, ids), x,
                        jnp.arange(repeats))


def run_layers(groups: Sequence[LayerGroup], graphdefs: Sequence[Sequence[Any]], stacked: Any, x: jax.Array,
               positions: jax.Array, ids: jax.Array, routing_replay: jax.Array | None = None,
               dispatch_fn: Callable | None = None, *, remat: str | Callable | None = None):
    """The layer loop of `DSV4ForCausalLM.__call__` as one `jax.lax.scan` per group (a group with a single
    repetition runs its body inline).

    Args:
      groups: `layer_groups(cfg)`. graphdefs: per group, the `nnx.graphdef` of each of its `period` sub-layers.
      stacked: `stack_layers(...)` of the layers' state (Params and Buffers; concrete or traced).
      x: [B, S, n, D] residual streams after the embedding. positions, ids: [B, S] int32 (right-aligned rows).
      routing_replay: [B, S, L, k] int32 forced expert ids (right-aligned; < 0 = route freely) or None.
      dispatch_fn: routed-expert implementation (as in the model).
      remat: None / "none" (keep activations), "block" (recompute each layer in the backward), "dots" (save only
        weight matmul outputs), or a `jax.checkpoint` policy; applied to each sub-layer of the scan body.
        "block" runs `dsv4.block_remat.scan_block_remat` (the same gradients, computed without copies of the stacks).
    Returns:
      (x [B, S, n, D], routing [B, S, L, k] int32, expert drops [2] int32 summed over the layers): equal to the
      Python loop's (same ops per layer, in order).

    The stacked weights are loop constants read one layer per step by `take`, never the scan's `xs` (see
    `take` for the copy that avoids).
    """
    _policy(remat)  # a bad policy name fails here, before any tracing
    b, s = ids.shape
    routes, drops = [], jnp.zeros((2,), jnp.int32)
    for g, grp in enumerate(groups):
        forced = None
        if routing_replay is not None:
            f = routing_replay[:, :, grp.start:grp.stop]  # -> [B, S, repeats * period, k]
            f = f.reshape(b, s, grp.repeats, grp.period, -1)
            forced = jnp.transpose(f, (2, 3, 0, 1, 4))  # -> [repeats, period, B, S, k]
        states = tuple(_raw(_raw(_raw(stacked)[g])[j]) for j in range(grp.period))
        x, (r, d) = run_group(group_steps(graphdefs[g], dispatch_fn), states, x, forced, positions, ids,
                              repeats=grp.repeats, remat=remat)
        routes.append(jnp.transpose(r, (2, 3, 0, 1, 4)).reshape(b, s, grp.repeats * grp.period, -1))
        drops = drops + jnp.sum(d.reshape(-1, 2), axis=0)
    return x, jnp.concatenate(routes, axis=2), drops


@struct.dataclass
class LayerStack:
    """Stacked layers for `DSV4ForCausalLM.__call__(..., layer_stack=...)`: a pytree whose only array child is
    `state` (so gradients w.r.t. a LayerStack are a LayerStack); groups, graphdefs and remat are static."""

    state: Any
    groups: tuple = struct.field(pytree_node=False)
    graphdefs: tuple = struct.field(pytree_node=False)
    remat: Any = struct.field(pytree_node=False, default=None)

    @property
    def num_layers(self) -> int:
        return self.groups[-1].stop if self.groups else 0

    def run(self, x, positions, ids, routing_replay=None, dispatch_fn=None):
        """`run_layers` with this stack's groups, graphdefs, state and remat policy."""
        return run_layers(self.groups, self.graphdefs, self.state, x, positions, ids, routing_replay, dispatch_fn,
                          remat=self.remat)


@dataclasses.dataclass(frozen=True)
class StackDef:
    """Static description of a stacked model: the graphdef of the model without its layers (`shell`), the
    groups and, per group, the graphdefs of its sub-layers. Hashable (usable as a jit static argument)."""

    shell: Any
    groups: tuple[LayerGroup, ...]
    graphdefs: tuple[tuple[Any, ...], ...]


def stack_def(model: DSV4ForCausalLM) -> StackDef:
    """The `StackDef` of a (concrete or `nnx.eval_shape`-abstract) model; the model is not modified.

    Raises:
      ValueError: two layers of one group whose NNX graphs differ (a schedule field `layer_signature` misses).
    """
    groups = layer_groups(model.config)
    gdefs = []
    for g, grp in enumerate(groups):
        row = tuple(nnx.graphdef(model.layers[grp.layer(0, j)]) for j in range(grp.period))
        for r in range(1, grp.repeats):
            for j in range(grp.period):
                if nnx.graphdef(model.layers[grp.layer(r, j)]) != row[j]:
                    raise ValueError(f"stack_def: layers {grp.layer(0, j)} and {grp.layer(r, j)} of group {g} have "
                                     f"different structures")
        gdefs.append(row)
    gd, st = nnx.split(model)
    shell = nnx.merge(gd, st)
    shell.layers = nnx.List([])
    return StackDef(nnx.graphdef(shell), groups, tuple(gdefs))


def merge_stacked(sdef: StackDef, *states: Any, remat: str | Callable | None = None):
    """(shell model, LayerStack) from stacked states (e.g. params and buffers, as `nnx.merge` takes them).

    The shell is the model without its `layers` (embedding, hyper head, norm, head, MTP); call it as
    `shell(ids, ..., layer_stack=stack)`. Works inside jit/grad (the states may be tracers).
    """
    full = nnx.merge_state(*states) if len(states) > 1 else states[0]
    d = dict(_raw(full))
    layers = nnx.State(d.pop("layers"))
    shell = nnx.merge(sdef.shell, nnx.State(d))
    return shell, LayerStack(layers, sdef.groups, sdef.graphdefs, remat)
