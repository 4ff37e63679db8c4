"""Memory-linear attention for the full-sequence path: query blocks, online softmax, per-query top-k gathers.

Same math as `dsv4.attention.attend` on the dense mask of `Attention.__call__` (one softmax over
[window keys | compressed keys | sink], spec §5.3), computed per block of `block_q` queries:
- sliding window: the query block's keys are the `n_prev + 1` kv blocks ending at it (n_prev = ceil((window-1) /
  block_q)), masked by position (s <= t, t - s < window): O(S * (window + block_q)) instead of O(S^2).
- HCA: the compressed entries are visited in blocks of `block_k` with an online (flash-style) softmax, masked by
  visibility (w < floor((t+1)/m)); never an [S, S/m] tensor for all queries at once.
- CSA: the indexer's top-k entries of each query are gathered ([block_q, k, d] per block): O(S * k).
- the sink is the initial state of the online softmax (running max = sink, denominator = exp(sink - sink) = 1).
The running max is a `stop_gradient` (the result does not depend on it), so autodiff gives the exact gradient.
Every block body runs under `jax.checkpoint`: the backward keeps only the scan inputs (O(S)) and recomputes a
block's logits when it needs them, so the backward is linear in S as well (checked by compiled memory analysis in
`benchmarks/learner_scale.py`).

Positions must be consecutive along each row (p, p+1, ...), which is what the model and the prefill pass
(0..S-1 after right-aligning padded rows); masks are computed from the positions themselves, as in the dense path.
Sources: online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867); FlashAttention (Dao et al. 2022,
arXiv 2205.14135) for the blocking; the dense path of this package is the reference (tests/dsv4/test_blocked.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.layers import dot_out

FAR = 1 << 29  # position given to padding: outside every window / causal range of a real query (no int32 overflow)


def _pad_seq(x: jax.Array, before: int, after: int, value) -> jax.Array:
    """Pad axis 1 of x [B, S, ...] with `value`."""
    return jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """[B, n*size, ...] -> [n, B, size, ...]."""
    b, s = x.shape[:2]
    return x.reshape(b, s // size, size, *x.shape[2:]).swapaxes(0, 1)


def _key_blocks(x: jax.Array, qb: int, n_prev: int, front) -> jax.Array:
    """x [B, nQ*qb, ...] -> [nQ, B, (n_prev+1)*qb, ...]: for query block i, the blocks i - n_prev .. i of x
    (blocks before the start filled with `front`)."""
    nq = x.shape[1] // qb
    xp = _pad_seq(x, n_prev * qb, 0, front)
    return jnp.concatenate([_blocks(xp[:, j * qb:(j + nq) * qb], qb) for j in range(n_prev + 1)], axis=2)


def _online_update(state, logits: jax.Array, values: jax.Array, per_query: bool):
    """One online-softmax step. state (m [B,H,Q], l [B,H,Q], acc [B,Q,H,d] float32); logits [B,H,Q,K] float32
    (-inf = masked); values [B,K,d] (shared by the block's queries) or [B,Q,K,d] (per query, `per_query`)."""
    m_old, l_old, acc = state
    m_new = jax.lax.stop_gradient(jnp.maximum(m_old, jnp.max(logits, axis=-1)))
    alpha = jnp.exp(m_old - m_new)
    p = jnp.exp(logits - m_new[..., None])
    l_new = l_old * alpha + jnp.sum(p, axis=-1)
    spec = "bhqk,bqkd->bqhd" if per_query else "bhqk,bkd->bqhd"
    pv = jnp.einsum(spec, p.astype(values.dtype), values, preferred_element_type=dot_out(values.dtype))
    acc = acc * jnp.swapaxes(alpha, 1, 2)[..., None] + pv.astype(jnp.float32)
    return m_new, l_new, acc


def attend_blocked(q: jax.Array, kv: jax.Array, positions: jax.Array, sink: jax.Array, scale: float, *,
                   window: int, entries: jax.Array | None = None, ratio: int = 0,
                   selected: tuple[jax.Array, jax.Array] | None = None, block_q: int = 128,
                   block_k: int = 512) -> jax.Array:
    """Attention over [sliding window | compressed entries | sink], blocked over queries (see the module doc).

    Args:
      q: [B, S, H, d] rotated queries (compute dtype). kv: [B, S, d] rotated K=V (compute dtype).
      positions: [B, S] int32, consecutive per row. sink: [H] float32 sink logits. scale: logit scale.
      window: sliding window (keys t - window < s <= t).
      entries: [B, W, d] compressed entries (compute dtype) or None (sliding layer). ratio: compression m.
      selected: CSA only: (idx [B, S, k] int32 into entries, valid [B, S, k] bool) from
        `dsv4.indexer.Indexer.select_blocked`; None with entries = HCA (every visible entry).
      block_q: queries per block. block_k: compressed entries per online-softmax step (HCA).
    Returns:
      o [B, S, H, d] float32, equal to `dsv4.attention.attend` with the dense mask (fp32: to rounding).
    """
    b, s, h, d = q.shape
    qb = max(1, min(block_q, s))
    nq = -(-s // qb)
    pad = nq * qb - s
    n_prev = -(-(window - 1) // qb)
    qpos = _pad_seq(positions, 0, pad, FAR)
    xs = {"q": _blocks(_pad_seq(q, 0, pad, 0), qb), "qpos": _blocks(qpos, qb),
          "k": _key_blocks(_pad_seq(kv, 0, pad, 0), qb, n_prev, 0),
          "kpos": _key_blocks(qpos, qb, n_prev, -FAR)}
    has_comp = entries is not None and entries.shape[1] > 0
    if has_comp and selected is not None:
        idx, valid = selected
        if idx.shape[-1] == 0:
            has_comp = False
        else:
            xs["idx"] = _blocks(_pad_seq(idx, 0, pad, 0), qb)
            xs["valid"] = _blocks(_pad_seq(valid, 0, pad, False), qb)
    hca = has_comp and selected is None
    if hca:
        n_ent = entries.shape[1]
        kc = max(1, min(block_k, n_ent))
        nk = -(-n_ent // kc)
        ent_blocks = _blocks(_pad_seq(entries, 0, nk * kc - n_ent, 0), kc)  # [nK, B, kc, d]
        ent_index = jnp.arange(nk * kc, dtype=jnp.int32).reshape(nk, kc)

    def logits_of(qi, keys, spec):
        lg = jnp.einsum(spec, qi, keys, preferred_element_type=dot_out(keys.dtype))
        return lg.astype(jnp.float32) * scale

    def body(_, blk):
        qi, tq = blk["q"], blk["qpos"][:, :, None]  # [B, Q, H, d], [B, Q, 1]
        m0 = jnp.broadcast_to(jax.lax.stop_gradient(sink.astype(jnp.float32))[None, :, None], (b, h, qb))
        l0 = jnp.exp(sink.astype(jnp.float32) - jax.lax.stop_gradient(sink.astype(jnp.float32)))  # 1, carries d/dsink
        state = (m0, jnp.broadcast_to(l0[None, :, None], (b, h, qb)), jnp.zeros((b, qb, h, d), jnp.float32))
        tk = blk["kpos"][:, None, :]
        wmask = (tk <= tq) & (tq - tk < window)  # [B, Q, L]
        lg = jnp.where(wmask[:, None], logits_of(qi, blk["k"], "bqhd,bkd->bhqk"), -jnp.inf)
        state = _online_update(state, lg, blk["k"], per_query=False)
        if hca:
            n_vis = (tq + 1) // ratio  # [B, Q, 1]

            def comp_body(st, cblk):
                ent, widx = cblk
                vis = widx[None, None, :] < n_vis
                lgc = jnp.where(vis[:, None], logits_of(qi, ent, "bqhd,bkd->bhqk"), -jnp.inf)
                return _online_update(st, lgc, ent, per_query=False), None

            state, _ = jax.lax.scan(jax.checkpoint(comp_body), state, (ent_blocks, ent_index))
        elif has_comp:
            ent = jax.vmap(lambda e, i: e[i])(entries, blk["idx"])  # [B, Q, k, d]
            lgc = jnp.where(blk["valid"][:, None], logits_of(qi, ent, "bqhd,bqkd->bhqk"), -jnp.inf)
            state = _online_update(state, lgc, ent, per_query=True)
        _, l_fin, acc = state
        return None, acc / jnp.swapaxes(l_fin, 1, 2)[..., None]

    _, o = jax.lax.scan(jax.checkpoint(body), None, xs)  # [nQ, B, Q, H, d]
    return o.swapaxes(0, 1).reshape(b, nq * qb, h, d)[:, :s]


__all__ = ["attend_blocked"]
