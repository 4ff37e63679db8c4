"""Manifold-constrained hyper-connections (mHC): 4 residual streams, Sinkhorn-projected mixing (spec §4).

Per site (two per layer: `hc_attn_*`, `hc_ffn_*`) parameters `fn` [(2+n)n, n*D], `base` [(2+n)n], `scale` [3],
all float32. Everything here runs in float32; the streams are cast back to the activation dtype after `post`.
Sources: HF `DeepseekV4HyperConnection` / `DeepseekV4HyperHead`; official `Block.hc_pre`, `hc_post`,
`ParallelHead.hc_head`; spec §12 items 14-15.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.layers import rms_norm


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Row softmax + eps, then column normalisation, then (iters-1) x (row, column) normalisations.

    logits [..., n, n] float32 -> R [..., n, n] with columns summing to ~1 (spec §4 step 5).
    """
    r = jax.nn.softmax(logits, axis=-1) + eps
    r = r / (jnp.sum(r, axis=-2, keepdims=True) + eps)

    def body(_, r):
        r = r / (jnp.sum(r, axis=-1, keepdims=True) + eps)
        return r / (jnp.sum(r, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, body, r)


def hc_pre(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, n: int, iters: int,
           hc_eps: float, norm_eps: float):
    """Compute the mHC coefficients and collapse the streams.

    Args:
      x: [..., n, D] residual streams (activation dtype).
      fn [(2+n)n, nD], base [(2+n)n], scale [3]: the site's parameters.
    Returns:
      y [..., D] collapsed block input (x.dtype), post [..., n] float32, comb [..., n, n] float32 (R of §4).
    """
    flat = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    mu = jnp.einsum("...k,ok->...o", rms_norm(flat, None, norm_eps), fn.astype(jnp.float32))
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mu[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mu[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = mu[..., 2 * n:].reshape(*mu.shape[:-1], n, n) * scale[2] + base[2 * n:].reshape(n, n)
    comb = sinkhorn(comb_logits, iters, hc_eps)
    y = jnp.einsum("...j,...jd->...d", pre, x.astype(jnp.float32)).astype(x.dtype)
    return y, post, comb


def hc_post(x: jax.Array, f: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k * F + sum_j R[j, k] X_j (R applied transposed; spec §4 / §12 item 14).

    x [..., n, D], f [..., D], post [..., n], comb [..., n, n] -> [..., n, D] in x.dtype (mixed in float32).
    """
    out = post[..., :, None] * f.astype(jnp.float32)[..., None, :] + jnp.einsum(
        "...jk,...jd->...kd", comb, x.astype(jnp.float32))
    return out.astype(x.dtype)


def hc_head(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, n: int, hc_eps: float,
            norm_eps: float) -> jax.Array:
    """Final collapse of the streams: pre = sigmoid(scale * fn . norm(x) + base) + eps; h = sum_j pre_j X_j.

    x [..., n, D] -> [..., D] (x.dtype); fn [n, nD], base [n], scale [1].
    """
    flat = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    mu = jnp.einsum("...k,ok->...o", rms_norm(flat, None, norm_eps), fn.astype(jnp.float32))
    pre = jax.nn.sigmoid(mu * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + hc_eps
    return jnp.einsum("...j,...jd->...d", pre, x.astype(jnp.float32)).astype(x.dtype)
