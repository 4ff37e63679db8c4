"""DeepSeek-V4 attention: low-rank query, one shared K=V head, sinks, sliding window, CSA / HCA (spec §5).

Per layer kind (static): `sliding` (window only), `csa` (window + indexer-selected compressed entries),
`hca` (window + every visible compressed entry). One softmax over [window keys | compressed keys | sink].
Output heads get the inverse RoPE (values = rotated keys) and go through the grouped low-rank projection.

Full-sequence path (training, prefill, scoring). Positions are 0..S-1 from the first real token: the model
right-aligns padded rows before calling this. Under a rule table that splits the sequence (`act_seq` over the
actor's `context` mesh axis) the blocked path runs context-parallel (`dsv4.context.attend_context`). Two implementations of the same math (static `impl`):
`"blocked"` (default; `dsv4.blocked.attend_blocked`: memory linear in S, forward and backward) and `"dense"`
(the reference: an explicit [B, H, S, S + W] score tensor and mask). The incremental decode path lives in
`dsv4/cache.py`.
Sources: official `Attention` (model.py L470-547), HF `DeepseekV4Attention`; spec §12 items 1-13, 21.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.blocked import attend_blocked
from dsv4.compressor import Compressor, visible_entries
from dsv4.config import CSA, HCA, SLIDING, yarn_inv_freq
from dsv4.context import attend_context, context_axis
from dsv4.indexer import Indexer
from dsv4.lora import grouped_delta
from dsv4.fp8_gemm import FakeQuantWeight, grouped_quantized_linear, runs_fp8_dots
from dsv4.layers import Linear, RMSNorm, apply_rope, dot_out, linear, param, rms_norm, rope_cos_sin, weight_of
from dsv4.quant import KERNEL_MATMULS, QuantizedTensor
from sharding import axes as ax


def rope_tables(cfg, kind: str) -> tuple[float, ...]:
    """Inverse frequencies of a layer: theta 10000 for sliding layers, 160000 + YaRN for CSA/HCA (§12 item 2)."""
    if kind == SLIDING:
        return tuple(yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None))
    return tuple(yarn_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling))


def attend(q: jax.Array, keys: jax.Array, mask: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """Single-KV-head attention with a sink logit in the denominator (spec §5.3, §12 item 13).

    q [B, S, H, d], keys [B, K, d] (= values), mask [B, S, K] bool, sink [H] -> o [B, S, H, d] float32.
    """
    logits = jnp.einsum("bshd,bkd->bhsk", q, keys, preferred_element_type=dot_out(keys.dtype))
    logits = logits.astype(jnp.float32) * scale
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    sink_l = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None, None], (*logits.shape[:3], 1))
    full = jnp.concatenate([logits, sink_l], axis=-1)
    p = jax.nn.softmax(full, axis=-1)[..., :-1]
    return jnp.einsum("bhsk,bkd->bshd", p.astype(keys.dtype), keys,
                      preferred_element_type=dot_out(keys.dtype)).astype(jnp.float32)


ATTENTION_IMPLS = ("blocked", "dense")


class Attention(nnx.Module):
    """Parameters named as the official `layers.i.attn.*` keys (weights [out, in]).

    impl: "blocked" (memory-linear, default) or "dense" (reference); block_q / block_k: query block and
    compressed-entry block sizes of the blocked path (static; results do not depend on them beyond rounding).
    """

    def __init__(self, cfg, layer_idx: int, *, rngs, param_dtype, dtype, impl: str = "blocked", block_q: int = 128,
                 block_k: int = 512):
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
        self.impl, self.block_q, self.block_k = impl, int(block_q), int(block_k)
        self.kind = cfg.layer_kind(layer_idx)
        self.ratio = cfg.compress_ratios[layer_idx]
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.o_groups, self.o_lora = cfg.o_groups, cfg.o_lora_rank
        self.eps, self.dtype = cfg.rms_norm_eps, dtype
        self.inv_freq = rope_tables(cfg, self.kind)
        std = cfg.initializer_range
        d, h = cfg.head_dim, cfg.num_attention_heads
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype, std=std)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, (ax.Q_LORA, ax.EMBED), **kw)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, param_dtype=param_dtype, axis=ax.Q_LORA)
        self.wq_b = Linear(cfg.q_lora_rank, h * d, (ax.HEADS, ax.Q_LORA), **kw)
        self.wkv = Linear(cfg.hidden_size, d, (ax.KV, ax.EMBED), **kw)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype, axis=ax.KV)
        self.wo_a = Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, (ax.O_LORA, ax.O_IN), **kw)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, (ax.EMBED, ax.O_LORA), **kw)
        self.attn_sink = param(rngs, (h,), (ax.HEADS,), dtype=jnp.float32, init="zeros")
        if self.kind in (CSA, HCA):
            self.compressor = Compressor(cfg.hidden_size, d, self.ratio, self.kind == CSA, eps=cfg.rms_norm_eps,
                                         inv_freq=self.inv_freq, **kw)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, inv_freq=self.inv_freq, rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    # -- pieces shared by the full-sequence and the decode paths ------------------------------------------
    @property
    def fp8_dots(self) -> bool:
        """Whether this layer runs FP8 dots (the FP8 rollout on a backend with FP8 GEMMs,
        `dsv4.fp8_gemm.runs_fp8_dots` of its projections): the cached paths then score the indexer's FP8 keys
        with an FP8 dot (`dsv4.indexer.Indexer.scores`)."""
        return runs_fp8_dots(weight_of(self.wq_b.weight))

    @property
    def kernel_matmul(self) -> str | None:
        """"pallas" | "interpret" where this layer's FP8 GEMMs run the kernels (`dsv4.quant.KERNEL_MATMULS`): the
        cached decode then runs its attention over an FP8 cache as one kernel too (`dsv4.decode_kernel`); else None."""
        w = weight_of(self.wq_b.weight)
        return w.matmul if runs_fp8_dots(w) and w.matmul in KERNEL_MATMULS else None

    def rope(self, positions: jax.Array):
        return rope_cos_sin(positions, jnp.asarray(self.inv_freq, jnp.float32))

    def query(self, x, cos, sin):
        """x [B, S, D] -> (q [B, S, H, d] normalised + rotated, q_latent [B, S, q_lora])."""
        b, s, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).reshape(b, s, self.n_heads, self.head_dim)
        q = rms_norm(q, None, self.eps)
        return apply_rope(q, cos[:, :, None, :], sin[:, :, None, :]), q_latent

    def key_value(self, x, cos, sin):
        """x [B, S, D] -> kv [B, S, d] (normalised + rotated; one head shared by all query heads)."""
        return apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

    def output(self, o, cos, sin):
        """o [B, S, H, d] float32 -> [B, S, D]: inverse RoPE, grouped low-rank projection (§5.6, §12.21)."""
        b, s = o.shape[:2]
        o = apply_rope(o, cos[:, :, None, :], sin[:, :, None, :], inverse=True).astype(self.dtype)
        g = self.o_groups
        og = o.reshape(b, s, g, -1)  # -> [B, S, G, (H/G) d]  (group g = heads [g H/G, (g+1) H/G))
        wa = weight_of(self.wo_a.weight)
        if isinstance(wa, (QuantizedTensor, FakeQuantWeight)):  # the FP8 rollout's (and FP8-aware learner's)
            r = grouped_quantized_linear(og, wa, self.dtype)
        else:
            wa = wa.astype(self.dtype).reshape(g, self.o_lora, -1)  # -> [G, o_lora, (H/G) d]
            r = jnp.einsum("bsgi,goi->bsgo", og, wa, preferred_element_type=dot_out(self.dtype)).astype(self.dtype)
        if self.wo_a.lora is not None:  # LoRA on the grouped product (dsv4.lora.grouped_delta)
            r = r + grouped_delta(self.wo_a.lora, og).astype(self.dtype)
        return self.wo_b(r.reshape(b, s, g * self.o_lora))

    # -- full sequence ---------------------------------------------------------------------------------------
    def __call__(self, x: jax.Array, positions: jax.Array, return_aux: bool = False):
        """x [B, S, D] (normalised block input), positions [B, S] int32 (0-based, right-aligned) -> [B, S, D].

        With `return_aux`, also returns the per-layer tensors the decode cache is built from
        (`dsv4.cache.build_layer_cache`): kv, compressor A/Z (+ape) and entries, indexer A/Z and keys.
        """
        cos, sin = self.rope(positions)
        q, q_latent = self.query(x, cos, sin)
        kv = self.key_value(x, cos, sin)
        cp = context_axis() if self.impl == "blocked" else None
        if cp is not None:  # context parallelism (dsv4/context.py): the sequence split over the actor's context axis
            if return_aux:
                raise ValueError("return_aux (decode-cache tensors) is not available under context parallelism")
            return self.output(attend_context(self, x, q, q_latent, kv, positions, cos, sin, *cp), cos, sin)
        if self.impl == "blocked":
            o, aux = self._blocked(x, q, q_latent, kv, positions, cos, sin)
            out = self.output(o, cos, sin)
            return (out, aux) if return_aux else out
        t = positions[:, :, None]
        s_ = positions[:, None, :]
        mask = (s_ <= t) & (t - s_ < self.window)  # [B, S, S] window including the current token
        keys = kv
        aux = {"kv": kv}
        if self.kind in (CSA, HCA):
            entries, a, z = self.compressor.full(x)  # [B, W, d]
            aux.update(comp=entries, ca=a, cz=z)
            vis = visible_entries(positions, entries.shape[1], self.ratio)  # [B, S, W]
            if self.kind == CSA:
                vis, (ia, iz, ik) = self.indexer.full(x, q_latent, positions, cos, sin)
                aux.update(ia=ia, iz=iz, ik=ik)
            keys = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
            mask = jnp.concatenate([mask, vis], axis=-1)
        o = attend(q, keys, mask, self.attn_sink[...], self.head_dim ** -0.5)
        out = self.output(o, cos, sin)
        return (out, aux) if return_aux else out

    def _blocked(self, x, q, q_latent, kv, positions, cos, sin):
        """The memory-linear path: -> (o [B, S, H, d] float32, aux as `__call__`'s)."""
        aux = {"kv": kv}
        entries = selected = None
        if self.kind in (CSA, HCA):
            entries, a, z = self.compressor.full(x)
            aux.update(comp=entries, ca=a, cz=z)
            entries = entries.astype(kv.dtype)
            if self.kind == CSA:
                selected, (ia, iz, ik) = self.indexer.select_blocked(x, q_latent, positions, cos, sin,
                                                                     block_q=self.block_q)
                aux.update(ia=ia, iz=iz, ik=ik)
        o = attend_blocked(q, kv, positions, self.attn_sink[...], self.head_dim ** -0.5, window=self.window,
                           entries=entries, ratio=self.ratio, selected=selected, block_q=self.block_q,
                           block_k=self.block_k)
        return o, aux


__all__ = ["ATTENTION_IMPLS", "Attention", "attend", "rope_tables", "linear"]
