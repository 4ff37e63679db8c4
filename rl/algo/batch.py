"""The one batch layout from the rollout request to the learner: `RolloutBatch` (rollout output) -> `TrainBatch`.

Layout of row i (S = P + T columns; P = the prompt bucket, T = max_new_tokens), left-aligned:

    [ prompt_i (P_i tokens) | response_i (T_i tokens) | 0 .. 0 ]
      <-------- P_i -------> <-------- T_i ---------> <- pad: S - P_i - T_i ->

The rollout engine runs its programs on this layout's prompt half (prompts right-padded to P: each row at positions
0..) and returns the row's two halves left-aligned: `prompt_tokens` [N, P] (prompt_i then 0) and `tokens` [N, T]
(response_i then 0), with the recorded routing [N, S, L, k] already in the joined row (-1 at padding).
`RolloutBatch.sequences()` joins the halves into the row above (`join_rows`: a per-row gather, the response placed
right after its prompt) and `TrainBatch.from_rollout` is the one place that turns a rollout (+ advantages) into the
learner's batch. Rows start at column 0 from then on: the learner cuts columns (rl/algo/batching.py) and runs the model's
left-aligned path (`DSV4ForCausalLM(..., left_aligned=True)`: no per-row roll). Per-token arrays sit at each token's
own position, so `response_mask` selects the same tokens in the rollout's logprobs, the learner's logprobs and the
loss (rl/algo/learner.py "Data"; rl/algo/logprobs.py); `response_half` reads a joined per-token array back as [N, T].
All arrays are host numpy until `rl.algo.learner.Learner` places the batch on the actor mesh, once.
The rollout engine (`rl.rollout.engine`) returns `RolloutBatch`; `rl.algo.learner` takes `TrainBatch`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import struct

ROWS_LAYOUT = "prompt|response|pad"  # the name of this layout, kept in the in-flight checkpoints (rl/pipeline.py)


def join_rows(prompt: np.ndarray, prompt_lengths: np.ndarray, response: np.ndarray, fill) -> np.ndarray:
    """The joined row of the module docstring: prompt [N, P, ...] (prompt_i then padding) and response [N, T, ...]
    -> [N, P + T, ...] with row i = [prompt[i, :P_i] | response[i, :] | fill], P_i = prompt_lengths[i] (a per-row
    gather; host numpy)."""
    n, p = prompt.shape[:2]
    t = response.shape[1]
    pl = np.asarray(prompt_lengths, np.int64)[:, None]
    cols = np.arange(p + t)[None]
    both = np.concatenate([prompt, response], axis=1)
    src = np.where(cols < pl, cols, cols - pl + p)  # response column j - P_i sits at column P + j - P_i of `both`
    inside = src < p + t
    out = both[np.arange(n)[:, None], np.where(inside, src, 0)]
    keep = inside.reshape(inside.shape + (1,) * (both.ndim - 2))
    return np.where(keep, out, np.asarray(fill, both.dtype)).astype(both.dtype)


@dataclasses.dataclass
class RolloutBatch:
    """Rollout output for N samples (numpy, on the host): the two halves of the joined rows of the module docstring.

    prompt_tokens [N, P] int32 prompts, left-aligned (prompt_i in columns 0..P_i, 0 after); P = the prompt bucket;
      prompt_lengths [N] (P_i).
    tokens [N, T] int32 response tokens, left-aligned (0 after `lengths`); T = max_new_tokens. In the joined row
      response token j sits at column P_i + j (`sequences()`).
    logprobs [N, T] float32 rollout logprob of each response token (0 after `lengths`).
    routing [N, P+T, L, k] int32 expert ids in the joined row ([prompt_i | response_i | pad], the layout of
      `sequences()`); -1 at padding.
    lengths [N] int32 generated tokens (a stop token, when hit, is included); finish_reasons: "stop" | "length".
    weight_version: the weights used (with partial rollouts: the newest of them).
    token_versions [N, T] int32 or None: the weight version each response token was sampled with (-1 after
      `lengths`); None = every token `weight_version` (one generation). Partial rollouts (rl/run/partial.py) set it:
      a sample continued across weight updates holds tokens of several versions. `versions_per_token()` reads both.
    loss_mask [N, T] int32 or None: 1 on the tokens the model sampled, 0 on response-side tokens an environment
      wrote (multi-turn rollouts, rl/rollout/multiturn.py: tool results; their `logprobs` are 0); None = every
      response token is the model's. The learner sees the whole sequence as context either way.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    routing: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[str]
    prompt_tokens: np.ndarray
    prompt_lengths: np.ndarray
    weight_version: int = 0
    token_versions: np.ndarray | None = None
    loss_mask: np.ndarray | None = None

    def versions_per_token(self) -> np.ndarray:
        """[N, T] int32: the weight version of each response token, -1 after `lengths` (module docstring)."""
        if self.token_versions is not None:
            return np.asarray(self.token_versions, np.int32)
        t = self.tokens.shape[1]
        return np.where(np.arange(t)[None] < self.lengths[:, None], self.weight_version, -1).astype(np.int32)

    def sequences(self):
        """The learner's layout, the joined rows of the module docstring: (input_ids [N, P+T], attention_mask
        [N, P+T], response_mask [N, P+T], rollout_logprobs [N, P+T]), every row [prompt_i | response_i | pad].
        response_mask is 0 on the tokens `loss_mask` gives to an environment (they stay in attention_mask:
        context)."""
        n, p = self.prompt_tokens.shape
        t = self.tokens.shape[1]
        pl = np.asarray(self.prompt_lengths)[:, None]
        ids = join_rows(np.asarray(self.prompt_tokens, np.int32), self.prompt_lengths,
                        np.asarray(self.tokens, np.int32), 0)
        pos = np.arange(p + t)[None]
        resp = (pos >= pl) & (pos < pl + self.lengths[:, None])
        lp = join_rows(np.zeros((n, p), np.float32), self.prompt_lengths, np.asarray(self.logprobs, np.float32), 0)
        real = (pos < pl) | resp
        if self.loss_mask is not None:
            resp = resp & join_rows(np.zeros((n, p), bool), self.prompt_lengths, np.asarray(self.loss_mask, bool),
                                    False)
        return ids, real.astype(np.int32), resp.astype(np.int32), np.where(resp, lp, 0.0)

    def response_half(self, x) -> np.ndarray:
        """A per-token array in the layout of `sequences()` [N, P+T, ...] -> its response half [N, T, ...] (column
        P_i + j of row i -> column j; a per-row gather, host numpy)."""
        x = np.asarray(x)
        t = self.tokens.shape[1]
        cols = np.asarray(self.prompt_lengths, np.int64)[:, None] + np.arange(t)[None]
        return x[np.arange(x.shape[0])[:, None], cols]

    def response_lists(self) -> list[list[int]]:
        return [self.tokens[i, : self.lengths[i]].tolist() for i in range(len(self.lengths))]

    def final_turns(self) -> list[list[int]]:
        """Each row's last model turn: its response tokens after the last one `loss_mask` gives to an environment
        (empty when the row ends inside an environment's turn, cut by the token budget); without a `loss_mask`,
        the whole response (`response_lists`). What a multi-turn run's reward reads (rl/run/env_task.py)."""
        if self.loss_mask is None:
            return self.response_lists()
        out = []
        for i, n in enumerate(self.lengths):
            env = np.flatnonzero(np.asarray(self.loss_mask[i, :n]) == 0)
            out.append(self.tokens[i, (env[-1] + 1 if len(env) else 0): n].tolist())
        return out


def concat_rollouts(parts: Sequence[tuple[RolloutBatch, np.ndarray]]) -> RolloutBatch:
    """Rows `rows_j` of batch `b_j`, for each (b_j, rows_j) in order, as one RolloutBatch (DAPO's resampling
    rounds): a row gather. Every half and the joined routing get empty columns at the right up to the widest
    prompt bucket P and the widest T of the parts (tokens 0, logprobs 0, routing -1), so `sequences()` keeps its
    layout (rows left-aligned: nothing moves).

    Raises ValueError when the parts come from different weight versions or disagree on routing's [L, k].
    """
    if not parts:
        raise ValueError("concat_rollouts needs at least one part")
    if any(b.loss_mask is not None for b, _ in parts):
        raise ValueError("concat_rollouts: multi-turn parts (loss_mask) are not concatenated")
    if any(b.token_versions is not None for b, _ in parts):
        raise ValueError("concat_rollouts: parts with per-token versions (partial rollouts) are not concatenated")
    versions = {b.weight_version for b, _ in parts}
    if len(versions) != 1:
        raise ValueError(f"concat_rollouts: parts come from different weight versions {sorted(versions)}")
    p = max(b.prompt_tokens.shape[1] for b, _ in parts)
    t = max(b.tokens.shape[1] for b, _ in parts)
    lk = {b.routing.shape[2:] for b, _ in parts}
    if len(lk) != 1:
        raise ValueError(f"concat_rollouts: routing [L, k] differ between parts: {sorted(lk)}")

    def right(x, width, fill=0):  # empty columns at the right
        return np.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=fill)

    out = {"tokens": [], "logprobs": [], "routing": [], "prompt_tokens": [], "lengths": [], "prompt_lengths": []}
    reasons: list[str] = []
    for b, rows in parts:
        rows = np.asarray(rows, np.int64)
        out["prompt_tokens"].append(right(b.prompt_tokens[rows], p))
        out["tokens"].append(right(b.tokens[rows], t))
        out["logprobs"].append(right(b.logprobs[rows], t))
        out["routing"].append(right(b.routing[rows], p + t, -1))
        out["lengths"].append(b.lengths[rows])
        out["prompt_lengths"].append(b.prompt_lengths[rows])
        reasons += [b.finish_reasons[i] for i in rows]
    cat = {k: np.concatenate(v, axis=0) for k, v in out.items()}
    return RolloutBatch(finish_reasons=reasons, weight_version=versions.pop(), **cat)


@struct.dataclass
class TrainBatch:
    """One learner batch (N rows of length S = P + T in the module's layout; `from_rollout` makes it).

    input_ids [N, S] int32; attention_mask [N, S] (1 on real prompt + response tokens, contiguous);
    response_mask [N, S] (1 on response tokens whose logprob counts); rollout_logprobs [N, S] float32 (the
    sampler's logprob of each response token at its own position, anything elsewhere); advantages [N] (or
    [N, S]) float32; routing [N, S, L, k] int32 recorded expert ids (< 0 = unknown) or None; old_logprobs
    [N, S] float32 (pi_old for multi-epoch updates, from `Learner.compute_logprobs`) or None (on-policy).
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    rollout_logprobs: jax.Array
    advantages: jax.Array
    routing: jax.Array | None = None
    old_logprobs: jax.Array | None = None

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch, advantages, *, routing: bool = True,
                     train_rows=None) -> TrainBatch:
        """The learner's batch of a rollout, in the same layout (no copy of the layout logic elsewhere).

        rollout: N rows from the sampler. advantages: [N] (or [N, S]) per-sample advantages. routing: carry the
        sampler's recorded experts (routing replay; False: None). train_rows: [N] bool or None; rows that are
        False (DAPO's filler groups) get a zero response_mask, so they count in no loss term or normaliser.
        Every array stays a host numpy array (int32 / float32): the learner places the batch on the actor mesh
        once. Returns a TrainBatch with old_logprobs None (on-policy)."""
        ids, mask, resp, rlp = rollout.sequences()
        if train_rows is not None:
            resp[~np.asarray(train_rows, bool)] = 0
        return cls(input_ids=ids, attention_mask=mask, response_mask=resp, rollout_logprobs=rlp.astype(np.float32),
                   advantages=np.asarray(advantages, np.float32), routing=rollout.routing if routing else None)

    def rows(self) -> list[dict]:
        """Each row without its padding: {"prompt": [P_i] int, "response": [T_i] int, "response_logprobs":
        [T_i] float32, "routing": [P_i + T_i, L, k] or None}, read back through the masks (the inverse of
        `from_rollout` on the rows it trains on; for checks and debugging, host arrays only)."""
        ids, mask, resp = (np.asarray(x) for x in (self.input_ids, self.attention_mask, self.response_mask))
        lp = np.asarray(self.rollout_logprobs)
        out = []
        for i in range(ids.shape[0]):
            real, r = mask[i].astype(bool), resp[i].astype(bool)
            prompt = real & ~r & (np.cumsum(r) == 0)  # real tokens before the first response token
            out.append({"prompt": ids[i][prompt], "response": ids[i][r], "response_logprobs": lp[i][r],
                        "routing": None if self.routing is None else np.asarray(self.routing)[i][real]})
        return out


def check_train_batch(batch: TrainBatch, *, micro_batch_size: int | None = None, token_budget: int | None = None,
                      batch_devices: int = 1) -> None:
    """Static shape checks of a learner's batch (ValueError naming the field): input_ids [N, S], the per-token
    arrays [N, S], advantages [N] or [N, S], N a multiple of `micro_batch_size` (unless a `token_budget` packs the
    micro-batches) and of the devices the batch axes split rows over (`batch_devices`)."""
    if batch.input_ids.ndim != 2:
        raise ValueError(f"TrainBatch.input_ids must be [N, S], got shape {batch.input_ids.shape}")
    n, s = batch.input_ids.shape
    for name in ("attention_mask", "response_mask", "rollout_logprobs", "old_logprobs"):
        x = getattr(batch, name)
        if x is not None and x.shape != (n, s):
            raise ValueError(f"TrainBatch.{name} has shape {x.shape}; expected [N, S] = {(n, s)}")
    if batch.advantages.shape not in ((n,), (n, s)):
        raise ValueError(f"TrainBatch.advantages has shape {batch.advantages.shape}; expected [N] = {(n,)}")
    if micro_batch_size is not None and n % micro_batch_size and token_budget is None:
        raise ValueError(f"batch size N={n} is not a multiple of micro_batch_size={micro_batch_size}")
    if n % batch_devices:
        raise ValueError(f"batch size N={n} is not divisible by the mesh's batch axes (= {batch_devices} devices)")
