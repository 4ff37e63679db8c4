"""The static-batch rollout program: prefill + a `lax.while_loop` decode over donated caches, every row decoding
until the longest one ends (`Sampler(slots=0)`, the default; continuous batching is rl/rollout/slots.py).

Rows are right-padded (each has its own positions), so a row's result does not depend on the other rows. Token g of
a row is drawn with fold_in(key_row, token_offset + g) (`rl.rollout.sampling`); the last response token is fed once
more after sampling stops so that its routing is recorded too. Prefill and decode ops sit under the `prefill` /
`decode_step` name scopes (profiles, compiled HLO; benchmarks/sampler.py counts the decode step's bytes from them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.cache import decode_step
from dsv4.chunked import prefill_chunked
from rl.rollout.sampling import sample_tokens


def static_program(sampler, shape, wstate, caches, ids, lens, key_data, temperature, top_p, top_k, max_new, stop_ids,
                   token_offset):
    """The static-batch rollout (traced by the sampler's static jit).

    shape = (B, P, T) static: batch, prompt bucket, response bucket. caches: decode caches of P + T positions
    (donated). ids [B, P] right-padded prompts, lens [B], key_data [B, ...] per-row keys, temperature / top_p /
    top_k scalars, max_new [B] per-row length limits, stop_ids [16] (-1 = unused), token_offset [B].
    Returns (tokens [B, T] int32, logprobs [B, T] f32, prompt routing [B, P, L, k], response routing [B, T, L, k],
    lengths [B], stopped [B] bool, caches).
    """
    b, p, t_cap = shape
    keys = jax.random.wrap_key_data(key_data)
    cache_len = p + t_cap
    layerwise = sampler.dequant == "per_layer"
    # per_layer: the model outside the layers as stored, each layer built (dequantised) right before it runs
    model = sampler.layerwise.shell(wstate) if layerwise else sampler.dense_model(wstate)
    layer_fn = sampler.layerwise.layer_fn(wstate) if layerwise else None
    with jax.named_scope("prefill"):  # names the ops in profiles and compiled HLO (benchmarks/sampler.py)
        logits, prompt_routing, caches = prefill_chunked(model, ids, lens, cache_len, sampler.prefill_chunk,
                                                         dispatch_fn=sampler.dispatch_fn, layer_fn=layer_fn,
                                                         kv_fp8=sampler.kv_fp8)

    def is_stop(tok):
        return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

    def keys_at(i):  # token g = token_offset + i of each row (a continued partial rollout keeps counting)
        return jax.vmap(lambda kk, o: jax.random.fold_in(kk, o + i))(keys, token_offset)

    tok0, lp0 = sample_tokens(logits, keys_at(0), temperature, top_p, top_k)
    n_l, k = sampler.config.num_hidden_layers, sampler.config.num_experts_per_tok
    out_tok = jnp.zeros((b, t_cap + 1), jnp.int32).at[:, 0].set(tok0)
    out_lp = jnp.zeros((b, t_cap + 1), jnp.float32).at[:, 0].set(lp0)
    resp_routing = jnp.full((b, t_cap + 1, n_l, k), -1, jnp.int32)
    stop0 = is_stop(tok0)
    done = stop0 | (max_new <= 1)
    length = jnp.ones((b,), jnp.int32)
    carry = (jnp.int32(1), tok0, done, length, out_tok, out_lp, resp_routing, caches, stop0)
    per_step = sampler.dequant == "per_step"

    def cond(c):
        i, _, _, length = c[:4]
        return jnp.any((i <= max_new) & (i - 1 < length))  # max_new: per row

    def body(c):
        i, cur, done, length, out_tok, out_lp, resp_routing, caches, stopped = c
        m = sampler.dense_model(jax.lax.optimization_barrier(wstate)) if per_step else model
        pos = lens + i - 1
        with jax.named_scope("decode_step"):
            logits, r, caches = decode_step(m, cur, pos, caches, dispatch_fn=sampler.dispatch_fn, layer_fn=layer_fn)
        fed_real = (i - 1) < length
        resp_routing = resp_routing.at[:, i - 1].set(jnp.where(fed_real[:, None, None], r, -1))
        active = (~done) & (i < max_new)
        tok, lp = sample_tokens(logits, keys_at(i), temperature, top_p, top_k)
        tok = jnp.where(active, tok, 0)
        out_tok = out_tok.at[:, i].set(tok)
        out_lp = out_lp.at[:, i].set(jnp.where(active, lp, 0.0))
        length = length + active.astype(jnp.int32)
        stop = active & is_stop(tok)
        done = done | stop | (active & (i + 1 >= max_new))
        return (i + 1, tok, done, length, out_tok, out_lp, resp_routing, caches, stopped | stop)

    if per_step:
        del model
    out = jax.lax.while_loop(cond, body, carry)
    _, _, _, length, out_tok, out_lp, resp_routing, caches, stopped = out
    return (out_tok[:, :t_cap], out_lp[:, :t_cap], prompt_routing, resp_routing[:, :t_cap], length, stopped, caches)
