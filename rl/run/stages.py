"""The stages of one GRPO step, written once for every layout: batch -> sample -> score -> advantages -> update ->
push, and the evaluation. They know nothing of schedules (rl/run/pipeline.py: synchronous or K steps off) or of where
the rollout runs (behind `wiring.rollout`, an `rl.rollout.service.RolloutService`).

1. batch: the next prompt batch from the grain iterator (checkpointable), the same on every host (`global_batch`);
2. sample: `group_size` rows per prompt through the rollout service (FP8 weights by default): a `RolloutBatch`
   (rl/algo/batch.py: tokens, logprobs, routing in the one layout) with the weight version it was generated with;
   with `--exact-rollout` the service draws them from the learner's own forward (`rl.rollout.exact.ExactRollout`);
3. score: the run's one `rl.data.rewards.RewardFn` (the built-in task's exact partial credit, or a dataset reward in a
   worker process with a per-sample time limit `--data.reward_timeout_s`); DAPO (`--algo dapo`) samples and scores
   further rounds until the batch holds `prompts_per_step` groups whose rewards differ (`dynamic_rollout`,
   bounded by `--dapo-max-resample-batches`);
   stages 1-3 together: `produce(wiring, step)` -> a `RolloutRecord`, what the pipeline queues;
4. advantages: group advantages (GRPO / Dr.GRPO / RLOO, `cfg.advantage`), host numpy;
5. update: `learn`: `Learner.update(TrainBatch.from_rollout(...))` on the actor mesh (routing replay, off-policy
   correction), a new weight version when it changed the weights;
6. push: `push`: the service loads the learner's params as that version (`RolloutService.load_weights`).
`evaluate`: greedy and sampled pass@k on the held-out prompts, two requests to the same service.

`wiring` is an `rl.run.wiring.RunWiring` (duck-typed here: a stage reads `wiring.cfg`, `wiring.rollout`,
`wiring.reward`, `wiring.learner`, `wiring.iterator`, `wiring.tokenizer`, ...; tests pass partial wirings).
Randomness is a function of (seed, step, prompt, sample): a resumed run is bitwise identical on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from rl.algo.advantages import DynamicSampler, compute_advantages
from rl.algo.batch import RolloutBatch, TrainBatch, concat_rollouts
from rl.run.env_task import multiturn_request
from rl.algo.metrics import pass_at_k, response_stats, reward_stats, to_python
from rl.rollout.service import RolloutRequest
from rl.rollout.engine import SamplingParams

log = logging.getLogger("dsv4rl")


@dataclasses.dataclass
class RolloutRecord:
    """One generated step batch (stages 1-3 of step `step`): `rb` (None: DAPO skipped the step), rewards [N]
    float32, train_rows [N] bool or None (DAPO fillers), versions [N] int64 (weight version of each sample),
    metrics (rollout / reward / response statistics, python floats)."""

    step: int
    rb: Any
    rewards: np.ndarray | None
    train_rows: np.ndarray | None
    versions: np.ndarray | None
    metrics: dict


# ------------------------------------------------------------------------------------------------ 1-3

def score(wiring, rb: RolloutBatch, refs: list[str]) -> tuple[np.ndarray, np.ndarray, dict]:
    """Stage 3: the run's one `rl.data.rewards.RewardFn` on a rollout's responses against per-row references ->
    (rewards [N] float32, exact [N] bool, metrics); host numpy throughout. A multi-turn batch (`rb.loss_mask`):
    the reward reads each trajectory's last model turn (`RolloutBatch.final_turns`) and its whole response side
    (an environment's shaped credit reads the first turn; rl/run/env_task.py::EnvReward)."""
    if rb.loss_mask is not None:
        return wiring.reward(refs, rb.final_turns(), rb.response_lists())
    return wiring.reward(refs, rb.final_turns())


def generate(wiring, rows: list[list[int]], params: SamplingParams, *, seed: int, step: int = 0,
             prompt_index: list[int] | None = None, sample_index: list[int] | None = None,
             tag: str = "", max_new_tokens_per_row: list[int] | None = None,
             token_offset: list[int] | None = None, train: bool = False,
             refs: list[str] | None = None) -> tuple[RolloutBatch, dict]:
    """One request to the rollout service, waited for -> (RolloutBatch, the generation's stats + perf metrics).
    `train`: a training batch's request (`RolloutRequest.train`). `refs` [N]: the rows' references, the
    environment's data of a multi-turn request (--rollout.env; `rl.run.env_task.multiturn_request`)."""
    mt = multiturn_request(wiring.cfg, refs) if refs is not None else None
    req = RolloutRequest(prompts=rows, params=params, seed=seed, step=step, prompt_index=prompt_index,
                         sample_index=sample_index, tag=tag or f"gen/{step}",
                         max_new_tokens_per_row=max_new_tokens_per_row, token_offset=token_offset, train=train,
                         multiturn=mt)
    t0 = time.perf_counter()
    res = wiring.rollout.collect(wiring.rollout.submit(req))
    dt = time.perf_counter() - t0
    n_tok = int(res.rb.lengths.sum())
    return res.rb, {**res.stats, "perf/rollout_s": dt, "perf/rollout_tok_per_s": n_tok / dt}


def sampling_params(wiring) -> SamplingParams:
    """The run's training SamplingParams (`cfg.rollout`; the tokenizer's eos stops a response, unless
    --rollout.ignore_eos)."""
    r = wiring.cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          stop_token_ids=() if r.ignore_eos else (wiring.tokenizer.eos_id,))


def sample(wiring, prompts: list[list[int]], step: int, round_index: int = 0,
           data_index=None, refs: list[str] | None = None) -> tuple[RolloutBatch, dict]:
    """Stage 2: `group_size` responses per prompt -> (RolloutBatch of N = len(prompts) x group_size rows,
    prompt-major; the generation's stats (continuous batching counters) and perf metrics). `data_index` [P]: the
    prompts' data indices, for `--rollout.length_schedule` (`RolloutConfig.length_caps`). `refs` [P]: the prompts'
    references, which a multi-turn run's environment reads (--rollout.env: the request carries them per row).

    `round_index` (DAPO resampling rounds within one step) offsets the prompt index of the sampler's randomness
    by round_index x len(prompts), so every round of a step draws fresh, reproducible samples."""
    r = wiring.cfg.rollout
    g, off = r.group_size, round_index * len(prompts)
    rows = [p for p in prompts for _ in range(g)]
    sp = sampling_params(wiring)
    pi = [off + i for i in range(len(prompts)) for _ in range(g)]
    si = [j for _ in prompts for j in range(g)]
    caps = None if data_index is None else r.length_caps(data_index)
    # --exact-rollout: the service draws training requests from the learner's own forward (rl/rollout/exact.py)
    return generate(wiring, rows, sp, seed=wiring.cfg.seed, step=step, prompt_index=pi, sample_index=si,
                    tag=f"train/{step}/{round_index}", train=True,
                    max_new_tokens_per_row=None if caps is None else [c for c in caps for _ in range(g)],
                    refs=None if refs is None else [r for r in refs for _ in range(g)])


def rollout(wiring, prompts: list[list[int]], refs: list[str], step: int, round_index: int = 0, data_index=None):
    """Stages 2-3 for one round of prompts: `sample`, then `score` -> (RolloutBatch, rewards [N], metrics)."""
    rb, metrics = sample(wiring, prompts, step, round_index, data_index, refs)
    rewards, _, rm = score(wiring, rb, [r for r in refs for _ in range(wiring.cfg.rollout.group_size)])
    return rb, rewards, {**rm, **metrics}


def global_batch(wiring, batch: dict) -> dict:
    """Multi-host: every host reads its own shard of prompts (grain, per-host sharding); the hosts then share
    them so that every process feeds the same global batch to the jits that span all processes. With the rollout
    on processes of its own (MPMD) every actor process reads one unsharded stream: nothing to share."""
    if jax.process_count() == 1 or (wiring.layout is not None and wiring.layout.split_roles):
        return batch
    idx = np.asarray(multihost_utils.process_allgather(batch["index"], tiled=True))
    ids = np.asarray(multihost_utils.process_allgather(batch["prompt_ids"], tiled=True))
    lens = np.asarray(multihost_utils.process_allgather(batch["prompt_len"], tiled=True))
    return {"prompt_ids": ids, "prompt_len": lens, "index": idx,
            "reference": [wiring.train_data.references[int(i)] for i in idx]}


def prompt_lists(batch: dict) -> list[list[int]]:
    return [batch["prompt_ids"][i, : batch["prompt_len"][i]].tolist() for i in range(len(batch["reference"]))]


def dynamic_rollout(wiring, step: int, first: dict):
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2): sample rounds of `prompts_per_step` prompts until
    `prompts_per_step` groups with non-equal rewards are held, at most 1 + `dapo_max_resample_batches` rounds
    (each extra round takes the next prompt batch from the data iterator, so the data order stays resumable).

    Returns (rb, rewards [N], train_rows [N] bool, metrics) with N = prompts_per_step x group_size, or
    (None, None, None, metrics) when the step is to be skipped. The reward statistics in the metrics are those
    of the first round (the on-policy sample of the data, comparable with the other algorithms). The batch always
    has N rows, so the learner never recompiles: kept groups first, then (when the budget ran out with fewer kept
    groups) filler groups from the dropped ones whose `train_rows` are False. Budget exhausted
    (`dapo_on_budget_exhausted`): "train" trains on the kept groups alone (the fillers' response tokens are
    masked out of the loss), "skip" skips the update and the push; with no kept group at all the step is skipped
    either way. Metrics `rollout/dynamic_sampling/*` (rounds, kept_groups, sampled_groups, budget_hit,
    kept_frac, skipped_step)."""
    cfg = wiring.cfg
    g, n = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    ds = DynamicSampler(target_groups=n, group_size=g, max_rounds=cfg.advantage.dynamic_sampling_max_rounds)
    batch, rounds, first_metrics = first, [], None
    while True:
        r_i = len(rounds)
        rb, rewards, m = rollout(wiring, prompt_lists(batch), batch["reference"], step, round_index=r_i,
                                 data_index=batch["index"])
        rounds.append((rb, rewards))
        first_metrics = first_metrics or m
        if ds.add_round(rewards, [(r_i, i) for i in range(len(rewards) // g)]):
            break
        batch = global_batch(wiring, next(wiring.iterator))
    kept, metrics = ds.result()
    # reward statistics are of the first round: the on-policy sample of the data, comparable across algorithms
    metrics = {**first_metrics, **to_python(reward_stats(jnp.asarray(rounds[0][1]), g)), **metrics}
    skip = not kept or (len(kept) < n and cfg.dapo.on_budget_exhausted == "skip")
    metrics["rollout/dynamic_sampling/kept_frac"] = len(kept) / ds.sampled_groups
    metrics["rollout/dynamic_sampling/skipped_step"] = float(skip)
    if len(kept) < n:
        log.warning("step %d: DAPO dynamic sampling kept %d of %d groups after %d rounds (budget "
                    "--dapo-max-resample-batches %d): %s", step, len(kept), n, ds.rounds,
                    cfg.dapo.max_resample_batches, "skipping the step" if skip else "training on the kept groups")
    if skip:
        return None, None, None, metrics
    # fillers are needed only when the budget ran out, i.e. every group with signal was kept: the others are
    # the all-equal groups DynamicSampler dropped
    kept_set = set(kept)
    dropped = [(r, i) for r, (_, rw) in enumerate(rounds) for i in range(len(rw) // g) if (r, i) not in kept_set]
    groups = kept + dropped[: n - len(kept)]
    parts = [(rounds[r][0], np.arange(i * g, (i + 1) * g)) for r, i in groups]
    rb = concat_rollouts(parts)
    rewards = np.concatenate([rounds[r][1][i * g:(i + 1) * g] for r, i in groups]).astype(np.float32)
    train_rows = np.repeat(np.arange(n) < len(kept), g)
    return rb, rewards, train_rows, metrics


def sample_step(wiring, step: int):
    """Stages 1-3 of step `step` -> (RolloutBatch, rewards [N], train_rows [N] bool or None, metrics); the
    RolloutBatch is None when DAPO skips the step."""
    cfg = wiring.cfg
    g = cfg.rollout.group_size
    batch = global_batch(wiring, next(wiring.iterator))  # 1. batch (every host: the same global batch)
    if cfg.advantage.dynamic_sampling:  # 2-3. DAPO: sample and score rounds until the groups have signal
        rb, rewards, train_rows, metrics = dynamic_rollout(wiring, step, batch)
    else:
        rb, metrics = sample(wiring, prompt_lists(batch), step, data_index=batch["index"],  # 2. sample
                             refs=batch["reference"])
        rewards, _, rm = score(wiring, rb, [r for r in batch["reference"] for _ in range(g)])  # 3. score
        metrics.update(rm)
        metrics.update(to_python(reward_stats(jnp.asarray(rewards), g)))
        train_rows = None
    if rb is not None:
        metrics.update(to_python(response_stats(jnp.asarray(rb.lengths), cfg.rollout.max_new_tokens,
                                                rb.finish_reasons)))
    return rb, rewards, train_rows, metrics


def produce(wiring, step: int) -> RolloutRecord:
    """Stages 1-3 of step `step` (`sample_step`), plus the weight version of every sample and the rollout
    service's counters (`RolloutService.stats`: MPMD's `mpmd/rollout_*`) -> the RolloutRecord the pipeline
    queues."""
    rb, rewards, train_rows, metrics = sample_step(wiring, step)
    metrics.update(wiring.rollout.stats())
    versions = None if rb is None else np.full(len(rewards), rb.weight_version, np.int64)
    return RolloutRecord(step=step, rb=rb, rewards=rewards, train_rows=train_rows, versions=versions, metrics=metrics)


# ------------------------------------------------------------------------------------------------ 4-6

def advantages(wiring, rewards: np.ndarray, train_rows: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """Stage 4: group advantages of rewards [N] (`cfg.advantage`: GRPO / Dr.GRPO / RLOO, rl/algo/advantages.py) ->
    (advantages [N] float32 host, metrics). Rows where `train_rows` is False (DAPO fillers) get 0."""
    adv, am = compute_advantages(jnp.asarray(rewards), wiring.cfg.rollout.group_size, wiring.cfg.advantage)
    if train_rows is not None:  # DAPO filler groups: out of the loss (tokens, normalisers, metrics)
        adv = jnp.where(jnp.asarray(train_rows), adv, 0.0)
    return np.asarray(adv), to_python(am)


def learn(wiring, rb: RolloutBatch, adv: np.ndarray, train_rows: np.ndarray | None = None) -> dict:
    """Stage 5: one learner update on the rollout batch; a new weight version (`wiring.weight_version`) when it
    changed the weights. The caller pushes it (`push`) at the schedule's push point.

    A step without learning signal (every advantage exactly 0: all groups zero-std or filtered by DAPO's
    dynamic sampling) changes nothing: no optimizer update (Adam's momentum would still move the params, and
    the KL/entropy terms alone are not a reason to step), the weight version stays; `train/skipped_no_signal` is
    1. Likewise a non-finite step (`train/skipped_nonfinite`, the learner's guard) keeps the version.
    `train_rows` [N] bool (DAPO fillers = False) takes rows out of the loss: their response tokens are masked, so
    they count in no normaliser. Returns the step's train/perf metrics."""
    if not np.any(np.asarray(adv) != 0):
        log.info("no learning signal in this batch (all advantages 0): update and push skipped")
        return {"train/skipped_no_signal": 1.0}
    tb = TrainBatch.from_rollout(rb, adv, routing=wiring.cfg.learner.routing_replay, train_rows=train_rows)
    t0 = time.perf_counter()
    wiring.counters["train_steps"] += 1
    tm = to_python(wiring.learner.update(tb))
    metrics = {**tm, "train/skipped_no_signal": 0.0, "perf/train_s": time.perf_counter() - t0}
    if not tm.get("train/skipped_nonfinite", 0):
        wiring.weight_version += 1
    return metrics


def push(wiring) -> dict:
    """Stage 6: the rollout service loads the learner's current params as version `wiring.weight_version`, when it
    serves an older one (nothing to push otherwise: no signal, non-finite, DAPO skip) -> perf metrics."""
    if wiring.rollout.weight_version == wiring.weight_version:
        return {}
    return wiring.rollout.load_weights(wiring.weight_version)


# ------------------------------------------------------------------------------------------------ eval

def evaluate(wiring, step: int) -> dict:
    """pass@1 (greedy and sampled, unbiased) and pass@k (k = eval.samples) on the held-out prompts: two requests
    to the rollout service (greedy, then k samples per prompt), scored here."""
    cfg = wiring.cfg
    r, k = cfg.rollout, cfg.eval.samples
    eos = (wiring.tokenizer.eos_id,)
    greedy, _ = generate(wiring, wiring.eval_prompts, SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens,
                                                                     stop_token_ids=eos),
                         seed=cfg.seed, tag=f"eval/{step}/{wiring.weight_version}/greedy", refs=wiring.eval_refs)
    g_r, g_exact, _ = score(wiring, greedy, wiring.eval_refs)
    rows = [p for p in wiring.eval_prompts for _ in range(k)]
    sampled, _ = generate(wiring, rows, SamplingParams(temperature=max(r.temperature, 1e-3), top_p=r.top_p,
                                                       max_new_tokens=r.max_new_tokens, stop_token_ids=eos),
                          seed=cfg.seed + 1, step=step,
                          prompt_index=[i for i in range(len(wiring.eval_prompts)) for _ in range(k)],
                          sample_index=[j for _ in wiring.eval_prompts for j in range(k)],
                          tag=f"eval/{step}/{wiring.weight_version}/sampled",
                          refs=[ref for ref in wiring.eval_refs for _ in range(k)])
    s_r, s_exact, _ = score(wiring, sampled, [ref for ref in wiring.eval_refs for _ in range(k)])
    c = s_exact.reshape(-1, k).sum(axis=1)
    return {"eval/greedy_pass@1": float(g_exact.mean()), "eval/greedy_reward": float(g_r.mean()),
            "eval/pass@1": float(np.mean(pass_at_k(k, c, 1))), "eval/pass@k": float(np.mean(pass_at_k(k, c, k))),
            "eval/k": k, "eval/reward_mean": float(s_r.mean())}
