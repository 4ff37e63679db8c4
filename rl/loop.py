"""The GRPO loop: batch -> sample -> score -> advantages -> update -> push, then eval and checkpoint.

    job = build(RunConfig(...))     # rl/job.py: meshes, model, learner (actor mesh), sampler (rollout mesh), data
    summary = run(job)              # the loop; returns {"reward_curve": [...], ...}

One call per stage, top to bottom (docs/style.md rule 8); `train_step` reads as the algorithm:
1. batch: the next prompt batch from the grain iterator (checkpointable), the same on every host (`global_batch`);
2. sample: `Sampler.generate` on the rollout mesh (FP8 weights by default), `group_size` rows per prompt:
   a `RolloutBatch` (rl/batch.py: tokens, logprobs, routing in the one layout);
3. score: the run's one `rl.rewards.RewardFn` (the built-in task's exact partial credit, or a dataset reward
   in a worker process with a per-sample time limit `--data.reward_timeout_s`); DAPO (`--algo dapo`: the
   `advantage.dynamic_sampling` preset) samples and scores further rounds until the batch holds
   `prompts_per_step` groups whose rewards differ (`dynamic_rollout`, bounded by `--dapo-max-resample-batches`);
4. advantages: group advantages (GRPO / Dr.GRPO / RLOO, `cfg.advantage`), host numpy;
5. update: `Learner.update(TrainBatch.from_rollout(...))` on the actor mesh (routing replay, off-policy
   correction); the learner places the host batch once;
6. push: actor -> rollout weights (bf16 -> device_put -> FP8), a new weight version;
then metrics (rl/sinks.py: JSONL, TensorBoard, W&B, progress bar), eval every `eval.every`, a checkpoint
every `ckpt.every`. Resume (`resume="auto"`) restores the newest usable checkpoint and continues
bitwise-identically on CPU: randomness is a function of (seed, step, prompt, sample). SIGTERM finishes the
current step, saves, exits 0. `--max-staleness K` / `--async-rollout` (K = 1): stages 1-3 run ahead in a
thread, K steps off (rl/async_loop.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl.batch import RolloutBatch, TrainBatch
from rl.config import RunConfig
# The wiring (rl/job.py) and the sinks (rl/sinks.py) are re-exported: `rl.loop.build`, `rl.loop.Job`, ... stay
from rl.job import (Job, _data, _rollout_slots, build, data_metrics, fingerprint, make_pusher, push,  # noqa: F401
                    resolve_model_config, same_data)
from rl.sinks import MetricsLogger, progress_bar  # noqa: F401

log = logging.getLogger("dsv4rl")


# ------------------------------------------------------------------------------------------------ stages

def score(job: Job, rb: RolloutBatch, refs: list[str]) -> tuple[np.ndarray, np.ndarray, dict]:
    """Stage 3: the run's one `rl.rewards.RewardFn` on a rollout's responses against per-row references ->
    (rewards [N] float32, exact [N] bool, metrics); host numpy throughout."""
    return job.reward(refs, rb.response_lists())


def sample(job: Job, prompts: list[list[int]], step: int, round_index: int = 0) -> tuple[RolloutBatch, dict]:
    """Stage 2: `group_size` responses per prompt on the rollout mesh -> (RolloutBatch of N = len(prompts) x
    group_size rows, prompt-major; perf metrics).

    `round_index` (DAPO resampling rounds within one step) offsets the prompt index of the sampler's randomness
    by round_index x len(prompts), so every round of a step draws fresh, reproducible samples."""
    from rl.sampler import SamplingParams

    g = job.cfg.group_size
    off = round_index * len(prompts)
    rows = [p for p in prompts for _ in range(g)]
    sp = SamplingParams(temperature=job.cfg.temperature, top_p=job.cfg.top_p, top_k=job.cfg.top_k,
                        max_new_tokens=job.cfg.max_new_tokens, stop_token_ids=(job.tokenizer.eos_id,))
    t0 = time.perf_counter()
    job.counters["generate"] += 1
    rb = job.sampler.generate(rows, sp, seed=job.cfg.seed, step=step,
                              prompt_index=[off + i for i in range(len(prompts)) for _ in range(g)],
                              sample_index=[j for _ in prompts for j in range(g)])
    dt = time.perf_counter() - t0
    n_tok = int(rb.lengths.sum())
    slot_m = dict(getattr(job.sampler, "last_stats", None) or {})  # continuous batching counters (rl/slots.py)
    return rb, {**slot_m, "perf/rollout_s": dt, "perf/rollout_tok_per_s": n_tok / dt}


def rollout(job: Job, prompts: list[list[int]], refs: list[str], step: int, round_index: int = 0):
    """Stages 2-3 for one round of prompts: `sample`, then `score` -> (RolloutBatch, rewards [N], metrics)."""
    rb, metrics = sample(job, prompts, step, round_index)
    rewards, _, rm = score(job, rb, [r for r in refs for _ in range(job.cfg.group_size)])
    return rb, rewards, {**rm, **metrics}


def advantages(job: Job, rewards: np.ndarray, train_rows: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """Stage 4: group advantages of rewards [N] (`cfg.advantage`: GRPO / Dr.GRPO / RLOO, rl/advantages.py) ->
    (advantages [N] float32 host, metrics). Rows where `train_rows` is False (DAPO fillers) get 0."""
    from rl.advantages import compute_advantages
    from rl.metrics import to_python

    adv, am = compute_advantages(jnp.asarray(rewards), job.cfg.group_size, job.cfg.advantage)
    if train_rows is not None:  # DAPO filler groups: out of the loss (tokens, normalisers, metrics)
        adv = jnp.where(jnp.asarray(train_rows), adv, 0.0)
    return np.asarray(adv), to_python(am)


def evaluate(job: Job, step: int, here: bool = False) -> dict:
    """pass@1 (greedy and sampled, unbiased) and pass@k (k = eval_samples) on the held-out prompts. MPMD: the
    rollout processes sample and score, the actor's receive the metrics (`here` = evaluate on this process)."""
    if job.layout is not None and job.layout.mpmd and not here:
        from rl.roles import evaluate_mpmd

        return evaluate_mpmd(job, step)
    from rl.metrics import pass_at_k
    from rl.sampler import SamplingParams

    cfg = job.cfg
    eos = (job.tokenizer.eos_id,)
    job.counters["generate"] += 2
    greedy = job.sampler.generate(job.eval_prompts, SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                                                                   stop_token_ids=eos), seed=cfg.seed)
    g_r, g_exact, _ = score(job, greedy, job.eval_refs)
    k = cfg.eval_samples
    rows = [p for p in job.eval_prompts for _ in range(k)]
    sampled = job.sampler.generate(rows, SamplingParams(temperature=max(cfg.temperature, 1e-3), top_p=cfg.top_p,
                                                        max_new_tokens=cfg.max_new_tokens, stop_token_ids=eos),
                                   seed=cfg.seed + 1, step=step,
                                   prompt_index=[i for i in range(len(job.eval_prompts)) for _ in range(k)],
                                   sample_index=[j for _ in job.eval_prompts for j in range(k)])
    s_r, s_exact, _ = score(job, sampled, [r for r in job.eval_refs for _ in range(k)])
    c = s_exact.reshape(-1, k).sum(axis=1)
    return {"eval/greedy_pass@1": float(g_exact.mean()), "eval/greedy_reward": float(g_r.mean()),
            "eval/pass@1": float(np.mean(pass_at_k(k, c, 1))), "eval/pass@k": float(np.mean(pass_at_k(k, c, k))),
            "eval/k": k, "eval/reward_mean": float(s_r.mean())}


def global_batch(job: Job, batch: dict) -> dict:
    """Multi-host: every host reads its own shard of prompts (grain, per-host sharding); the hosts then share
    them so that every process feeds the same global batch to the jits that span all processes."""
    if jax.process_count() == 1 or (job.layout is not None and job.layout.mpmd):  # MPMD: one unsharded stream
        return batch
    from jax.experimental import multihost_utils

    idx = np.asarray(multihost_utils.process_allgather(batch["index"], tiled=True))
    ids = np.asarray(multihost_utils.process_allgather(batch["prompt_ids"], tiled=True))
    lens = np.asarray(multihost_utils.process_allgather(batch["prompt_len"], tiled=True))
    return {"prompt_ids": ids, "prompt_len": lens, "index": idx,
            "reference": [job.train_data.references[int(i)] for i in idx]}


def _prompt_lists(batch: dict) -> list[list[int]]:
    return [batch["prompt_ids"][i, : batch["prompt_len"][i]].tolist() for i in range(len(batch["reference"]))]


def dynamic_rollout(job: Job, step: int, first: dict):
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2): sample rounds of `prompts_per_step` prompts until
    `prompts_per_step` groups with non-equal rewards are held, at most 1 + `dapo_max_resample_batches` rounds
    (each extra round takes the next prompt batch from the data iterator, so the data order stays resumable).

    Returns (rb, rewards [N], train_rows [N] bool, metrics) with N = prompts_per_step x group_size, or
    (None, None, None, metrics) when the step is to be skipped. The reward statistics in the metrics are those
    of the first round (the on-policy sample of the data, comparable with the other algorithms). The batch always
    has N rows, so the learner never recompiles: kept groups first, then (when the budget ran out with fewer kept groups)
    filler groups from the dropped ones whose `train_rows` are False. Budget exhausted
    (`dapo_on_budget_exhausted`): "train" trains on the kept groups alone (the fillers' response tokens are
    masked out of the loss), "skip" skips the update and the push; with no kept group at all the step is skipped
    either way. Metrics `rollout/dynamic_sampling/*` (rounds, kept_groups, sampled_groups, budget_hit,
    kept_frac, skipped_step)."""
    from rl.advantages import DynamicSampler
    from rl.metrics import reward_stats, to_python
    from rl.sampler import concat_rollouts

    cfg, g, n = job.cfg, job.cfg.group_size, job.cfg.prompts_per_step
    ds = DynamicSampler(target_groups=n, group_size=g, max_rounds=cfg.advantage_config().dynamic_sampling_max_rounds)
    batch, rounds, first_metrics = first, [], None
    while True:
        r_i = len(rounds)
        rb, rewards, m = rollout(job, _prompt_lists(batch), batch["reference"], step, round_index=r_i)
        rounds.append((rb, rewards))
        first_metrics = first_metrics or m
        if ds.add_round(rewards, [(r_i, i) for i in range(len(rewards) // g)]):
            break
        batch = global_batch(job, next(job.iterator))
    kept, metrics = ds.result()
    # reward statistics are of the first round: the on-policy sample of the data, comparable across algorithms
    metrics = {**first_metrics, **to_python(reward_stats(jnp.asarray(rounds[0][1]), g)), **metrics}
    skip = not kept or (len(kept) < n and cfg.dapo_on_budget_exhausted == "skip")
    metrics["rollout/dynamic_sampling/kept_frac"] = len(kept) / ds.sampled_groups
    metrics["rollout/dynamic_sampling/skipped_step"] = float(skip)
    if len(kept) < n:
        log.warning("step %d: DAPO dynamic sampling kept %d of %d groups after %d rounds (budget "
                    "--dapo-max-resample-batches %d): %s", step, len(kept), n, ds.rounds,
                    cfg.dapo_max_resample_batches, "skipping the step" if skip else "training on the kept groups")
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


def train_step(job: Job, step: int) -> dict:
    """One GRPO step: batch -> sample -> score (`sample_step`) -> advantages -> update -> push (`learn_step`);
    returns its metrics. MPMD: each role runs its half on its own processes (rl/roles.py)."""
    if job.layout is not None and job.layout.mpmd:
        from rl.roles import train_step_mpmd

        return train_step_mpmd(job, step)
    t_step = time.perf_counter()
    rb, rewards, train_rows, metrics = sample_step(job, step)
    if rb is None:  # DAPO, nothing to learn from: no update, no push, same weight version
        metrics["weight_version"] = job.weight_version
        metrics["perf/step_s"] = time.perf_counter() - t_step
        return metrics
    return learn_step(job, rb, rewards, train_rows, metrics, t_step)


def sample_step(job: Job, step: int):
    """Stages 1-3 of step `step` -> (RolloutBatch, rewards [N], train_rows [N] bool or None, metrics); the
    RolloutBatch is None when DAPO skips the step."""
    from rl.metrics import response_stats, reward_stats, to_python

    cfg = job.cfg
    batch = global_batch(job, next(job.iterator))  # 1. batch (every host: the same global batch)
    if cfg.advantage.dynamic_sampling:  # 2-3. DAPO: sample and score rounds until the groups have signal
        rb, rewards, train_rows, metrics = dynamic_rollout(job, step, batch)
    else:
        rb, metrics = sample(job, _prompt_lists(batch), step)  # 2. sample
        rewards, _, rm = score(job, rb, [r for r in batch["reference"] for _ in range(cfg.group_size)])  # 3.
        metrics.update(rm)
        metrics.update(to_python(reward_stats(jnp.asarray(rewards), cfg.group_size)))
        train_rows = None
    if rb is not None:
        metrics.update(to_python(response_stats(jnp.asarray(rb.lengths), cfg.max_new_tokens, rb.finish_reasons)))
    return rb, rewards, train_rows, metrics


def learn_step(job: Job, rb: RolloutBatch, rewards: np.ndarray, train_rows: np.ndarray | None, metrics: dict,
               t_step: float) -> dict:
    """Stages 4-6 on a sampled batch (`sample_step`'s outputs): advantages, update, push. Returns the step's
    metrics (`metrics` + the learner's, the weight version and `perf/step_s` since `t_step`)."""
    adv, am = advantages(job, rewards, train_rows)  # 4. advantages
    metrics.update(am)
    metrics.update(job.data_metrics)
    metrics.update(learn_and_push(job, rb, adv, train_rows))  # 5-6. update, push
    metrics["weight_version"] = job.weight_version
    metrics["perf/step_s"] = time.perf_counter() - t_step
    return metrics


def learn_and_push(job: Job, rb, adv: np.ndarray, train_rows: np.ndarray | None = None, *,
                   defer_push: bool = False) -> dict:
    """Stages 5-6: one learner update on the rollout batch, then push the new weights as the next version.

    A step without learning signal (every advantage exactly 0: all groups zero-std or filtered by DAPO's
    dynamic sampling) changes nothing: no optimizer update (Adam's momentum would still move the params, and
    the KL/entropy terms alone are not a reason to step), no push, the weight version stays;
    `train/skipped_no_signal` is 1. Likewise a non-finite step (`train/skipped_nonfinite`, the learner's guard)
    is not pushed. `train_rows` [N] bool (DAPO fillers = False) takes rows out of the loss: their response
    tokens are masked, so they count in no normaliser. `defer_push` (the asynchronous loop, rl/async_loop.py):
    the version is bumped but the caller pushes (`push(job)`) once the rollout is between generations.
    Returns the step's train/perf metrics.
    """
    from rl.metrics import to_python

    if not np.any(np.asarray(adv) != 0):
        log.info("no learning signal in this batch (all advantages 0): update and push skipped")
        return {"train/skipped_no_signal": 1.0}
    tb = TrainBatch.from_rollout(rb, adv, routing=job.cfg.learner.routing_replay, train_rows=train_rows)
    t0 = time.perf_counter()
    job.counters["train_steps"] += 1
    tm = to_python(job.learner.update(tb))
    metrics = {**tm, "train/skipped_no_signal": 0.0, "perf/train_s": time.perf_counter() - t0}
    if not tm.get("train/skipped_nonfinite", 0):
        job.weight_version += 1
        if not defer_push:
            metrics.update(push(job))
    return metrics


# ------------------------------------------------------------------------------------------------ run

def save(job: Job, step: int, *, force: bool = False) -> None:
    if job.ckpt is None:
        return
    if job.inflight is not None:  # async mode: the batches generated ahead of the learner go with the checkpoint
        job.inflight.save(job.ckpt, step)
    job.ckpt.save(step, job.learner.state_dict(), {"data": job.iterator.get_state(),
                                                   "weight_version": job.weight_version, "seed": job.cfg.seed,
                                                   "data_identity": job.data_identity},
                  force=force)


def run(job: Job) -> dict:
    """The loop from `job.start_step` to `cfg.steps`. Returns a summary with the reward curve.

    SIGTERM and SIGINT (Ctrl-C) are handled alike: the current step finishes, a checkpoint of it is saved and
    the loop ends (`summary["signal"]` names the signal). A second Ctrl-C exits the process at once (status
    130): an unfinished save is only an orbax temp directory, so the newest complete checkpoint is untouched.
    """
    cfg = job.cfg
    stop = {"flag": False, "signal": None}

    def on_signal(signum, frame):
        if stop["flag"] and signum == signal.SIGINT:  # second Ctrl-C: leave now; an unfinished save stays a temp dir
            sys.stderr.write("\ninterrupted again: exiting now; the newest complete checkpoint is kept\n")
            sys.stderr.flush()
            os._exit(130)
        name = signal.Signals(signum).name
        extra = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        log.warning("%s: finishing the current step, saving, exiting%s", name, extra)
        stop["flag"], stop["signal"] = True, name

    handled = (signal.SIGTERM, signal.SIGINT)
    old = {s: signal.signal(s, on_signal) for s in handled} if _main_thread() else None
    curve = []
    bar = progress_bar(cfg, job.start_step)
    try:
        if cfg.eval_before_train and job.start_step == 0:  # veRL's val_before_train
            ev = evaluate(job, 0)
            log.info("eval before training:\n%s", eval_table(ev, job))
            job.logger.log(0, {**ev, "eval/before_train": 1.0})
        if cfg.staleness() > 0:  # --max-staleness / --async-rollout: rollouts run ahead in a thread
            from rl.async_loop import start_async

            job.inflight = start_async(job)  # MPMD: this process's side of it (rl/async_mpmd.py)
        for step in range(job.start_step, cfg.steps):
            eval_due = bool(cfg.eval_every) and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps)
            if job.inflight is None:
                metrics = train_step(job, step)
                if eval_due:
                    metrics.update(evaluate(job, step))
            else:
                metrics = job.inflight.step(step, eval_due)
            job.logger.log(step, metrics)
            curve.append(metrics["rollout/reward_mean"])
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}",
                                tok_s=f"{metrics['perf/rollout_tok_per_s']:.0f}")
            done = step + 1
            saved = bool(cfg.ckpt_every) and (done % cfg.ckpt_every == 0 or done == cfg.steps)
            if saved:
                save(job, done)
            if stop["flag"]:
                if not saved:
                    save(job, done, force=True)
                break
    finally:
        if job.inflight is not None:
            job.inflight.close()
        if bar is not None:
            bar.close()
        if job.ckpt is not None:
            job.ckpt.wait()
        job.logger.close()
        if job.layout is not None and job.layout.mpmd:  # the roles' programs, counted (tests read this line)
            log.info("role %s (process %d): generate calls %d, train steps %d", job.layout.role,
                     job.layout.process, job.counters["generate"], job.counters["train_steps"])
        if old is not None:
            for s, handler in old.items():
                signal.signal(s, handler)
    return {"reward_curve": curve, "steps_run": len(curve), "weight_version": job.weight_version,
            "stopped_by_signal": stop["flag"], "signal": stop["signal"]}


def run_eval(job: Job) -> dict:
    """--eval-only: one evaluation of the loaded weights (`--init`, or the newest checkpoint of --ckpt-dir with
    --resume auto) on the eval prompts, logged as step `job.start_step`; prints the table. Returns the metrics."""
    try:
        ev = evaluate(job, job.start_step)
        job.logger.log(job.start_step, {**ev, "eval/only": 1.0})
    finally:
        job.logger.close()
    print(eval_table(ev, job))
    return ev


def eval_table(metrics: dict, job: Job) -> str:
    """The eval metrics as a small text table (rl.metrics.format_eval_table) naming the eval set."""
    from rl.metrics import format_eval_table

    cfg = job.cfg
    source = cfg.eval_dataset or (f"the first {len(job.eval_prompts)} training prompts" if cfg.dataset
                                  else "the task's eval split")
    return format_eval_table(metrics, n_prompts=len(job.eval_prompts), source=source,
                             weights=cfg.init if job.start_step == 0 else f"{cfg.ckpt_dir} step {job.start_step}")


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
