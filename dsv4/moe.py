"""Mixture of experts: hash or top-k routing, clamped-SwiGLU routed experts, shared expert (spec §6).

Router (float32): s_e = sqrt(softplus(W_g u)). Selection: top-k of s + bias (learned layers) or `tid2eid[id]`
(the first `num_hash_layers` layers). Weights: s at the selection, renormalised over the k picks, x
`routed_scaling_factor`. The bias only selects (spec §12 item 17).
Routing replay: `forced_ids` [T, k] (>= 0 forced, < 0 = route normally) replaces the selection in any layer,
hash layers included; the weights still come from the router so it keeps its gradient.

Experts are stacked: w1, w3 [E, I, D], w2 [E, D, I] (official per-expert `w1/w3/w2`, [out, in]).
The model's routed computation is sort-by-expert + `jax.lax.ragged_dot_general` (dropless; a grouped matmul on
GPU/TPU). `dispatch_fn` substitutes another implementation with the same contract: `parallel/expert.py`'s
expert-parallel all-to-all, or the XLA:CPU ones here (`routed_experts_cpu`: gathered / dense / tiled with a custom
VJP; XLA:CPU's `ragged_dot` is a slow generic fallback), which `default_dispatch` picks for the sampler and the
learner on CPU. All of them are dropless and equal to `routed_experts_ragged` up to summation order.
Sources: official `Gate`, `Expert`, `MoE`; HF `DeepseekV4TopKRouter`, `DeepseekV4HashRouter`,
`DeepseekV4Experts`, `DeepseekV4MLP`; spec §12 items 16-20.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.fp8_gemm import FakeQuantWeight
from dsv4.layers import Buffer, Linear, dot_out, linear_f32, param, weight_of
from dsv4.quant import ROUTED_EXPERT_RE, QuantizedTensor, act_fake_quant, act_fake_quant_ste
from sharding import axes as ax

def _aq(act_q, h):
    """h, or act_q(h) when the routed experts quantise their activations (the release's FP4 x FP8 GEMM input)."""
    return h if act_q is None else act_q(h)


# The name scope of the routed-expert dispatch (its FFN dots carry it in their HLO op_name metadata): what
# launch/hlo_stats.py counts as the routed experts' flops (`expert_flops_x_routed`).
ROUTED_EXPERTS_SCOPE = "routed_experts"
_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """SiLU(min(gate, limit)) * clip(up, -limit, limit) in float32 (spec §12 item 19)."""
    gate = jnp.minimum(gate.astype(jnp.float32), limit)
    up = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(gate) * up


def routed_experts_ragged(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                          w2: jax.Array, *, limit: float, dtype, act_q=None) -> jax.Array:
    """Dropless routed-expert FFN by sorting token copies by expert and grouped matmuls.

    x [T, D]; ids [T, k] int32 in [0, E); weights [T, k] float32; w1, w3 [E, I, D]; w2 [E, D, I].
    Returns [T, D] float32 = sum_j weights[t, j] * E_{ids[t, j]}(x_t).
    act_q: None, or a function applied to the w2 input (the weighted SwiGLU output in `dtype`, [rows, I]) before
    the w2 product: the rollout's release-exact FP8 activations (`MoE`). Every implementation here takes it.
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

    h = _aq(act_q, (swiglu(gmm(xs, w1), gmm(xs, w3), limit) * weights.reshape(-1)[order][:, None]).astype(dtype))
    y = gmm(h, w2)
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[tok].add(y)


def routed_experts_dense(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                         w2: jax.Array, *, limit: float, dtype, act_q=None) -> jax.Array:
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
    h = _aq(act_q, jnp.transpose(h, (1, 0, 2)).astype(dtype))  # [E, T, I]
    y = jax.lax.dot_general(h, w2.astype(dtype), (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    return jnp.sum(y, axis=0)


def routed_experts_gathered(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                            w2: jax.Array, *, limit: float, dtype, act_q=None) -> jax.Array:
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
    h = _aq(act_q, (swiglu(g, u, limit) * weights.reshape(-1)[:, None]).astype(dtype))[:, None, :]
    y = jax.lax.dot_general(h, w2[flat].astype(dtype), bd, preferred_element_type=jnp.float32)[:, 0]
    return jnp.sum(y.reshape(t, k, -1), axis=1)


def _tile_plan(ids: jax.Array, n_exp: int, tile: int):
    """Expert-sorted layout of the T*k (token, pick) copies and its cut into tiles (see `routed_experts_tiled`)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    tiles_e = (sizes + tile - 1) // tile
    return {"order": order, "sizes": sizes, "starts": jnp.cumsum(sizes) - sizes, "tiles_e": tiles_e,
            "tile_end": jnp.cumsum(tiles_e)}


def _tile_at(plan, j, n_exp: int, tile: int):
    """Loop step j -> (expert e, first sorted row, [tile] bool mask of the rows that belong to e)."""
    e = jnp.minimum(jnp.searchsorted(plan["tile_end"], j, side="right"), n_exp - 1).astype(jnp.int32)
    local = j - (plan["tile_end"][e] - plan["tiles_e"][e])
    return e, plan["starts"][e] + local * tile, jnp.arange(tile) + local * tile < plan["sizes"][e]


_NT = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]


def _tiled_forward(x, ids, weights, w1, w3, w2, limit, dtype, tile, act_q=None):
    t, k = ids.shape
    n_exp, d, n = w1.shape[0], x.shape[-1], ids.size
    plan = _tile_plan(ids, n_exp, tile)
    tok = plan["order"] // k
    xs = jnp.concatenate([x[tok].astype(dtype), jnp.zeros((tile, d), dtype)])  # padded: slices stay in bounds
    ws = jnp.concatenate([weights.reshape(-1)[plan["order"]], jnp.zeros((tile,), jnp.float32)])

    def body(j, y):
        def run(y):
            e, row0, valid = _tile_at(plan, j, n_exp, tile)
            xt = jax.lax.dynamic_slice_in_dim(xs, row0, tile)
            wt = jnp.where(valid, jax.lax.dynamic_slice_in_dim(ws, row0, tile), 0.0)
            a, b, c = (jax.lax.dynamic_index_in_dim(w, e, keepdims=False).astype(dtype) for w in (w1, w3, w2))
            g = jax.lax.dot_general(xt, a, _NT, preferred_element_type=jnp.float32)
            u = jax.lax.dot_general(xt, b, _NT, preferred_element_type=jnp.float32)
            h = _aq(act_q, (swiglu(g, u, limit) * wt[:, None]).astype(dtype))
            yt = jax.lax.dot_general(h, c, _NT, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(y, jax.lax.dynamic_slice_in_dim(y, row0, tile) + yt, row0, 0)
        return jax.lax.cond(j < plan["tile_end"][-1], run, lambda y: y, y)

    y = jax.lax.fori_loop(0, n // tile + n_exp, body, jnp.zeros((n + tile, d), jnp.float32))[:n]
    return jnp.zeros((t, d), jnp.float32).at[tok].add(y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _tiled(x, ids, weights, w1, w3, w2, limit, dtype, tile, act_q):
    return _tiled_forward(x, ids, weights, w1, w3, w2, limit, dtype, tile, act_q)


def _tiled_fwd(x, ids, weights, w1, w3, w2, limit, dtype, tile, act_q):
    return _tiled_forward(x, ids, weights, w1, w3, w2, limit, dtype, tile, act_q), (x, ids, weights, w1, w3, w2)


def _tiled_bwd(limit, dtype, tile, act_q, res, dout):
    """The backward as a second tile loop: each step recomputes its tile's gate/up activations and adds its
    expert's weight gradients into that expert's slice of the (loop-carried, updated in place) gradient buffers,
    so no step touches more than one expert (autodiff of the forward loop adds full [E, I, D] buffers per step)."""
    x, ids, weights, w1, w3, w2 = res
    t, k = ids.shape
    n_exp, d, n = w1.shape[0], x.shape[-1], ids.size
    plan = _tile_plan(ids, n_exp, tile)
    tok = plan["order"] // k
    pad = lambda a: jnp.concatenate([a, jnp.zeros((tile,) + a.shape[1:], a.dtype)])  # noqa: E731
    xs = pad(x[tok].astype(dtype))
    ws = pad(weights.reshape(-1)[plan["order"]].astype(jnp.float32))
    dys = pad(dout.astype(jnp.float32)[tok])  # cotangent of each sorted row's output

    def body(j, carry):
        def run(carry):
            dxs, dws, dw1, dw3, dw2 = carry
            e, row0, valid = _tile_at(plan, j, n_exp, tile)
            xt = jax.lax.dynamic_slice_in_dim(xs, row0, tile)
            wt = jnp.where(valid, jax.lax.dynamic_slice_in_dim(ws, row0, tile), 0.0)
            dy = jnp.where(valid[:, None], jax.lax.dynamic_slice_in_dim(dys, row0, tile), 0.0)
            a, b, c = (jax.lax.dynamic_index_in_dim(w, e, keepdims=False).astype(dtype) for w in (w1, w3, w2))
            g = jax.lax.dot_general(xt, a, _NT, preferred_element_type=jnp.float32)
            u = jax.lax.dot_general(xt, b, _NT, preferred_element_type=jnp.float32)
            gc, uc = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
            sig = jax.nn.sigmoid(gc)
            act = gc * sig  # silu
            s = act * uc
            h = _aq(act_q, (s * wt[:, None]).astype(dtype))  # the w2 input as the forward saw it
            # y = h c^T: dh = dy c, dc = dy^T h
            dh = jax.lax.dot_general(dy.astype(dtype), c, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            dc = jax.lax.dot_general(dy.astype(dtype), h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            dwt = jnp.sum(dh * s, axis=-1)
            ds = dh * wt[:, None]
            dg = ds * uc * (sig * (1.0 + gc * (1.0 - sig))) * (g < limit)
            du = ds * act * (jnp.abs(u) <= limit)
            dg_c, du_c = dg.astype(dtype), du.astype(dtype)
            first = (((0,), (0,)), ((), ()))  # [C, I] x [C, D] -> [I, D]
            da = jax.lax.dot_general(dg_c, xt, first, preferred_element_type=jnp.float32)
            db = jax.lax.dot_general(du_c, xt, first, preferred_element_type=jnp.float32)
            mm = (((1,), (0,)), ((), ()))
            dxt = (jax.lax.dot_general(dg_c, a, mm, preferred_element_type=jnp.float32)
                   + jax.lax.dot_general(du_c, b, mm, preferred_element_type=jnp.float32))

            def add_rows(buf, val):
                return jax.lax.dynamic_update_slice_in_dim(buf, jax.lax.dynamic_slice_in_dim(buf, row0, tile) + val,
                                                           row0, 0)

            def add_expert(buf, val):
                cur = jax.lax.dynamic_index_in_dim(buf, e, keepdims=True)
                return jax.lax.dynamic_update_index_in_dim(buf, cur + val[None], e, 0)

            return (add_rows(dxs, jnp.where(valid[:, None], dxt, 0.0)), add_rows(dws, jnp.where(valid, dwt, 0.0)),
                    add_expert(dw1, da), add_expert(dw3, db), add_expert(dw2, dc))
        return jax.lax.cond(j < plan["tile_end"][-1], run, lambda c: c, carry)

    init = (jnp.zeros((n + tile, d), jnp.float32), jnp.zeros((n + tile,), jnp.float32),
            jnp.zeros(w1.shape, jnp.float32), jnp.zeros(w3.shape, jnp.float32), jnp.zeros(w2.shape, jnp.float32))
    dxs, dws, dw1, dw3, dw2 = jax.lax.fori_loop(0, n // tile + n_exp, body, init)
    dx = jnp.zeros((t, d), jnp.float32).at[tok].add(dxs[:n]).astype(x.dtype)
    dweights = jnp.zeros((n,), jnp.float32).at[plan["order"]].set(dws[:n]).reshape(t, k).astype(weights.dtype)
    return (dx, None, dweights, dw1.astype(w1.dtype), dw3.astype(w3.dtype), dw2.astype(w2.dtype))


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def routed_experts_tiled(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                         w2: jax.Array, *, limit: float, dtype, tile: int | None = None, act_q=None) -> jax.Array:
    """Dropless routed experts as a loop over fixed-size tiles of the expert-sorted token copies.

    Same contract as `routed_experts_ragged`. The T*k (token, pick) copies are sorted by expert; expert e's rows
    are cut into ceil(n_e / tile) tiles and each loop step runs one tile through one expert ([tile, D] matmuls
    against that expert's weights, rows past n_e masked). The loop has a static trip count (T*k // tile + E: the
    most tiles any routing can need; the steps past the real tile count skip their work with `lax.cond`). The
    gradient is a custom VJP: a second tile loop that recomputes each tile's activations and accumulates weight
    gradients into that expert's slice only. This is a grouped matmul for backends without one (XLA:CPU's
    `ragged_dot` fallback is 4-8x slower at 512-2048 tokens). tile: rows per tile (default: the mean rows per
    expert rounded up to a power of two, clipped to [16, 128]). Math: spec §6 / §12 item 19 (clamped SwiGLU).
    """
    n_exp = w1.shape[0]
    if tile is None:
        mean_rows = max(1, ids.size // n_exp)
        tile = int(min(128, max(16, 1 << (mean_rows - 1).bit_length())))
    return _tiled(x, ids, weights, w1, w3, w2, float(limit), jnp.dtype(dtype), int(tile), act_q)


def routed_experts_cpu(x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w3: jax.Array,
                       w2: jax.Array, *, limit: float, dtype, act_q=None) -> jax.Array:
    """Routed experts for XLA:CPU: picks an implementation from the static shapes (same contract as
    `routed_experts_ragged`).

    T * k <= E / 4: `routed_experts_gathered`; T * k <= 4 E: `routed_experts_dense`; otherwise
    `routed_experts_tiled`. Measured on XLA:CPU (small config: E = 16, k = 2, D = I = 512; see
    benchmarks/README.md): one layer at T = 1 / 8 / 32 decode tokens takes 0.6 / 3.1 / 6.8 ms against 25 / 27 /
    32 ms for the `ragged_dot` fallback, and at T = 512 / 2048 the tiled loop runs the forward in 23 / 51 ms against
    143 / 494 ms and the gradient in 140 / 330 ms against 412 / 1551 ms. GPUs and TPUs have a real grouped
    matmul: keep `routed_experts_ragged` there (`default_dispatch`).
    """
    picks, n_exp = ids.size, w1.shape[0]
    if 4 * picks <= n_exp:
        return routed_experts_gathered(x, ids, weights, w1, w3, w2, limit=limit, dtype=dtype, act_q=act_q)
    if picks <= 4 * n_exp:
        return routed_experts_dense(x, ids, weights, w1, w3, w2, limit=limit, dtype=dtype, act_q=act_q)
    return routed_experts_tiled(x, ids, weights, w1, w3, w2, limit=limit, dtype=dtype, act_q=act_q)


def routed_experts_local(devices: Sequence[Any], param_shardings: Mapping[str, Any] | None = None):
    """The routed-expert implementation when the experts are not split over an `expert` mesh axis (the model's
    part of `parallel.expert.default_dispatch`, the one place that decides; that function adds expert parallelism).

    Args:
      devices: the devices the model runs on (`jax.Device`s; only `.platform` is read).
      param_shardings: {"/"-joined parameter path, e.g. "layers/1/ffn/experts/w1": its sharding (None or a
        sharding without `.spec` = not sharded)}, or None for a single device.
    Returns:
      `routed_experts_cpu` when every device is a CPU and no routed-expert weight is sharded on its expert axis
      (a gather or a dynamic index over a sharded expert axis would make XLA all-gather the weights); otherwise
      None, i.e. the model's stock `routed_experts_ragged` (`ragged_dot`: a grouped matmul on GPU/TPU,
      partitioned by GSPMD).
    """
    expert_sh = [sh for k, sh in (param_shardings or {}).items() if ROUTED_EXPERT_RE.search(k)]
    sharded = any(getattr(sh, "spec", None) and sh.spec[0] is not None for sh in expert_sh)
    if sharded or any(d.platform != "cpu" for d in devices):
        return None
    return routed_experts_cpu


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
        self.lora = nnx.data(None)  # per-expert LoRA adapters (`dsv4.lora.ExpertAdapters`), merged in the forward


class _SharedExpert(nnx.Module):
    def __init__(self, cfg, *, rngs, param_dtype, dtype):
        i, d, std = cfg.shared_intermediate_size, cfg.hidden_size, cfg.initializer_range
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype, std=std)
        self.w1 = Linear(d, i, (ax.MLP, ax.EMBED), **kw)
        self.w3 = Linear(d, i, (ax.MLP, ax.EMBED), **kw)
        self.w2 = Linear(i, d, (ax.EMBED, ax.MLP), **kw)


class MoE(nnx.Module):
    """Parameters named as the official `layers.i.ffn.*`: `gate.{weight,bias|tid2eid}`, `experts`, `shared_experts`."""

    def __init__(self, cfg, layer_idx: int, *, rngs, param_dtype, dtype):
        self.is_hash = cfg.is_hash_layer(layer_idx)
        self.top_k, self.scale, self.limit = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit
        self.norm_topk = cfg.norm_topk_prob
        self.dtype = dtype
        self.gate = _Gate(cfg, self.is_hash, rngs=rngs, param_dtype=param_dtype)
        self.experts = _Experts(cfg, rngs=rngs, param_dtype=param_dtype)
        self.shared_experts = (_SharedExpert(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
                               if cfg.n_shared_experts else None)

    def route(self, u: jax.Array, token_ids: jax.Array, forced_ids: jax.Array | None = None):
        """u [T, D], token_ids [T] -> (ids [T, k] int32, weights [T, k] float32) (spec §6 router)."""
        scores = jnp.sqrt(jax.nn.softplus(linear_f32(u, weight_of(self.gate.weight))))  # [T, E]
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
        """u [B, S, D] (normalised), token_ids [B, S], forced_ids [B, S, k] | None -> (out [B, S, D], ids [B, S, k],
        drops [2] int32: (pairs dropped, pairs routed) by a dispatch that can drop (`dispatch_fn.can_drop` and
        `.with_stats`, `parallel.expert.make_ep_dispatch` with a capacity factor), else constant zeros)."""
        b, s, d = u.shape
        uf = u.reshape(b * s, d)
        ids, w = self.route(uf, token_ids.reshape(-1), None if forced_ids is None else forced_ids.reshape(b * s, -1))
        counted = getattr(dispatch_fn, "can_drop", False)
        fn = jax.named_scope(ROUTED_EXPERTS_SCOPE)(dispatch_fn.with_stats if counted else
                                                    (dispatch_fn or routed_experts_ragged))
        e = self.experts
        # The routed experts stay as placed (not `weight_of`): the EP dispatch gathers D inside its shard_map, and
        # gathering every expert for the single-device path costs more than it saves (benchmarks/README.md
        # "Context parallelism": +24% temp at 16K tokens on context=4).
        w1, w3, w2 = e.w1.get_value(), e.w3.get_value(), e.w2.get_value()
        if isinstance(w1, QuantizedTensor) and w1.matmul != "dequant" and getattr(dispatch_fn, "fp8_experts", False):
            # FP8 expert GEMMs (the rollout's `--rollout.matmul fp8`, `parallel.padded.padded_ffn`): the dispatch
            # quantises the rows and the w2 input per 1 x 128 block and multiplies the stored FP8 blocks
            y = fn(uf.astype(self.dtype), ids, w, w1, w3, w2, limit=self.limit, dtype=self.dtype)
        elif isinstance(w1, QuantizedTensor):
            # The rollout's quantised experts (`dsv4.rollout_format`): as the release's FP8 x FP4 (or FP8) expert GEMMs,
            # the inputs of w1/w3 and of w2 are quantised to FP8 per 1 x 128 block (`act_fake_quant`, ue8m0 scales)
            # and multiply the dequantised weights (the same products as the quantised GEMM).
            w1, w3, w2 = (v.dequantize(self.dtype) for v in (w1, w3, w2))
            if e.lora is not None:
                w1, w3, w2 = e.lora.merged(w1, w3, w2)
            y = fn(act_fake_quant(uf.astype(self.dtype)), ids, w, w1, w3, w2, limit=self.limit, dtype=self.dtype,
                   act_q=act_fake_quant)
        elif isinstance(w1, FakeQuantWeight):
            # The FP8-aware learner (`dsv4.rollout_format.fp8_aware_params`): the rollout's dequantised experts and the
            # same activation quantisation, with straight-through gradients (the tiled CPU path's custom VJP treats
            # act_q as the identity already).
            w1, w3, w2 = (v.w for v in (w1, w3, w2))
            if e.lora is not None:
                w1, w3, w2 = e.lora.merged(w1, w3, w2)
            y = fn(act_fake_quant_ste(uf.astype(self.dtype)), ids, w, w1, w3, w2, limit=self.limit, dtype=self.dtype,
                   act_q=act_fake_quant_ste)
        else:
            if e.lora is not None:
                w1, w3, w2 = e.lora.merged(w1, w3, w2)
            y = fn(uf, ids, w, w1, w3, w2, limit=self.limit, dtype=self.dtype)
        drops = jnp.zeros((2,), jnp.int32)
        if counted:
            y, st = y
            drops = jnp.stack([st.dropped, st.routed]).astype(jnp.int32)
        if self.shared_experts is not None:
            se = self.shared_experts
            h = swiglu(se.w1(uf), se.w3(uf), self.limit)
            y = y + se.w2(h).astype(jnp.float32)
        return y.astype(u.dtype).reshape(b, s, d), ids.reshape(b, s, -1), drops
