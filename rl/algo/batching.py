"""Learner input at its real size: rows re-aligned and trimmed to the longest real row, then cut into token-budget
micro-batches (rl/algo/learner.py runs them; this module only moves data).

Trim (host side, before the jit): the rollout's rows start at column 0 (`[prompt | response | pad]`, rl/batch.py),
so trimming cuts the columns to W = the bucket of the longest real row: the next power of two >= max(8, longest),
at most S (and at most the token budget); nothing moves. The learner's forward then runs the model's left-aligned
path (no per-row roll). Rows an outside caller left-pads (their real tokens, `attention_mask` == 1, contiguous, after
`shift` columns of padding) are rolled to column 0 first, the one place left that moves a row: the model runs every
row at positions 0.. (dsv4/model.py "Padding"), so a row's values do not depend on how much padding preceded it,
and causal attention never lets trailing padding reach a real token. Steady state does not recompile: W takes at
most log2(S) values. `untrim` puts per-token outputs back at their original columns (0 / -1 elsewhere, which is
what those columns hold anyway: padding).

Micro-batches (inside the jit): `layout` picks R rows per micro-batch and M = ceil(N / R) micro-batches; with a
token budget B (`max_tokens_per_micro_batch`, per device of the batch axes, as Miles' `--max-tokens-per-gpu`)
R = floor(B / W) x (devices of the batch axes); under context parallelism (C devices share each row, the actor's
`context` axis) the budget counts tokens per context shard: R = floor(B C / W) x (devices of the batch axes). `split` appends M x R - N padding rows (copies of row 0 with
`response_mask` and advantages 0: the model sees a real row, so nothing non-finite can arise, and the loss, its
gradient and every metric get exactly 0 from them) and assigns row r to micro-batch r % M (strided: with the
batch sharded in blocks every device holds a share of each micro-batch). The loss normalisers come from the
unpadded full batch (`rl.algo.losses.loss_normalizers`), so the summed micro-batch gradients equal the full-batch one.

Tests: tests/rl/test_learner_scale.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_PER_TOKEN = ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "old_logprobs", "routing")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape plan of one step: `seq_len` S of the caller's batch, `width` W after trimming, `micro_batches`
    M of `rows` R each (M * R >= N)."""

    seq_len: int
    width: int
    micro_batches: int
    rows: int


def bucket(length: int, cap: int) -> int:
    """Smallest power of two >= max(8, length), capped at `cap` (>= length)."""
    return min(cap, 1 << max(3, (max(1, length) - 1).bit_length()))


def real_extent(attention_mask) -> tuple[np.ndarray, int]:
    """attention_mask [N, S] -> (leading padding per row [N] int64, longest real row)."""
    m = np.asarray(attention_mask) > 0
    lengths = m.sum(axis=1)
    shift = np.where(lengths > 0, np.argmax(m, axis=1), 0)
    return shift, int(lengths.max(initial=0))


def layout(n: int, seq_len: int, longest: int, *, trim: bool, micro_batch_size: int | None,
           max_tokens: int | None, batch_devices: int = 1, context: int = 1) -> Layout:
    """The step's Layout for N rows of S columns whose longest real row has `longest` tokens.

    `context` C: the devices one row's tokens are split over (context parallelism, the actor's `context` axis):
    the budget counts tokens per context shard, so a row of W columns costs ceil(W / C) of it and a micro-batch
    holds floor(B C / W) rows per device of the batch axes.
    Raises:
      ValueError: the longest row's share of a context shard is longer than the token budget (names
        --max-tokens-per-micro-batch).
    """
    if max_tokens is not None and -(-longest // context) > max_tokens:
        per = "" if context == 1 else f" / context={context} = {-(-longest // context)} per context shard"
        raise ValueError(f"--max-tokens-per-micro-batch (LearnerConfig.max_tokens_per_micro_batch) = {max_tokens} "
                         f"is smaller than the batch's longest row ({longest} tokens{per}); raise it to >= "
                         f"{-(-longest // context)}")
    width = bucket(longest, seq_len) if trim else seq_len
    if max_tokens is not None:
        budget = max_tokens * context  # tokens of one row's width that fit, spread over the context shards
        if width > budget and not trim:
            raise ValueError(f"--max-tokens-per-micro-batch (LearnerConfig.max_tokens_per_micro_batch) = "
                             f"{max_tokens} is smaller than the untrimmed row length {seq_len} (trim is off)")
        width = max(longest, min(width, budget))
        per_device = max(1, budget // width)
        rows = min(n, per_device * batch_devices)
        return Layout(seq_len, width, math.ceil(n / rows), rows)
    m = 1 if micro_batch_size is None else n // micro_batch_size
    return Layout(seq_len, width, m, n // m)


def fixed_layout(n: int, seq_len: int, longest: int, *, rows: int, width: int) -> Layout:
    """The batch-invariant Layout of exact mode (rl/rollout/exact.py): every micro-batch is R = `rows` rows of W = `width`
    columns whatever N, S and the longest row, so each row runs in a program of one shape (its value then does not
    depend on the batch around it: XLA:CPU's results depend on the shapes, measured in tests/rl/test_exact.py).
    M = ceil(N / R) micro-batches (`split` pads the last with neutral rows); a batch narrower than W is padded with
    empty columns (`pad_columns`). Raises ValueError when the longest real row is longer than W."""
    if longest > width:
        raise ValueError(f"--exact-rollout: a row of {longest} tokens is longer than the exact layout's width "
                         f"{width} (--max-prompt-len + --max-new-tokens, bucketed)")
    return Layout(seq_len, width, math.ceil(n / rows), rows)


def pad_columns(batch: Any, width: int) -> Any:
    """[N, S, ...] -> [N, width, ...] (width >= S) for every per-token field: empty columns at the right
    (ids, masks, logprobs 0; routing -1). Host numpy or jax arrays."""
    n, s = batch.input_ids.shape
    if width <= s:
        return batch

    def pad(x, fill):
        if x is None:
            return None
        return np.pad(np.asarray(x), [(0, 0), (0, width - s)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)

    upd = {f: pad(getattr(batch, f), -1 if f == "routing" else 0) for f in _PER_TOKEN}
    if batch.advantages.ndim == 2:
        upd["advantages"] = pad(batch.advantages, 0)
    return batch.replace(**upd)


def trim(batch: Any, shift: np.ndarray, width: int) -> Any:
    """Keep `width` columns of every per-token field ([N, S, ...] -> [N, W, ...]), each row first rolled left by
    `shift` (0 for left-aligned rows: a plain column cut). Identity when nothing moves. Works on numpy and jax
    arrays."""
    n, s = batch.input_ids.shape
    if not np.any(shift):
        if width == s:
            return batch
        cut = {f: None if getattr(batch, f) is None else getattr(batch, f)[:, :width] for f in _PER_TOKEN}
        if batch.advantages.ndim == 2:
            cut["advantages"] = batch.advantages[:, :width]
        return batch.replace(**cut)
    cols = (np.arange(width)[None, :] + np.asarray(shift)[:, None]) % s  # [N, W] source column of each slot
    rows = np.arange(n)[:, None]

    def take(x):
        return None if x is None else x[rows, cols]

    upd = {f: take(getattr(batch, f)) for f in _PER_TOKEN}
    adv = batch.advantages
    if adv.ndim == 2:
        upd["advantages"] = take(adv)
    return batch.replace(**upd)


def untrim(x: jax.Array, shift: np.ndarray, seq_len: int, fill) -> jax.Array:
    """Inverse of `trim` for an output [N, W, ...]: -> [N, S, ...] with `fill` at the columns trim dropped."""
    n, w = x.shape[:2]
    if not np.any(shift):
        if w >= seq_len:
            return x[:, :seq_len]
        return jnp.concatenate([x, jnp.full((n, seq_len - w) + x.shape[2:], fill, x.dtype)], axis=1)
    cols = (np.arange(w)[None, :] + np.asarray(shift)[:, None]) % seq_len
    full = jnp.full((n, seq_len) + x.shape[2:], fill, x.dtype)
    return full.at[np.arange(n)[:, None], cols].set(x)


def split(batch: Any, lay: Layout) -> Any:
    """[N, ...] -> [M, R, ...] (traced): pad to M * R rows with neutral copies of row 0, row r -> micro-batch r % M."""
    n = batch.input_ids.shape[0]
    m, r = lay.micro_batches, lay.rows
    pad = m * r - n
    if pad:
        def extend(x, zero=False):
            if x is None:
                return None
            extra = jnp.broadcast_to(x[:1], (pad,) + x.shape[1:])
            return jnp.concatenate([x, jnp.zeros_like(extra) if zero else extra])

        batch = batch.replace(**{f: extend(getattr(batch, f)) for f in _PER_TOKEN if f != "response_mask"},
                              response_mask=extend(batch.response_mask, zero=True),
                              advantages=extend(batch.advantages, zero=True))
    return jax.tree.map(lambda x: x.reshape(r, m, *x.shape[1:]).swapaxes(0, 1), batch)


def merge(x: jax.Array, n: int) -> jax.Array:
    """Inverse of `split` for an output [M, R, ...] -> [N, ...] (padding rows dropped)."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])[:n]
