"""Pipeline parallelism over the scanned layer stack: contiguous stages of one layer group over the `stage` mesh axis,
micro-batches moved between them by a rotating shift (a collective permute), GPipe schedule.

What is pipelined. `dsv4.scan.layer_groups` covers the layers with periodic groups (DeepSeek-V4-Flash: 2 sliding
hash layers, 1 CSA hash layer, then 20 x (HCA, CSA)). The group holding the most layers is split into `stages`
contiguous stages: stage p runs repetitions [p R / P, (p + 1) R / P) of it, i.e. the contiguous layers
start + p L_s .. start + (p + 1) L_s - 1 (L_s = period R / P), so its repetitions must divide by the stage count
(else a one-line ValueError naming the flag). The other groups (Flash: the 3 hash layers in front) run outside the
pipeline, as MaxText runs DeepSeek's dense prefix: with the embedding before it and the final norm, head, MTP head
and loss after it. The embedding, head and loss run replicated over `stage` (each stage computes them for the whole
batch: see sharding/rules.py for why `act_batch` cannot name `stage`); the layers outside the pipeline split the
batch's rows over the stages (`run_split_over_stages`), their weights not split over `stage`.
The stacked state is today's (`dsv4.scan.stack_params`), so checkpoints and the push are unchanged; only the
pipelined group's leading dim is split over `stage` (`stage_shardings`: the mesh axes of the logical axis `layers`).

How (ideas from MaxText's `layers/pipeline.py` and Praxis' `LayerwiseShardablePipelined`, no code): the group's
leaves [R, ...] are viewed as [P, R / P, ...], each sub-layer's step is `jax.vmap`ped over the stage dim with
`spmd_axis_name="stage"` (so XLA runs stage p on the devices of stage p), and `dsv4.scan.run_group` scans those
steps over a stage's R / P repetitions, remat policy included. The vmap sits inside the remat, not around it: the
"block" remat's hand-written backward then differentiates the vmapped step, so JAX makes the EP dispatch's
shard_map residuals knowing `stage` is the vmap's axis (vmapping the whole stage instead, the backward's shard_map
residuals named `stage` and JAX refused them: "vmap spmd_axis_name cannot appear in shard_map out_specs").
A carry `buf` [P, B_m, S, n, D] holds each stage's input; at iteration t
(t = 0 .. M + P - 2) stage 0 reads micro-batch t, every stage runs, and `jnp.roll(out, 1, axis=0)` hands stage p's
output to stage p + 1 (XLA lowers the roll of a stage-split dim to a collective permute). Stage p works on
micro-batch t - p; the token ids (hash routing), positions and the routing-replay ids it needs are read per stage
for that micro-batch, and the routes / expert drops it records are kept per stage and gathered once at the end
(the routing record never travels through the ring). Iterations where a stage has no micro-batch (the bubble) run
on real, finite data whose results are discarded, so their cotangents are exactly zero.

Schedule: GPipe, all forwards then all backwards; the backward runs the iterations in reverse, with the same permutes
reversed. Under remat "block" (the learner's default) the backward is hand-written (`_block_remat_pipeline`): each
layer is recomputed from its saved input and its weight cotangent added into one accumulator per weight, in place;
with other remat policies it is `jax.grad` of the loop (which keeps each iteration's stacked weight cotangents beside
the accumulator: a second copy of the pipelined weights' gradients). Bubble fraction (P - 1) / (M + P - 1)
(`bubble_fraction`), in forward and backward alike. Activation memory: every micro-batch's per-layer inputs of its
stage (each stage holds M micro-batches' under remat "block"), as GPipe. Not done: 1F1B (it would hold P
micro-batches' inputs, not M) and circular / interleaved stages.

Use:
    plan = pipeline_plan(sdef.groups, stages=2, micro_batches=4)
    shell, stack = dsv4.scan.merge_stacked(sdef, params, buffers, remat="block")
    out = shell(ids, attention_mask=m, routing_replay=r, layer_stack=PipelineStack.of(stack, plan))
Rows: the batch's B = M B_m rows, micro-batch m = rows m, m + M, m + 2M, ... (`split_micro_batches`).
Tests: tests/parallel/test_pipeline.py (loss, logits, routing and every gradient equal to the unpipelined step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from dsv4 import block_remat as br
from dsv4.scan import LayerGroup, LayerStack, group_steps, is_block_remat, run_group, run_layers
from sharding import axes as ax
from sharding import rules as rl

PIPELINE_FLAG = "--learner.pipeline_stages"
_BUF = (ax.ACT_STAGE, ax.ACT_BATCH, ax.ACT_SEQ, None, ax.ACT_EMBED)  # [P, B_m, S, n, D] per-stage streams
_ROWS = _BUF[1:]  # [B_m, S, n, D]: one micro-batch's streams


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe schedule of `micro_batches` M over `stages` P: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """stages P, micro_batches M, group: the index (in `layer_groups`) of the pipelined group; `repeats` its
    repetitions (P divides them). Hashable (a jit static argument)."""

    stages: int
    micro_batches: int
    group: int
    repeats: int

    def __post_init__(self):
        if self.stages < 1:
            raise ValueError(f"{PIPELINE_FLAG} must be >= 1, got {self.stages}")
        if self.micro_batches < 1:
            raise ValueError(f"pipeline micro-batches must be >= 1, got {self.micro_batches}")
        if self.repeats % self.stages:
            raise ValueError(f"{PIPELINE_FLAG}={self.stages} does not divide the {self.repeats} repetitions of the "
                             f"pipelined layer group {self.group}")

    @property
    def iterations(self) -> int:
        """Steps of the schedule: M + P - 1."""
        return self.micro_batches + self.stages - 1

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.micro_batches)


def pipelined_group(groups: Sequence[LayerGroup]) -> int:
    """Index of the group the pipeline splits: the one with the most layers (the first of equals)."""
    sizes = [g.period * g.repeats for g in groups]
    return sizes.index(max(sizes))


def check_stage_axis(stages: int, stage_axis: int) -> None:
    """Raises ValueError naming --learner.pipeline_stages when `stages` is not a multiple of the mesh's `stage`
    axis size `stage_axis` (each device of the axis holds whole stages)."""
    if stages % stage_axis:
        raise ValueError(f"{PIPELINE_FLAG}={stages} does not spread over the mesh's stage={stage_axis} axis: use a "
                         f"multiple of {stage_axis}")


def pipeline_plan(groups: Sequence[LayerGroup], stages: int, micro_batches: int) -> PipelinePlan:
    """The `PipelinePlan` of `stages` over `layer_groups(cfg)`. Raises ValueError (one line, naming
    `--learner.pipeline_stages`) when the stage count does not divide the pipelined group's repetitions."""
    g = pipelined_group(groups)
    grp = groups[g]
    if stages >= 1 and grp.repeats % stages:
        raise ValueError(f"{PIPELINE_FLAG}={stages} does not divide the {grp.repeats} repetitions of layer group {g} "
                         f"(layers {grp.start}..{grp.stop - 1}, period {grp.period}): use a divisor of {grp.repeats}")
    return PipelinePlan(stages=stages, micro_batches=micro_batches, group=g, repeats=grp.repeats)


def _key(k: Any) -> Any:
    """A pytree path entry as the name or index it stands for."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def stage_shardings(shardings: Any, plan: PipelinePlan, rules: rl.Rules) -> Any:
    """`shardings` (a pytree of NamedShardings of stacked state: params, buffers, optimizer moments, masters, a
    whole `TrainState`'s) with the leading dim of every leaf of the pipelined group (path `.../layers/<group>/...`)
    split over the mesh axes `rules` give the logical axis `layers` (the actor's: `stage`), so stage p holds its
    own repetitions (contiguous blocks). Other leaves are unchanged; structures and Variable metadata are kept."""
    def one(path, sh):
        keys = [_key(k) for k in path]
        hit = any(a == "layers" and str(b) == str(plan.group) for a, b in zip(keys, keys[1:]))
        if not hit or not isinstance(sh, NamedSharding) or not len(sh.spec) or sh.spec[0] is not None:
            return sh
        lead = rl.logical_to_spec((ax.LAYERS,), rules, sh.mesh)[0]
        return NamedSharding(sh.mesh, PartitionSpec(lead, *tuple(sh.spec)[1:]))

    return jax.tree_util.tree_map_with_path(one, shardings)


def split_micro_batches(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...], micro-batch i = rows i, i + M, i + 2M, ... (strided, as `rl.algo.batching.split`:
    with the batch split in blocks over the data axes, every device holds an equal share of each micro-batch)."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def merge_micro_batches(a: jax.Array) -> jax.Array:
    """Inverse of `split_micro_batches`: [M, B_m, ...] -> [M B_m, ...]."""
    return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _stage_axis() -> str | None:
    """`stage` when the active rules split the stage dim over a mesh axis of size > 1 (the vmap's spmd axis)."""
    active = rl.active_rules()
    if active is None:
        return None
    rules, mesh = active
    axes = rl.mesh_axes_for(ax.ACT_STAGE, rules)
    return rl.STAGE if rl.STAGE in axes and mesh.shape.get(rl.STAGE, 1) > 1 else None


def run_pipelined_group(plan: PipelinePlan, grp: LayerGroup, graphdefs: Sequence[Any], state: Any, x: jax.Array,
                        positions: jax.Array, ids: jax.Array, routing_replay: jax.Array | None = None,
                        dispatch_fn: Callable | None = None, *, remat: Any = None):
    """Group `grp`'s layers (stacked `state` {j: tree of [R, ...]}) over `plan.stages` stages and
    `plan.micro_batches` micro-batches.

    Args: x [B, S, n, D] streams; positions, ids [B, S] int32; routing_replay [B, S, L, k] int32 (all layers; this
      group's are read) or None; graphdefs: the group's sub-layer graphdefs; remat: as `dsv4.scan.run_layers`.
    Returns:
      (x [B, S, n, D], routes [B, S, period R, k] int32 of the group's layers in order, drops [2] int32): what
      `run_layers((grp,), ...)` returns for the whole batch.
    Raises:
      ValueError: B not a multiple of the micro-batch count.
    """
    n_st, n_mb = plan.stages, plan.micro_batches
    b, s = ids.shape
    if b % n_mb:
        raise ValueError(f"the pipeline's batch of {b} rows does not split into {n_mb} micro-batches")
    bm, rps = b // n_mb, grp.repeats // n_st
    lps = grp.period * rps  # layers per stage
    raw = [state[j].raw_mapping if isinstance(state[j], nnx.State) else state[j] for j in range(grp.period)]
    x_mb, ids_mb, pos_mb = (split_micro_batches(a, n_mb) for a in (x, ids, positions))  # [M, B_m, ...]
    forced = None
    if routing_replay is not None:  # -> [P, M, B_m, S, R / P, period, k]: stage p's layers of micro-batch m
        f = split_micro_batches(routing_replay[:, :, grp.start:grp.stop], n_mb)
        forced = jnp.transpose(f.reshape(n_mb, bm, s, n_st, rps, grp.period, -1), (3, 0, 1, 2, 4, 5, 6))
    stage = jnp.arange(n_st)
    # each sub-layer step vmapped over the stage dim, inside `run_group` / the hand-written backward: the remat's
    # backward and the EP dispatch's shard_map are then differentiated inside the vmap, which is how JAX batches a
    # shard_map (`spmd_axis_name` known while its residuals are made)
    spmd = _stage_axis()
    steps = [jax.vmap(st, in_axes=(0, 0, None if forced is None else 0, 0, 0), spmd_axis_name=spmd)
             for st in group_steps(graphdefs, dispatch_fn)]
    if is_block_remat(remat):
        w = tuple(jax.tree.map(lambda a: a.reshape(n_st, rps, *a.shape[1:]), st) for st in raw)  # [P, R / P, ...]
        ys, rs, ds = _block_remat_pipeline(steps, n_st, n_mb, rps)(w, x_mb, pos_mb, ids_mb, forced)
    else:
        # [R, ...] -> [P, R / P, ...] (stage p's contiguous repetitions) -> [R / P, P, ...]: the scan over a stage's
        # repetitions steps every stage's layer at once (`run_group` over the stage-vmapped steps)
        w = tuple(jax.tree.map(lambda a: jnp.swapaxes(a.reshape(n_st, rps, *a.shape[1:]), 0, 1), st) for st in raw)

        def body(buf, t):
            mb = (t - stage) % n_mb  # [P]: the micro-batch each stage works on (bubble: any, discarded)
            inp = _stage_input(x_mb, buf, t, n_mb)
            fo = None if forced is None else _stage_forced(forced[stage, mb])
            out, (r, d) = run_group(steps, w, inp, fo, pos_mb[mb], ids_mb[mb], repeats=rps, remat=remat)
            return _stage_output(out, r, d)

        _, (ys, rs, ds) = jax.lax.scan(body, _buf0(x_mb, n_st), jnp.arange(plan.iterations))
    # routes [T, R / P, period, P, B_m, S, k] -> [T, P, B_m, S, L_s, k] (layer order in the stage); drops [T, P, 2]
    rs = jnp.transpose(rs, (0, 3, 4, 5, 1, 2, 6)).reshape(plan.iterations, n_st, bm, s, lps, -1)
    it = jnp.arange(plan.iterations)[:, None]
    valid = (it >= stage[None]) & (it - stage[None] < n_mb)  # [T, P]: the iterations a stage had a micro-batch
    ds = jnp.where(valid[..., None], jnp.sum(ds, axis=(1, 2)), 0)
    x_out = merge_micro_batches(ys[n_st - 1:])  # the last stage's outputs, micro-batch m at iteration m + P - 1
    at = jnp.arange(n_mb)[:, None] + stage[None, :]  # iteration at which stage p ran micro-batch m: [M, P]
    r = rs[at, stage[None, :]]  # -> [M, P, B_m, S, L_s, k]
    routes = merge_micro_batches(jnp.transpose(r, (0, 2, 3, 1, 4, 5)).reshape(n_mb, bm, s, n_st * lps, -1))
    return x_out, routes, jnp.sum(ds, axis=(0, 1))


def _stage_input(x_mb: jax.Array, buf: jax.Array, t: jax.Array, n_mb: int) -> jax.Array:
    """Iteration t's stage inputs [P, B_m, S, n, D]: stage 0 reads micro-batch t (mod M), the others `buf`."""
    first = (jnp.arange(buf.shape[0]) == 0)[:, None, None, None, None]
    return rl.constrain(jnp.where(first, x_mb[t % n_mb][None], buf), _BUF)


def _stage_forced(fo: jax.Array) -> jax.Array:
    """Forced routes of each stage's micro-batch [P, B_m, S, R / P, period, k] -> [R / P, period, P, B_m, S, k]."""
    return jnp.transpose(fo, (3, 4, 0, 1, 2, 5))


def _stage_output(out: jax.Array, r: Any, d: jax.Array):
    """(next `buf`, (the last stage's output, routes, drops)) of one iteration: `jnp.roll(out, 1, axis=0)` hands stage
    p's output to stage p + 1 (XLA lowers the roll of a stage-split dim to a collective permute); the last stage's
    output keeps the batch's row split (without the constraint the backward's slice of the stacked cotangents was
    all-gathered over the batch axes, whole, every iteration: 96 GiB per step at 7 Flash layers on
    stage=2,expert=8)."""
    nxt = rl.constrain(jnp.roll(out, 1, axis=0), _BUF)
    return nxt, (rl.constrain(out[out.shape[0] - 1], _ROWS), r, d)


def _buf0(x_mb: jax.Array, n_st: int) -> jax.Array:
    """The first iterations' `buf`: finite filler (micro-batch 0), its results discarded."""
    return jnp.broadcast_to(x_mb[0][None], (n_st, *x_mb.shape[1:]))


def _block_remat_pipeline(steps: Sequence[Callable], n_st: int, n_mb: int, rps: int):
    """The GPipe loop under remat "block" with a hand-written backward, as
    `f(w, x_mb, pos_mb, ids_mb, forced) -> (ys [T, B_m, S, n, D], routes [T, R / P, period, P, B_m, S, k],
    drops [T, R / P, period, P, 2])`; w: per sub-layer the stacked state viewed [P, R / P, ...] (stage p's
    repetitions, no copy), x_mb / pos_mb / ids_mb [M, B_m, ...], forced [P, M, B_m, S, R / P, period, k] or None.

    The forward saves each sub-layer's input per iteration (`block_remat.to_bits`), as `dsv4.scan`'s block remat. The
    backward runs the iterations in reverse, each stage's repetitions in reverse (`dsv4.block_remat.period_backward`:
    recompute, differentiate), and adds each layer's weight cotangent into one accumulator per weight, in place
    (a carry of both loops; repetition i of every stage is the slice [:, i]). `jax.grad` of the plain loop
    instead made each iteration's stacked weight cotangents as a loop output and added them to its own
    accumulator: two copies of the pipelined weights' gradients (Flash on stage=2,expert=8: +30 GiB per device, the
    routed experts' 6 x 5 GiB)."""
    stage = jnp.arange(n_st)
    n_it = n_mb + n_st - 1

    def run(w, x_mb, pos_mb, ids_mb, forced, save):
        def body(buf, t):
            mb = (t - stage) % n_mb
            inp = _stage_input(x_mb, buf, t, n_mb)
            fo = None if forced is None else _stage_forced(forced[stage, mb])
            pos, tid = pos_mb[mb], ids_mb[mb]

            def rep(x, i):
                saved = [] if save else None
                x, r = br.run_period(steps, br.take(w, i, axis=1), None if fo is None else fo[i], x, pos, tid,
                                     saved)
                return x, (None if saved is None else tuple(saved), r)

            out, (sv, (r, d)) = jax.lax.scan(rep, inp, jnp.arange(rps))
            nxt, y = _stage_output(out, r, d)
            return nxt, (y, sv)

        _, (y, sv) = jax.lax.scan(body, _buf0(x_mb, n_st), jnp.arange(n_it))
        return y, sv

    @jax.custom_vjp
    def f(w, x_mb, pos_mb, ids_mb, forced):
        return run(w, x_mb, pos_mb, ids_mb, forced, save=False)[0]

    def f_fwd(w, x_mb, pos_mb, ids_mb, forced):
        y, sv = run(w, x_mb, pos_mb, ids_mb, forced, save=True)
        return y, (w, sv, x_mb, pos_mb, ids_mb, forced)

    def f_bwd(res, cts):
        w, sv, x_mb, pos_mb, ids_mb, forced = res
        ct_ys = cts[0]  # [T, B_m, S, n, D]; the routes and drops are integers
        diff = br.differentiable(w)
        acc0 = tuple([jnp.zeros_like(a) for a, d in zip(jax.tree.leaves(st), dj) if d] for st, dj in zip(w, diff))
        last = (stage == n_st - 1)[:, None, None, None, None]

        def body(carry, t):
            ct_buf, acc = carry
            mb = (t - stage) % n_mb
            fo = None if forced is None else _stage_forced(forced[stage, mb])
            pos, tid = pos_mb[mb], ids_mb[mb]
            sv_t = br.take(sv, t)
            # out -> (roll: next buf, out[P - 1]: ys[t]); the last stage's rolled-over output is ignored by stage 0
            ct_out = jnp.roll(ct_buf, -1, axis=0) + jnp.where(last, ct_ys[t][None], 0).astype(ct_buf.dtype)
            ct_out = rl.constrain(ct_out, _BUF)

            def rep(c, i):
                ct_x, acc = c
                ct_x, cts = br.period_backward(steps, diff, br.take(w, i, axis=1), br.take(sv_t, i),
                                               None if fo is None else fo[i], pos, tid, ct_x)
                put = lambda a, g: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
                    a, jax.lax.dynamic_index_in_dim(a, i, 1, keepdims=False) + g.astype(a.dtype), i, 1)
                return (ct_x, tuple([put(a, g) for a, g in zip(aj, gj)] for aj, gj in zip(acc, cts))), None

            (ct_inp, acc), _ = jax.lax.scan(rep, (ct_out, acc), jnp.arange(rps), reverse=True)
            ct_inp = rl.constrain(ct_inp, _BUF)
            ct_buf = jnp.where((stage == 0)[:, None, None, None, None], 0, ct_inp).astype(ct_buf.dtype)
            # stage 0's input cotangent, its rows split as the batch's (a carry of all M micro-batches' instead lost
            # that split: all-gathered over the batch axes every iteration, 83 GiB per step on Flash)
            return (ct_buf, acc), rl.constrain(ct_inp[0], _ROWS)

        ct_buf0 = jnp.zeros((n_st, *x_mb.shape[1:]), ct_ys.dtype)
        (ct_buf, acc), ct_first = jax.lax.scan(body, (ct_buf0, acc0), jnp.arange(n_it), reverse=True)
        # iteration t read micro-batch t mod M at stage 0 (t >= M: the bubble, a zero cotangent); `_buf0`'s filler
        # is micro-batch 0 (a zero cotangent too)
        rounds = -(-n_it // n_mb)
        ct_first = jnp.pad(ct_first, [(0, rounds * n_mb - n_it)] + [(0, 0)] * (ct_first.ndim - 1))
        ct_x_mb = jnp.sum(ct_first.reshape(rounds, n_mb, *ct_first.shape[1:]), axis=0).at[0].add(
            jnp.sum(ct_buf, axis=0))
        return br.weight_cotangents(w, diff, acc), ct_x_mb.astype(x_mb.dtype), None, None, None

    f.defvjp(f_fwd, f_bwd)
    return f


def run_split_over_stages(n_st: int, groups: Sequence[LayerGroup], graphdefs: Sequence[Sequence[Any]], stacked: Any,
                          x: jax.Array, positions: jax.Array, ids: jax.Array, routing_replay: jax.Array | None = None,
                          dispatch_fn: Callable | None = None, *, remat: Any = None):
    """`dsv4.scan.run_layers` of layers outside the pipeline (their weights on every stage) with the batch's rows
    split over the `n_st` stages: stage p runs rows p, p + P, ... (`split_micro_batches`: with the rows split in
    blocks over the batch axes, each device keeps its own rows), each sub-layer step vmapped over the stage dim as
    the pipeline's are, and the outputs gathered back over `stage`. Before, every stage ran these layers (Flash's 3
    hash layers) for the whole batch. Returns what `run_layers` returns. B must divide by `n_st`."""
    b, s = ids.shape
    bs = b // n_st
    split = lambda a: rl.constrain(split_micro_batches(a, n_st), _BUF[:a.ndim + 1])  # noqa: E731  [P, B / P, ...]
    xs, pos, tid = split(x), split(positions), split(ids)
    spmd = _stage_axis()
    routes, drops = [], jnp.zeros((2,), jnp.int32)
    for g, grp in enumerate(groups):
        forced = None
        if routing_replay is not None:  # -> [R, period, P, B / P, S, k]
            f = split_micro_batches(routing_replay[:, :, grp.start:grp.stop], n_st)
            forced = jnp.transpose(f.reshape(n_st, bs, s, grp.repeats, grp.period, -1), (3, 4, 0, 1, 2, 5))
        st = stacked[g].raw_mapping if isinstance(stacked[g], nnx.State) else stacked[g]
        # the weights broadcast over the stage dim (each stage's copy is its own: no traffic): `ragged_dot` (the
        # capacity and ragged EP backends) has no batching rule for unbatched weights beside batched rows
        states = tuple(jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], n_st, *a.shape[1:])),
                                    st[j].raw_mapping if isinstance(st[j], nnx.State) else st[j])
                       for j in range(grp.period))  # [R, P, ...]
        steps = [jax.vmap(step, in_axes=(0, 0, None if forced is None else 0, 0, 0), spmd_axis_name=spmd)
                 for step in group_steps(graphdefs[g], dispatch_fn)]
        xs, (r, d) = run_group(steps, states, xs, forced, pos, tid, repeats=grp.repeats, remat=remat)
        r = jnp.transpose(r, (2, 3, 4, 0, 1, 5)).reshape(n_st, bs, s, grp.repeats * grp.period, -1)
        routes.append(merge_micro_batches(r))
        drops = drops + jnp.sum(d.reshape(-1, 2), axis=0)
    x = rl.constrain(merge_micro_batches(xs), _BUF[1:])  # every stage's rows on every stage again
    return x, jnp.concatenate(routes, axis=2), drops


@struct.dataclass
class PipelineStack:
    """`LayerStack`'s interface (`num_layers`, `run`) for `DSV4ForCausalLM.__call__(..., layer_stack=...)`, with the
    plan's group pipelined (`run_pipelined_group`) and the other groups run as `dsv4.scan.run_layers` does, in
    layer order. A pytree whose only array child is `state` (gradients w.r.t. it are a PipelineStack)."""

    state: Any
    groups: tuple = struct.field(pytree_node=False)
    graphdefs: tuple = struct.field(pytree_node=False)
    plan: PipelinePlan = struct.field(pytree_node=False)
    remat: Any = struct.field(pytree_node=False, default=None)

    @classmethod
    def of(cls, stack: LayerStack, plan: PipelinePlan) -> "PipelineStack":
        """The pipelined form of a `dsv4.scan.merge_stacked` layer stack."""
        return cls(stack.state, stack.groups, stack.graphdefs, plan, stack.remat)

    @property
    def num_layers(self) -> int:
        return self.groups[-1].stop if self.groups else 0

    def run(self, x, positions, ids, routing_replay=None, dispatch_fn=None):
        """x [B, S, n, D], positions / ids [B, S] -> (x [B, S, n, D], routing [B, S, L, k] int32, drops [2] int32),
        equal to `LayerStack.run`'s."""
        g = self.plan.group
        st = self.state.raw_mapping if isinstance(self.state, nnx.State) else self.state
        routes, drops = [], jnp.zeros((2,), jnp.int32)
        for lo, hi in ((0, g), (g, g + 1), (g + 1, len(self.groups))):
            if lo == hi:
                continue
            part = {i: st[lo + i] for i in range(hi - lo)}
            if lo == g:
                gs = part[0].raw_mapping if isinstance(part[0], nnx.State) else part[0]
                x, r, d = run_pipelined_group(self.plan, self.groups[g], self.graphdefs[g], gs, x, positions, ids,
                                              routing_replay, dispatch_fn, remat=self.remat)
            elif x.shape[0] % self.plan.stages:  # rows that do not split over the stages: every stage runs all
                x, r, d = run_layers(self.groups[lo:hi], self.graphdefs[lo:hi], part, x, positions, ids,
                                     routing_replay, dispatch_fn, remat=self.remat)
            else:
                x, r, d = run_split_over_stages(self.plan.stages, self.groups[lo:hi], self.graphdefs[lo:hi], part,
                                                x, positions, ids, routing_replay, dispatch_fn, remat=self.remat)
            routes.append(r)
            drops = drops + d
        return x, jnp.concatenate(routes, axis=2), drops
