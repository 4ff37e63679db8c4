"""The wiring of a GRPO run (`RunWiring`): everything `rl.run.loop.run` needs, built once before step 1, for every
layout. ("Job" is kept for the two-job layout: the actor job and the rollout job, `build_rollout_job`.)

    wiring = build(RunConfig(...))  # meshes, data, model, learner (actor mesh), the rollout service (rollout mesh),
                                    # checkpoints, metric sinks; every input error is raised here, before step 1

Where the roles live is decided here, once (`sharding.mpmd.role_layout`): both roles in this process (one mesh,
two disjoint meshes, colocated) -> `wiring.rollout` is an `rl.rollout.service.LocalRollout`; the rollout on
processes of its own (MPMD) -> on actor processes `wiring.rollout` is an `rl.rollout.mpmd.ProcessRollout`, on
rollout processes `wiring.server` is the `rl.rollout.mpmd.RolloutServer` they run instead of the loop; the rollout
as a JAX job of its own (the two-job layout, --rollout-address / --rollout-job) -> `wiring.rollout` is an
`rl.rollout.two_job.JobRollout` on the actor job, and a rollout job (`build_rollout_job`) runs
`rl.rollout.two_job.RolloutJobServer` as `wiring.server`.
The learner, the Sampler (`rl.rollout.engine.Sampler` with the run's `EngineSettings`), the checkpoints and the
resume are built by the same code for every layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import tempfile
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

from dsv4 import DSV4Config, abstract_model
from dsv4.chunked import check_chunk
from dsv4.io.load import init_model, load_hf_checkpoint, loaded_config
from dsv4.lora import attach, is_adapter_key
from parallel.push.job import JobPusher
from parallel.push.local import WeightPusher
from parallel.model_bytes import kv_cache_bytes
from parallel.push.mpmd import MpmdPusher
from rl.rollout import slots as sl
from rl.run.checkpoint import Checkpointer, check_writable, file_identity
from rl.config.run import RunConfig
from rl.data.prompts import PromptDataset, make_prompt_iterator
from rl.data.formats import build_datasets, resolve_reward_name
from rl.run.env_task import load_env_data
from rl.run.eval_source import eval_checkpoint_dir, eval_reader
from rl.rollout.exact import ExactRollout, exact_layout
from rl.rollout.job_identity import job_identity
from rl.algo.learner import Learner
from rl.algo.learner_state import resolve_param_dtype
from rl.data.math_rewards import make_reward, prompt_independent_best
from rl.run.partial import requests_per_batch
from rl.run.pipeline import read_inflight
from rl.data.rewards import TextReward
from rl.rollout.two_job import JobRollout, RolloutJobServer
from rl.rollout.mpmd import ProcessRollout, RolloutServer
from rl.rollout.engine import Sampler
from rl.rollout.service import LocalRollout, RolloutService
from rl.rollout.settings import EngineSettings
from rl.run.sinks import MetricsLogger
from rl.data.tasks import DigitTask, TaskReward
from rl.data.tokenizer import load_tokenizer
from sharding.mesh import build_job_plan, build_mesh_plan
from sharding.mpmd import HostChannel, actor_job_layout, role_layout
from sharding.rules import ACTOR, ACTOR_RULES, ROLLOUT, ROLLOUT_RULES, batch_shards

if TYPE_CHECKING:  # annotations only
    import grain

    from rl.run.pipeline import Pipeline
    from rl.data.rewards import RewardFn
    from rl.data.tokenizer import TokenizerLike
    from sharding.mesh import MeshPlan
    from sharding.mpmd import RoleLayout

log = logging.getLogger("dsv4rl")


@dataclasses.dataclass
class RunWiring:
    """Everything `rl.run.loop.run` needs, built once by `build` (tests build partial wirings: fields a stage does not
    use may be None).

    cfg: the resolved run config. model_cfg: the model's DSV4Config. plan: the actor / rollout meshes.
    tokenizer: the prompt/response tokenizer (`eos_id`, `decode`). task: the built-in task (None with
    --dataset). train_data: the training prompts. eval_prompts / eval_refs: held-out prompt ids and their
    references. reward: the run's one `rl.data.rewards.RewardFn` (the built-in task's or --reward's). learner: the
    actor (None on MPMD rollout processes). rollout: the rollout service (rl/rollout/service.py; None on MPMD
    rollout processes). iterator: the checkpointable prompt-batch iterator. ckpt: checkpoints (None: --ckpt-dir
    ''). logger: the metric sinks. start_step / weight_version: where the run starts (0, or the restored
    checkpoint's). data_identity: the dataset files' identity (checked on resume). data_metrics: load-time data
    counters. inflight: the pipeline (rl/run/pipeline.py) while `rl.run.loop.run` runs. layout: the process roles.
    server: on an MPMD rollout process, the loop it runs instead (rl/rollout/mpmd.py). counters: train steps run
    by this process.
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
    learner: Learner | None
    rollout: RolloutService | None
    iterator: grain.DatasetIterator | None
    ckpt: Checkpointer | None
    logger: MetricsLogger | None
    start_step: int = 0
    weight_version: int = 0
    data_identity: dict = dataclasses.field(default_factory=dict)
    data_metrics: dict = dataclasses.field(default_factory=dict)
    inflight: Pipeline | None = None
    layout: RoleLayout | None = None
    server: RolloutServer | RolloutJobServer | None = None
    counters: dict = dataclasses.field(default_factory=lambda: {"train_steps": 0})


def _engine_settings(cfg: RunConfig, mesh, max_prompt: int, slots: int = 0,
                     kv_budget: float | None = None) -> EngineSettings:
    """The run's rollout engine settings (`EngineSettings.for_run` of `cfg.rollout` on the rollout mesh's
    platform; None: this process's default device)."""
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    return EngineSettings.for_run(cfg.rollout, platform=platform, max_prompt_len=max_prompt, slots=slots,
                                  kv_budget_bytes=kv_budget)


def rollout_slots(cfg: RunConfig, model_cfg, plan, max_prompt: int) -> tuple[int, float | None]:
    """--rollout-slots -> (slots for the Sampler, KV budget per rollout device from the memory plan or None).
    0 stays static batching; N is checked against the plan here, before any model is built (rl/rollout/slots.py)."""
    r = cfg.rollout
    if r.slots == 0:
        return 0, None
    mesh = getattr(plan, "rollout", None)  # (a plan of the spec alone: unmeshed, one shard)
    # the cache layout and dtype of the run's engine (its settings, as `_engine_settings` resolves them)
    st = _engine_settings(cfg, mesh, max_prompt)
    seq = sl.cache_len_for(model_cfg, max_prompt, r.max_new_tokens)  # as Sampler.generate sizes it
    budget, note = sl.kv_budget_from_plan(model_cfg, str(plan.spec), seq, rollout_dtype=r.dtype)
    shards = batch_shards(ROLLOUT_RULES, mesh) if mesh is not None else 1  # split over the rollout batch axes
    try:
        n = sl.plan_slots(r.slots, per_slot_bytes=kv_cache_bytes(model_cfg, seq, st.compute_dtype, st.kv_bytes_format),
                          budget_bytes=budget, seq_len=seq, shards=shards)
    except ValueError as e:  # say which plan: a GPU's, or this CPU host's RAM
        raise ValueError(f"{e} ({note})") from None
    rows = r.prompts_per_step * r.group_size
    n = min(n, rows) if r.slots == "auto" else n
    log.info("rollout: %s (--rollout-slots %s; %s)", f"continuous batching over {n} slots" if n else
             "static batching", r.slots, note)
    return n, budget


def resolve_model_config(cfg: RunConfig, tokenizer_vocab: int):
    """The DSV4Config of `--config` (preset or config.json). With `--init random` and a tokenizer smaller
    than the preset's vocabulary, the vocabulary is shrunk to the tokenizer's (no untrainable dead logits)."""
    m = cfg.model
    if m.init != "random" and m.config in ("tiny", "small", "flash"):
        mc = DSV4Config.from_hf(m.init)
    elif m.config in ("tiny", "small", "flash"):
        mc = DSV4Config.preset(m.config)
    else:
        mc = DSV4Config.from_hf(m.config)
    if m.init == "random" and tokenizer_vocab < mc.vocab_size:
        log.info("random init: vocab_size %d -> %d (the tokenizer's)", mc.vocab_size, tokenizer_vocab)
        mc = dataclasses.replace(mc, vocab_size=tokenizer_vocab)
    if tokenizer_vocab > mc.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is "
                         f"{mc.vocab_size} (--tokenizer / --config)")
    return mc


def load_data(cfg: RunConfig):
    """(tokenizer, task or None, train PromptDataset, eval prompts [list[int]], eval references, reward (the
    `rl.data.rewards.RewardFn` of the task or of --reward), eval PromptDataset when it is a separate file else None).
    A multi-turn run (--rollout.env): the environment's prompts, tokenizer and reward
    (`rl.run.env_task.load_env_data`)."""
    if cfg.rollout.env is not None:
        return load_env_data(cfg)
    d = cfg.data
    if d.dataset is None and d.eval_dataset is None:
        task = DigitTask(kind=d.task, n_digits=d.task_digits, seed=cfg.seed)
        tok = task.tokenizer
        train = PromptDataset.from_task(task, "train")
        ev = task.prompts("eval", min(cfg.eval.prompts, len(task.prompts("eval"))))
        return tok, task, train, [p.prompt_ids for p in ev], [p.answer for p in ev], TaskReward(task), None
    tok = load_tokenizer(d.tokenizer, chat_template=d.chat_template)
    train, evd = build_datasets(cfg, tok)  # --data-format fields, chat template, overlong prompts
    n = min(cfg.eval.prompts, len(evd))
    name = resolve_reward_name(cfg)
    log.info("reward %s: the best prompt-independent response scores %.4f on %s", name,
             prompt_independent_best(name, train.references), train.source)
    return (tok, None, train, [evd.prompt(i) for i in range(n)], evd.references[:n],
            TextReward(make_reward(name), tok, timeout_s=d.reward_timeout_s),
            evd if evd is not train else None)


# the fingerprint's keys as checkpoints store them (named before the dotted paths; renaming a key would refuse
# every older checkpoint) -> the knob each one records
_FINGERPRINT = {"config": "model.config", "init": "model.init", "task": "data.task", "task_digits": "data.task_digits",
                "dataset": "data.dataset", "prompts_per_step": "rollout.prompts_per_step",
                "group_size": "rollout.group_size", "max_new_tokens": "rollout.max_new_tokens", "algo": "algo",
                "seed": "seed", "routing_replay": "learner.routing_replay", "kl_coef": "learner.loss.kl_coef",
                "lr": "learner.lr"}


def fingerprint(cfg: RunConfig, model_cfg) -> dict:
    """What must match between a checkpoint and the run restoring it (keys: `_FINGERPRINT`)."""
    knobs = cfg.knobs()
    return {"model": json.dumps(model_cfg.to_dict(), sort_keys=True, default=str),
            **{k: knobs[p] for k, p in _FINGERPRINT.items()},
            **({"scan_layers": True} if cfg.learner.scan_layers else {}),  # stacked state (absent: older ones)
            **({"fp8_forward": True} if cfg.learner.fp8_forward else {}),  # the FP8-aware learner's policy
            **({"max_staleness": cfg.staleness()} if cfg.staleness() else {}),  # the pipeline's K (rl/run/pipeline.py)
            **({"env": cfg.rollout.env} if cfg.rollout.env else {}),  # multi-turn: another task and tokenizer
            **(lora_fingerprint(cfg) if cfg.learner.lora.enabled else {})}


def lora_fingerprint(cfg: RunConfig) -> dict:
    """LoRA checkpoints hold the adapters alone (`Learner.state_dict`): the adapters' shape and the frozen base they
    apply to: --init (already a key) and its content identity (`rl.run.checkpoint.file_identity` of the checkpoint
    directory; a random base is the run's seed, also a key)."""
    lo, init = cfg.learner.lora, cfg.model.init
    return {"lora": f"rank={lo.rank} alpha={lo.alpha} targets={lo.targets}",
            "lora_base": "random" if init == "random" else file_identity(init)}


def prompt_bucket(cfg: RunConfig, train: PromptDataset, ev_prompts: list[list[int]]) -> int:
    """The rollout's largest prompt (tokens), the same on every side of a run (the actor, MPMD rollout processes,
    a rollout job): the longest training or eval prompt, + --max-new-tokens with --partial-rollout (a continued
    sample is re-prefilled from prompt + its tokens so far, rl/run/partial.py) or --rollout.env (a later turn is
    re-prefilled from prompt + every turn so far, rl/rollout/multiturn.py)."""
    n = max(train.max_prompt_len, max(len(p) for p in ev_prompts))
    return n + cfg.rollout.max_new_tokens if cfg.rollout.partial_rollout or cfg.rollout.env else n


def channel_window(cfg: RunConfig) -> int:
    """Publications a HostChannel keeps (MPMD, an actor job of several processes): a few steps' rollout results,
    2 per step of staleness, times the requests one batch may send (partial rollouts: its segments,
    `rl.run.partial.requests_per_batch`), so an actor process one step behind still finds every result it needs."""
    r, k = cfg.rollout, cfg.staleness()
    per_batch = requests_per_batch(r.max_new_tokens, k, r.partial_segment) if r.partial_rollout else 1
    return 4 + 2 * k * per_batch


def build(cfg: RunConfig) -> RunWiring:
    """Set up meshes, data, model, learner, the rollout service, checkpoints and metric sinks (errors before step
    1), the same code for every layout (module docstring). A rollout job of the two-job layout (--rollout-job):
    `build_rollout_job`."""
    if cfg.rollout.env is not None and (cfg.rollout.job or cfg.rollout.address is not None):
        raise ValueError(f"--rollout.env {cfg.rollout.env}: multi-turn rollouts run in one job for now; the two-job "
                         f"layout (--rollout-address / --rollout-job) does not carry them")
    if cfg.rollout.job:
        return build_rollout_job(cfg)
    evaluated = eval_checkpoint_dir(cfg) if cfg.eval.only else None  # --eval-only: a checkpoint, --init or an error
    log.info("resolved config: %s", json.dumps(cfg.to_tree(), sort_keys=False, default=str))
    tok, task, train, ev_prompts, ev_refs, reward, ev_data = load_data(cfg)
    model_cfg = resolve_model_config(cfg, tok.vocab_size)
    two_jobs = cfg.rollout.address is not None  # the rollout is a job of its own (rl/rollout/two_job.py)
    plan = build_job_plan(cfg.mesh, ACTOR, config=model_cfg) if two_jobs else build_mesh_plan(cfg.mesh,
                                                                                              config=model_cfg)
    log.info("meshes: %s%s", plan.describe(), " (the rollout mesh: a stand-in for the rollout job's tiling)"
             if two_jobs else "")
    max_prompt = prompt_bucket(cfg, train, ev_prompts)
    slots, kv_budget = rollout_slots(cfg, model_cfg, plan, max_prompt)  # --rollout-slots checked before any model
    check_chunk(model_cfg, cfg.rollout.prefill_chunk)  # --prefill-chunk: a multiple of the compression ratios
    # MPMD (whole processes per role) or both roles here; bad layouts fail now. The two-job layout's actor job: every
    # process an actor (several: one prompt stream, process 0's rollout results shared over the channel)
    layout = actor_job_layout() if two_jobs else role_layout(plan)
    # MPMD: heartbeats from now on (builds and compiles are long); the results channel keeps a few steps' values
    channel = HostChannel(layout, timeout_s=cfg.rollout.push_timeout, keep=channel_window(cfg)) \
        if layout.split_roles else None
    # the actor's processes save and restore the learner state; the rollout's is derived (rl/rollout/mpmd.py)
    # (the run lock, taken here, comes before any write: a run refused by it writes nothing, not even config.yaml;
    # an evaluation only reads its checkpoint: rl/run/eval_source.py)
    processes = layout.actor_processes if layout.split_roles else None
    if cfg.eval.only:
        ckpt = eval_reader(evaluated, fingerprint(cfg, model_cfg), processes) \
            if evaluated is not None and layout.is_actor else None
    else:
        ckpt = Checkpointer(cfg.ckpt.dir, keep=cfg.ckpt.keep, fingerprint=fingerprint(cfg, model_cfg),
                            processes=processes) if cfg.ckpt.dir and layout.is_actor else None
    for path, flag in ((cfg.log.metrics_jsonl, "--metrics-jsonl"), (cfg.log.tensorboard_dir, "--tensorboard-dir")):
        if path:
            check_writable(pathlib.Path(path).parent if flag == "--metrics-jsonl" else path, flag)
    if not cfg.eval.only:  # an evaluation writes its metrics, not the run's config
        write_resolved_config(cfg)
    data_identity = {"dataset": file_identity(cfg.data.dataset), "eval_dataset": file_identity(cfg.data.eval_dataset)}
    if ckpt is not None and cfg.ckpt.resume == "auto":
        latest = ckpt.check_latest()  # a checkpoint of another config is an error now, not after the model is built
        if latest is not None and not cfg.eval.only:
            same_data(cfg, latest, data_identity)
    elif ckpt is not None and ckpt.all_steps():
        raise ValueError(f"--ckpt-dir {ckpt.dir} already holds checkpoints (steps {ckpt.all_steps()}); --resume never "
                         f"would collide with them: use another --ckpt-dir or --resume auto")
    lcfg = resolve_param_dtype(cfg.learner, plan.actor.devices.flat)  # the run's learner, "auto" resolved
    lora = lcfg.lora if lcfg.lora.enabled else None  # LoRA: adapters on the actor's and the rollout's model
    if lora is not None and (two_jobs or layout.split_roles):
        raise ValueError(f"--learner.lora.rank {lora.rank}: the adapter push runs with both roles in one process for "
                         f"now (not with --mesh roles on processes of their own nor with a rollout job)")
    # created in the actor's shardings (each process reads / computes only its shards), in the learner's param
    # dtype (the fp32 masters are made from these values by the optimizer: exact for a bf16 / FP8 checkpoint)
    load_dtype = jnp.bfloat16 if lcfg.param_dtype == "bfloat16" else jnp.float32
    init = cfg.model.init
    # the loaded model's shapes (a transformers checkpoint has no MTP block), known without loading it
    shapes_cfg = loaded_config(init, model_cfg) if init != "random" else model_cfg
    model = learner = None
    if layout.is_actor:
        if init == "random":
            model = init_model(model_cfg, seed=cfg.seed, param_dtype=load_dtype, mesh=plan.actor)
        else:
            model = load_hf_checkpoint(init, dtype=load_dtype, config=model_cfg, mesh=plan.actor,
                                       progress=cfg.log.progress)
        if lora is not None:  # fresh adapters (B = 0: the policy starts as the base), from the run's seed
            attach(model, lora, nnx.Rngs(cfg.seed))
        r = cfg.rollout  # --exact-rollout: the learner's fixed micro-batch layout (rl/rollout/exact.py)
        exact = exact_layout(lcfg, rows_per_step=r.prompts_per_step * r.group_size, max_prompt_len=max_prompt,
                             max_new_tokens=r.max_new_tokens, batch_devices=batch_shards(ACTOR_RULES, plan.actor)) \
            if r.exact else None
        learner = Learner(model, lcfg, mesh=plan.actor, rollout_dtype=cfg.rollout.dtype,
                          rollout_devices=None if plan.rollout is None else list(plan.rollout.devices.flat),
                          exact_layout=exact)
    abstract = abstract_model(shapes_cfg, param_dtype=load_dtype, lora=lora)
    # a random init in one process: the rollout's version 0 is quantised from the same model; else its weights
    # come from --init's own FP8 blocks or by the first push
    here = init == "random" and not layout.split_roles and not two_jobs
    sampler = Sampler(model if here else abstract, _engine_settings(cfg, plan.rollout, max_prompt, slots, kv_budget),
                      mesh=plan.rollout)
    del model
    rollout = server = None
    if two_jobs:  # the stand-in sampler gives the rollout job's tiling; the weights leave by transfer server
        state = nnx.state(abstract)
        pusher = JobPusher(plan, sampler, state, plan.param_shardings(ACTOR, state))
        rollout = JobRollout(cfg.rollout.address, pusher, learner.params_for_push, timeout_s=cfg.rollout.push_timeout,
                             restart_timeout_s=cfg.rollout.restart_timeout, channel=channel,
                             identity=job_identity(cfg, shapes_cfg, tok, max_prompt_len=max_prompt))
    elif not layout.split_roles:
        if init != "random":  # version 0 from the file's own FP8 blocks, first: the pusher copies the stored layout
            LocalRollout(sampler, config=shapes_cfg, progress=cfg.log.progress).load_weights(0, source=init)
        # LoRA: the push moves the adapters alone; the rollout applies them unmerged over its base (dsv4/lora.py)
        params_fn = learner.params_for_push if lora is None else learner.adapters_for_push
        pusher = WeightPusher(plan, sampler, params_fn(), verify_every=cfg.rollout.push_verify_every,
                              only=None if lora is None else is_adapter_key)
        rollout = LocalRollout(sampler, params_fn, pusher, config=shapes_cfg, progress=cfg.log.progress,
                               tokenizer=tok)
    else:
        state = nnx.state(abstract)
        pusher = MpmdPusher(plan, layout, sampler, state, plan.param_shardings(ACTOR, state), channel,
                            verify_every=cfg.rollout.push_verify_every)
        if layout.is_actor:
            rollout = ProcessRollout(layout, channel, pusher, learner.params_for_push)
        else:
            server = RolloutServer(sampler, layout, channel, pusher, init=init, config=shapes_cfg,
                                   progress=cfg.log.progress, tokenizer=tok)
        log.info("MPMD: process %d runs the %s (actor processes %s, rollout processes %s)", layout.process,
                 layout.role, list(layout.actor_processes), list(layout.rollout_processes))
    if rollout is not None and cfg.rollout.exact:  # training batches drawn from the learner's forward
        rollout = ExactRollout(learner, rollout, routing_replay=cfg.learner.routing_replay)
    # MPMD: every actor process reads one unsharded stream (the global batch), so the data order is the one-process
    # run's; otherwise each host reads its shard (rl/run/stages.py::global_batch)
    it = make_prompt_iterator(train, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed,
                              **({"shard_index": 0, "shard_count": 1} if layout.split_roles else {}))
    wiring = RunWiring(cfg=cfg, model_cfg=model_cfg, plan=plan, tokenizer=tok, task=task, train_data=train,
                       eval_prompts=ev_prompts, eval_refs=ev_refs, reward=reward, learner=learner, rollout=rollout,
                       iterator=it, ckpt=ckpt, logger=MetricsLogger(cfg), data_identity=data_identity,
                       data_metrics=data_metrics(train, *([ev_data] if ev_data is not None else [])), layout=layout,
                       server=server)
    if ckpt is not None and cfg.ckpt.resume == "auto":
        # K >= 1: a checkpoint whose in-flight batches file is missing or corrupt is passed over like an unreadable one
        inflight = (lambda step: read_inflight(ckpt.dir, step)) if cfg.staleness() and not cfg.eval.only else None
        restored = ckpt.restore(learner.state_dict(), check=inflight)
        if restored is not None:
            state, meta = restored
            learner.load_state_dict(state)
            if not cfg.eval.only and same_data(cfg, meta, data_identity):
                it.set_state(meta["data"])
            wiring.start_step = int(meta["step"])
            wiring.weight_version = int(meta["weight_version"])
            log.info("resumed from %s at step %d (weight version %d)", ckpt.dir, wiring.start_step,
                     wiring.weight_version)
    # A run that checkpoints owns its logs: records of steps >= start_step (written after the checkpoint it
    # resumes from, or by a run killed before its first checkpoint) are dropped, since this run recomputes them.
    owns = ckpt is not None and cfg.ckpt.resume == "auto" and not cfg.eval.only
    wiring.logger.open(wiring.start_step if owns else None)
    if rollout is not None and rollout.weight_version != wiring.weight_version:
        # the rollout serves the restored params (or its first weights): version 0 of --init from the file's own
        # FP8 blocks where the engine can read it, else the learner's params pushed
        from_init = init != "random" and wiring.weight_version == 0
        rollout.load_weights(wiring.weight_version, source=init if from_init else None)
    return wiring


def build_rollout_job(cfg: RunConfig) -> RunWiring:
    """A rollout job of the two-job layout (rl/rollout/two_job.py): the Sampler on this job's devices (the mesh's
    rollout section; weights arrive from the actor by pull) and the loop it serves (`wiring.server`). It reads the
    data only to size the prompt buckets as the actor does; it writes no metrics, config file or checkpoint."""
    if jax.process_count() > 1:
        raise ValueError(f"--rollout-job: a rollout job of one process for now (this one has {jax.process_count()})")
    tok, task, train, ev_prompts, ev_refs, _, _ = load_data(cfg)
    model_cfg = resolve_model_config(cfg, tok.vocab_size)
    plan = build_job_plan(cfg.mesh, ROLLOUT, config=model_cfg)
    log.info("meshes: %s (the actor mesh: unused here)", plan.describe())
    max_prompt = prompt_bucket(cfg, train, ev_prompts)  # the actor's (its stand-in sampler's tiling, the requests)
    slots, kv_budget = rollout_slots(cfg, model_cfg, plan, max_prompt)
    check_chunk(model_cfg, cfg.rollout.prefill_chunk)
    lcfg = resolve_param_dtype(cfg.learner, plan.actor.devices.flat)  # the actor's dtype: the same tiling
    load_dtype = jnp.bfloat16 if lcfg.param_dtype == "bfloat16" else jnp.float32
    init = cfg.model.init
    shapes_cfg = loaded_config(init, model_cfg) if init != "random" else model_cfg
    abstract = abstract_model(shapes_cfg, param_dtype=load_dtype)
    sampler = Sampler(abstract, _engine_settings(cfg, plan.rollout, max_prompt, slots, kv_budget), mesh=plan.rollout)
    server = RolloutJobServer(sampler, cfg.rollout.actor_address, timeout_s=cfg.rollout.push_timeout,
                              connect_timeout_s=cfg.rollout.restart_timeout,
                              identity=job_identity(cfg, shapes_cfg, tok, max_prompt_len=max_prompt))
    return RunWiring(cfg=cfg, model_cfg=model_cfg, plan=plan, tokenizer=tok, task=task, train_data=train,
                     eval_prompts=ev_prompts, eval_refs=ev_refs, reward=None, learner=None, rollout=None, iterator=None,
                     ckpt=None, logger=None, server=server)


def run_dir(cfg: RunConfig) -> pathlib.Path | None:
    """The run's directory: the folder of --metrics-jsonl, else the parent of --ckpt-dir, else None."""
    if cfg.log.metrics_jsonl:
        return pathlib.Path(cfg.log.metrics_jsonl).parent
    if cfg.ckpt.dir:
        return pathlib.Path(cfg.ckpt.dir).parent
    return None


def write_resolved_config(cfg: RunConfig) -> pathlib.Path | None:
    """Write the resolved config to `run_dir(cfg)/config.yaml` (process 0; temp file, then rename: never
    half-written; `build` logs it first and writes it once it holds the run lock). The file is the nested shape
    `launch/run.py --config-file` reads back to an equal RunConfig. Returns its path (None: no run directory, or
    not process 0)."""
    d = run_dir(cfg)
    if d is None or jax.process_index() != 0:
        return None
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
    the flag, unless `cfg.ckpt.allow_dataset_change`: then False (a warning is logged) and the caller restarts the
    data order from the beginning while keeping the learner state.
    """
    saved = meta.get("data_identity")
    if not saved:
        return True
    changed = [k for k in ("dataset", "eval_dataset") if saved.get(k) != identity.get(k)]
    if not changed:
        return True
    what = "; ".join(f"--{k.replace('_', '-')} {getattr(cfg.data, k)}: checkpoint {saved.get(k)} vs now {identity.get(k)}"
                     for k in changed)
    if not cfg.ckpt.allow_dataset_change:
        raise ValueError(f"the dataset changed since checkpoint step {meta.get('step')} ({what}); resuming would "
                         "repeat some prompts and skip others: restore the file, use another --ckpt-dir, or pass "
                         "--allow-dataset-change to keep the learner state and restart the data order")
    log.warning("dataset changed since the checkpoint (%s); --allow-dataset-change: the data order restarts", what)
    return False
