"""Exact mode (`--exact-rollout`, issue 26 point 4): the training rollouts are drawn from the learner's own forward,
so the behaviour policy *is* the learner's policy, to the bit, and the logprobs the loss sees are exactly those the
tokens were drawn with.

    layout = exact_layout(cfg.learner, rows_per_step=N, max_prompt_len=P, max_new_tokens=T)
    learner = Learner(model, cfg.learner, ..., exact_layout=layout)
    rb, stats = generate(learner, prompts, params, seed=, step=, prompt_index=, sample_index=, weight_version=,
                         routing_replay=cfg.learner.routing_replay)
    service = ExactRollout(learner, rollout, routing_replay=...)   # the contract: training requests drawn here,
                                                                   # evaluation served by `rollout`

How. XLA's results depend on the program's shapes (measured on XLA:CPU: a row scored alone, or in a batch trimmed
to another width, differs by ~1e-6 from the same row in the full batch), and the rollout's decode path (one token
against a KV cache, FP8 KV cache, incremental compressors) is another program than the learner's blocked forward, so
its logits differ from the learner's by ~1e-7 (fp32) to ~4e-2 nats (FP8 KV cache). Exact mode therefore
1. fixes the learner's layout (`rl.algo.batching.fixed_layout`): every forward, the draws', the scoring's and the train
   step's, runs in micro-batches of R rows x W columns (R: the rows the step's batch would put in one micro-batch;
   W: the bucket of `--max-prompt-len + --max-new-tokens`), rows at column 0: a row's values then do not depend on
   its position in the micro-batch nor on its neighbours (tests/rl/test_exact.py, bitwise);
2. draws token g of every row from softmax(z), z = the learner's tempered logits at the row's last token
   (`Learner.next_logits`: the same model call, weights, layout and head chunk as the loss's scoring; the
   FP8-aware forward, `--learner.fp8_forward`, with an FP8 rollout), with the rollout's randomness
   (`rl.rollout.sampling.row_keys`: key fold_in(key_row, g); top-k / top-p as the sampler's `sample_tokens`): one full
   forward of the [R, W] layout per generated token (causal: the positions after the row's last token are padding
   and change nothing before it);
3. scores the finished rows once with `Learner.compute_logprobs` (the logprobs and the routing the batch carries;
   with routing replay, scored again with that routing forced, as the train step forces it).
Then `train/train_rollout_logprob_abs_diff` is exactly 0 and the off-policy ratio exactly 1 at the first micro-step.
Measured on XLA:CPU (tests/rl/test_exact.py): the z of every draw equals, bitwise, the z the same forward computes
from the finished rows (the padding after a row's last token changes nothing before it), and scoring that z in the
learner's [N, S, V] shape gives the batch's logprob bitwise. The draw itself reads z unnormalised (Gumbel-max); the
log-softmax the draw computes in its own [N, V] shape differs from the learner's by ~5e-7 (the normaliser's
reduction order), which is why the batch carries the learner's logprob, not the draw's.

What exact mode turns off: the rollout engine for training batches (its KV cache, FP8 KV cache, continuous
batching, chunked prefill, speculative decoding): the tokens come from the actor's devices; evaluation still runs
on the rollout. The cost is a full forward per token instead of a decode step (`benchmarks/mismatch.py`,
`exact_cost_frac`, `exact_rollout_tok_s`): a mode for checking and for small runs, not for Flash-scale generation.
What is left inexact: with several micro-batches per step the train step's scanned micro-batch loop rounds apart
from the scoring forward (~1e-7 nats; `exact_layout` warns).

Scope: the learner must hold the weights the batch is drawn with (synchronous loop, `--max-staleness 0`;
`RunConfig` refuses exact mode with K >= 1).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from rl.algo import batching
from rl.config.algo import LearnerConfig
from rl.algo.batch import RolloutBatch, TrainBatch
from rl.algo.learner import Learner
from rl.rollout.engine import SamplingParams
from rl.rollout.service import RolloutRequest, RolloutResult, RolloutService
from rl.rollout.sampling import row_keys, sample_tokens

log = logging.getLogger(__name__)


def exact_layout(cfg: LearnerConfig, *, rows_per_step: int, max_prompt_len: int, max_new_tokens: int,
                 batch_devices: int = 1) -> tuple[int, int]:
    """(rows R, width W) of exact mode's fixed micro-batches (`Learner(exact_layout=...)`).

    W: the smallest power of two >= max(8, max_prompt_len + max_new_tokens) (the longest row a rollout can make).
    R: the rows per micro-batch the learner picks for a step batch of `rows_per_step` rows at width W
    (`rl.algo.batching.layout`: `micro_batch_size`, or the token budget `max_tokens_per_micro_batch` x
    `batch_devices`, or the whole batch). Raises ValueError as `rl.algo.batching.layout` (token budget below W)."""
    width = batching.bucket(max_prompt_len + max_new_tokens, 1 << 62)
    lay = batching.layout(rows_per_step, width, width, trim=True, micro_batch_size=cfg.micro_batch_size,
                          max_tokens=cfg.max_tokens_per_micro_batch, batch_devices=batch_devices)
    if lay.micro_batches > 1:
        log.warning("--exact-rollout with %d micro-batches per step: the step's scanned micro-batch loop rounds "
                    "apart from the draws' and scoring forward (~1e-7 nats, benchmarks/README.md); one micro-batch is "
                    "bitwise", lay.micro_batches)
    return lay.rows, width


def rescore(learner: Learner, rb: RolloutBatch, *, routing_replay: bool) -> RolloutBatch:
    """`rb` with its logprobs [N, T] float32 replaced by the learner's forward on its sequences (the learner's
    current state; 0 after each row's length), everything else unchanged.

    learner: a `Learner` built with `exact_layout` (else the values depend on the batch: ValueError).
    routing_replay: score with `rb.routing` forced, as the train step will (`LearnerConfig.routing_replay`).
    Raises ValueError from `Learner.compute_logprobs` (mis-shaped or invalid routing, row longer than W)."""
    if learner.exact_layout is None:
        raise ValueError("rl.rollout.exact.rescore needs a Learner built with exact_layout (--exact-rollout)")
    n = rb.prompt_tokens.shape[0]
    tb = TrainBatch.from_rollout(rb, np.zeros(n, np.float32), routing=routing_replay)
    res, _ = learner.compute_logprobs(learner.state, tb, routing_replay=routing_replay)
    lp = _to_host(res.logprobs)
    resp = np.asarray(tb.response_mask) > 0
    return dataclasses.replace(rb, logprobs=rb.response_half(np.where(resp, lp, 0.0)).astype(np.float32))


def generate(learner: Learner, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int, step: int = 0,
             prompt_index: Sequence[int] | None = None, sample_index: Sequence[int] | None = None,
             weight_version: int = 0, routing_replay: bool = False) -> tuple[RolloutBatch, dict]:
    """One continuation per prompt drawn from the learner's forward (module docstring) -> (RolloutBatch with the
    learner's logprobs and routing, metrics {"rollout/exact_forwards": full forwards run}).

    prompts: N token-id lists; params, seed, step, prompt_index / sample_index [N] (default row index, 0): as
    `Sampler.generate` (the same randomness). weight_version: the learner's version, recorded in the batch.
    routing_replay: score with the drawn routing forced, as the train step will (`LearnerConfig.routing_replay`).
    Raises ValueError: no exact layout, an empty prompt, or a prompt + max_new_tokens longer than the width W."""
    if learner.exact_layout is None:
        raise ValueError("rl.rollout.exact.generate needs a Learner built with exact_layout (--exact-rollout)")
    n, width, t_max = len(prompts), learner.exact_layout[1], params.max_new_tokens
    lens = np.array([len(p) for p in prompts], np.int64)
    if n == 0 or lens.min() < 1:
        raise ValueError("rl.rollout.exact.generate: every prompt needs at least one token")
    if lens.max() + t_max > width:
        raise ValueError(f"rl.rollout.exact.generate: a prompt of {lens.max()} tokens + {t_max} new tokens is "
                         f"longer than the exact layout's width {width} (--max-prompt-len + --max-new-tokens)")
    ids = np.zeros((n, width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    keys = row_keys(seed, step, np.arange(n) if prompt_index is None else prompt_index,
                    np.zeros(n, np.int64) if sample_index is None else sample_index)
    # z is already divided by T (the learner's temperature): draw from it as is (T 1), greedy stays greedy
    temperature = 1.0 if params.temperature > 0 else 0.0
    cur, gen, done, stopped = lens.copy(), np.zeros(n, np.int64), np.zeros(n, bool), np.zeros(n, bool)
    out_tok = np.zeros((n, t_max), np.int32)
    cols, rows, zeros = np.arange(width)[None], np.arange(n), np.zeros((n, width), np.float32)
    forwards = 0
    while not done.all():
        last = np.zeros((n, width), np.int32)
        last[rows, cur - 1] = 1  # the position whose logits predict the next token
        tb = TrainBatch(input_ids=ids.copy(), attention_mask=(cols < cur[:, None]).astype(np.int32), response_mask=last,
                        rollout_logprobs=zeros, advantages=np.zeros(n, np.float32))
        z = _to_host(learner.next_logits(learner.state, tb))
        forwards += 1
        tok = np.asarray(draw_tokens(z, _fold(keys, gen), np.float32(temperature), np.float32(params.top_p),
                                     np.int32(params.top_k))[0])
        act = np.flatnonzero(~done)
        ids[act, cur[act]] = tok[act]
        out_tok[act, gen[act]] = tok[act]
        cur[act] += 1
        gen[act] += 1
        stop = np.isin(tok, params.stop_token_ids) & ~done
        stopped |= stop
        done |= stop | (gen >= t_max)
    p = int(lens.max())
    prompt_tokens = ids[:, :p].copy()  # left-aligned (rl/batch.py): the prompt columns of the draws' rows
    prompt_tokens[np.arange(p)[None] >= lens[:, None]] = 0
    rb = RolloutBatch(tokens=out_tok, logprobs=np.zeros((n, t_max), np.float32), routing=np.full((n, p + t_max, 1, 1), -1, np.int32),
                      lengths=gen.astype(np.int32), finish_reasons=["stop" if s else "length" for s in stopped],
                      prompt_tokens=prompt_tokens, prompt_lengths=lens.astype(np.int32), weight_version=weight_version)
    tb = TrainBatch.from_rollout(rb, np.zeros(n, np.float32), routing=False)
    res, _ = learner.compute_logprobs(learner.state, tb, routing_replay=False)
    resp_cols = np.asarray(tb.response_mask) > 0
    rb = dataclasses.replace(rb, routing=_to_host(res.routing).astype(np.int32),
                             logprobs=rb.response_half(np.where(resp_cols, _to_host(res.logprobs), 0.0)
                                                       ).astype(np.float32))
    scored = rescore(learner, rb, routing_replay=True) if routing_replay else rb  # the train step's forced routing
    return scored, {"rollout/exact_forwards": float(forwards)}


class ExactRollout(RolloutService):
    """Exact mode as a rollout engine (`--exact-rollout`): a training request (`RolloutRequest.train`) is drawn
    from the learner's own forward (`generate`, with the weight version the inner engine serves: the learner's,
    since exact mode is synchronous); every other request (evaluation) and every weight load go to `inner`, the
    run's rollout engine. The request's per-row length limits and token offsets are not supported (`RunConfig`
    refuses --rollout.length_schedule and partial rollouts with exact mode): ValueError.

    Args:
      learner: the `Learner` built with `exact_layout`. inner: the run's `RolloutService`. routing_replay: score with
        the drawn routing forced, as the train step will (`LearnerConfig.routing_replay`).
    """

    def __init__(self, learner: Learner, inner: RolloutService, *, routing_replay: bool):
        self.learner, self.inner, self.routing_replay = learner, inner, routing_replay
        self._done: dict[int, RolloutResult] = {}
        self._inner: dict[int, object] = {}
        self._next = 0

    def submit(self, request: RolloutRequest) -> int:
        handle, self._next = self._next, self._next + 1
        if not request.train:
            self._inner[handle] = self.inner.submit(request)
            return handle
        if request.max_new_tokens_per_row is not None or request.token_offset is not None:
            raise ValueError("exact mode (--exact-rollout) draws every row up to --max-new-tokens from the start")
        if request.multiturn is not None:
            raise ValueError("exact mode (--exact-rollout) is not combined with multi-turn rollouts (--rollout.env)")
        t0 = time.time()
        rb, stats = generate(self.learner, request.prompts, request.params, seed=request.seed, step=request.step,
                             prompt_index=request.prompt_index, sample_index=request.sample_index,
                             weight_version=self.weight_version, routing_replay=self.routing_replay)
        self._done[handle] = RolloutResult(rb=rb, stats=stats, t0=t0, t1=time.time())
        return handle

    def collect(self, handle: int) -> RolloutResult:
        if handle in self._inner:
            return self.inner.collect(self._inner.pop(handle))
        return self._done.pop(handle)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @property
    def generate_calls(self) -> int:  # the rollout engine's programs (the draws run the learner's)
        return self.inner.generate_calls

    def load_weights(self, version: int, source: str | None = None) -> dict:
        return self.inner.load_weights(version, source=source)

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


@jax.jit
def draw_tokens(z, keys, temperature, top_p, top_k):
    """One exact-mode draw: `sample_tokens` (rl/rollout/sampling.py) jitted on its own, so the logits the learner's
    forward produced are drawn from exactly as the sampler draws. z [N, V] f32 logits, keys [N] PRNG keys (row i's
    key already folded with its token index), temperature / top_p f32 scalars, top_k int -> (tokens [N] int32,
    logprobs [N] f32). Public so a test can watch the draws."""
    return sample_tokens(z, keys, temperature, top_p, top_k)


@jax.jit
def _fold_keys(keys, g):
    return jax.vmap(jax.random.fold_in)(keys, g)


def _fold(keys: jax.Array, gen: np.ndarray) -> jax.Array:
    """Row i's key for its token gen[i] (the sampler's fold_in(key_row, g))."""
    return _fold_keys(keys, np.asarray(gen, np.uint32))


def _to_host(x: jax.Array) -> np.ndarray:
    """numpy copy of a (possibly batch-sharded, multi-process) array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
