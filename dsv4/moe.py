"""Mixture of experts: hash or top-k routing, clamped-SwiGLU routed experts, shared expert (spec §6).

Router (float32): s_e = sqrt(softplus(W_g u)). Selection: top-k of s + bias (learned layers) or `tid2eid[id]`
(the first `num_hash_layers` layers). Weights: s at the selection, renormalised over the k picks, x
`routed_scaling_factor`. The bias only selects (spec §12 item 17).
Routing replay: `forced_ids` [T, k] (>= 0 forced, < 0 = route normally) replaces the selection in any layer,
hash layers included; the weights still come from the router so it keeps its gradient.

Experts are stacked: w1, w3 [E, I, D], w2 [E, D, I] (official per-expert `w1/w3/w2`, [out, in]).
The routed computation is sort-by-expert + `jax.lax.ragged_dot_general` (dropless; runs on CPU and GPU);
`dispatch_fn` lets `sharding/expert.py` substitute an expert-parallel all-to-all version.
Sources: official `Gate`, `Expert`, `MoE`; HF `DeepseekV4TopKRouter`, `DeepseekV4HashRouter`,
`DeepseekV4Experts`, `DeepseekV4MLP`; spec §12 items 16-20.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.layers import Buffer, dot_out, linear, linear_f32, param
from sharding import axes as ax

_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """SiLU(min(gate, limit)) * clip(up, -limit, limit) in float32 (spec §12 item 19)."""
    gate = jnp.minimum(gate.astype(jnp.float32), limit)
    up = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(gate) * up


def routed_experts_ragged(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                          w2: jax.Array, *, limit: float, dtype) -> jax.Array:
    """Dropless routed-expert FFN by sorting token copies by expert and grouped matmuls.

    x [T, D]; ids [T, k] int32 in [0, E); weights [T, k] float32; w1, w3 [E, I, D]; w2 [E, D, I].
    Returns [T, D] float32 = sum_j weights[t, j] * E_{ids[t, j]}(x_t).
    """
    t, k = ids.shape
    n_exp = w1.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    xs = x[tok].astype(dtype)  # [T k, D] grouped by expert
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    def gmm(lhs, w):
        out = jax.lax.ragged_dot_general(lhs, w.astype(dtype), sizes, _RAGGED_DN, preferred_element_type=dot_out(dtype))
        return out.astype(jnp.float32)

    h = (swiglu(gmm(xs, w1), gmm(xs, w3), limit) * weights.reshape(-1)[order][:, None]).astype(dtype)
    y = gmm(h, w2)
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[tok].add(y)


def routed_experts_dense(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                         w2: jax.Array, *, limit: float, dtype) -> jax.Array:
    """Routed experts by running every expert on every token and combining with the routing weights.

    Same contract as `routed_experts_ragged` (x [T, D]; ids [T, k]; weights [T, k] f32; w1, w3 [E, I, D];
    w2 [E, D, I]; returns [T, D] f32). Reads all E experts once and does E/k times the routed FLOPs, so it pays
    only when T * k is comparable to E (decode on CPU, where XLA's `ragged_dot` fallback is slow). w1/w3 run as
    one [T, D] x [E*I, D] dot over their free reshape (no weight copy); dots accumulate in f32.
    """
    t, d = x.shape
    e, i, _ = w1.shape
    xt = x.astype(dtype)
    combine = jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], ids].add(weights)  # [T, E]
    nt = (((1,), (1,)), ((), ()))
    g = jax.lax.dot_general(xt, w1.reshape(e * i, d).astype(dtype), nt, preferred_element_type=jnp.float32)
    u = jax.lax.dot_general(xt, w3.reshape(e * i, d).astype(dtype), nt, preferred_element_type=jnp.float32)
    h = swiglu(g, u, limit).reshape(t, e, i) * combine[..., None]
    h = jnp.transpose(h, (1, 0, 2)).astype(dtype)  # [E, T, I]
    y = jax.lax.dot_general(h, w2.astype(dtype), (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    return jnp.sum(y, axis=0)


def routed_experts_gathered(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                            w2: jax.Array, *, limit: float, dtype) -> jax.Array:
    """Routed experts by gathering each (token, pick)'s expert weights: T * k matrix-vector products.

    Same contract as `routed_experts_ragged`. Copies T * k experts per call, so it pays only for a handful of
    tokens (single-sequence decode), where it touches k/E of the dense path's bytes.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    xr = jnp.repeat(x.astype(dtype), k, axis=0)[:, None, :]  # [T k, 1, D]
    bd = (((2,), (2,)), ((0,), (0,)))
    g = jax.lax.dot_general(xr, w1[flat].astype(dtype), bd, preferred_element_type=jnp.float32)[:, 0]
    u = jax.lax.dot_general(xr, w3[flat].astype(dtype), bd, preferred_element_type=jnp.float32)[:, 0]
    h = (swiglu(g, u, limit) * weights.reshape(-1)[:, None]).astype(dtype)[:, None, :]
    y = jax.lax.dot_general(h, w2[flat].astype(dtype), bd, preferred_element_type=jnp.float32)[:, 0]
    return jnp.sum(y.reshape(t, k, -1), axis=1)


def routed_experts_small_batch(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                               w2: jax.Array, *, limit: float, dtype) -> jax.Array:
    """Routed experts for CPU decode: picks an implementation from the static shapes.

    T * k <= E / 4: `routed_experts_gathered`; T * k <= 4 E: `routed_experts_dense`; otherwise (prefill)
    `routed_experts_ragged`. Thresholds measured with benchmarks/sampler.py on XLA:CPU (small config, E = 16,
    k = 2: one layer at T = 1 / 8 / 32 tokens takes 0.6 / 3.1 / 6.8 ms against 25 / 27 / 32 ms for the ragged
    fallback). Accelerators have a real grouped matmul: use `routed_experts_ragged` there.
    """
    picks, n_exp = ids.size, w1.shape[0]
    if 4 * picks <= n_exp:
        return routed_experts_gathered(x, ids, weights, w1, w3, w2, limit=limit, dtype=dtype)
    if picks <= 4 * n_exp:
        return routed_experts_dense(x, ids, weights, w1, w3, w2, limit=limit, dtype=dtype)
    return routed_experts_ragged(x, ids, weights, w1, w3, w2, limit=limit, dtype=dtype)


DispatchFn = Callable[..., jax.Array]


class _Gate(nnx.Module):
    def __init__(self, cfg, is_hash: bool, *, rngs, param_dtype):
        self.weight = param(rngs, (cfg.n_routed_experts, cfg.hidden_size), (ax.EXPERT, ax.EMBED),
                            dtype=param_dtype, std=cfg.initializer_range)
        if is_hash:
            # Distinct experts per token id (a random permutation prefix per row): a usable default for random init.
            keys = jax.random.split(rngs.params(), cfg.vocab_size)
            perm = jax.vmap(lambda kk: jax.random.permutation(kk, cfg.n_routed_experts)[: cfg.num_experts_per_tok])
            self.tid2eid = Buffer(perm(keys).astype(jnp.int32), logical_axes=(ax.VOCAB, ax.TABLE))
        else:
            self.bias = Buffer(jnp.zeros((cfg.n_routed_experts,), jnp.float32), logical_axes=(ax.EXPERT,))


class _Experts(nnx.Module):
    def __init__(self, cfg, *, rngs, param_dtype):
        e, i, d, std = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.initializer_range
        self.w1 = param(rngs, (e, i, d), (ax.EXPERT, ax.MLP, ax.EMBED), dtype=param_dtype, std=std)
        self.w3 = param(rngs, (e, i, d), (ax.EXPERT, ax.MLP, ax.EMBED), dtype=param_dtype, std=std)
        self.w2 = param(rngs, (e, d, i), (ax.EXPERT, ax.EMBED, ax.MLP), dtype=param_dtype, std=std)


class _SharedExpert(nnx.Module):
    def __init__(self, cfg, *, rngs, param_dtype):
        i, d, std = cfg.shared_intermediate_size, cfg.hidden_size, cfg.initializer_range
        self.w1 = _W(param(rngs, (i, d), (ax.MLP, ax.EMBED), dtype=param_dtype, std=std))
        self.w3 = _W(param(rngs, (i, d), (ax.MLP, ax.EMBED), dtype=param_dtype, std=std))
        self.w2 = _W(param(rngs, (d, i), (ax.EMBED, ax.MLP), dtype=param_dtype, std=std))


class _W(nnx.Module):
    def __init__(self, weight):
        self.weight = weight


class MoE(nnx.Module):
    """Parameters named as the official `layers.i.ffn.*`: `gate.{weight,bias|tid2eid}`, `experts`, `shared_experts`."""

    def __init__(self, cfg, layer_idx: int, *, rngs, param_dtype, dtype):
        self.is_hash = cfg.is_hash_layer(layer_idx)
        self.top_k, self.scale, self.limit = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit
        self.norm_topk = cfg.norm_topk_prob
        self.dtype = dtype
        self.gate = _Gate(cfg, self.is_hash, rngs=rngs, param_dtype=param_dtype)
        self.experts = _Experts(cfg, rngs=rngs, param_dtype=param_dtype)
        self.shared_experts = _SharedExpert(cfg, rngs=rngs, param_dtype=param_dtype) if cfg.n_shared_experts else None

    def route(self, u: jax.Array, token_ids: jax.Array, forced_ids: jax.Array | None = None):
        """u [T, D], token_ids [T] -> (ids [T, k] int32, weights [T, k] float32) (spec §6 router)."""
        scores = jnp.sqrt(jax.nn.softplus(linear_f32(u, self.gate.weight[...])))  # [T, E]
        if self.is_hash:
            ids = self.gate.tid2eid[...][token_ids].astype(jnp.int32)
        else:
            biased = scores + self.gate.bias[...].astype(jnp.float32)
            ids = jax.lax.top_k(jax.lax.stop_gradient(biased), self.top_k)[1].astype(jnp.int32)
        if forced_ids is not None:
            ids = jnp.where(forced_ids >= 0, forced_ids.astype(jnp.int32), ids)
        w = jnp.take_along_axis(scores, ids, axis=-1)
        if self.norm_topk:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return ids, w * self.scale

    def __call__(self, u: jax.Array, token_ids: jax.Array, forced_ids: jax.Array | None = None,
                 dispatch_fn: DispatchFn | None = None):
        """u [B, S, D] (normalised), token_ids [B, S], forced_ids [B, S, k] | None -> (out [B, S, D], ids [B, S, k])."""
        b, s, d = u.shape
        uf = u.reshape(b * s, d)
        ids, w = self.route(uf, token_ids.reshape(-1), None if forced_ids is None else forced_ids.reshape(b * s, -1))
        fn = dispatch_fn or routed_experts_ragged
        e = self.experts
        y = fn(uf, ids, w, e.w1[...], e.w3[...], e.w2[...], limit=self.limit, dtype=self.dtype)
        if self.shared_experts is not None:
            se = self.shared_experts
            h = swiglu(linear(uf, se.w1.weight[...], self.dtype), linear(uf, se.w3.weight[...], self.dtype),
                       self.limit)
            y = y + linear(h, se.w2.weight[...], self.dtype).astype(jnp.float32)
        return y.astype(u.dtype).reshape(b, s, d), ids.reshape(b, s, -1)
