"""The one batch layout from the sampler to the learner: `RolloutBatch` (sampler output) -> `TrainBatch`.

Layout of row i (S = P + T columns; P = the prompt bucket, T = max_new_tokens):

    [ 0 .. 0 | prompt_i (P_i tokens) | response_i (T_i tokens) | 0 .. 0 ]
      left pad to P                     right pad to T
      <---------------- P ------------> <------------ T --------------->

`RolloutBatch` keeps the two halves (`prompt_tokens` [N, P] left-padded, `tokens` [N, T] right-padded) and the
recorded routing [N, S, L, k] already in the joined layout (-1 at padding); `RolloutBatch.sequences()` joins
them, and `TrainBatch.from_rollout` is the one place that turns a rollout (+ advantages) into the learner's
batch. Per-token arrays sit at each token's own position, so `response_mask` selects the same tokens in the
rollout's logprobs, the learner's logprobs and the loss (rl/algo/learner.py "Data"; rl/algo/logprobs.py).
All arrays are host numpy until `rl.algo.learner.Learner` places the batch on the actor mesh, once.
The rollout engine (`rl.rollout.engine`) returns `RolloutBatch`; `rl.algo.learner` takes `TrainBatch`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import struct


@dataclasses.dataclass
class RolloutBatch:
    """Sampler output for N samples (numpy, on the host).

    tokens [N, T] int32 response tokens (0 after `lengths`); T = max_new_tokens.
    logprobs [N, T] float32 sampler logprob of each response token (0 after `lengths`).
    routing [N, P+T, L, k] int32 expert ids for the layout of `sequences()`: the prompt left-padded to P (the
      prompt bucket) then the response; -1 at padding.
    lengths [N] int32 generated tokens (a stop token, when hit, is included); finish_reasons: "stop" | "length".
    prompt_tokens [N, P] int32 left-padded prompts; prompt_lengths [N]; weight_version: the weights used (with
      partial rollouts: the newest of them).
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
        """The learner's layout: (input_ids [N, P+T], attention_mask [N, P+T], response_mask [N, P+T],
        rollout_logprobs [N, P+T]) with prompts left-padded and responses right-padded. response_mask is 0 on the
        tokens `loss_mask` gives to an environment (they stay in attention_mask: context)."""
        n, p = self.prompt_tokens.shape
        t = self.tokens.shape[1]
        ids = np.concatenate([self.prompt_tokens, self.tokens], axis=1).astype(np.int32)
        pos = np.arange(p + t)[None]
        prompt_real = (pos >= p - self.prompt_lengths[:, None]) & (pos < p)
        resp = (pos >= p) & (pos < p + self.lengths[:, None])
        lp = np.zeros((n, p + t), np.float32)
        lp[:, p:] = self.logprobs
        real = prompt_real | resp
        if self.loss_mask is not None:
            resp = resp & np.pad(np.asarray(self.loss_mask, bool), ((0, 0), (p, 0)))
        return ids, real.astype(np.int32), resp.astype(np.int32), np.where(resp, lp, 0.0)

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
    rounds). Prompts are re-left-padded to the widest prompt bucket P and responses right-padded to the widest
    T of the parts (tokens 0, logprobs 0, routing -1 at the new padding), so `sequences()` keeps its layout.

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
    out = {"tokens": [], "logprobs": [], "routing": [], "prompt_tokens": [], "lengths": [], "prompt_lengths": []}
    reasons: list[str] = []
    for b, rows in parts:
        rows = np.asarray(rows, np.int64)
        bp, bt = b.prompt_tokens.shape[1], b.tokens.shape[1]
        out["prompt_tokens"].append(np.pad(b.prompt_tokens[rows], ((0, 0), (p - bp, 0))))  # left pad
        out["tokens"].append(np.pad(b.tokens[rows], ((0, 0), (0, t - bt))))
        out["logprobs"].append(np.pad(b.logprobs[rows], ((0, 0), (0, t - bt))))
        r = b.routing[rows]  # [n, bp + bt, L, k]
        out["routing"].append(np.concatenate([
            np.full((len(rows), p - bp) + r.shape[2:], -1, r.dtype), r[:, :bp],
            r[:, bp:], np.full((len(rows), t - bt) + r.shape[2:], -1, r.dtype)], axis=1))
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
