"""Logical-axis -> mesh-axis rule tables, one named preset per role, and the helpers that apply them.

This file is the only place that decides where an array lives (house rule 3). Model code names *logical*
axes from `sharding/axes.py` (`embed`, `mlp`, `act_batch`, ...); a rule table maps each of them to a mesh axis,
a tuple of mesh axes (the dim is split over their product, major to minor), or None (replicated).

Two presets:

* `ACTOR_RULES` (training mesh, BF16 + fp32 master/optimizer state): FSDP + CP + EP + TP. Weights are split along
  `embed` over `fsdp` x `context` (ZeRO-3 style over every data-like axis, as MaxText: gathered per layer by
  XLA, so a context axis does not multiply the weight bytes per device), routed experts over `expert`, and the
  head/intermediate/vocab dims over `tensor`. The batch is split over `data`, `fsdp`, `expert` (FSDP and EP
  ranks are data-parallel for activations) and the sequence of every per-token activation (`act_seq`) over
  `context` (context parallelism; the attention's collectives across it are in `dsv4/context.py`). Pipeline
  parallelism (`parallel/pipeline.py`): the stacked layer dim of the pipelined layer group (`layers`) and the
  pipeline's per-stage activations (`act_stage`) are split over `stage` (contiguous layers per stage). `act_batch`
  does not use `stage`: inside the pipeline the stage dim is a `jax.vmap(spmd_axis_name="stage")` dim, on which
  no constraint may name `stage` again (the rules cannot tell inside from outside: JAX traces a custom_vjp's
  rules after the vmap's body), so outside it (embedding, un-pipelined layers, head, loss) the batch is replicated
  over `stage` (not data-parallel over it, as MaxText's separate `activation_embed_and_logits_batch` is).
* `ROLLOUT_RULES` (sampling mesh, FP8): EP + TP and no FSDP: weights are never split along `embed`, so decode
  steps never all-gather weights. The batch is split over `data`, `fsdp` and `expert`; on a rollout mesh the
  `fsdp` axis is therefore a second data axis. It is 1 on the usual disjoint rollout meshes and is only > 1
  when the rollout shares the actor mesh (`MeshPlan.colocated`), where it keeps the FSDP ranks busy.

Resolution (`logical_to_spec`): mesh axes that the mesh lacks or whose size is 1 are dropped, and a mesh axis
is used at most once per PartitionSpec: when two dims map to the same mesh axis, the first dim (left to
right) keeps it and the later dim is replicated along it. Example, actor rules on fsdp=2, tensor=2:
`("embed", "mlp") -> P("fsdp", "tensor")`, `("heads", "mlp") -> P("tensor", None)`.

Activations: model code calls `constrain(x, (ACT_BATCH, ACT_SEQ, ACT_EMBED))`; it is the identity unless a
`use_rules(rules, mesh)` context is active (a `contextvars.ContextVar`, so threads and asyncio tasks each see
their own). Inside jit, `with_sharding_constraint` accepts uneven dims (XLA pads), so `constrain` does not check
divisibility; parameters are checked strictly (`param_shardings`) because jit in/out shardings must divide.

Sources (ideas, not code): MaxText's `logical_axis_rules` table in `configs/base.yml` and its
"first rule wins, axis used once" resolution; Tunix's separate sampling layout (`ShardingConfig(is_sampling)`)
that drops FSDP; jax docs "Distributed arrays and automatic parallelization" for NamedSharding /
with_sharding_constraint. Run the tests: `.venv/bin/python -m pytest -q tests/sharding/test_rules.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding import axes as ax

# Mesh axis names, in mesh order (major to minor). `tensor` is innermost so TP peers are adjacent devices; `stage`
# (pipeline parallelism, parallel/pipeline.py) outermost: stage boundaries send one activation per micro-batch,
# the cheapest traffic to put across nodes.
STAGE = "stage"
DATA = "data"
FSDP = "fsdp"
CONTEXT = "context"  # context parallelism: the actor's sequence dim of per-token activations (dsv4/context.py)
EXPERT = "expert"
TENSOR = "tensor"
MESH_AXES = (STAGE, DATA, FSDP, CONTEXT, EXPERT, TENSOR)

# Roles.
ACTOR = "actor"
ROLLOUT = "rollout"
ROLES = (ACTOR, ROLLOUT)

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

ACTOR_RULES: Rules = (
    # Weights.
    (ax.VOCAB, TENSOR),
    (ax.EMBED, (FSDP, CONTEXT)),
    (ax.Q_LORA, None),
    (ax.HEADS, TENSOR),
    (ax.KV, None),
    (ax.O_LORA, TENSOR),
    (ax.O_IN, None),
    (ax.COMPRESS, None),
    (ax.INDEX_HEADS, None),
    (ax.EXPERT, EXPERT),
    (ax.MLP, TENSOR),
    (ax.HC, None),
    (ax.TABLE, None),
    (ax.LAYERS, STAGE),
    # Activations.
    (ax.ACT_BATCH, (DATA, FSDP, EXPERT)),
    (ax.ACT_SEQ, CONTEXT),
    (ax.ACT_EMBED, None),
    (ax.ACT_HEADS, TENSOR),
    (ax.ACT_VOCAB, TENSOR),
    (ax.ACT_EXPERT, EXPERT),
    (ax.ACT_STAGE, STAGE),
)

# Same as the actor except: no FSDP on weights (embed replicated), and no context parallelism: a rollout mesh
# with a context axis (only when colocated with such an actor) uses it as one more data axis of the batch.
_ROLLOUT_CHANGES: dict[str, MeshAxes] = {ax.EMBED: None, ax.ACT_SEQ: None, ax.LAYERS: None,
                                         ax.ACT_BATCH: (STAGE, DATA, FSDP, CONTEXT, EXPERT)}
ROLLOUT_RULES: Rules = tuple((name, _ROLLOUT_CHANGES.get(name, m)) for name, m in ACTOR_RULES)

PRESETS: dict[str, Rules] = {ACTOR: ACTOR_RULES, ROLLOUT: ROLLOUT_RULES}


def rules_for(role: str) -> Rules:
    """The rule preset of `role` (`"actor"` or `"rollout"`). Raises ValueError for any other role."""
    try:
        return PRESETS[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; known roles: {', '.join(ROLES)}") from None


def check_rules(rules: Rules) -> None:
    """Raise ValueError unless `rules` maps every name of `axes.ALL_AXES` exactly once to known mesh axes."""
    names = [name for name, _ in rules]
    dup = sorted({n for n in names if names.count(n) > 1})
    missing = [n for n in ax.ALL_AXES if n not in names]
    unknown = [n for n in names if n not in ax.ALL_AXES]
    bad_mesh = [(n, m) for n, m in rules if any(a not in MESH_AXES for a in _as_tuple(m))]
    problems = []
    if dup:
        problems.append(f"duplicated logical axes {dup}")
    if missing:
        problems.append(f"missing logical axes {missing}")
    if unknown:
        problems.append(f"unknown logical axes {unknown}")
    if bad_mesh:
        problems.append(f"unknown mesh axes in {bad_mesh} (mesh axes are {MESH_AXES})")
    if problems:
        raise ValueError("bad rule table: " + "; ".join(problems))


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


def mesh_axes_for(logical: str, rules: Rules) -> tuple[str, ...]:
    """The mesh axes (possibly empty) that `rules` gives the logical axis `logical`; ValueError if unlisted."""
    for name, mesh_axes in rules:
        if name == logical:
            return _as_tuple(mesh_axes)
    raise ValueError(f"logical axis {logical!r} has no rule; known logical axes: {', '.join(n for n, _ in rules)}")


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """Resolve per-dim logical names to a PartitionSpec with one entry per dim.

    Args:
      logical_axes: one entry per array dim, a name from `sharding.axes` or None (replicated).
      rules: a rule table (`ACTOR_RULES`, `ROLLOUT_RULES`, or `rules_for(role)`).
      mesh: when given, mesh axes absent from it or of size 1 are dropped (so the spec is minimal).
    Returns:
      PartitionSpec of len(logical_axes) entries: None, a mesh axis, or a tuple of mesh axes. A mesh axis is
      used at most once: a later dim that maps to an axis already taken is replicated along that axis.
    Raises:
      ValueError: a logical name without a rule.
    """
    used: set[str] = set()
    entries: list[MeshAxes] = []
    for logical in logical_axes:
        if logical is None:
            entries.append(None)
            continue
        kept = []
        for mesh_axis in mesh_axes_for(logical, rules):
            if mesh is not None and mesh.shape.get(mesh_axis, 1) == 1:
                continue
            if mesh_axis in used:
                continue
            used.add(mesh_axis)
            kept.append(mesh_axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*entries)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _logical_axes_of(var: nnx.Variable) -> tuple[str | None, ...] | None:
    logical = getattr(var, "logical_axes", None)
    if logical is None:
        logical = var.get_metadata().get("logical_axes")
    return None if logical is None else tuple(logical)


def _sharding_for_leaf(path: tuple, leaf: Any, mesh: Mesh, rules: Rules) -> Any:
    name = jax.tree_util.keystr(path, simple=True, separator=".") or "<root>"
    if not _is_variable(leaf):  # a bare array / ShapeDtypeStruct / scalar: replicated
        return NamedSharding(mesh, PartitionSpec())
    logical = _logical_axes_of(leaf)
    if logical is None:
        return leaf.replace(NamedSharding(mesh, PartitionSpec()))
    shape = tuple(getattr(leaf.get_value(), "shape", ()))
    if len(logical) != len(shape):
        raise ValueError(f"parameter {name}: logical_axes {logical} has {len(logical)} entries but shape {shape} "
                         f"has {len(shape)} dims")
    spec = logical_to_spec(logical, rules, mesh)
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        mesh_axes = _as_tuple(entry)
        parts = math.prod(mesh.shape[a] for a in mesh_axes)
        if size % parts:
            split = "*".join(f"{a}={mesh.shape[a]}" for a in mesh_axes)
            raise ValueError(f"parameter {name}: dim {dim} (logical {logical[dim]!r}) has size {size}, "
                             f"not divisible by mesh axes {split} (= {parts})")
    return leaf.replace(NamedSharding(mesh, spec))


def param_shardings(abstract_state: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for every variable of an (abstract) parameter tree, for jit out_shardings / device_put.

    Args:
      abstract_state: an `nnx.State` (e.g. `nnx.state(nnx.eval_shape(lambda: Model(...)))`) or any pytree
        whose leaves are `nnx.Variable`s (values may be arrays or ShapeDtypeStructs). A variable's
        `logical_axes` metadata (one entry per dim) picks its layout; variables without it and bare leaves
        are replicated.
    Returns:
      The same tree structure with each Variable's value replaced by its `NamedSharding(mesh, spec)` (the
      convention of `nnx.get_named_sharding`), usable as `jax.jit(..., out_shardings=...)` for an init
      function returning that state, or as the target of `jax.device_put`. Bare leaves become NamedShardings.
    Raises:
      ValueError: a logical_axes tuple whose length differs from the rank, an unknown logical axis, or a dim
        whose size is not divisible by the product of its mesh axes (names the parameter path, dim, size
        and mesh axes; `sharding.mesh.MeshSpec.validate(config=...)` reports the same before any weight exists).
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _sharding_for_leaf(path, leaf, mesh, rules), abstract_state, is_leaf=_is_variable
    )


def activation_spec(*logical_axes: str | None, rules: Rules, mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an activation, e.g. `activation_spec(ACT_BATCH, ACT_SEQ, ACT_EMBED, rules=r, mesh=m)`
    for an `[B, T, D]` tensor; same resolution as `logical_to_spec`."""
    return logical_to_spec(logical_axes, rules, mesh)


_ACTIVE: contextvars.ContextVar[tuple[Rules, Mesh] | None] = contextvars.ContextVar("dsv4_sharding_rules",
                                                                                     default=None)


@contextlib.contextmanager
def use_rules(rules: Rules, mesh: Mesh) -> Iterator[None]:
    """Make `constrain` apply `rules` on `mesh` inside the block (nests; restores the outer setting on exit).

    Trace the model inside this block (the constraint is recorded at trace time); typical use:
    `with jax.set_mesh(mesh), use_rules(rules_for("actor"), mesh): loss = train_step(...)`
    (or `MeshPlan.activate(role)`, which does both).
    """
    check_rules(rules)
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[Rules, Mesh] | None:
    """The `(rules, mesh)` of the innermost active `use_rules` block, or None outside any."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on activation `x` (any shape, one logical name per dim, e.g. `[B, T, D]` with
    `(ACT_BATCH, ACT_SEQ, ACT_EMBED)`). Identity when no `use_rules` block is active; otherwise
    `with_sharding_constraint(x, NamedSharding(mesh, spec))`. Raises ValueError when the number of names
    differs from `x.ndim`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} logical axes {tuple(logical_axes)} for an array of "
                         f"shape {x.shape}")
    rules, mesh = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, rules, mesh)))


def batch_shards(rules: Rules, mesh: Mesh) -> int:
    """Number of shards of an activation's batch dim (`ACT_BATCH`) under `rules` on `mesh` (1 = replicated):
    the rollout's batch is padded to a multiple of it."""
    spec = logical_to_spec((ax.ACT_BATCH,), rules, mesh)
    return math.prod(mesh.shape[a] for a in _as_tuple(spec[0]))


def cache_shardings(caches: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for decode caches (`dsv4.cache` layout: every leaf [B, ...], one K=V head, so no head dim):
    the batch dim over the mesh axes of `ACT_BATCH` (rollout rules: `data`, `fsdp`, `expert`: "EP as DP", the
    attention and its caches outside the MoE are data-parallel over the expert ranks), every other dim
    replicated. Works on arrays, ShapeDtypeStructs or any pytree of them. Per device a cache holds
    1 / `batch_shards(rules, mesh)` of the batch."""
    def one(x):
        return NamedSharding(mesh, logical_to_spec((ax.ACT_BATCH,) + (None,) * (len(x.shape) - 1), rules, mesh))

    return jax.tree.map(one, caches)
