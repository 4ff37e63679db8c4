"""Per-token log-probabilities (and entropies) of a token sequence under the model: the one place the RL loss
calls the model (house rule 5).

Alignment: the log-prob of token j is read from the logits at position j - 1 (next-token prediction), and is
stored at position j, the token's own position, so one `[N, S]` mask (the sampler's `response_mask`) selects
the same tokens in logprobs, rollout_logprobs and the loss:

    logprobs[:, j] = log softmax(logits[:, j - 1] / T)[input_ids[:, j]]        for j >= 1
    entropy[:, j]  = H(softmax(logits[:, j - 1] / T)) = -sum_v p_v log p_v       (the distribution token j came from)

Both are 0 at j = 0 and wherever token j or token j - 1 is padding (`attention_mask` == 0): such a position
predicts nothing real, so it carries no value that a mask could forget to remove.

Choices:
- Temperature: the sampler draws from softmax(logits / T), so the learner must score with the same T, or the
  PPO ratio and the train/rollout mismatch compare different distributions (verl and OpenRLHF also divide).
  T == 0 means greedy decoding in the sampler; there is no greedy distribution to score, so T is taken as 1.
- Precision: log-softmax, logsumexp and entropy run in float32 whatever the model's compute dtype (its head
  already returns float32 logits).
- Memory (`chunk_size`): with `chunk_size=None` the model's full `[N, S, V]` float32 logits are used. With
  `chunk_size=C` the model is asked for its final hidden state `[N, S, D]` (`return_hidden=True`) and the
  head + log-softmax run over sequence chunks of C positions inside `lax.scan` with `jax.checkpoint`, so
  the forward and the backward each hold one `[N, C, V]` block of logits at a time. The model's own full logits
  are then unused and XLA removes them (dead code) when this runs under `jax.jit`, which is how the learner
  calls it; called eagerly, the model still materialises them. The results are equal up to float32 rounding.

Sources: next-token scoring as in every PPO-for-LMs implementation (e.g. verl `logprobs_from_logits`,
OpenRLHF `log_probs_from_logits`); entropy via logsumexp(z) - sum softmax(z) z (same value as -sum p log p,
computed without log(0)).

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_logprobs.py`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def effective_temperature(temperature: float) -> float:
    """The temperature logits are divided by: `temperature`, or 1.0 when it is 0 (greedy sampling)."""
    t = float(temperature)
    if t < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    return 1.0 if t == 0.0 else t


def _score(z: jnp.ndarray, targets: jnp.ndarray, return_entropy: bool) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """z [..., V] float32 tempered logits, targets [...] int -> (log p(target) [...], entropy [...] | None)."""
    lse = jax.nn.logsumexp(z, axis=-1)  # [...]
    lp = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0] - lse
    if not return_entropy:
        return lp, None
    p = jax.nn.softmax(z, axis=-1)
    return lp, lse - jnp.sum(p * z, axis=-1)


def _score_chunked(head, h_prev: jnp.ndarray, targets: jnp.ndarray, inv_t: float, chunk: int,
                   return_entropy: bool) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """Chunked head + scoring. h_prev [N, S-1, D], targets [N, S-1] -> ([N, S-1], [N, S-1] | None)."""
    n, s1, d = h_prev.shape
    chunk = max(1, min(chunk, s1))  # a chunk longer than the sequence would only add padded positions
    n_chunks = -(-s1 // chunk)
    pad = n_chunks * chunk - s1
    h = jnp.pad(h_prev, ((0, 0), (0, pad), (0, 0))).reshape(n, n_chunks, chunk, d).swapaxes(0, 1)  # -> [K, N, C, D]
    t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(n, n_chunks, chunk).swapaxes(0, 1)  # -> [K, N, C]

    @jax.checkpoint
    def one(h_c, t_c):
        lp, ent = _score(head(h_c).astype(jnp.float32) * inv_t, t_c, return_entropy)
        return lp, (jnp.zeros_like(lp) if ent is None else ent)

    def body(carry, xs):
        return carry, one(*xs)

    _, (lp, ent) = jax.lax.scan(body, None, (h, t))  # [K, N, C] each
    lp = lp.swapaxes(0, 1).reshape(n, -1)[:, :s1]  # -> [N, S-1]
    ent = ent.swapaxes(0, 1).reshape(n, -1)[:, :s1] if return_entropy else None
    return lp, ent


def token_logprobs(
    model: Any,
    input_ids: jnp.ndarray,
    attention_mask: jnp.ndarray | None,
    *,
    temperature: float = 1.0,
    routing_replay: jnp.ndarray | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    dispatch_fn: Any = None,
    layer_stack: Any = None,
    mtp: bool = False,
    expert_drops: bool = False,
    left_aligned: bool = False,
) -> tuple[jnp.ndarray, jnp.ndarray | None, jnp.ndarray]:
    """Log-probability of every token given its prefix, under `model` (a `dsv4.DSV4ForCausalLM`).

    Args:
        model: callable as `model(ids, attention_mask=, routing_replay=, return_hidden=, dispatch_fn=)` returning
            an object with `.logits [N, S, V]`, `.routing [N, S, L, k]`, `.hidden [N, S, D]`; and `.lm_head(h)`.
        input_ids: [N, S] int32, e.g. `[prompt | response | pad]` (rl/batch.py).
        attention_mask: [N, S] (1 = real token, contiguous) or None (all real).
        temperature: the sampler's temperature T (static Python float); 0 (greedy) is treated as 1.
        routing_replay: [N, S, L, k] int32 expert ids to force (entries < 0 route freely), or None.
        return_entropy: also return the per-position entropy of the tempered distribution.
        chunk_size: None for the full-logits path, or C >= 1 to run head + log-softmax over chunks of C positions
            (see the module docstring; bounds the logits memory to [N, C, V]).
        dispatch_fn: the model's routed-expert implementation (None: its default; on a mesh e.g.
            `parallel.expert.make_ep_dispatch(mesh)`).
        layer_stack: a `dsv4.scan.LayerStack` when `model` is a `dsv4.scan.merge_stacked` shell (scanned layers),
            passed to the model as `layer_stack=`; None = not passed (the model's own layers).
        mtp: also return the MTP block's log-probability of every token given the prefix up to two tokens back
            (`return_mtp="detached"`: no gradient reaches the trunk, the embedding or the head; temperature 1; the
            full [N, S, V] MTP logits are materialised).
        expert_drops: also return the model's `expert_drops` ([2] int32: expert pairs dropped, pairs routed by a
            dispatch that can drop; `dsv4.model.DSV4Output`).
        left_aligned: every row starts at column 0 (rl/batch.py's layout): passed to the model as
            `left_aligned=True` (no per-row roll, `dsv4.model` "Padding"); False = not passed (any padding).
    Returns:
        (logprobs [N, S] float32, entropy [N, S] float32 or None, routing [N, S, L, k] int32 from the model),
        logprobs/entropy aligned and zeroed as in the module docstring; with `mtp`, a 4th element mtp_logprobs
        [N, S] float32 (position j: log q(token j) from the MTP block at j - 2; 0 where j < 2 or any of j - 2..j is
        padding); with `expert_drops`, the drops last.
    Raises:
        ValueError: temperature < 0, chunk_size < 1, input_ids not [N, S], or a mis-shaped attention_mask /
            routing_replay (the latter two raised by the model).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [N, S], got shape {input_ids.shape}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    inv_t = 1.0 / effective_temperature(temperature)
    extra = {} if layer_stack is None else {"layer_stack": layer_stack}
    if left_aligned:
        extra["left_aligned"] = True
    if mtp:
        extra["return_mtp"] = "detached"
    out = model(input_ids, attention_mask=attention_mask, routing_replay=routing_replay,
                return_hidden=chunk_size is not None, dispatch_fn=dispatch_fn, **extra)
    targets = input_ids[:, 1:].astype(jnp.int32)  # token j, predicted at j - 1 -> [N, S-1]
    if chunk_size is None:
        z = out.logits[:, :-1].astype(jnp.float32) * inv_t  # -> [N, S-1, V]
        lp, ent = _score(z, targets, return_entropy)
    else:
        lp, ent = _score_chunked(model.lm_head, out.hidden[:, :-1], targets, inv_t, chunk_size, return_entropy)

    if attention_mask is None:
        valid = jnp.ones(targets.shape, bool)
    else:
        m = attention_mask.astype(bool)
        valid = m[:, 1:] & m[:, :-1]  # real target with a real predecessor -> [N, S-1]

    def place(x):  # [N, S-1] -> [N, S]: zero invalid positions, 0 at j = 0
        x = jnp.where(valid, x, 0.0)
        return jnp.concatenate([jnp.zeros((x.shape[0], 1), jnp.float32), x], axis=1)

    tail = (out.expert_drops,) if expert_drops else ()
    if not mtp:
        return place(lp), (None if ent is None else place(ent)), out.routing, *tail
    lq, _ = _score(out.mtp_logits[:, :-2].astype(jnp.float32), input_ids[:, 2:].astype(jnp.int32), False)
    ok = jnp.ones(lq.shape, bool) if attention_mask is None else (
        attention_mask[:, 2:].astype(bool) & attention_mask[:, 1:-1].astype(bool) & attention_mask[:, :-2].astype(bool))
    lq = jnp.concatenate([jnp.zeros((lq.shape[0], 2), jnp.float32), jnp.where(ok, lq, 0.0)], axis=1)
    return place(lp), (None if ent is None else place(ent)), out.routing, lq, *tail


def next_token_logits(model: Any, input_ids: jnp.ndarray, attention_mask: jnp.ndarray | None, at: jnp.ndarray, *,
                      temperature: float = 1.0, chunk_size: int | None = None, dispatch_fn: Any = None,
                      layer_stack: Any = None, left_aligned: bool = False) -> jnp.ndarray:
    """The tempered logits z [N, V] float32 at position `at[i]` of row i: the distribution from which
    `token_logprobs` scores token at[i] + 1 (log p = z[token] - logsumexp(z)), computed the same way (the same
    model call; with `chunk_size` the head runs on each row's chunk of C positions, the shape `token_logprobs`
    gives it), so that a token drawn from softmax(z) has the learner's own probability (exact mode, rl/rollout/exact.py).

    input_ids / attention_mask [N, S] as `token_logprobs` (no routing replay); at [N] int32 in [0, S - 2];
    left_aligned as `token_logprobs`.
    """
    inv_t = 1.0 / effective_temperature(temperature)
    extra = {} if layer_stack is None else {"layer_stack": layer_stack}
    if left_aligned:
        extra["left_aligned"] = True
    out = model(input_ids, attention_mask=attention_mask, return_hidden=chunk_size is not None,
                dispatch_fn=dispatch_fn, **extra)
    rows = jnp.arange(input_ids.shape[0])
    if chunk_size is None:
        return out.logits[:, :-1].astype(jnp.float32)[rows, at] * inv_t
    s1 = input_ids.shape[1] - 1
    chunk = max(1, min(chunk_size, s1))  # as _score_chunked: chunk k holds positions k*C .. k*C + C - 1
    n_chunks = -(-s1 // chunk)
    h = jnp.pad(out.hidden[:, :-1], ((0, 0), (0, n_chunks * chunk - s1), (0, 0)))
    h = h.reshape(h.shape[0], n_chunks, chunk, h.shape[-1])[rows, at // chunk]  # [N, C, D]: each row's own chunk
    z = model.lm_head(h).astype(jnp.float32) * inv_t  # [N, C, V]
    return z[rows, at % chunk]
