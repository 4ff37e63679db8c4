"""The token draw of the rollout: temperature, top-k and top-p over one decode step's logits, with the logprob
the learner recomputes. Shared by the static program (rl/rollout/static.py), continuous batching
(rl/rollout/slots.py), speculative decoding and exact mode, so all draw a sample's tokens with the same math from
the same keys.

Logprobs are `log_softmax(logits / T)` over the full vocabulary at the drawn token: after temperature, before
top-k/top-p truncation (the distribution the learner recomputes from training logits / T). Temperature 0 is
greedy (argmax), with the logprobs of T = 1. All sampling parameters are traced values.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def filter_logits(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Top-k then nucleus filtering of scaled logits [B, V] (traced k and p); removed entries -> -inf."""
    v = scaled.shape[-1]
    srt = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[None, None].repeat(srt.shape[0], 0), axis=-1)
    srt = jnp.where(srt >= kth, srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the first token is always kept
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    thresh = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
    return jnp.where((scaled >= thresh) & (scaled >= kth), scaled, -jnp.inf)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature, top_p, top_k):
    """logits [B, V] f32, keys [B] PRNG keys -> (tokens [B] int32, logprobs [B] f32 of log_softmax(logits/T))."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)
    scaled = logits / t
    lp_all = jax.nn.log_softmax(scaled, axis=-1)
    filtered = jax.lax.cond((top_k > 0) | (top_p < 1), filter_logits, lambda s, p, k: s, scaled, top_p, top_k)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    tok = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tok, jnp.take_along_axis(lp_all, tok[:, None], axis=-1)[:, 0]


def row_keys(seed: int, step: int, prompt_index: Sequence[int], sample_index: Sequence[int]) -> jax.Array:
    """[N] PRNG keys of the rows: fold_in(fold_in(fold_in(key(seed), step), prompt), sample); a row draws its token
    g with fold_in(key, g). Every sampler path (static, slots, exact mode) derives its randomness here, so a sample's
    tokens are a function of (seed, step, prompt, sample) wherever and whenever it is generated."""
    base = jax.random.fold_in(jax.random.key(seed), step)
    return jnp.stack([jax.random.fold_in(jax.random.fold_in(base, int(p)), int(q))
                      for p, q in zip(prompt_index, sample_index)])
