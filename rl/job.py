"""The job wiring of a GRPO run: everything `rl.loop.run` needs, built once before step 1.

    job = build(RunConfig(...))   # meshes, data, model, learner (actor mesh), sampler (rollout mesh), push,
                                  # checkpoints, metric sinks; every input error is raised here, before step 1

`Job` is the typed bundle; `push` is the actor -> rollout weight push of the job's current params.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.config import RunConfig
from rl.sinks import MetricsLogger

if TYPE_CHECKING:  # annotations only: importing these modules here would start nothing, but keeps this light
    import grain

    from dsv4 import DSV4Config
    from rl.async_loop import AsyncRollout
    from rl.checkpoint import Checkpointer
    from rl.data import PromptDataset
    from rl.learner import Learner
    from rl.rewards import RewardFn
    from rl.sampler import Sampler
    from rl.tasks import DigitTask
    from rl.tokenizer import TokenizerLike
    from sharding.mesh import MeshPlan
    from sharding.mpmd import HostChannel, RoleLayout
    from parallel.push import WeightPusher

log = logging.getLogger("dsv4rl")


@dataclasses.dataclass
class Job:
    """Everything `rl.loop.run` needs, built once by `build` (tests build partial jobs: fields a stage does not
    use may be None).

    cfg: the resolved run config. model_cfg: the model's DSV4Config. plan: the actor / rollout meshes.
    tokenizer: the prompt/response tokenizer (`eos_id`, `decode`). task: the built-in task (None with
    --dataset). train_data: the training prompts. eval_prompts / eval_refs: held-out prompt ids and their
    references. reward: the run's one `rl.rewards.RewardFn` (the built-in task's or --reward's). learner /
    sampler / pusher: the actor, the rollout engine and the push between them (None: `Sampler.update_weights`).
    iterator: the checkpointable prompt-batch iterator. ckpt: checkpoints (None: --ckpt-dir ''). logger: the
    metric sinks. start_step / weight_version: where the run starts (0, or the restored checkpoint's).
    data_identity: the dataset files' identity (checked on resume). data_metrics: load-time data counters.
    inflight: the asynchronous rollout (rl/async_loop.py) while `rl.loop.run` runs with --max-staleness K >= 1.
    layout / channel / mpmd_step: the process roles and, when the rollout has processes of its own (MPMD), the
    channel between them (rl/roles.py). counters: generate calls and train steps run by this process.
    """

    cfg: RunConfig
    model_cfg: DSV4Config | None
    plan: MeshPlan | None
    tokenizer: TokenizerLike | None
    task: DigitTask | None
    train_data: PromptDataset | None
    eval_prompts: list[list[int]]
    eval_refs: list[str]
    reward: RewardFn | None
    learner: Learner
    sampler: Sampler
    pusher: WeightPusher | None
    iterator: grain.DatasetIterator | None
    ckpt: Checkpointer | None
    logger: MetricsLogger | None
    start_step: int = 0
    weight_version: int = 0
    data_identity: dict = dataclasses.field(default_factory=dict)
    data_metrics: dict = dataclasses.field(default_factory=dict)
    inflight: AsyncRollout | None = None  # --max-staleness K >= 1: batches generated ahead (checkpointed with it)
    layout: RoleLayout | None = None  # which processes run the actor / the rollout (sharding/mpmd.py)
    channel: HostChannel | None = None  # MPMD runs only: the host messages between the roles
    counters: dict = dataclasses.field(default_factory=lambda: {"generate": 0, "train_steps": 0})
    mpmd_step: int | None = None  # the step an MPMD push belongs to (rl/roles.py)


def _rollout_slots(cfg: RunConfig, model_cfg, plan, max_prompt: int) -> tuple[int, float | None]:
    """--rollout-slots -> (slots for the Sampler, KV budget per rollout device from the memory plan or None).
    0 stays static batching; N is checked against the plan here, before any model is built (rl/slots.py)."""
    if cfg.rollout_slots == 0:
        return 0, None
    from rl import slots as sl

    rcd = cfg.rollout_compute_dtype  # the cache dtype is the sampler's compute dtype (as build() resolves it)
    if cfg.rollout_dtype == "fp32" or (rcd == "auto" and jax.devices()[0].platform == "cpu"):
        rcd = "float32"
    dtype = "bfloat16" if rcd == "auto" else rcd

    seq = sl.cache_len_for(model_cfg, max_prompt, cfg.max_new_tokens)  # as Sampler.generate sizes it
    budget, note = sl.kv_budget_from_plan(model_cfg, str(plan.spec), seq, rollout_dtype=cfg.rollout_dtype)
    from rl.rollout_weights import kv_cache_layout  # the sampler's cache layout (fn / fnuz: the same bytes)
    fp8 = "e4m3fn" if kv_cache_layout(cfg.kv_cache_dtype, cfg.rollout_dtype) == "fp8" else None
    shards, mesh = 1, getattr(plan, "rollout", None)  # the slots are split over the rollout batch axes
    if mesh is not None:
        from sharding.rules import ROLLOUT_RULES, batch_shards
        shards = batch_shards(ROLLOUT_RULES, mesh)
    n = sl.plan_slots(cfg.rollout_slots, per_slot_bytes=sl.cache_bytes_per_slot_for(model_cfg, seq, dtype, fp8),
                      budget_bytes=budget, seq_len=seq, shards=shards)
    rows = cfg.prompts_per_step * cfg.group_size
    n = min(n, rows) if cfg.rollout_slots == "auto" else n
    log.info("rollout: %s (--rollout-slots %s; %s)", f"continuous batching over {n} slots" if n else
             "static batching", cfg.rollout_slots, note)
    return n, budget


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
    """(tokenizer, task or None, train PromptDataset, eval prompts [list[int]], eval references, reward (the
    `rl.rewards.RewardFn` of the task or of --reward), eval PromptDataset when it is a separate file else None)."""
    from rl.data import PromptDataset
    from rl.tasks import DigitTask, TaskReward

    if cfg.dataset is None and cfg.eval_dataset is None:
        task = DigitTask(kind=cfg.task, n_digits=cfg.task_digits, seed=cfg.seed)
        tok = task.tokenizer
        train = PromptDataset.from_task(task, "train")
        ev = task.prompts("eval", min(cfg.eval_prompts, len(task.prompts("eval"))))
        return tok, task, train, [p.prompt_ids for p in ev], [p.answer for p in ev], TaskReward(task), None
    from rl.data_formats import build_datasets, resolve_reward_name
    from rl.math_rewards import make_reward, prompt_independent_best
    from rl.rewards import TextReward
    from rl.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer, chat_template=cfg.chat_template)
    train, evd = build_datasets(cfg, tok)  # --data-format fields, chat template, overlong prompts
    n = min(cfg.eval_prompts, len(evd))
    name = resolve_reward_name(cfg)
    log.info("reward %s: the best prompt-independent response scores %.4f on %s", name,
             prompt_independent_best(name, train.references), train.source)
    return (tok, None, train, [evd.prompt(i) for i in range(n)], evd.references[:n],
            TextReward(make_reward(name), tok, timeout_s=cfg.data.reward_timeout_s),
            evd if evd is not train else None)


def fingerprint(cfg: RunConfig, model_cfg) -> dict:
    """What must match between a checkpoint and the run restoring it."""
    keep = ("config", "init", "task", "task_digits", "dataset", "prompts_per_step", "group_size", "max_new_tokens",
            "algo", "seed", "routing_replay", "kl_coef", "lr")
    return {"model": json.dumps(model_cfg.to_dict(), sort_keys=True, default=str),
            **{k: getattr(cfg, k) for k in keep},
            **({"scan_layers": True} if cfg.scan_layers else {}),  # stacked state (absent: earlier fingerprints)
            **({"max_staleness": cfg.staleness()} if cfg.staleness() else {})}  # async schedule (rl/async_loop.py)


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
    from sharding.mpmd import role_layout

    for path, flag in ((cfg.metrics_jsonl, "--metrics-jsonl"), (cfg.tensorboard_dir, "--tensorboard-dir")):
        if path:
            check_writable(pathlib.Path(path).parent if flag == "--metrics-jsonl" else path, flag)
    write_resolved_config(cfg)
    tok, task, train, ev_prompts, ev_refs, reward, ev_data = _data(cfg)
    model_cfg = resolve_model_config(cfg, tok.vocab_size)
    plan = build_mesh_plan(cfg.mesh, config=model_cfg)
    log.info("meshes: %s", plan.describe())
    max_prompt = max(train.max_prompt_len, max(len(p) for p in ev_prompts))
    slots, kv_budget = _rollout_slots(cfg, model_cfg, plan, max_prompt)  # --rollout-slots checked before any model
    from dsv4.chunked import check_chunk
    check_chunk(model_cfg, cfg.rollout.prefill_chunk)  # --prefill-chunk: a multiple of the compression ratios
    layout = role_layout(plan)  # MPMD (whole processes per role) or both roles here; bad layouts fail now
    if layout.mpmd:
        from rl.roles import check_mpmd_config

        check_mpmd_config(cfg, layout)
    # MPMD: the actor processes save and restore the learner state; the rollout's is derived (rl/roles.py)
    ckpt = Checkpointer(cfg.ckpt_dir, keep=cfg.keep_checkpoints, fingerprint=fingerprint(cfg, model_cfg),
                        processes=layout.actor_processes if layout.mpmd else None) \
        if cfg.ckpt_dir and layout.is_actor else None
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
    if layout.mpmd:  # each process builds its role only (rl/roles.py)
        from rl.roles import build_mpmd

        return build_mpmd(cfg, model_cfg, plan, layout, tok, task, train, ev_prompts, ev_refs, reward, ev_data,
                          param_dtype, data_identity, ckpt=ckpt)
    if cfg.init == "random":
        model = init_model(model_cfg, seed=cfg.seed, param_dtype=load_dtype, mesh=plan.actor)
    else:
        model = load_hf_checkpoint(cfg.init, dtype=load_dtype, config=model_cfg, mesh=plan.actor,
                                   progress=cfg.progress)
    lcfg = dataclasses.replace(cfg.learner, param_dtype=param_dtype)  # the run's learner section, "auto" resolved
    learner = Learner(model, lcfg, mesh=plan.actor)
    rcd = cfg.rollout_compute_dtype
    if rcd == "auto":  # bf16 matmuls are emulated (slow) on CPUs; FP8 weights are then dequantised to fp32
        rcd = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
    # from a checkpoint, the rollout's first weights come from the file's own FP8 blocks, read on its mesh
    ckpt_init = cfg.init != "random"
    abstract = nnx.eval_shape(lambda: DSV4ForCausalLM(model.config, rngs=nnx.Rngs(0)))
    sampler = Sampler(abstract if ckpt_init else model, mesh=plan.rollout,
                      weights=cfg.rollout_dtype, max_prompt_len=max_prompt,
                      compute_dtype=None if cfg.rollout_dtype == "fp32" else rcd, slots=slots,
                      kv_budget_bytes=kv_budget, kv_cache_dtype=cfg.kv_cache_dtype,
                      prefill_chunk=cfg.rollout.prefill_chunk)
    if ckpt_init:
        sampler.set_weights(checkpoint_rollout_weights(sampler, cfg.init, config=model.config,
                                                       progress=cfg.progress), version=0)
    del model
    pusher = make_pusher(plan, learner, sampler, cfg.rollout.push_verify_every)
    it = make_prompt_iterator(train, batch_size=cfg.prompts_per_step, seed=cfg.seed)
    job = Job(cfg=cfg, model_cfg=model_cfg, plan=plan, tokenizer=tok, task=task, train_data=train,
              eval_prompts=ev_prompts, eval_refs=ev_refs, reward=reward, learner=learner, sampler=sampler,
              pusher=pusher, iterator=it, ckpt=ckpt, logger=MetricsLogger(cfg), data_identity=data_identity,
              data_metrics=data_metrics(train, *([ev_data] if ev_data is not None else [])), layout=layout)
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


def run_dir(cfg: RunConfig) -> pathlib.Path | None:
    """The run's directory: the folder of --metrics-jsonl, else the parent of --ckpt-dir, else None."""
    if cfg.log.metrics_jsonl:
        return pathlib.Path(cfg.log.metrics_jsonl).parent
    if cfg.ckpt.dir:
        return pathlib.Path(cfg.ckpt.dir).parent
    return None


def write_resolved_config(cfg: RunConfig) -> pathlib.Path | None:
    """Log the resolved config once and write it to `run_dir(cfg)/config.yaml` (process 0; temp file, then
    rename: never half-written). The file is the nested shape `launch/run.py --config-file` reads back to an
    equal RunConfig. Returns its path (None: no run directory, or not process 0)."""
    text = json.dumps(cfg.to_tree(), sort_keys=False, default=str)
    log.info("resolved config: %s", text)
    d = run_dir(cfg)
    if d is None or jax.process_index() != 0:
        return None
    import tempfile

    import yaml

    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".config.", suffix=".yaml")
    with open(fd, "w") as f:
        f.write("# the resolved config of this run (launch/run.py --config-file loads it back)\n")
        yaml.safe_dump(cfg.to_tree(), f, sort_keys=False)
    path = d / "config.yaml"
    pathlib.Path(tmp).replace(path)
    return path


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


def make_pusher(plan, learner, sampler, verify_every: int = 10):
    """The actor -> rollout weight push (parallel/push.py): compiled and warmed up here; verification of the
    pushed FP8 weights is sampled (every `verify_every`-th push: `--rollout.push_verify_every`)."""
    from parallel.push import WeightPusher

    return WeightPusher(plan, sampler, learner.params_for_push(), verify_every=verify_every)


def push(job: Job) -> dict:
    """Push the learner's current params to the sampler as version `job.weight_version`."""
    if job.layout is not None and job.layout.mpmd:
        from rl.roles import push_mpmd

        return push_mpmd(job)
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
