"""KV compressors of CSA (ratio m, overlapping windows) and HCA (ratio m', disjoint windows); spec §5.4.

Per token t: A_t = W_kv x_t, Z_t = W_gate x_t + ape[t mod m] (float32). Window w = tokens [w m, w m + m - 1].
- HCA: entry C_w = sum over the window of softmax_t(Z) * A (per channel).
- CSA (overlap): entry w pools 2m slots: window w-1's first halves ("a", dims [0, d)) and window w's second
  halves ("b", dims [d, 2d)); entry 0 has only the b slots.
Then C_w = RoPE_{p = w m}(RMSNorm(C_w)) with the compressed-layer frequencies. Only complete windows give
entries; entry w is visible to query t iff w < floor((t+1)/m).

The windowing here assumes that position 0 of the sequence is the first real token (the model right-aligns
left-padded rows before calling it), which is what keeps pad tokens out of every entry.
Sources: official `Compressor` (`overlap_transform`, prefill path); HF `DeepseekV4HCACompressor`,
`DeepseekV4CSACompressor`; spec §12 items 7-10.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.layers import apply_rope, linear_f32, param, rms_norm, rope_cos_sin, weight_of
from sharding import axes as ax


def window_pool(a: jax.Array, z: jax.Array, *, overlap: bool, d: int,
                prev_a: jax.Array | None = None, prev_z: jax.Array | None = None) -> jax.Array:
    """Softmax-pool complete windows.

    Args:
      a, z: [B, W, m, c*d] float32 projections and gate logits (ape already added) of W complete windows.
      overlap: CSA layout (c = 2) if True, HCA (c = 1) otherwise.
      prev_a, prev_z: optional [B, m, c*d] window preceding window 0 (decode: the cached previous window).
    Returns:
      [B, W, d] float32 pooled entries (before norm and RoPE).
    """
    if not overlap:
        return jnp.sum(jax.nn.softmax(z, axis=2) * a, axis=2)
    b_, w_, m = a.shape[:3]
    if prev_a is None:
        first_a = jnp.zeros((b_, 1, m, d), a.dtype)
        first_z = jnp.full((b_, 1, m, d), -jnp.inf, z.dtype)
    else:
        first_a, first_z = prev_a[:, None, :, :d], prev_z[:, None, :, :d]
    prev_slots_a = jnp.concatenate([first_a, a[:, :-1, :, :d]], axis=1)  # -> [B, W, m, d]
    prev_slots_z = jnp.concatenate([first_z, z[:, :-1, :, :d]], axis=1)
    slots_a = jnp.concatenate([prev_slots_a, a[..., d:]], axis=2)  # -> [B, W, 2m, d]
    slots_z = jnp.concatenate([prev_slots_z, z[..., d:]], axis=2)
    return jnp.sum(jax.nn.softmax(slots_z, axis=2) * slots_a, axis=2)


class Compressor(nnx.Module):
    """Learned KV compressor; parameters named as the official `attn.compressor.*` (`wkv`, `wgate`, `ape`, `norm`).

    Args:
      d_model: D. d: output dim (head_dim, or index_head_dim for the indexer's compressor). ratio: m.
      overlap: CSA (True, projections of width 2d) or HCA (False, width d).
    """

    def __init__(self, d_model: int, d: int, ratio: int, overlap: bool, *, eps: float, inv_freq, rngs,
                 param_dtype, dtype, std: float = 0.02):
        c = 2 if overlap else 1
        self.d, self.ratio, self.overlap, self.eps, self.dtype = d, ratio, overlap, eps, dtype
        self.inv_freq = tuple(inv_freq)
        self.wkv = Weight(param(rngs, (c * d, d_model), (ax.COMPRESS, ax.EMBED), dtype=param_dtype, std=std))
        self.wgate = Weight(param(rngs, (c * d, d_model), (ax.COMPRESS, ax.EMBED), dtype=param_dtype, std=std))
        self.ape = param(rngs, (ratio, c * d), (None, ax.COMPRESS), dtype=jnp.float32, init="zeros")
        self.norm = Weight(param(None, (d,), (ax.KV,), dtype=param_dtype, init="ones"))

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, S, D] -> (A, Z) [B, S, c*d] float32, Z without ape (spec §12 item 10: fp32 projections)."""
        return linear_f32(x, weight_of(self.wkv.weight)), linear_f32(x, weight_of(self.wgate.weight))

    def finish(self, pooled: jax.Array, window_index: jax.Array | int) -> jax.Array:
        """Norm + RoPE at p = w*m of pooled entries.

        pooled [B, W, d] float32; window_index: int (index of the first of the W windows) or [B] int32 (one
        window per row, W == 1, decode). Returns [B, W, d] in the compute dtype (the official code casts back
        before the norm).
        """
        return self.finish_with(pooled, window_index, self.norm.weight[...])

    def finish_with(self, pooled: jax.Array, window_index: jax.Array | int, norm_weight: jax.Array) -> jax.Array:
        """`finish` with the norm weight [d] given (dsv4/context.py passes it into a shard_map); window_index: an
        int, or [B] int32 = the index of each row's first window (any W)."""
        y = rms_norm(pooled.astype(self.dtype), norm_weight, self.eps)
        b, w_ = pooled.shape[:2]
        if isinstance(window_index, int):
            w = jnp.broadcast_to(jnp.arange(w_) + window_index, (b, w_))
        else:
            w = window_index[:, None] + jnp.arange(w_)[None]
        cos, sin = rope_cos_sin(w * self.ratio, jnp.asarray(self.inv_freq, jnp.float32))
        return apply_rope(y, cos, sin)

    def full(self, x: jax.Array):
        """All complete windows of x [B, S, D] -> (entries [B, S // m, d], A [B, S, c d], Z + ape [B, S, c d]).

        A and Z (float32, Z with `ape[t mod m]` added) are returned for the decode cache (dsv4/cache.py).
        """
        b, s, _ = x.shape
        n_win = s // self.ratio
        a, z = self.project(x)
        z = z + jnp.tile(self.ape[...].astype(jnp.float32), (-(-s // self.ratio), 1))[:s]
        if n_win == 0:  # S < m: no complete window, no entry (an explicit shape: reshape(-1) of 0 elements fails)
            return jnp.zeros((b, 0, self.d), self.dtype), a, z
        cut = n_win * self.ratio
        width = a.shape[-1]
        pooled = window_pool(a[:, :cut].reshape(b, n_win, self.ratio, width),
                             z[:, :cut].reshape(b, n_win, self.ratio, width), overlap=self.overlap, d=self.d)
        return self.finish(pooled, 0), a, z

    def __call__(self, x: jax.Array) -> jax.Array:
        """All complete windows of x [B, S, D] -> entries [B, S // m, d] (full-sequence path)."""
        return self.full(x)[0]


class Weight(nnx.Module):
    """Holder so that checkpoint names read `compressor.wkv.weight` like the official keys."""

    def __init__(self, weight: nnx.Param):
        self.weight = weight


def visible_entries(positions: jax.Array, n_entries: int, ratio: int) -> jax.Array:
    """Entry visibility mask: w < floor((t+1)/m). positions [..., S] -> [..., S, W] bool (spec §12 item 8)."""
    return jnp.arange(n_entries) < ((positions + 1) // ratio)[..., None]
