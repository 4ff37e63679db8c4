"""Expert parallelism (EP) for the routed experts: a `jax.shard_map` all-to-all dispatch behind one function.

`make_ep_dispatch(mesh, ...)` returns a drop-in replacement for `dsv4.moe.routed_experts_ragged`:

    fn(x [T, D], ids [T, k] int32, weights [T, k] f32, w1 [E, I, D], w3 [E, I, D], w2 [E, D, I],
       *, limit, dtype) -> [T, D] float32

used as `model(input_ids, dispatch_fn=fn)` inside a jit on `mesh`. Routing is decided by the model before the
call, so the expert choice is identical whichever dispatch runs; only where the expert FFN is computed moves.

Layout inside the shard_map (one program per device):
* tokens `x`, `ids`, `weights` are split along T over `token_axes` (the `act_batch` axes of the rule
  presets: data, fsdp, expert; then the actor's `act_seq` axis, context). T is zero-padded to a multiple of their
  product (pad pairs are skipped).
* experts are split over `expert_axis` (ep ranks, E/ep local experts each). The other weight dims arrive as
  the rule table places them (`rules`, default the actor preset): `embed` (D) over fsdp x context, `mlp` (I) over
  tensor.
  D is all-gathered inside the body (FSDP / ZeRO-3: the transpose is a reduce-scatter of the gradient). I stays
  split: each tensor rank computes SwiGLU on its I/tp slice (elementwise in I) and a partial w2 product; one
  psum over the tensor axes of the [T_local, D] output completes it (Megatron MLP; tokens are replicated over
  tensor, which is why tensor may not be a token axis). This moves T*D activations instead of the weights.

Backends (`backend=`):
* "capacity" (runs everywhere, the CPU test path): each rank sorts its (token, k) pairs by destination rank
  into a fixed buffer [ep, C, D], `jax.lax.all_to_all` over the expert axis, grouped FFN over the local experts
  (`jax.lax.ragged_dot_general` after a sort by local expert), all_to_all back, weighted scatter-add combine.
  C = T_local * k (`capacity_factor=None`) is dropless: the worst case, every local pair bound for one rank,
  fits. The price is memory and traffic O(ep * T_local * k * D) per rank, so on large EP meshes pass
  `capacity_factor=f`: C = ceil(f * T_local * k / ep); pairs beyond a rank's C are dropped (they contribute 0,
  the token keeps its other picks and the shared expert): NOT equal to the reference any more, a rollout knob.
* "padded" (every backend; GShard/Switch-style, the path with memory bounded by the capacity; `parallel/padded.py`):
  each rank writes its pairs into per-expert slots [E, C, D] (C = ceil(f * T_local * k / E), `padded_capacity`;
  pairs past an expert's C dropped, first come in (token, k) order), one all_to_all over the expert axis gives each
  rank [n_local, ep * C, D], and the FFN is three batched dense matmuls (`padded_ffn`) instead of `ragged_dot`. Memory
  and traffic per rank O(f * T_local * k * D). Why it exists: XLA:CPU (and CUDA jaxlib 0.10) lower `ragged_dot`
  densely, every row through every local expert ([n_local, rows, I] f32: at Flash scale, 96-192 GiB per buffer,
  measured with `python -m launch.plan --compile`), and on MI300X a grouped `ragged_dot` has been reported
  5-12x slower than capacity-padded dense matmuls. Dropless with `capacity_factor=None`: C = T_local. A token sends
  an expert at most one row (its k picks are distinct experts; repeated picks of one expert, possible only with
  hash routing, are merged first into one row with the summed routing weight, exact since the FFN output is linear
  in that weight), so T_local rows per (source rank, expert) hold every routing: the bound of DeepEP's low-latency
  (decode) buffers, [n_local, ep * T_local, D] per rank. Its work is E / k times the routed pairs', so it is the
  rollout's path where tokens per device per call are few (continuous-batching decode: slots / shards; chunked
  prefill: one request's chunk / shards). With a factor it is a capacity dispatch, C = min(T_local,
  ceil(f * T_local * k / E)): pairs past an expert's C are dropped, first come first served in (token, k) order
  (they contribute 0; the token keeps its other picks and the shared expert).
* "sized" (every backend; the rollout's default on GPUs, `rollout_backend`): "padded" with C chosen per call from
  the actual loads: the global max of the rows a rank sends one expert (a scalar pmax) selects the smallest of a
  few compiled capacities that holds it (`parallel.padded.capacity_buckets`: x `bucket_growth` from the mean load
  up to T_local, or up to f_max = `capacity_factor`), run under `jax.lax.switch`. Dropless (no factor): equal to
  the reference at every load, and a balanced call runs <= `bucket_growth` x the routed rows (all_to_all and
  matmuls) instead of E / k times; memory is the top bucket's, today's dropless bound. With f_max, pairs past
  it are dropped and counted. `compact=True`: each local expert's rows compacted after the all_to_all, the FFN
  on a second load-sized count (random routing at Flash decode: 2x the routed rows instead of 4x).
* "ragged" (GPU): pairs sorted by expert are sent with `jax.lax.ragged_all_to_all` (only the real rows move);
  send/receive offsets come from an all_gather of the [ep] per-rank counts. The receive buffer is
  ep * T_local * k rows (dropless) or ceil(f * T_local * k) with `capacity_factor` (every rank knows all counts,
  so senders clip what a full receiver cannot take, consistently on both sides). XLA:CPU has no
  ragged-all-to-all ("HLO opcode ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"), so on CPU the
  tests exercise this backend's offset bookkeeping with `ragged_all_to_all_reference` (all_gather based).

FP8 experts ("padded" / "sized", `fp8_experts`): w1, w3, w2 may be kind 'fp8' `QuantizedTensor`s (the rollout's
`--rollout.matmul fp8`); their bytes and scales go through the shard_map as they are stored and the expert FFN runs
FP8 GEMMs (`parallel.padded.padded_ffn`); a layout whose I slices are not whole scale blocks is dequantised instead.

Every backend counts what it did: `dispatch_fn.with_stats` returns the output and a `DispatchStats` (capacity
bucket, pairs dropped, pairs routed; global over the token ranks) for `train/expert_drop_frac`; the plain call
returns the output alone and XLA removes the counting.

Numerics follow the reference exactly: the routing weight multiplies the SwiGLU output before w2 (as the official
code), dots return their input dtype for bf16 (`dsv4.layers.dot_out`), the combine accumulates in float32. Tokens
and expert outputs travel in the compute dtype (the outputs are already rounded to it, so nothing is lost), except
with tensor-parallel experts: then each rank's w2 product is a partial sum, kept in float32 through the psum
(one rounding less than the single-device dot; bf16 results then differ from the reference by rounding only).
Gradients: shard_map, all_to_all, ragged_all_to_all, all_gather and psum are all differentiable; `check_vma`
stays on so JAX inserts the psums that the weight gradients need over the axes the weights are replicated on.

Sources (ideas, not code): MaxText `layers/moe.py` (`permute`, `get_all_to_all_params`, `ra2a_and_route`,
dropless `sparse_matmul`); GShard/Switch capacity-factor dispatch; jax docs "shard_map" and
`jax.lax.ragged_all_to_all` (offset semantics); docs/jax-stack.md §3.2 (what runs on CPU).
Tests: `.venv/bin/python -m pytest -q tests/sharding/test_expert.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from dsv4.layers import dot_out
from dsv4.moe import ROUTED_EXPERT_RE, routed_experts_local, swiglu
from dsv4.quant import QuantizedTensor, act_fake_quant
from parallel import padded as padded_lib
from parallel.padded import DispatchStats, exclusive_cumsum, return_dtype
from sharding import axes as ax
from sharding import rules as rl
from sharding.mesh import auto_axes

BACKENDS = ("capacity", "ragged", "padded", "sized")
FP8_BACKENDS = ("padded", "sized")  # the backends whose expert FFN multiplies FP8 experts as FP8 (`padded_ffn`)
DEFAULT_TOKEN_AXES = None  # = the rules' act_batch axes then act_seq axes (`token_axes_of`)


def token_axes_of(rules: rl.Rules) -> tuple[str, ...]:
    """Mesh axes splitting the flattened tokens T = B * S of a `[B, S, D]` activation under `rules`: the `act_batch`
    axes (major) then the `act_seq` axes (context parallelism), the order `reshape(B * S, D)` leaves them in."""
    return rl.mesh_axes_for(ax.ACT_BATCH, rules) + tuple(
        a for a in rl.mesh_axes_for(ax.ACT_SEQ, rules) if a not in rl.mesh_axes_for(ax.ACT_BATCH, rules))

_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_ffn(rows: jax.Array, eid: jax.Array, gate_w: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array,
                *, limit: float, dtype, partial: bool = False, act_q=None) -> jax.Array:
    """Clamped-SwiGLU expert FFN of each row by its own local expert, in the rows' original order.

    Args:
      rows: [M, D] token copies (compute dtype). eid: [M] int32 local expert in [0, n) or n = "empty row".
      gate_w: [M] float32 routing weight (multiplies the SwiGLU output before w2; 0 for empty rows).
      w1, w3: [n, I', D]; w2: [n, D, I'] (I' may be a tensor-parallel slice of I: the result is then partial).
      partial: the w2 product is a tensor-parallel partial sum: keep it in float32 (one rounding after the psum
        instead of one per rank). Otherwise the dots follow the model's rule (`_dot_out`), as the reference.
      act_q: None, or the function applied to the w2 input (`dsv4.moe.routed_experts_ragged`'s contract).
    Returns:
      [M, D] float32 (values of `dtype` precision unless partial); empty rows are 0.
    """
    n = w1.shape[0]
    order = jnp.argsort(eid, stable=True)  # empty rows (eid == n) sort last, outside every group
    sizes = jnp.bincount(eid, length=n).astype(jnp.int32)  # values >= n are not counted

    def gmm(lhs, w, out):
        return jax.lax.ragged_dot_general(lhs, w.astype(dtype), sizes, _RAGGED_DN,
                                          preferred_element_type=out).astype(jnp.float32)

    xs = rows[order].astype(dtype)
    h = swiglu(gmm(xs, w1, dot_out(dtype)), gmm(xs, w3, dot_out(dtype)), limit)
    h = (h * gate_w[order][:, None]).astype(dtype)
    h = h if act_q is None else act_q(h)
    y = gmm(h, w2, jnp.float32 if partial else dot_out(dtype))
    y = jnp.where((eid[order] < n)[:, None], y, 0.0)  # rows past the groups: never garbage, whatever the backend
    return jnp.zeros_like(y).at[order].set(y)


def _capacity_body(x, ids, w, w1, w3, w2, *, ep, n_local, capacity, expert_axis, limit, dtype, partial, act_q=None):
    """One rank, capacity backend. x [Tl, D], ids/w [Tl, k] -> ([Tl, D] float32 (partial over I if TP), local
    `DispatchStats`: pairs past a destination rank's C dropped)."""
    t_loc, k = ids.shape
    n_pairs = t_loc * k
    flat = ids.reshape(-1)
    dest = jnp.where(flat >= 0, flat // n_local, ep)  # [N] destination rank; ep = skipped pair
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=ep)  # [ep]
    starts = exclusive_cumsum(counts)
    slot = jnp.arange(capacity)
    valid = slot[None, :] < jnp.minimum(counts, capacity)[:, None]  # [ep, C]
    pair = order[jnp.clip(starts[:, None] + slot[None, :], 0, n_pairs - 1)]  # [ep, C] pair index per slot
    tok = pair // k
    send_x = jnp.where(valid[..., None], x[tok].astype(dtype), 0)  # [ep, C, D]
    send_e = jnp.where(valid, flat[pair] % n_local, n_local).astype(jnp.int32)  # [ep, C]; n_local = empty
    send_w = jnp.where(valid, w.reshape(-1)[pair], 0.0)
    if ep > 1:
        a2a = functools.partial(jax.lax.all_to_all, axis_name=expert_axis, split_axis=0, concat_axis=0, tiled=True)
        send_x, send_e, send_w = a2a(send_x), a2a(send_e), a2a(send_w)  # now [source rank, C, ...]
    d = x.shape[-1]
    y = grouped_ffn(send_x.reshape(-1, d), send_e.reshape(-1), send_w.reshape(-1), w1, w3, w2, limit=limit,
                    dtype=dtype, partial=partial, act_q=act_q).reshape(ep, capacity, d)
    if ep > 1:  # back to [destination rank, C, D]; exact in `dtype` unless a tensor-parallel partial sum
        y = jax.lax.all_to_all(y.astype(return_dtype(dtype, partial)), expert_axis, 0, 0, tiled=True)
    y = jnp.where(valid[..., None], y, 0.0)
    y = jnp.zeros((t_loc, d), jnp.float32).at[tok.reshape(-1)].add(y.reshape(-1, d).astype(jnp.float32))
    return y, padded_lib.local_stats(0, capacity, counts)


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                 axis_name):
    """Same result as `jax.lax.ragged_all_to_all` (without axis_index_groups), built from all_gather + gather.

    For CPU tests only (XLA:CPU lacks the real op): it moves the whole operand of every rank. Shapes as the jax
    op: operand [N, ...], output [M, ...], the four offset/size arrays [ep] int32.
    """
    me = jax.lax.axis_index(axis_name)
    all_x = jax.lax.all_gather(operand, axis_name)  # [ep, N, ...]
    in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [ep sources]: where my rows start at s
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]  # where s writes into my output
    m = jnp.arange(output.shape[0])
    hit = (m[None, :] >= out_off[:, None]) & (m[None, :] < (out_off + sizes)[:, None])  # [ep, M]
    src = jnp.argmax(hit, axis=0)
    row = jnp.clip(in_off[src] + m - out_off[src], 0, operand.shape[0] - 1)
    got = all_x[src, row]
    mask = jnp.any(hit, axis=0).reshape((-1,) + (1,) * (operand.ndim - 1))
    return jnp.where(mask, got, output)


def _ragged_body(x, ids, w, w1, w3, w2, *, ep, n_local, buffer_rows, expert_axis, limit, dtype, partial, ra2a,
                 act_q=None):
    """One rank, ragged backend. x [Tl, D], ids/w [Tl, k] -> ([Tl, D] float32 (partial over I if TP), local
    `DispatchStats`: pairs a full receiver could not take dropped)."""
    t_loc, k = ids.shape
    d = x.shape[-1]
    flat = ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, ep * n_local)  # sort by global expert = by (rank, local expert)
    order = jnp.argsort(key, stable=True)
    tok = order // k
    dest = key[order] // n_local  # [N] sorted; ep = skipped
    counts = jnp.bincount(dest, length=ep).astype(jnp.int32)  # [ep] pairs I send to each rank
    if ep == 1:
        y = grouped_ffn(x[tok], key[order].astype(jnp.int32), w.reshape(-1)[order], w1, w3, w2, limit=limit,
                        dtype=dtype, partial=partial,
                        act_q=act_q)  # one rank: the global id is the local one; skipped = n_local
        return jnp.zeros((t_loc, d), jnp.float32).at[tok].add(y), padded_lib.local_stats(0, t_loc * k, counts)
    me = jax.lax.axis_index(expert_axis)
    all_counts = jax.lax.all_gather(counts, expert_axis)  # [ep src, ep dst]
    in_off = exclusive_cumsum(all_counts, axis=1)  # where rows for dst start in src's send buffer
    out_off = exclusive_cumsum(all_counts, axis=0)  # where src's rows start in dst's receive buffer
    sent = jnp.clip(buffer_rows - out_off, 0, all_counts)  # what fits in a full receiver (dropless: all)
    # Offsets of empty (size-0) slices are clipped into range; a non-empty slice always starts in range.
    n_pairs = t_loc * k
    send_args = (jnp.minimum(in_off[me], n_pairs - 1), sent[me], jnp.minimum(out_off[me], buffer_rows - 1),
                 sent[:, me])
    rows = ra2a(x[tok].astype(dtype), jnp.zeros((buffer_rows, d), dtype), *send_args, axis_name=expert_axis)
    eid = ra2a((key[order] % n_local).astype(jnp.int32), jnp.full((buffer_rows,), n_local, jnp.int32),
               *send_args, axis_name=expert_axis)
    gw = ra2a(w.reshape(-1)[order], jnp.zeros((buffer_rows,), jnp.float32), *send_args, axis_name=expert_axis)
    y = grouped_ffn(rows, eid, gw, w1, w3, w2, limit=limit, dtype=dtype, partial=partial,
                    act_q=act_q)  # [buffer_rows, D]
    ret = return_dtype(dtype, partial)
    back_args = (jnp.minimum(out_off[:, me], buffer_rows - 1), sent[:, me], jnp.minimum(in_off[:, me], n_pairs - 1),
                 sent[me])
    back = ra2a(y.astype(ret), jnp.zeros((n_pairs, d), ret), *back_args, axis_name=expert_axis)  # sorted pairs
    stats = padded_lib.DispatchStats(jnp.int32(0), jnp.int32(buffer_rows), jnp.sum(counts - sent[me]).astype(
        jnp.int32), jnp.sum(counts).astype(jnp.int32), jnp.int32(buffer_rows))
    return jnp.zeros((t_loc, d), jnp.float32).at[tok].add(back.astype(jnp.float32)), stats


def _axes_tuple(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def make_ep_dispatch(mesh: Mesh, *, backend: str = "capacity", capacity_factor: float | None = None,
                     token_axes: Sequence[str] | None = DEFAULT_TOKEN_AXES, expert_axis: str = rl.EXPERT,
                     rules: rl.Rules = rl.ACTOR_RULES, bucket_growth: float = 2.0, compact: bool = False,
                     check_vma: bool = True, _ragged_all_to_all: Callable | None = None) -> Callable:
    """Build the expert-parallel `dispatch_fn` for `mesh` (see the module docstring for the algorithm).

    Args:
      mesh: the jax Mesh the model's jit runs on (actor or rollout mesh of `MeshPlan`; Explicit axes are taken as
        Auto, `sharding.mesh.auto_axes`).
      backend: "capacity" (all_to_all on a padded per-rank buffer, `ragged_dot` over the local experts; CPU and
        GPU), "ragged" (ragged_all_to_all + `ragged_dot`; GPU), "padded" (all_to_all on per-expert buffers and
        batched dense matmuls, no `ragged_dot`: GShard-style; every backend; the one with bounded memory on XLA:CPU
        and with a `capacity_factor`) or "sized" (padded with the buffer sized per call from the loads:
        `parallel.padded.sized_body`).
      capacity_factor: None = dropless (default). f > 0 bounds the buffers (module docstring; "padded": C =
        `padded_capacity`; "sized": the largest of its capacities, f_max); pairs that do not fit are dropped, so
        results differ from the reference once any buffer overflows (`with_stats` counts them).
      token_axes: mesh axes splitting the flattened tokens T; None = `token_axes_of(rules)` (the act_batch axes,
        then the act_seq axes: context parallelism); axes the mesh lacks are ignored. Must include `expert_axis`
        and the axes that split the weights' `embed` dim, and exclude the axes that split `mlp` (tokens must be
        replicated where the FFN is tensor-parallel).
      expert_axis: the mesh axis splitting the expert dim E.
      rules: rule table that placed the weights (ACTOR_RULES / ROLLOUT_RULES); it fixes the shard_map in_specs
        of w1, w3, w2. Weights laid out otherwise are resharded by XLA at the boundary (correct, slower).
      bucket_growth: "sized": ratio of consecutive compiled capacities (`parallel.padded.capacity_buckets`).
      check_vma: the shard_map's varying-axes check (module docstring "Gradients"). False for a dispatch that runs
        inside the pipeline's stage vmap (`parallel/pipeline.py`, `jax.vmap(spmd_axis_name="stage")`): JAX's
        batching of a checked shard_map marks the batched inputs as varying over `stage` but not the values the
        body makes itself, and refuses the mix ("requires varying manual axes to match"). Unchecked, the weight
        gradients are still the unpipelined step's (tests/parallel/test_pipeline.py, on stage x expert x fsdp).
      compact: "sized": after the all_to_all, each local expert's rows are compacted and the FFN runs on the
        smallest of a second set of compiled row counts (x `bucket_growth` from the mean rows per expert) that
        holds the busiest expert: expert flops ~ the routed ones even where a few (source rank, expert) loads
        set C; more compiled branches (outer x inner).
      _ragged_all_to_all: test hook replacing `jax.lax.ragged_all_to_all` (same signature).
    Returns:
      dispatch_fn(x [T, D], ids [T, k] int32, weights [T, k] f32, w1 [E, I, D], w3 [E, I, D], w2 [E, D, I], *,
      limit, dtype) -> [T, D] float32, equal to `dsv4.moe.routed_experts_ragged` (dropless). ids < 0 are skipped.
      Its attributes: `with_stats` (same arguments) -> ([T, D], `DispatchStats` over all tokens: the capacity
      bucket that ran, pairs dropped / routed), `can_drop` (a capacity factor is set), `dispatch_name`.
    Raises:
      ValueError: unknown backend, bad capacity_factor, unknown mesh axes, or token axes incompatible with the
        weight layout (at construction); E not divisible by the expert axis or a weight layout that does not
        split E over `expert_axis` alone (when first traced).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown EP backend {backend!r}; expected one of {BACKENDS}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be None (dropless) or > 0, got {capacity_factor!r}")
    if not bucket_growth > 1:
        raise ValueError(f"bucket_growth must be > 1, got {bucket_growth!r}")
    mesh = auto_axes(mesh)  # a jax.make_mesh mesh (Explicit axes) works too: see sharding.mesh.auto_axes
    names = tuple(mesh.axis_names)
    if expert_axis not in names:
        raise ValueError(f"expert_axis {expert_axis!r} is not an axis of the mesh {names}")
    if token_axes is None:
        token_axes = token_axes_of(rules)
    unknown = [a for a in token_axes if a not in rl.MESH_AXES and a not in names]
    if unknown:
        raise ValueError(f"token_axes {tuple(token_axes)}: unknown mesh axes {unknown}")
    tok_axes = tuple(a for a in token_axes if a in names)
    w13_spec = rl.logical_to_spec((ax.EXPERT, ax.MLP, ax.EMBED), rules, mesh)
    w2_spec = rl.logical_to_spec((ax.EXPERT, ax.EMBED, ax.MLP), rules, mesh)
    exp_axes, mlp_axes, emb_axes = (_axes_tuple(e) for e in w13_spec)
    ep = mesh.shape[expert_axis]
    if exp_axes != ((expert_axis,) if ep > 1 else ()):
        raise ValueError(f"the rules split the expert dim over {exp_axes or 'no axis'}; the EP dispatch needs "
                         f"exactly ({expert_axis!r},) of size {ep}")
    if ep > 1 and expert_axis not in tok_axes:
        raise ValueError(f"expert_axis {expert_axis!r} must be one of token_axes {tok_axes}")
    if set(mlp_axes) & set(tok_axes):
        raise ValueError(f"token_axes {tok_axes} overlap the tensor-parallel axes {mlp_axes} of the weights' "
                         f"mlp dim: tokens must be replicated over them")
    if not set(emb_axes) <= set(tok_axes):
        raise ValueError(f"the weights' embed dim is split over {emb_axes}, which must be among token_axes {tok_axes}")
    n_tok = math.prod(mesh.shape[a] for a in tok_axes)
    tp = math.prod(mesh.shape[a] for a in mlp_axes)
    ra2a = _ragged_all_to_all or jax.lax.ragged_all_to_all
    fp8_experts = backend in FP8_BACKENDS

    def with_stats(x, ids, weights, w1, w3, w2, *, limit, dtype, act_q=None):
        t, k = ids.shape
        n_exp = w1.shape[0]
        if n_exp % ep:
            raise ValueError(f"n_routed_experts={n_exp} is not divisible by the expert axis "
                             f"{expert_axis}={ep}")
        pad = -t % n_tok
        if pad:  # pad rows carry id -1: skipped by both backends
            x = jnp.pad(x, ((0, pad), (0, 0)))
            ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1)
            weights = jnp.pad(weights, ((0, pad), (0, 0)))
        t_loc = (t + pad) // n_tok
        n_pairs = t_loc * k
        fp8 = isinstance(w1, QuantizedTensor)
        if fp8 and not (fp8_experts and padded_lib.fp8_layout_ok(w1, w2, tp)):  # the dequant path, as `dsv4.moe.MoE`'s
            x, act_q = act_fake_quant(x.astype(dtype)), act_fake_quant
            w1, w3, w2 = (v.dequantize(dtype) for v in (w1, w3, w2))
            fp8 = False
        kw = dict(ep=ep, n_local=n_exp // ep, expert_axis=expert_axis, limit=limit, dtype=dtype,
                  partial=bool(mlp_axes), act_q=act_q)
        if backend == "capacity":
            cap = n_pairs if capacity_factor is None else min(n_pairs, max(1, math.ceil(capacity_factor * n_pairs
                                                                                         / ep)))
            local = functools.partial(_capacity_body, capacity=cap, **kw)
        elif backend == "padded":
            local = functools.partial(padded_lib.padded_body, capacity=padded_lib.padded_capacity(
                t_loc, k, n_exp, capacity_factor), **kw)
        elif backend == "sized":
            inner = padded_lib.capacity_buckets(ep * t_loc, k, n_exp, None, bucket_growth) if compact else None
            local = functools.partial(padded_lib.sized_body, buckets=padded_lib.capacity_buckets(
                t_loc, k, n_exp, capacity_factor, bucket_growth), token_axes=tok_axes, inner=inner, **kw)
        else:
            rows = ep * n_pairs if capacity_factor is None else max(1, math.ceil(capacity_factor * n_pairs))
            local = functools.partial(_ragged_body, buffer_rows=rows, ra2a=ra2a, **kw)

        def body(x_l, ids_l, w_l, w1_l, w3_l, w2_l):
            if fp8:  # the local experts' FP8 bytes (D gathered under FSDP) and their local scale blocks
                w1_l, w3_l = (padded_lib.local_fp8(v, 2, 1, emb_axes, mlp_axes) for v in (w1_l, w3_l))
                w2_l = padded_lib.local_fp8(w2_l, 1, 2, emb_axes, mlp_axes)
            elif emb_axes:  # FSDP: gather the full D of the local experts (cast first: half the bytes in bf16)
                w1_l = jax.lax.all_gather(w1_l.astype(dtype), emb_axes, axis=2, tiled=True)
                w3_l = jax.lax.all_gather(w3_l.astype(dtype), emb_axes, axis=2, tiled=True)
                w2_l = jax.lax.all_gather(w2_l.astype(dtype), emb_axes, axis=1, tiled=True)
            y, st = local(x_l, ids_l.astype(jnp.int32), w_l.astype(jnp.float32), w1_l, w3_l, w2_l)
            if tok_axes:  # counts over every token rank (unused by a plain call: XLA removes the psums)
                st = st._replace(dropped=jax.lax.psum(st.dropped, tok_axes), routed=jax.lax.psum(st.routed, tok_axes))
            return (jax.lax.psum(y, mlp_axes) if mlp_axes else y), st  # complete the tensor-parallel w2 sum

        tok2 = PartitionSpec(tok_axes or None, None)
        w13_in, w2_in = w13_spec, w2_spec
        if fp8:  # scales split over the experts only (small: 1 / 16,384 of the elements); sliced in the body
            sc = PartitionSpec(w13_spec[0], None, None)
            w13_in = dataclasses.replace(w1, q=w13_spec, scale=sc)
            w2_in = dataclasses.replace(w2, q=w2_spec, scale=sc)
        # unchecked for the GEMM kernel in Pallas' interpreter (CPU tests): its loop drops its carry's varying axes
        checked = check_vma and not (fp8 and w1.matmul == "interpret")  # (jax 0.10.2)
        out, st = jax.shard_map(body, mesh=mesh, in_specs=(tok2, tok2, tok2, w13_in, w13_in, w2_in),
                                out_specs=(tok2, DispatchStats(*(PartitionSpec(),) * 5)),
                                check_vma=checked)(x, ids, weights, w1, w3, w2)
        return (out[:t] if pad else out), st

    def dispatch(*args, **kwargs):
        return with_stats(*args, **kwargs)[0]

    dispatch.__doc__ = f"EP dispatch ({backend}) over {expert_axis}={ep}, tokens split over {tok_axes}."
    bound = ("dropless" if capacity_factor is None else f"capacity factor {capacity_factor:g}") + (
        "; rows compacted per local expert" if compact and backend == "sized" else "")
    dispatch.dispatch_name = f"EP dispatch ({backend}) over {expert_axis}={ep}, tokens split over {tok_axes}; {bound}"
    dispatch.with_stats, dispatch.can_drop = with_stats, capacity_factor is not None
    dispatch.fp8_experts = fp8_experts  # takes FP8 `QuantizedTensor` experts and runs FP8 GEMMs (`dsv4.moe.MoE`)
    return dispatch


def dispatch_name(fn) -> str:
    """How a routed-expert implementation runs, in words: 'EP dispatch (padded) over expert=8, tokens split over
    (...); dropless' / '...; capacity factor 2' for `make_ep_dispatch`'s, else the function's name (None: the
    model's stock ragged_dot)."""
    if fn is None:
        return "the model's ragged_dot"
    return getattr(fn, "dispatch_name", None) or getattr(fn, "__name__", "the model's ragged_dot")


def rollout_backend(cpu: bool) -> str:
    """The backend the sampler's `--rollout.ep_backend auto` picks: "capacity" on XLA:CPU (as the learner), on GPUs
    "sized" with or without a capacity factor. Why not ragged: XLA:GPU expands the sampler's `ragged_dot` densely
    and sizes the dropless ragged buffers for the worst case (the seed rollout compiled to 4,481 GiB per device;
    benchmarks/README.md "GPU plan"); the padded buffers are bounded by the tokens per device of one call
    (C <= T_local), which continuous batching keeps small (decode: slots / shards; prefill: one request's chunk).
    Why "sized" rather than fixed dropless "padded" (C = T_local): the same bound and the same (exact) result, but
    a call runs the smallest compiled capacity its loads need, ~ the routed rows instead of E / k = 43x them."""
    return "capacity" if cpu else "sized"


def auto_backend(cpu: bool, capacity_factor: float | None) -> str:
    """The backend `ep_backend="auto"` (None) picks: "capacity" on XLA:CPU (no ragged all-to-all); on GPUs
    "padded" when a capacity factor bounds the buffers, else "ragged" (dropless). Why padded: XLA:GPU's compile of
    the Flash train step (4 layers, actor fsdp=2 x expert=8, 9,216 tokens per device, MI308X-sized target;
    `python -m launch.plan --compile --target mi308x`) needs 25.5 GiB of temporaries per device with padded at
    f = 1.25 and 476.7 GiB with ragged, whose ragged_dot XLA:GPU expands densely (117x the model flops;
    benchmarks/README.md "GPU plan"). Without a factor the learner's dropless path stays ragged (dropless
    padded, C = T_local, runs E / k = 43x Flash's expert work at a train step's 9,216 tokens per device); the
    sampler's default is `rollout_backend`."""
    if cpu:
        return "capacity"
    return "padded" if capacity_factor is not None else "ragged"


def default_dispatch(devices: Sequence[Any], param_shardings: Mapping[str, Any] | None = None, *,
                     ep_backend: str | None = None, ep_capacity_factor: float | None = None, check_vma: bool = True,
                     compact: bool = False):
    """The routed-expert implementation the sampler and the learner use when none is given (the one place that
    decides).

    Args:
      devices: the devices the model runs on (`jax.Device`s; only `.platform` is read).
      param_shardings: {"/"-joined parameter path, e.g. "layers/1/ffn/experts/w1": its sharding (None or a
        sharding without `.spec` = not sharded)}, or None for a single device.
      ep_backend: backend of `make_ep_dispatch` (`BACKENDS`); None = `auto_backend`
        ("capacity" on CPU; on GPUs "padded" with a capacity factor, else "ragged"). ep_capacity_factor: its
        `capacity_factor` (None = dropless). check_vma: `make_ep_dispatch`'s (False under a pipeline). compact:
        its `compact` ("sized": the rows compacted per local expert after the all_to_all). Expert meshes only.
    Returns:
      - experts split over the `expert` mesh axis (size > 1) of a NamedSharding laid out by the actor or the
        rollout rule table: `make_ep_dispatch(mesh, rules=that table)`, the shard_map all-to-all expert
        parallelism (backend "capacity" on CPU, which lacks ragged-all-to-all; "padded" or "ragged" on GPUs:
        `auto_backend`), so no device ever gathers other devices' experts;
      - otherwise `dsv4.moe.routed_experts_local(devices, param_shardings)`: `routed_experts_cpu` on CPU with
        unsharded experts, else None (the model's stock `routed_experts_ragged`; also the fallback for an expert
        layout the EP dispatch cannot take).
    """
    expert_sh = [sh for k, sh in (param_shardings or {}).items() if ROUTED_EXPERT_RE.search(k)]
    ep = _ep_dispatch(expert_sh, devices, ep_backend, ep_capacity_factor, check_vma, compact)
    if ep is not None:
        return ep
    return routed_experts_local(devices, param_shardings)


def _ep_dispatch(expert_shardings: Sequence[Any], devices: Sequence[Any], backend: str | None = None,
                 capacity_factor: float | None = None, check_vma: bool = True, compact: bool = False):
    """`make_ep_dispatch` for experts sharded over a mesh's `expert` axis (> 1) by a known rule table, else None."""
    named = [sh for sh in expert_shardings if isinstance(sh, jax.sharding.NamedSharding)]
    if not named or len(named) != len(expert_shardings):
        return None
    mesh = named[0].mesh
    if mesh.shape.get(rl.EXPERT, 1) <= 1 or any(sh.mesh != mesh for sh in named):
        return None
    norm = lambda spec: tuple(spec) + (None,) * (3 - len(spec))  # noqa: E731
    if backend is None:
        backend = auto_backend(all(d.platform == "cpu" for d in devices), capacity_factor)
    for rules in (rl.ACTOR_RULES, rl.ROLLOUT_RULES):
        w13 = norm(rl.logical_to_spec((ax.EXPERT, ax.MLP, ax.EMBED), rules, mesh))
        w2 = norm(rl.logical_to_spec((ax.EXPERT, ax.EMBED, ax.MLP), rules, mesh))
        if all(norm(sh.spec) in (w13, w2) for sh in named):
            try:
                return make_ep_dispatch(mesh, backend=backend, capacity_factor=capacity_factor, rules=rules,
                                        check_vma=check_vma, compact=compact)
            except ValueError:  # a layout the EP dispatch cannot take (e.g. tokens split over tensor): GSPMD
                return None
    return None
