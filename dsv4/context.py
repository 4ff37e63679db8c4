"""Context parallelism (CP) of the full-sequence attention: the sequence split over the actor's `context` mesh axis.

Under a rule table that maps `act_seq` to a mesh axis of size C > 1 (`sharding.rules.ACTOR_RULES`: `context`),
every per-token activation of the model is split along S into C contiguous shards of S_l = S / C tokens (SPMD
places them from the model's `constrain` calls; per-token work needs nothing more). Only the attention mixes
tokens; `attend_context` runs its token-mixing part under `jax.shard_map` over the context axis alone (the other
mesh axes stay automatic), shard c holding global positions [c S_l, (c+1) S_l):
- sliding window: shard c receives the last h = window - 1 keys/values of the shards before it (one collective
  permute per shard hop, ceil(h / S_l) hops, 1 whenever S_l >= h): never the whole sequence. Its queries then
  attend over [halo | own keys] with `dsv4.blocked.attend_blocked` (halo queries are zero and dropped).
- CSA / HCA compressed entries: S_l is a multiple of the ratio m (the model pads S, `seq_multiple`), so every
  compression window lies inside one shard; each shard pools its own windows. CSA's overlap (entry w also pools
  window w-1's first halves) takes the previous shard's last window of projections (A, Z + ape) as the
  compressor's `prev_a` / `prev_z` (a collective permute of m tokens); shard 0 gets the empty slots of the dense
  math (A = 0, Z = -inf). Entries are normed and rotated at their global position w m, then all-gathered
  (S / m entries, m = 4 or 128: the cheap part), as are the lightning indexer's compressed keys.
- the indexer scores each query against all gathered keys and keeps its top-k (the same `jax.lax.top_k` over the
  same row as `Indexer.select_blocked`); visibility, the window and RoPE use global positions, so sinks, YaRN
  and the (right-aligned) padding behave as in the unsplit model.
Gradients: autodiff through the collectives (a permute's transpose is the reverse permute, an all-gather's a
reduce-scatter), so the backward is as split as the forward. Equality with context=1: tests/dsv4/test_context.py.

Sources (ideas, not code): ring / context-parallel attention as in MaxText (`context` mesh axis, sequence sharded
by the logical-axis rules) and Megatron-LM CP; NeMo-RL's DeepSeek-V4 CP (sequence-sharded, compressed KV
all-gathered); jax docs "shard_map" (partial manual axes via `axis_names`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsv4.blocked import FAR, attend_blocked
from dsv4.compressor import visible_entries, window_pool
from dsv4.config import CSA, SLIDING
from sharding import axes as ax
from sharding.rules import active_rules, mesh_axes_for


def context_axis() -> tuple[str, int, Mesh] | None:
    """(mesh axis, size C, mesh) splitting `act_seq` under the active `use_rules` block, or None (no CP: no block,
    or the axis absent / of size 1). Raises ValueError if the rules split the sequence over more than one axis."""
    active = active_rules()
    if active is None:
        return None
    rules, mesh = active
    axes = [a for a in mesh_axes_for(ax.ACT_SEQ, rules) if mesh.shape.get(a, 1) > 1]
    if not axes:
        return None
    if len(axes) > 1:
        raise ValueError(f"context parallelism splits the sequence over one mesh axis; the rules give {axes}")
    return axes[0], int(mesh.shape[axes[0]]), mesh


def seq_multiple(cfg) -> int:
    """Per-shard token count multiple under CP: the lcm of the compression ratios in use (1 if none), so that
    every compression window lies inside one context shard. The model pads S to C times this."""
    ratios = [int(r) for r in cfg.compress_ratios if int(r) > 0]
    return math.lcm(*ratios) if ratios else 1


def _from_prev(x: jax.Array, axis: str, n: int, hop: int) -> jax.Array:
    """Shard c receives shard c - hop's x (shards c < hop receive zeros). x [B, ...] any local array."""
    return jax.lax.ppermute(x, axis, [(j, j + hop) for j in range(n - hop)])


def _halo(kv: jax.Array, axis: str, n: int, h: int) -> jax.Array:
    """The h keys/values before this shard's first token: kv [B, S_l, d] -> [B, h, d] (zeros before the start)."""
    s_l = kv.shape[1]
    hops = -(-h // s_l)
    parts = [_from_prev(kv, axis, n, j) if j < n else jnp.zeros_like(kv)  # before shard 0: nothing
             for j in range(hops, 0, -1)]  # shards c-hops .. c-1, in order
    return jnp.concatenate(parts, axis=1)[:, hops * s_l - h:]


def _pool_local(compressor, a: jax.Array, z: jax.Array, axis: str, n: int) -> jax.Array:
    """This shard's compressed entries: a, z [B, S_l, c d] float32 (z with ape) -> [B, S_l / m, d] (compute dtype of
    the compressor), pooled as `Compressor.full` (CSA: the previous shard's last window carried in) and normed +
    rotated at global window index (shard index) * S_l / m."""
    b, s_l, width = a.shape
    m = compressor.ratio
    n_win = s_l // m
    idx = jax.lax.axis_index(axis)
    prev_a = prev_z = None
    if compressor.overlap:
        prev_a = _from_prev(a[:, -m:], axis, n, 1)
        prev_z = jnp.where(idx == 0, -jnp.inf, _from_prev(z[:, -m:], axis, n, 1))
    pooled = window_pool(a.reshape(b, n_win, m, width), z.reshape(b, n_win, m, width), overlap=compressor.overlap,
                         d=compressor.d, prev_a=prev_a, prev_z=prev_z)
    return compressor.finish(pooled, jnp.full((b,), idx * n_win, jnp.int32))


def _gather(x: jax.Array, axis: str) -> jax.Array:
    """[B, W_l, ...] per shard -> [B, C W_l, ...] (all shards, in order), x's dtype. Gathered as float32 (exact for
    bf16): its transpose, a psum_scatter of the cotangent, must not be a bf16 reduce-scatter in this partially manual
    shard_map, which aborts XLA:CPU as the bf16 psum does (`attend_context`)."""
    return jax.lax.all_gather(x.astype(jnp.float32), axis, axis=1, tiled=True).astype(x.dtype)


def _select(indexer, qi: jax.Array, omega: jax.Array, positions: jax.Array, keys: jax.Array, block_q: int):
    """Top-k entries per query over all gathered keys (as `Indexer.select_blocked`, from precomputed queries).
    qi [B, S_l, H_I, d_I], omega [B, S_l, H_I] float32, positions [B, S_l] (global), keys [B, W, d_I] ->
    (idx [B, S_l, k] int32, valid [B, S_l, k] bool), k = min(index_topk, W)."""
    b, s_l = positions.shape
    n = keys.shape[1]
    k = min(indexer.topk, n)
    if k == 0 or k == n:
        return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, s_l, k)), visible_entries(positions, k,
                                                                                               indexer.ratio)
    sg = jax.lax.stop_gradient
    qb = max(1, min(block_q, s_l))
    nq = -(-s_l // qb)
    pad = nq * qb - s_l

    def blocks(t):  # [B, S_l, ...] -> [nQ, B, qb, ...]
        t = jnp.pad(sg(t), [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        return t.reshape(b, nq, qb, *t.shape[2:]).swapaxes(0, 1)

    def one(blk):
        q, om, pb = blk
        vis = visible_entries(pb, n, indexer.ratio)
        sel = jax.lax.top_k(jnp.where(vis, indexer.scores(q, om, sg(keys)), -jnp.inf), k)[1]
        return sel.astype(jnp.int32), jnp.take_along_axis(vis, sel, axis=-1)

    idx, valid = jax.lax.map(one, (blocks(qi), blocks(omega), blocks(positions)))
    unblock = lambda t: t.swapaxes(0, 1).reshape(b, nq * qb, k)[:, :s_l]  # noqa: E731
    return unblock(idx), unblock(valid)


def attend_context(attn, x: jax.Array, q: jax.Array, q_latent: jax.Array, kv: jax.Array, positions: jax.Array,
                   cos: jax.Array, sin: jax.Array, axis: str, n: int, mesh: Mesh) -> jax.Array:
    """The blocked attention of `attn` (a `dsv4.attention.Attention`) under context parallelism over `axis` (size n)
    of `mesh`.

    Args (global shapes; each is split along S over `axis` by the shard_map):
      x [B, S, D] normalised block input; q [B, S, H, d] rotated queries; q_latent [B, S, q_lora];
      kv [B, S, d] rotated K=V; positions [B, S] int32 (0..S-1 per row, right-aligned as the model runs it);
      cos, sin [B, S, rope/2] the layer's RoPE tables at those positions.
    Returns:
      o [B, S, H, d] float32, equal to `attend_blocked` on the unsplit sequence (fp32: to rounding).
    Raises:
      ValueError: S not a multiple of n * `seq_multiple` (the model pads to it).
    """
    s = q.shape[1]
    ratio = attn.ratio
    if s % n or (ratio and (s // n) % ratio):
        raise ValueError(f"context parallelism over {axis}={n}: S={s} must split into shards that are multiples of "
                         f"the compression ratio {ratio}")
    seq = lambda r: P(None, axis, *([None] * (r - 2)))  # noqa: E731
    args = {"q": q, "kv": kv, "pos": positions}
    if attn.kind != SLIDING:
        a, z = attn.compressor.project(x)
        args.update(ca=a, cz=z + _ape(attn.compressor, s))
        if attn.kind == CSA:
            ind = attn.indexer
            ia, iz = ind.compressor.project(x)
            qi, omega = ind.queries(x, q_latent, cos, sin)
            args.update(ia=ia, iz=iz + _ape(ind.compressor, s), qi=qi, omega=omega)
    # the replicated inputs enter as float32 (their use inside is float32 already: rms_norm, the softmax sink): the
    # transpose of a replicated input is a psum of its cotangent over `axis`, and a bf16 psum (or reduce-scatter:
    # `_gather`) inside this partially manual shard_map aborts XLA:CPU (AllReducePromotion clones its reduction,
    # whose root Shardy left as a copy: `F hlo_instruction.cc Invalid binary instruction opcode copy`;
    # tests/dsv4/test_context.py keeps the smallest such program)
    f32 = lambda w: w.astype(jnp.float32)  # noqa: E731
    sink = f32(attn.attn_sink[...])
    norms = {"c": f32(attn.compressor.norm.weight[...])} if attn.kind != SLIDING else {}
    if attn.kind == CSA:
        norms["i"] = f32(attn.indexer.compressor.norm.weight[...])
    h = attn.window - 1

    def body(args, sink, norms):
        q_l, kv_l, pos = args["q"], args["kv"], args["pos"]
        b, s_l, n_h, d = q_l.shape
        entries = selected = None
        if "ca" in args:
            comp = _Normed(attn.compressor, norms["c"])
            entries = _gather(_pool_local(comp, args["ca"], args["cz"], axis, n), axis).astype(kv_l.dtype)
        if "ia" in args:
            icomp = _Normed(attn.indexer.compressor, norms["i"])
            keys = _gather(_pool_local(icomp, args["ia"], args["iz"], axis, n), axis)
            selected = _select(attn.indexer, args["qi"], args["omega"], pos, keys, attn.block_q)
        if h > 0:
            idx = jax.lax.axis_index(axis)
            before = idx * s_l - h + jnp.arange(h, dtype=jnp.int32)  # global index of each halo slot
            halo_pos = jnp.where(before >= 0, pos[:, :1] - h + jnp.arange(h, dtype=jnp.int32)[None], -FAR)
            kv_l = jnp.concatenate([_halo(kv_l, axis, n, h), kv_l], axis=1)
            q_l = jnp.concatenate([jnp.zeros((b, h, n_h, d), q_l.dtype), q_l], axis=1)
            pos = jnp.concatenate([halo_pos, pos], axis=1)
            if selected is not None:
                selected = (jnp.pad(selected[0], ((0, 0), (h, 0), (0, 0))),
                            jnp.pad(selected[1], ((0, 0), (h, 0), (0, 0))))
        o = attend_blocked(q_l, kv_l, pos, sink, attn.head_dim ** -0.5, window=attn.window, entries=entries,
                           ratio=ratio, selected=selected, block_q=attn.block_q, block_k=attn.block_k)
        return o[:, h:]

    in_specs = ({k: seq(v.ndim) for k, v in args.items()}, P(), {k: P() for k in norms})
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=seq(4), axis_names={axis}, check_vma=False)(
        args, sink, norms)


def _ape(compressor, s: int) -> jax.Array:
    """The learned position bias of a compressor at positions 0..s-1: [s, c d] float32 (`ape[t mod m]`)."""
    return jnp.tile(compressor.ape[...].astype(jnp.float32), (-(-s // compressor.ratio), 1))[:s]


class _Normed:
    """A compressor's pooling constants with its norm weight passed into the shard_map explicitly (`finish`)."""

    def __init__(self, compressor, norm_weight: jax.Array):
        self.c, self.w = compressor, norm_weight
        self.ratio, self.overlap, self.d = compressor.ratio, compressor.overlap, compressor.d

    def finish(self, pooled: jax.Array, window_index: jax.Array) -> jax.Array:
        return self.c.finish_with(pooled, window_index, self.w)


__all__ = ["attend_context", "context_axis", "seq_multiple"]
