"""Exact mode (`--exact-rollout`, issue 26 point 4): the rollout's logprobs are the learner's forward, bitwise.

    layout = exact_layout(cfg.learner, rows_per_step=N, max_prompt_len=P, max_new_tokens=T)
    learner = Learner(model, cfg.learner, ..., exact_layout=layout)
    rb = rescore(learner, sampler.generate(...), routing_replay=cfg.learner.routing_replay)

How: after generation, every sampled sequence is scored again by the learner's own jitted logprob program
(`Learner.compute_logprobs`: the same function and weights the train step's forward uses; the FP8-aware forward,
`--learner.fp8_forward`, when the rollout is FP8, which reproduces the rollout's FP8 weights and activation
quantisation; with routing replay, the rollout's recorded experts forced as the train step forces them), and those
logprobs replace the sampled ones in the `RolloutBatch`. Equality then holds by construction if the learner
computes a row the same way whichever batch it sits in. It does not by default: XLA:CPU's results depend on the
program's shapes (measured: a row re-scored alone, or in a batch trimmed to another width, differs by ~1e-6 from the
same row in the full batch), and the learner trims each batch to its longest row and sizes micro-batches by N.
So exact mode fixes the learner's layout (`rl.batching.fixed_layout`): every forward, the re-scoring's and the
train step's, runs in micro-batches of R rows x W columns (R: the rows the step's batch would put in one
micro-batch; W: the bucket of `--max-prompt-len + --max-new-tokens`), rows re-aligned to column 0 as always.
With a fixed shape, a row's value does not depend on its position in the micro-batch nor on its neighbours
(tests/rl/test_exact.py checks this bitwise over permuted, sub- and re-composed batches), so the rows of one
rollout request, of several DAPO rounds concatenated, or of the step batch get the same logprobs; the train step's
`train/train_rollout_logprob_abs_diff` is then exactly 0 and the off-policy ratio exp(old - rollout) exactly 1 at
the first micro-step (on-policy: the rollout serves the learner's current weights).

Nothing of the rollout is turned off: chunked prefill, continuous batching, routing recording and the FP8 KV cache
sample the tokens as before. What exact mode does not change is the distribution the tokens were drawn from: the
sampler's decode path (FP8 KV cache, incremental attention, its own FP8 roundings). The logprobs it reports are the
learner's probabilities of those tokens, so the importance ratio the loss sees is 1 while the true ratio
pi_learner / pi_sampler is not: the per-token gap is the mismatch `benchmarks/mismatch.py` measures without exact
mode (FP8 KV cache + decode path, ~0.03-0.06 nats mean on `small`). Removing that too needs the sampler itself to
draw from the learner's forward (a full forward per token, or a decode path bitwise equal to the blocked one).

Scope: the learner must hold the weights the rollout sampled with (synchronous loop, `--max-staleness 0`;
`RunConfig` refuses exact mode with K >= 1). Cost: one learner forward per generated batch on the actor mesh
(`benchmarks/mismatch.py`, `exact_cost_frac`), and the train step runs at width W instead of the batch's own.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from rl import batching
from rl.algo_config import LearnerConfig
from rl.batch import RolloutBatch, TrainBatch
from rl.learner import Learner

log = logging.getLogger(__name__)


def exact_layout(cfg: LearnerConfig, *, rows_per_step: int, max_prompt_len: int, max_new_tokens: int,
                 batch_devices: int = 1) -> tuple[int, int]:
    """(rows R, width W) of exact mode's fixed micro-batches (`Learner(exact_layout=...)`).

    W: the smallest power of two >= max(8, max_prompt_len + max_new_tokens) (the longest row a rollout can make).
    R: the rows per micro-batch the learner picks for a step batch of `rows_per_step` rows at width W
    (`rl.batching.layout`: `micro_batch_size`, or the token budget `max_tokens_per_micro_batch` x
    `batch_devices`, or the whole batch). Raises ValueError as `rl.batching.layout` (token budget below W)."""
    width = batching.bucket(max_prompt_len + max_new_tokens, 1 << 62)
    lay = batching.layout(rows_per_step, width, width, trim=True, micro_batch_size=cfg.micro_batch_size,
                          max_tokens=cfg.max_tokens_per_micro_batch, batch_devices=batch_devices)
    if lay.micro_batches > 1:
        log.warning("--exact-rollout with %d micro-batches per step: the step's scanned micro-batch loop rounds "
                    "apart from the re-scoring forward (~1e-7 nats, benchmarks/README.md); one micro-batch is "
                    "bitwise", lay.micro_batches)
    return lay.rows, width


def rescore(learner: Learner, rb: RolloutBatch, *, routing_replay: bool) -> RolloutBatch:
    """`rb` with its logprobs [N, T] float32 replaced by the learner's forward on its sequences (the learner's
    current state; 0 after each row's length), everything else unchanged.

    learner: a `Learner` built with `exact_layout` (else the values depend on the batch: ValueError).
    routing_replay: score with `rb.routing` forced, as the train step will (`LearnerConfig.routing_replay`).
    Raises ValueError from `Learner.compute_logprobs` (mis-shaped or invalid routing, row longer than W)."""
    if learner.exact_layout is None:
        raise ValueError("rl.exact.rescore needs a Learner built with exact_layout (--exact-rollout)")
    n, p = rb.prompt_tokens.shape
    tb = TrainBatch.from_rollout(rb, np.zeros(n, np.float32), routing=routing_replay)
    res, _ = learner.compute_logprobs(learner.state, tb, routing_replay=routing_replay)
    lp = _to_host(res.logprobs)
    resp = np.asarray(tb.response_mask) > 0
    return dataclasses.replace(rb, logprobs=np.where(resp, lp, 0.0)[:, p:].astype(np.float32))


def _to_host(x: jax.Array) -> np.ndarray:
    """numpy copy of a (possibly batch-sharded, multi-process) array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
