"""Lightning indexer of CSA layers: picks the top-k compressed entries per query (spec §5.5).

  K^I_w   = indexer compressor entries (d_I = index_head_dim, overlap, ratio m, RoPE at w m)
  q^I_t,h = RoPE_t(W^I_q c_t)_h            (c_t = the normalised query latent; no per-head norm)
  omega   = (W_w x_t)_h / sqrt(H_I)
  I_t,w   = sum_h omega_t,h ReLU(<q^I_t,h, K^I_w>) / sqrt(d_I)
Invisible entries (w >= floor((t+1)/m)) are masked; top k = min(index_topk, W) are kept, invisible picks dropped.
Selection is by index only: no gradient reaches these parameters from the LM loss (spec §12 item 25).
Everything is float32 (selection flips are costly) but the FP8 rollout's dot over FP8 keys (`Indexer.scores`).
The official QAT (Hadamard + FP4) is not emulated (§12.27).
Sources: official `Indexer`; HF `DeepseekV4Indexer`, `DeepseekV4IndexerScorer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.compressor import Compressor, Weight, visible_entries
from dsv4.decode_kernel import fp8_index_scores, index_kernel_fits
from dsv4.layers import apply_rope, linear, linear_f32, param, weight_of
from dsv4.quant import act_quant, fp8_format_of
from sharding import axes as ax


class Indexer(nnx.Module):
    """Parameters named as the official `attn.indexer.*`: `wq_b`, `weights_proj`, `compressor.*`."""

    def __init__(self, cfg, *, inv_freq, rngs, param_dtype, dtype):
        std = cfg.initializer_range
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.csa_compress_ratio
        self.wq_b = Weight(param(rngs, (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                                  (ax.INDEX_HEADS, ax.Q_LORA), dtype=param_dtype, std=std))
        self.weights_proj = Weight(param(rngs, (cfg.index_n_heads, cfg.hidden_size), (ax.INDEX_HEADS, ax.EMBED),
                                          dtype=param_dtype, std=std))
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, self.ratio, True, eps=cfg.rms_norm_eps,
                                     inv_freq=inv_freq, rngs=rngs, param_dtype=param_dtype, dtype=jnp.float32,
                                     std=std)

    def queries(self, x: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B, S, D], q_latent [B, S, q_lora] -> (q^I [B, S, H_I, d_I], omega [B, S, H_I]) float32."""
        b, s, _ = x.shape
        # f32 (`linear` in f32 is `linear_f32` for a dense weight); the FP8 rollout's: the release's FP8 GEMM
        q = linear(q_latent, weight_of(self.wq_b.weight), jnp.float32).reshape(b, s, self.n_heads, self.head_dim)
        q = apply_rope(q, cos[:, :, None, :], sin[:, :, None, :])
        omega = linear_f32(x, weight_of(self.weights_proj.weight)) * (self.n_heads ** -0.5)
        return q, omega

    def scores(self, q: jax.Array, omega: jax.Array, keys: jax.Array, scale: jax.Array | None = None, *,
               fp8: bool = False, kernel: str | None = None) -> jax.Array:
        """q [B, S, H, d], omega [B, S, H], keys [B, W, d] -> I [B, S, W] float32. scale: None, or [B, W] powers
        of two the keys are multiplied by (an FP8 cache's stored bytes and their per-vector scales,
        `dsv4.cache.index_keys`), applied after the head sum: the same value (a power of two commutes with the dot,
        ReLU and the sum), and the dot reads the bytes instead of an f32 copy.

        fp8 (FP8 keys, a layer that runs FP8 dots: `dsv4.attention.Attention.fp8_dots`): each query head's vector is
        quantised to the keys' format with one power-of-two scale (`dsv4.quant.act_quant`, block d), the dot runs
        on FP8 operands with f32 accumulation, and the query scales join omega (positive: they commute with the
        ReLU). DeepSeek-V3.2's FP8 indexer (DeepGEMM's `fp8_mqa_logits`); the release trained this dot under FP4
        QAT (spec §5.5), coarser than these FP8 queries. Only the queries' rounding changes the scores.
        kernel ("pallas" | "interpret", `dsv4.attention.Attention.kernel_matmul`): that FP8 dot, the ReLU and the
        weighted head sum as one kernel (`dsv4.decode_kernel.fp8_index_scores`; no per-head scores in HBM)."""
        if fp8 and scale is not None:
            q8, sq = act_quant(q, fmt=fp8_format_of(keys.dtype), block=q.shape[-1], scale_fmt="ue8m0")
            if kernel is not None and index_kernel_fits(*q.shape[-2:]):
                w = omega * sq[..., 0] * (self.head_dim ** -0.5)
                return fp8_index_scores(q8, w, keys, scale, interpret=kernel == "interpret")
            dots = jnp.einsum("bshd,bwd->bshw", q8, keys, preferred_element_type=jnp.float32)
            omega = omega * sq[..., 0]
        else:
            dots = jnp.einsum("bshd,bwd->bshw", q, keys.astype(jnp.float32))
        out = jnp.einsum("bshw,bsh->bsw", jax.nn.relu(dots), omega) * (self.head_dim ** -0.5)
        return out if scale is None else out * scale[:, None, :]

    def select(self, scores: jax.Array, visible: jax.Array) -> jax.Array:
        """Top-k selection mask. scores, visible [B, S, W] -> selected [B, S, W] bool (subset of visible)."""
        n = scores.shape[-1]
        k = min(self.topk, n)
        if k == 0:
            return jnp.zeros(scores.shape, bool)
        if k == n:
            return visible
        idx = self.top_entries(scores, visible)[0]  # [B, S, k]
        sel = jnp.zeros(scores.shape, jnp.int32)
        sel = jax.vmap(jax.vmap(lambda row, i: row.at[i].set(1)))(sel, idx)
        return (sel > 0) & visible

    def top_entries(self, scores: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
        """scores, visible [..., W] -> (idx [..., k] int32, valid [..., k] bool): the k = min(index_topk, W)
        best-scored entries (invisible ones last), valid = picked among the visible (`select`'s mask is their
        scatter)."""
        idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(self.topk, scores.shape[-1]))[1]
        return idx.astype(jnp.int32), jnp.take_along_axis(visible, idx, axis=-1)

    def full(self, x, q_latent, positions, cos, sin):
        """Full-sequence selection: x [B, S, D], q_latent [B, S, q_lora], positions [B, S].

        Returns (selected [B, S, S//m] bool, (A, Z + ape) of the indexer compressor for the decode cache).
        """
        keys, a, z = self.compressor.full(x)
        q, omega = self.queries(x, q_latent, cos, sin)
        sc = self.scores(q, omega, keys)
        return self.select(sc, visible_entries(positions, keys.shape[1], self.ratio)), (a, z, keys)

    def select_blocked(self, x, q_latent, positions, cos, sin, *, block_q: int = 128):
        """Memory-linear selection: scores and top-k per block of `block_q` queries ([block_q, H_I, W] at a time).

        Same selection as `full` (the same scores per query, the same `jax.lax.top_k` over each query's row),
        returned as indices instead of a dense mask. No gradient flows (selection is by index, spec §12.25).
        Args: as `full`. Returns:
          ((idx [B, S, k] int32, valid [B, S, k] bool) with k = min(index_topk, W), W = S // m: the selected
          entries of each query (valid = visible; `full`'s mask is the scatter of idx where valid),
          (A, Z + ape, keys) of the indexer compressor for the decode cache).
        """
        keys, a, z = self.compressor.full(x)
        b, s, _ = x.shape
        n = keys.shape[1]
        k = min(self.topk, n)
        if k == 0 or k == n:  # as `select`: nothing, or every visible entry
            idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, s, k))
            return (idx, visible_entries(positions, k, self.ratio)), (a, z, keys)
        qb = max(1, min(block_q, s))
        nq = -(-s // qb)
        pad = nq * qb - s
        sg = jax.lax.stop_gradient

        def blocks(t):  # [B, S, ...] -> [nQ, B, qb, ...]
            t = jnp.pad(sg(t), [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
            return t.reshape(b, nq, qb, *t.shape[2:]).swapaxes(0, 1)

        def one(blk):
            xb, qlb, pb, cb, sb = blk
            q, omega = self.queries(xb, qlb, cb, sb)
            return self.top_entries(self.scores(q, omega, sg(keys)), visible_entries(pb, n, self.ratio))

        idx, valid = jax.lax.map(one, tuple(map(blocks, (x, q_latent, positions, cos, sin))))
        unblock = lambda t: t.swapaxes(0, 1).reshape(b, nq * qb, k)[:, :s]  # noqa: E731
        return (unblock(idx), unblock(valid)), (a, z, keys)

    def __call__(self, x, q_latent, positions, cos, sin) -> jax.Array:
        """Full-sequence selection mask [B, S, S//m] bool."""
        return self.full(x, q_latent, positions, cos, sin)[0]
