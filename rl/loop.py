"""The GRPO loop: dataset -> sampler -> rewards -> advantages -> update -> push -> (eval, checkpoint).

    job = build(RunConfig(...))     # meshes, model, learner (actor mesh), sampler (rollout mesh), data, ckpt
    summary = run(job)              # the loop; returns {"reward_curve": [...], ...}

One call per stage, top to bottom (docs/style.md rule 8). Each step:
1. next prompt batch from the grain iterator (checkpointable), each prompt repeated `group_size` times;
2. `Sampler.generate` on the rollout mesh (FP8 weights by default): tokens, logprobs, routing;
3. rewards: the built-in task's exact partial-credit reward, or GSM8K answer verification (+ format) in a
   worker process with a per-sample time limit;
4. group advantages (GRPO / Dr.GRPO); DAPO (`--algo dapo`) first resamples until the batch holds
   `prompts_per_step` groups whose rewards differ (`dynamic_rollout`, bounded by `--dapo-max-resample-batches`);
5. `Learner.update` on the actor mesh with routing replay and the off-policy correction;
6. weight push actor -> rollout (bf16 -> device_put -> FP8), a new weight version;
7. metrics (JSONL, TensorBoard, progress bar); eval every `eval_every`; checkpoint every `ckpt_every`.
Resume (`resume="auto"`) restores the newest usable checkpoint and continues bitwise-identically on CPU:
randomness is a function of (seed, step, prompt, sample). SIGTERM finishes the current step, saves, exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import signal
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.config import LearnerConfig, RunConfig

log = logging.getLogger("dsv4rl")


@dataclasses.dataclass
class Job:
    """Everything `run` needs, built once by `build`."""

    cfg: RunConfig
    model_cfg: Any
    plan: Any
    tokenizer: Any
    task: Any
    train_data: Any
    eval_prompts: list
    eval_refs: list
    reward: Any
    learner: Any
    sampler: Any
    pusher: Any
    iterator: Any
    ckpt: Any
    logger: Any
    start_step: int = 0
    weight_version: int = 0
    data_identity: dict = dataclasses.field(default_factory=dict)
    data_metrics: dict = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ build

def resolve_model_config(cfg: RunConfig, tokenizer_vocab: int):
    """The DSV4Config of `--config` (preset or config.json). With `--init random` and a tokenizer smaller
    than the preset's vocabulary, the vocabulary is shrunk to the tokenizer's (no untrainable dead logits)."""
    from dsv4 import DSV4Config

    if cfg.init != "random" and cfg.config in ("tiny", "small", "flash"):
        mc = DSV4Config.from_hf(cfg.init)
    elif cfg.config in ("tiny", "small", "flash"):
        mc = DSV4Config.preset(cfg.config)
    else:
        mc = DSV4Config.from_hf(cfg.config)
    if cfg.init == "random" and tokenizer_vocab < mc.vocab_size:
        log.info("random init: vocab_size %d -> %d (the tokenizer's)", mc.vocab_size, tokenizer_vocab)
        mc = dataclasses.replace(mc, vocab_size=tokenizer_vocab)
    if tokenizer_vocab > mc.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is "
                         f"{mc.vocab_size} (--tokenizer / --config)")
    return mc


def _data(cfg: RunConfig):
    """(tokenizer, task or None, train PromptDataset, eval prompts [list[int]], eval references, reward, eval
    PromptDataset when it is a separate file else None)."""
    from rl.data import PromptDataset
    from rl.tasks import DigitTask

    if cfg.dataset is None and cfg.eval_dataset is None:
        task = DigitTask(kind=cfg.task, n_digits=cfg.task_digits, seed=cfg.seed)
        tok = task.tokenizer
        train = PromptDataset.from_task(task, "train")
        ev = task.prompts("eval", min(cfg.eval_prompts, len(task.prompts("eval"))))
        return tok, task, train, [p.prompt_ids for p in ev], [p.answer for p in ev], None, None
    from rl.data_formats import build_datasets, resolve_reward_name
    from rl.math_rewards import make_reward, prompt_independent_best
    from rl.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer, chat_template=cfg.chat_template)
    train, evd = build_datasets(cfg, tok)  # --data-format fields, chat template, overlong prompts
    n = min(cfg.eval_prompts, len(evd))
    name = resolve_reward_name(cfg)
    log.info("reward %s: the best prompt-independent response scores %.4f on %s", name,
             prompt_independent_best(name, train.references), train.source)
    return (tok, None, train, [evd.prompt(i) for i in range(n)], evd.references[:n], make_reward(name),
            evd if evd is not train else None)


def fingerprint(cfg: RunConfig, model_cfg) -> dict:
    """What must match between a checkpoint and the run restoring it."""
    keep = ("config", "init", "task", "task_digits", "dataset", "prompts_per_step", "group_size", "max_new_tokens",
            "algo", "seed", "routing_replay", "kl_coef", "lr")
    return {"model": json.dumps(model_cfg.to_dict(), sort_keys=True, default=str),
            **{k: getattr(cfg, k) for k in keep},
            **({"scan_layers": True} if cfg.scan_layers else {})}  # stacked state (absent: earlier fingerprints)


def build(cfg: RunConfig) -> Job:
    """Set up meshes, data, model, learner, sampler, push, checkpoints and metric sinks (errors before step 1)."""
    from dsv4 import DSV4ForCausalLM
    from dsv4.load import init_model, load_hf_checkpoint
    from rl.checkpoint import Checkpointer, check_writable, file_identity
    from rl.rollout_init import checkpoint_rollout_weights
    from rl.data import make_prompt_iterator
    from rl.learner import Learner
    from rl.sampler import Sampler
    from sharding.mesh import build_mesh_plan

    for path, flag in ((cfg.metrics_jsonl, "--metrics-jsonl"), (cfg.tensorboard_dir, "--tensorboard-dir")):
        if path:
            check_writable(pathlib.Path(path).parent if flag == "--metrics-jsonl" else path, flag)
    tok, task, train, ev_prompts, ev_refs, reward, ev_data = _data(cfg)
    model_cfg = resolve_model_config(cfg, tok.vocab_size)
    plan = build_mesh_plan(cfg.mesh, config=model_cfg)
    log.info("meshes: %s", plan.describe())
    ckpt = Checkpointer(cfg.ckpt_dir, keep=cfg.keep_checkpoints, fingerprint=fingerprint(cfg, model_cfg)) \
        if cfg.ckpt_dir else None
    data_identity = {"dataset": file_identity(cfg.dataset), "eval_dataset": file_identity(cfg.eval_dataset)}
    if ckpt is not None and cfg.resume == "auto":
        latest = ckpt.check_latest()  # a checkpoint of another config is an error now, not after the model is built
        if latest is not None:
            same_data(cfg, latest, data_identity)
    elif ckpt is not None and ckpt.all_steps():
        raise ValueError(f"--ckpt-dir {ckpt.dir} already holds checkpoints (steps {ckpt.all_steps()}); --resume never "
                         f"would collide with them: use another --ckpt-dir or --resume auto")
    param_dtype = cfg.param_dtype
    if param_dtype == "auto":  # bf16 params + fp32 masters on accelerators; fp32 on CPU (emulated bf16 matmuls)
        param_dtype = "float32" if plan.actor.devices.flat[0].platform == "cpu" else "bfloat16"
    # created in the actor's shardings (each process reads / computes only its shards), in the learner's param
    # dtype (the fp32 masters are made from these values by the optimizer: exact for a bf16 / FP8 checkpoint)
    load_dtype = jnp.bfloat16 if param_dtype == "bfloat16" else jnp.float32
    if cfg.init == "random":
        model = init_model(model_cfg, seed=cfg.seed, param_dtype=load_dtype, mesh=plan.actor)
    else:
        model = load_hf_checkpoint(cfg.init, dtype=load_dtype, config=model_cfg, mesh=plan.actor,
                                   progress=cfg.progress)
    lcfg = LearnerConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, loss=cfg.loss_config(),
                         routing_replay=cfg.routing_replay, freeze_router=cfg.freeze_router,
                         micro_batch_size=cfg.micro_batch_size, compute_dtype=cfg.compute_dtype,
                         temperature=cfg.temperature, b2=0.99, weight_decay=0.0,
                         max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                         logprob_chunk_size=cfg.logprob_chunk_size, param_dtype=param_dtype,
                         offload_optimizer=cfg.offload_optimizer, remat=cfg.remat,
                         scan_layers=cfg.scan_layers)
    learner = Learner(model, lcfg, mesh=plan.actor)
    max_prompt = max(train.max_prompt_len, max(len(p) for p in ev_prompts))
    rcd = cfg.rollout_compute_dtype
    if rcd == "auto":  # bf16 matmuls are emulated (slow) on CPUs; FP8 weights are then dequantised to fp32
        rcd = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
    # from a checkpoint, the rollout's first weights come from the file's own FP8 blocks, read on its mesh
    ckpt_init = cfg.init != "random"
    abstract = nnx.eval_shape(lambda: DSV4ForCausalLM(model.config, rngs=nnx.Rngs(0)))
    sampler = Sampler(abstract if ckpt_init else model, mesh=plan.rollout,
                      weights=cfg.rollout_dtype, max_prompt_len=max_prompt,
                      compute_dtype=None if cfg.rollout_dtype == "fp32" else rcd)
    if ckpt_init:
        sampler.set_weights(checkpoint_rollout_weights(sampler, cfg.init, config=model.config,
                                                       progress=cfg.progress), version=0)
    del model
    pusher = make_pusher(plan, learner, sampler)
    it = make_prompt_iterator(train, batch_size=cfg.prompts_per_step, seed=cfg.seed)
    job = Job(cfg=cfg, model_cfg=model_cfg, plan=plan, tokenizer=tok, task=task, train_data=train,
              eval_prompts=ev_prompts, eval_refs=ev_refs, reward=reward, learner=learner, sampler=sampler,
              pusher=pusher, iterator=it, ckpt=ckpt, logger=MetricsLogger(cfg), data_identity=data_identity,
              data_metrics=data_metrics(train, *([ev_data] if ev_data is not None else [])))
    if ckpt is not None and cfg.resume == "auto":
        restored = ckpt.restore(learner.state_dict())
        if restored is not None:
            state, meta = restored
            learner.load_state_dict(state)
            if same_data(cfg, meta, data_identity):
                it.set_state(meta["data"])
            job.start_step = int(meta["step"])
            job.weight_version = int(meta["weight_version"])
            log.info("resumed from %s at step %d (weight version %d)", ckpt.dir, job.start_step, job.weight_version)
    # A run that checkpoints owns its logs: records of steps >= start_step (written after the checkpoint it
    # resumes from, or by a run killed before its first checkpoint) are dropped, since this run recomputes them.
    job.logger.open(job.start_step if ckpt is not None and cfg.resume == "auto" and not cfg.eval_only else None)
    if job.weight_version > 0:  # resumed: the sampler serves the restored params (a fresh run's sampler
        push(job)                # already holds version 0, built from the same model)
    return job


def data_metrics(*datasets) -> dict:
    """Records the run's datasets dropped at load time, summed over them (logged with every step):
    data/skipped_records: malformed records skipped (--on-bad-record skip); data/dropped_overlong: prompts
    longer than --max-prompt-len that were dropped."""
    overlong = sum(getattr(d, "dropped_overlong", 0) for d in datasets)
    skipped = sum(getattr(d, "skipped", 0) for d in datasets) - overlong  # `skipped` counts every cause
    return {"data/skipped_records": float(skipped), "data/dropped_overlong": float(overlong)}


def same_data(cfg: RunConfig, meta: dict, identity: dict) -> bool:
    """Compare the datasets' identity recorded in a checkpoint's meta with this run's (`file_identity`).

    Returns True when they match (or the checkpoint predates the record): resume the data order. A changed
    file under the same path would silently repeat some prompts and skip others, so it raises ValueError naming
    the flag, unless `cfg.allow_dataset_change`: then False (a warning is logged) and the caller restarts the
    data order from the beginning while keeping the learner state.
    """
    saved = meta.get("data_identity")
    if not saved:
        return True
    changed = [k for k in ("dataset", "eval_dataset") if saved.get(k) != identity.get(k)]
    if not changed:
        return True
    what = "; ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)}: checkpoint {saved.get(k)} vs now {identity.get(k)}"
                     for k in changed)
    if not cfg.allow_dataset_change:
        raise ValueError(f"the dataset changed since checkpoint step {meta.get('step')} ({what}); resuming would "
                         "repeat some prompts and skip others: restore the file, use another --ckpt-dir, or pass "
                         "--allow-dataset-change to keep the learner state and restart the data order")
    log.warning("dataset changed since the checkpoint (%s); --allow-dataset-change: the data order restarts", what)
    return False


def make_pusher(plan, learner, sampler):
    """The actor -> rollout weight push (parallel/push.py): compiled and warmed up here; verification of the
    pushed FP8 weights is sampled (every 10th push) in production runs."""
    from parallel.push import WeightPusher

    return WeightPusher(plan, sampler, learner.params_for_push(), verify_every=10)


def push(job: Job) -> dict:
    """Push the learner's current params to the sampler as version `job.weight_version`."""
    t0 = time.perf_counter()
    params = job.learner.params_for_push()
    nbytes = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(params))  # bf16 on the wire
    if job.pusher is not None:
        from parallel.push import push_weights

        stats = push_weights(job.pusher, params, job.sampler, job.weight_version)
        nbytes = stats.bytes
    else:
        job.sampler.update_weights(params, job.weight_version)
        jax.block_until_ready(jax.tree.leaves(job.sampler.weight_state()))
    dt = time.perf_counter() - t0
    return {"perf/weight_push_s": dt, "perf/weight_push_gbps": nbytes / dt / 1e9}


# ------------------------------------------------------------------------------------------------ stages

def score(job: Job, rb, refs: list[str]) -> tuple[np.ndarray, np.ndarray, dict]:
    """Rewards [N] and exactness [N] of a rollout batch against per-row references."""
    responses = rb.response_lists()
    if job.task is not None:
        r = job.task.rewards(refs, responses)
        exact = np.array([job.task.exact(a, x) for a, x in zip(refs, responses)])
        return r.astype(np.float32), exact, {}
    from rl.rewards import compute_rewards

    eos = job.tokenizer.eos_id
    texts = [job.tokenizer.decode([t for t in x if t != eos]) for x in responses]
    r, m = compute_rewards(job.reward, texts, refs, timeout_s=5.0)
    return r, r >= 0.999, m


def rollout(job: Job, prompts: list[list[int]], refs: list[str], step: int, round_index: int = 0):
    """Sample `group_size` responses per prompt -> (RolloutBatch, rewards [N], metrics).

    `round_index` (DAPO resampling rounds within one step) offsets the prompt index of the sampler's randomness
    by round_index x len(prompts), so every round of a step draws fresh, reproducible samples."""
    from rl.sampler import SamplingParams

    g = job.cfg.group_size
    off = round_index * len(prompts)
    rows = [p for p in prompts for _ in range(g)]
    row_refs = [r for r in refs for _ in range(g)]
    sp = SamplingParams(temperature=job.cfg.temperature, top_p=job.cfg.top_p, top_k=job.cfg.top_k,
                        max_new_tokens=job.cfg.max_new_tokens, stop_token_ids=(job.tokenizer.eos_id,))
    t0 = time.perf_counter()
    rb = job.sampler.generate(rows, sp, seed=job.cfg.seed, step=step,
                              prompt_index=[off + i for i in range(len(prompts)) for _ in range(g)],
                              sample_index=[j for _ in prompts for j in range(g)])
    dt = time.perf_counter() - t0
    rewards, _, rm = score(job, rb, row_refs)
    n_tok = int(rb.lengths.sum())
    return rb, rewards, {**rm, "perf/rollout_s": dt, "perf/rollout_tok_per_s": n_tok / dt}


def train_batch(rb, advantages: np.ndarray, replay: bool):
    from rl.learner import TrainBatch

    ids, mask, resp, rlp = rb.sequences()  # host numpy: the learner places them on the actor mesh
    return TrainBatch(input_ids=ids, attention_mask=mask, response_mask=resp, rollout_logprobs=rlp.astype(np.float32),
                      advantages=np.asarray(advantages, np.float32), routing=rb.routing if replay else None)


def evaluate(job: Job, step: int) -> dict:
    """pass@1 (greedy and sampled, unbiased) and pass@k (k = eval_samples) on the held-out prompts."""
    from rl.metrics import pass_at_k
    from rl.sampler import SamplingParams

    cfg = job.cfg
    eos = (job.tokenizer.eos_id,)
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
    if jax.process_count() == 1:
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
    of the first round (the on-policy sample of the data, comparable with the other algorithms). The batch always has N rows,
    so the learner never recompiles: kept groups first, then (when the budget ran out with fewer kept groups)
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
    """One GRPO step (stages 1-6); returns its metrics."""
    from rl.advantages import compute_advantages
    from rl.metrics import response_stats, reward_stats, to_python

    cfg = job.cfg
    t_step = time.perf_counter()
    batch = global_batch(job, next(job.iterator))
    train_rows = None
    if cfg.algo == "dapo":
        rb, rewards, train_rows, metrics = dynamic_rollout(job, step, batch)
        if rb is None:  # nothing to learn from: no update, no push, same weight version
            metrics["weight_version"] = job.weight_version
            metrics["perf/step_s"] = time.perf_counter() - t_step
            return metrics
    else:
        rb, rewards, metrics = rollout(job, _prompt_lists(batch), batch["reference"], step)
        metrics.update(to_python(reward_stats(jnp.asarray(rewards), cfg.group_size)))
    metrics.update(to_python(response_stats(jnp.asarray(rb.lengths), cfg.max_new_tokens, rb.finish_reasons)))
    adv, am = compute_advantages(jnp.asarray(rewards), cfg.group_size, cfg.advantage_config())
    metrics.update(to_python(am))
    if train_rows is not None:  # DAPO filler groups: out of the loss (tokens, normalisers, metrics)
        adv = jnp.where(jnp.asarray(train_rows), adv, 0.0)
    metrics.update(job.data_metrics)
    metrics.update(learn_and_push(job, rb, np.asarray(adv), train_rows))
    metrics["weight_version"] = job.weight_version
    metrics["perf/step_s"] = time.perf_counter() - t_step
    return metrics


def learn_and_push(job: Job, rb, adv: np.ndarray, train_rows: np.ndarray | None = None) -> dict:
    """Stages 5-6: one learner update on the rollout batch, then push the new weights as the next version.

    A step without learning signal (every advantage exactly 0: all groups zero-std or filtered by DAPO's
    dynamic sampling) changes nothing: no optimizer update (Adam's momentum would still move the params, and
    the KL/entropy terms alone are not a reason to step), no push, the weight version stays;
    `train/skipped_no_signal` is 1. Likewise a non-finite step (`train/skipped_nonfinite`, the learner's guard)
    is not pushed. `train_rows` [N] bool (DAPO fillers = False) takes rows out of the loss: their response
    tokens are masked, so they count in no normaliser. Returns the step's train/perf metrics.
    """
    from rl.metrics import to_python

    if not np.any(np.asarray(adv) != 0):
        log.info("no learning signal in this batch (all advantages 0): update and push skipped")
        return {"train/skipped_no_signal": 1.0}
    tb = train_batch(rb, adv, job.cfg.routing_replay)
    if train_rows is not None:
        tb.response_mask[~np.asarray(train_rows)] = 0
    t0 = time.perf_counter()
    tm = to_python(job.learner.update(tb))
    metrics = {**tm, "train/skipped_no_signal": 0.0, "perf/train_s": time.perf_counter() - t0}
    if not tm.get("train/skipped_nonfinite", 0):
        job.weight_version += 1
        metrics.update(push(job))
    return metrics


# ------------------------------------------------------------------------------------------------ run

class MetricsLogger:
    """JSONL (one line per step, flushed) + TensorBoard (tensorboardX) sinks."""

    def __init__(self, cfg: RunConfig):
        primary = jax.process_index() == 0  # one writer in multi-host runs
        self.jsonl = pathlib.Path(cfg.metrics_jsonl) if cfg.metrics_jsonl and primary else None
        self.tb_dir = cfg.tensorboard_dir if primary else None
        self.tb = None
        self.cfg, self.wandb = cfg, None
        self.wandb_project = cfg.wandb_project if primary else None

    def open(self, first_step: int | None) -> None:
        """Open the sinks. `first_step` (not None): drop the records of steps >= first_step, which this run writes
        again: JSONL rewritten atomically, TensorBoard told to purge them (`purge_step`)."""
        if first_step is not None:
            self.truncate(first_step)
        if self.tb_dir:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(self.tb_dir, purge_step=first_step)
        if self.wandb_project:
            from rl.wandb_sink import WandbSink

            self.wandb = WandbSink(self.wandb_project, dataclasses.asdict(self.cfg),
                                   run_dir=self.jsonl.parent if self.jsonl else None)

    def truncate(self, last_step: int) -> None:
        """Keep only the records of steps < last_step (a resumed run recomputes the rest); atomic rewrite.
        A line cut short by a kill mid-write is dropped too."""
        if not self.jsonl or not self.jsonl.exists():
            return
        keep = []
        for ln in self.jsonl.read_text().splitlines():
            try:
                if json.loads(ln)["step"] < last_step:
                    keep.append(ln)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        fd, tmp = tempfile.mkstemp(dir=self.jsonl.parent, prefix=".metrics.")
        with os.fdopen(fd, "w") as f:
            f.write("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.jsonl)

    def log(self, step: int, metrics: dict) -> None:
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    # TensorBoard tags allow [\w./-]: "eval/pass@k" is logged as "eval/pass_k" (the jsonl keeps it)
                    self.tb.add_scalar(re.sub(r"[^\w./-]", "_", k), v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


def save(job: Job, step: int, *, force: bool = False) -> None:
    if job.ckpt is None:
        return
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
    bar = _progress(cfg, job.start_step)
    try:
        if cfg.eval_before_train and job.start_step == 0:  # veRL's val_before_train
            ev = evaluate(job, 0)
            log.info("eval before training:\n%s", eval_table(ev, job))
            job.logger.log(0, {**ev, "eval/before_train": 1.0})
        for step in range(job.start_step, cfg.steps):
            metrics = train_step(job, step)
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                metrics.update(evaluate(job, step))
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
        if bar is not None:
            bar.close()
        if job.ckpt is not None:
            job.ckpt.wait()
        job.logger.close()
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


def _progress(cfg: RunConfig, start: int):
    if not cfg.progress or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="grpo", unit="step", dynamic_ncols=True)
