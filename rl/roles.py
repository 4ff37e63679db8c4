"""The GRPO loop with the rollout on its own processes (MPMD): what each role's processes do per step.

`rl/loop.py` hands over here when `sharding.mpmd.role_layout(plan).mpmd` (a disjoint rollout mesh whose devices are
whole processes, e.g. `--mesh actor:fsdp=2,expert=2/rollout:expert=2` on 3 processes x 2 devices: processes 0-1 are
the actor, process 2 the rollout). Every process reads the same, unsharded prompt stream (`prompts_per_step` is the
global batch, as on one process), so the data order and the step-1 batch equal the single-process run's.

Per step:
  rollout processes: next prompts -> `Sampler.generate` -> rewards (and DAPO's resampling) -> publish the packet
    (RolloutBatch: tokens, logprobs, routing, lengths; rewards; train rows; the rollout metrics; the iterator
    state) -> wait for the actor's push decision -> receive the push (`sharding.mpmd.MpmdPusher`).
  actor processes: next prompts (kept in step) -> receive the packet -> advantages -> `Learner.update` -> publish the
    push decision -> push. The first actor process (process 0) is the only metrics writer; the rollout's metrics
    arrive in the packet.
No process runs the other role's programs (`Job.counters`, logged at the end of `run`). A wait fails once the other
side's heartbeat has stopped for `--push-timeout` s, naming that side (`sharding.mpmd.PeerTimeoutError`); launch/run.py
then exits with status 1 at once (jax's shutdown barrier would wait for the dead process).

Checkpoints (`--ckpt-dir`): the actor processes save and restore the learner state with orbax, its barriers among
the actor processes only (`rl.checkpoint.Checkpointer(processes=...)`); the rollout processes hold no checkpointed
state: on resume the actor's first process sends them the restored step, weight version and data-iterator state
(`_resume_point`) and the weights arrive by the start-up push; per-sample randomness is a function of (seed, step,
prompt, sample), so nothing else is needed for the resumed run to equal the uninterrupted one.
`--init` from a checkpoint: the actor processes load their shards (`dsv4.load.load_hf_checkpoint` on the actor
mesh), the rollout processes read the file's own FP8 blocks for version 0 (`rl.rollout_init.
checkpoint_rollout_weights`, as the colocated path does); a resumed run's weights come by the push instead.
`--max-staleness K >= 1` (`--async-rollout`): the same roles, pipelined one step off (rl/async_mpmd.py).
Not supported yet in MPMD (a one-line error at start-up): checkpoints together with --max-staleness.
Tests: `.venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_run.py tests/launch/test_mpmd_resume.py
tests/launch/test_mpmd_async.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
from flax import nnx

from sharding.rules import ACTOR, ROLLOUT

log = logging.getLogger("dsv4rl")


def check_mpmd_config(cfg, layout) -> None:
    """Raise ValueError naming the flag for settings an MPMD run does not support yet."""
    if cfg.ckpt_dir and cfg.staleness() > 0:
        raise ValueError(f"--ckpt-dir with --max-staleness {cfg.staleness()} and the rollout on its own processes "
                         f"(--mesh {cfg.mesh}, processes {list(layout.rollout_processes)}) is not supported yet: "
                         "pass --ckpt-dir '' or drop --max-staleness")


def build_mpmd(cfg, model_cfg, plan, layout, tok, task, train, ev_prompts, ev_refs, reward, ev_data, param_dtype,
               data_identity, ckpt=None):
    """`rl.loop.build` for an MPMD layout: the learner on actor processes only (from --init or random, then the
    newest checkpoint of `ckpt` with --resume auto), the sampler's weights on rollout processes only (every process
    builds the sampler object from the abstract model for its shardings), the push planned on every process; the
    resume point sent to the rollout, then the weights: version 0 read from --init's file on the rollout, else the
    actor's params pushed (version 0 of a random init, or the restored version)."""
    import jax.numpy as jnp

    from dsv4 import DSV4ForCausalLM
    from dsv4.load import init_model
    from rl.data import make_prompt_iterator
    from rl.job import Job, data_metrics
    from rl.sinks import MetricsLogger
    from rl.sampler import Sampler
    from parallel.mpmd_push import MpmdPusher
    from sharding.mpmd import HostChannel

    channel = HostChannel(layout, timeout_s=cfg.push_timeout)  # heartbeats from now on: builds and compiles are long
    file_cfg = model_cfg
    if cfg.init != "random":  # the loaded model's shapes (a transformers checkpoint has no MTP block)
        from dsv4.load import loaded_config

        model_cfg = loaded_config(cfg.init, model_cfg)
    load_dtype = jnp.bfloat16 if param_dtype == "bfloat16" else jnp.float32
    learner = None
    if layout.is_actor:
        from rl.learner import Learner

        if cfg.init == "random":
            model = init_model(model_cfg, seed=cfg.seed, param_dtype=load_dtype, mesh=plan.actor)
        else:
            from dsv4.load import load_hf_checkpoint

            model = load_hf_checkpoint(cfg.init, dtype=load_dtype, config=file_cfg, mesh=plan.actor,
                                       progress=cfg.progress)
        lcfg = dataclasses.replace(cfg.learner, param_dtype=param_dtype)  # the run's learner, "auto" resolved
        learner = Learner(model, lcfg, mesh=plan.actor)
        del model
    max_prompt = max(train.max_prompt_len, max(len(p) for p in ev_prompts))
    rcd = cfg.rollout_compute_dtype
    if rcd == "auto":
        rcd = "float32" if plan.rollout.devices.flat[0].platform == "cpu" else "bfloat16"
    abstract = nnx.eval_shape(lambda: DSV4ForCausalLM(model_cfg, rngs=nnx.Rngs(0), param_dtype=load_dtype))
    sampler = Sampler(abstract, mesh=plan.rollout, weights=cfg.rollout_dtype, max_prompt_len=max_prompt,
                      compute_dtype=None if cfg.rollout_dtype == "fp32" else rcd, kv_cache_dtype=cfg.kv_cache_dtype,
                      prefill_chunk=cfg.rollout.prefill_chunk)
    state = nnx.state(abstract)
    pusher = MpmdPusher(plan, layout, sampler, state, plan.param_shardings(ACTOR, state), channel,
                        verify_every=cfg.rollout.push_verify_every)
    it = make_prompt_iterator(train, batch_size=cfg.prompts_per_step, seed=cfg.seed, shard_index=0, shard_count=1)
    job = Job(cfg=cfg, model_cfg=file_cfg, plan=plan, tokenizer=tok, task=task, train_data=train,
              eval_prompts=ev_prompts, eval_refs=ev_refs, reward=reward, learner=learner, sampler=sampler,
              pusher=pusher, iterator=it, ckpt=ckpt, logger=MetricsLogger(cfg), data_identity=data_identity,
              data_metrics=data_metrics(train, *([ev_data] if ev_data is not None else [])), layout=layout,
              channel=channel)
    log.info("MPMD: process %d runs the %s (actor processes %s, rollout processes %s)", layout.process, layout.role,
             list(layout.actor_processes), list(layout.rollout_processes))
    _resume_point(job)
    # a run that checkpoints owns its logs (as rl.job.build): records of steps >= start_step are dropped
    job.logger.open(job.start_step if cfg.ckpt_dir and cfg.resume == "auto" and not cfg.eval_only else None)
    if cfg.init != "random" and job.weight_version == 0:  # version 0 from the file's own FP8 blocks
        if layout.is_rollout:
            from rl.rollout_init import checkpoint_rollout_weights

            sampler.set_weights(checkpoint_rollout_weights(sampler, cfg.init, config=model_cfg,
                                                           progress=cfg.progress), version=0)
            log.info("MPMD: rollout weights version 0 read from %s (its own FP8 blocks)", cfg.init)
    else:  # the rollout holds no weights until the actor pushes them (version 0, or the restored version)
        _push_now(job, tag="init")
    return job


def _resume_point(job) -> None:
    """--resume auto with a checkpoint: the actor processes restore the learner state (orbax among themselves) and
    the first of them sends the rollout processes what their state is derived from: the step to start at, the
    weight version and the data iterator's state. Without a checkpoint every process starts at step 0."""
    from rl.job import same_data

    lay, cfg = job.layout, job.cfg
    if lay.is_actor:
        point = {"step": 0, "weight_version": 0, "data": None}
        if job.ckpt is not None and cfg.resume == "auto":
            restored = job.ckpt.restore(job.learner.state_dict())
            if restored is not None:
                state, meta = restored
                job.learner.load_state_dict(state)
                point = {"step": int(meta["step"]), "weight_version": int(meta["weight_version"]),
                         "data": meta["data"] if same_data(cfg, meta, job.data_identity) else None}
                log.info("resumed from %s at step %d (weight version %d)", job.ckpt.dir, point["step"],
                         point["weight_version"])
        if lay.process == lay.writer:
            job.channel.publish("resume", point)
    else:
        point = job.channel.receive("resume", ACTOR, "the actor's resume point (step, weight version, data state)")
    if point["data"] is not None:
        job.iterator.set_state(point["data"])
    job.start_step, job.weight_version = point["step"], point["weight_version"]


def _push_now(job, tag) -> dict:
    """Actor: publish the decision, then push. Rollout: the decision arrives first (so the receive does not time out
    while the actor trains), then the push."""
    lay = job.layout
    if lay.is_actor:
        if lay.process == lay.writer:
            job.channel.publish(f"push/{tag}", {"push": True, "version": job.weight_version})
        return job.pusher.push(job.learner.params_for_push(), job.weight_version)
    decision = job.channel.receive(f"push/{tag}", ACTOR, f"the weight push decision ({tag})")
    if not decision["push"]:
        return {}
    job.weight_version = int(decision["version"])
    return job.pusher.push(None, job.weight_version)


def push_mpmd(job) -> dict:
    """`rl.loop.push` on an actor process of an MPMD run (the decision tag is the current step)."""
    return _push_now(job, tag=job.mpmd_step)


def train_step_mpmd(job, step: int) -> dict:
    """One GRPO step of an MPMD run on this process's role (module docstring). Returns the step's metrics (the
    rollout's on rollout processes; the full set on actor processes)."""
    from rl.loop import learn_step, sample_step

    lay, ch = job.layout, job.channel
    t_step = time.perf_counter()
    job.mpmd_step = step
    if lay.is_rollout:
        rb, rewards, train_rows, metrics = sample_step(job, step)
        metrics["mpmd/rollout_generate_calls"] = float(job.counters["generate"])  # this role's programs, counted
        metrics["mpmd/rollout_train_steps"] = float(job.counters["train_steps"])
        if lay.process == min(lay.rollout_processes):
            ch.publish(f"rollout/{step}", {"rb": rb, "rewards": rewards, "train_rows": train_rows,
                                           "metrics": metrics, "iterator": job.iterator.get_state()})
        metrics = dict(metrics)
        metrics.update(_push_now(job, tag=step))
        metrics["weight_version"] = job.weight_version
        return metrics
    next(job.iterator)  # keep the data order in step with the rollout's (DAPO rounds come with the packet)
    t0 = time.perf_counter()
    packet = ch.receive(f"rollout/{step}", ROLLOUT, f"the rollout results of step {step} did not arrive")
    job.iterator.set_state(packet["iterator"])
    metrics = {**packet["metrics"], "perf/rollout_wait_s": time.perf_counter() - t0}
    if packet["rb"] is None:  # DAPO skipped the step
        if lay.process == lay.writer:
            ch.publish(f"push/{step}", {"push": False, "version": job.weight_version})
        metrics["weight_version"] = job.weight_version
        metrics["perf/step_s"] = time.perf_counter() - t_step
        return metrics
    version = job.weight_version
    metrics = learn_step(job, packet["rb"], np.asarray(packet["rewards"]), packet["train_rows"], metrics, t_step)
    if job.weight_version == version and lay.process == lay.writer:  # no signal / non-finite: nothing pushed
        ch.publish(f"push/{step}", {"push": False, "version": job.weight_version})
    return metrics


def evaluate_mpmd(job, step: int) -> dict:
    """Evaluation of an MPMD run: the rollout processes sample and score, the actor processes receive the metrics."""
    from rl.loop import evaluate

    lay = job.layout
    tag = f"eval/{step}/{job.weight_version}"
    if lay.is_rollout:
        ev = evaluate(job, step, here=True)
        if lay.process == min(lay.rollout_processes):
            job.channel.publish(tag, ev)
        return ev
    return job.channel.receive(tag, ROLLOUT, f"the evaluation at step {step} did not arrive")


