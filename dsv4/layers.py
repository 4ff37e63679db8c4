"""Basic building blocks: parameters with logical axes, linear maps, RMSNorm, RoPE application.

Weights are stored in the checkpoint's own layout `[out, in]` (PyTorch / official DeepSeek layout), so the
checkpoint mapping is a table of names with no transposes; `linear` contracts the last axis of x with the last
axis of w. Every parameter carries `logical_axes` metadata (names from `sharding.axes`), read by
`sharding.rules.param_shardings`.

Precision: norms, RoPE and anything marked fp32 in spec §13 run in float32; matmuls run in the module's
compute `dtype` (bf16 or fp32). Dots return their input dtype (`dot_out`): GPU BLAS accumulates bf16 products
in float32 anyway, and XLA:CPU cannot run some bf16 x bf16 -> f32 dots ("Unsupported element type for
DotThunk"), so float32 outputs are requested only for float32 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.fp8_gemm import FakeQuantWeight, fake_quant_linear, quantized_linear
from dsv4.quant import QuantizedTensor
from sharding import axes as ax
from sharding.rules import constrain


class Buffer(nnx.Variable):
    """A model tensor that is not trained by the optimizer: `tid2eid` hash tables, the router selection bias.

    It is still part of the model (saved, loaded, pushed to the rollout mesh), unlike a cache.
    """


def param(rngs: nnx.Rngs | None, shape, logical_axes, *, dtype, init: str = "normal", std: float = 0.02,
          value: float = 0.0) -> nnx.Param:
    """Create an `nnx.Param` of `shape` and `dtype` annotated with `logical_axes` (one entry per dim).

    init: "normal" (N(0, std^2)), "ones", "zeros" or "const" (filled with `value`).
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical_axes {logical_axes} do not match shape {shape}")
    if init == "normal":
        v = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        v = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        v = jnp.zeros(shape, jnp.float32)
    elif init == "const":
        v = jnp.full(shape, value, jnp.float32)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(v.astype(dtype), logical_axes=tuple(logical_axes))


def dot_out(dtype):
    """`preferred_element_type` for a dot whose inputs are in `dtype` (see the module docstring)."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.float32 else None


def linear(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """y[..., o] = sum_i x[..., i] w[o, i], computed in `dtype` (f32 accumulation on the dot).

    w may also be a quantised `dsv4.quant.QuantizedTensor` (the rollout's FP8 weights): then x is quantised to FP8
    per 1 x 128 block as the release does, and the matmul runs on FP8 operands (w.matmul "fp8") or on the
    dequantised weight (`dsv4.fp8_gemm.quantized_linear`). A `dsv4.fp8_gemm.FakeQuantWeight` (the FP8-aware
    learner's) runs the same products with straight-through gradients (`dsv4.fp8_gemm.fake_quant_linear`)."""
    if isinstance(w, QuantizedTensor):
        return quantized_linear(x, w, dtype)
    if isinstance(w, FakeQuantWeight):
        return fake_quant_linear(x, w, dtype)
    return jnp.einsum("...i,oi->...o", x.astype(dtype), w.astype(dtype),
                      preferred_element_type=dot_out(dtype)).astype(dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """Linear map entirely in float32 (router, compressor projections, mHC; spec §12 items 10, 16)."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32))


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in float32 (spec §8): x / sqrt(mean(x^2) + eps) * weight, cast back to x.dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def weight_of(var):
    """The value of the parameter `var` for use in a per-token product: an array constrained to its layout with the
    `embed` dim whole (the per-layer all-gather of FSDP / ZeRO-3, made explicit; identity without active rules);
    quantised weights (`QuantizedTensor`, `FakeQuantWeight`) pass unchanged. Why: left to SPMD, a product with an
    FSDP-split weight (and its gradient) may keep the weight split along D and move the [B, S, D] activation to a
    D-split layout instead; with the batch and (context parallelism) the sequence split over the same devices as D,
    SPMD reaches that layout only by replicating the activation ("involuntary full rematerialization")."""
    w = var.get_value()
    logical = getattr(var, "logical_axes", None)
    if not isinstance(w, jax.Array) or logical is None or ax.EMBED not in logical or len(logical) < w.ndim:
        return w
    logical = tuple(logical)[len(logical) - w.ndim:]  # a stacked (dsv4.scan) variable seen per layer: [out, in]
    return constrain(w, tuple(None if a == ax.EMBED else a for a in logical))


class Linear(nnx.Module):
    """Bias-free linear layer with weight `[out, in]` named `weight` (official checkpoint layout).

    `lora`: None, or a LoRA adapter attached by `dsv4.lora.attach` (a callable x [..., in] -> [..., out] in `dtype`):
    its low-rank path is added to the base product, whatever the weight's form (dense, FP8, fake-quantised)."""

    def __init__(self, d_in: int, d_out: int, axes_out_in, *, rngs, param_dtype, dtype, std=0.02):
        self.weight = param(rngs, (d_out, d_in), axes_out_in, dtype=param_dtype, std=std)
        self.dtype = dtype
        self.lora = nnx.data(None)

    def __call__(self, x):
        y = linear(x, weight_of(self.weight), self.dtype)
        return y if self.lora is None else y + self.lora(x).astype(y.dtype)


class RMSNorm(nnx.Module):
    """Weighted RMSNorm; the weight is named `weight` as in the checkpoint."""

    def __init__(self, dim: int, eps: float, *, param_dtype, axis=ax.EMBED):
        self.weight = param(None, (dim,), (axis,), dtype=param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, weight_of(self.weight), self.eps)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Angles theta_i * p in float32. positions [...] int -> cos, sin [..., r/2] float32 (spec §5.2, §12.26)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the trailing 2*len(cos) dims of x by interleaved pairs (2i, 2i+1) (spec §5.2, §12 item 1).

    x [..., d]; cos/sin broadcastable to [..., r/2] (r = rope dims). `inverse` rotates by -theta (used on the
    attention output, spec §12 item 4). Computed in float32, returned in x.dtype.
    """
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:].astype(jnp.float32)
    pairs = rope.reshape(*rope.shape[:-1], r // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, out.astype(x.dtype)], axis=-1)
