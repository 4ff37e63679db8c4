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

Not supported yet in MPMD (a one-line error at start-up): checkpoints (`--ckpt-dir`: orbax would need the rollout
processes in its barriers) and `--init` from a checkpoint (the rollout reads the file's FP8 blocks on its mesh).
Tests: `.venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_run.py`.
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
    if cfg.ckpt_dir:
        raise ValueError(f"--ckpt-dir with the rollout on its own processes (--mesh {cfg.mesh}, processes "
                         f"{list(layout.rollout_processes)}) is not supported yet: pass --ckpt-dir ''")
    if cfg.staleness() > 0:
        raise ValueError(f"--max-staleness {cfg.staleness()} (--async-rollout) with the rollout on its own processes "
                         f"(--mesh {cfg.mesh}) is not supported yet: the asynchronous loop runs both roles in one "
                         "process; drop the flag or use a single-process mesh")
    if cfg.init != "random":
        raise ValueError(f"--init {cfg.init} with the rollout on its own processes (--mesh {cfg.mesh}) is not "
                         "supported yet: the rollout cannot read the checkpoint's FP8 blocks; use --init random")


def build_mpmd(cfg, model_cfg, plan, layout, tok, task, train, ev_prompts, ev_refs, reward, ev_data, param_dtype,
               data_identity):
    """`rl.loop.build` for an MPMD layout: the learner on actor processes only, the sampler's weights on rollout
    processes only (every process builds the sampler object from the abstract model for its shardings), the push
    planned on every process, and version 0 pushed from the actor."""
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
    load_dtype = jnp.bfloat16 if param_dtype == "bfloat16" else jnp.float32
    learner = None
    if layout.is_actor:
        from rl.learner import Learner

        model = init_model(model_cfg, seed=cfg.seed, param_dtype=load_dtype, mesh=plan.actor)
        lcfg = dataclasses.replace(cfg.learner, param_dtype=param_dtype)  # the run's learner, "auto" resolved
        learner = Learner(model, lcfg, mesh=plan.actor)
        del model
    max_prompt = max(train.max_prompt_len, max(len(p) for p in ev_prompts))
    rcd = cfg.rollout_compute_dtype
    if rcd == "auto":
        rcd = "float32" if plan.rollout.devices.flat[0].platform == "cpu" else "bfloat16"
    abstract = nnx.eval_shape(lambda: DSV4ForCausalLM(model_cfg, rngs=nnx.Rngs(0), param_dtype=load_dtype))
    sampler = Sampler(abstract, mesh=plan.rollout, weights=cfg.rollout_dtype, max_prompt_len=max_prompt,
                      compute_dtype=None if cfg.rollout_dtype == "fp32" else rcd,
                      prefill_chunk=cfg.rollout.prefill_chunk)
    state = nnx.state(abstract)
    pusher = MpmdPusher(plan, layout, sampler, state, plan.param_shardings(ACTOR, state), channel)
    it = make_prompt_iterator(train, batch_size=cfg.prompts_per_step, seed=cfg.seed, shard_index=0, shard_count=1)
    job = Job(cfg=cfg, model_cfg=model_cfg, plan=plan, tokenizer=tok, task=task, train_data=train,
              eval_prompts=ev_prompts, eval_refs=ev_refs, reward=reward, learner=learner, sampler=sampler,
              pusher=pusher, iterator=it, ckpt=None, logger=MetricsLogger(cfg), data_identity=data_identity,
              data_metrics=data_metrics(train, *([ev_data] if ev_data is not None else [])), layout=layout,
              channel=channel)
    log.info("MPMD: process %d runs the %s (actor processes %s, rollout processes %s)", layout.process, layout.role,
             list(layout.actor_processes), list(layout.rollout_processes))
    job.logger.open(None)
    _push_now(job, tag="init")  # version 0: the rollout holds no weights until the actor pushes them
    return job


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


