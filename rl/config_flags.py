"""The run config's flag spellings and the checks that name them.

`FLAT`: the historic flat names (`lr`, `group_size`, `eval_every`, ...), each a spelling of one dotted path: they work
as `RunConfig(lr=...)`, `--lr` and flat YAML keys (rl/config.py). `flag(path)` is the command-line flag a message
names for a path; `check_ints` and `check_choices` are the section checks (rl/config.py, rl/rollout/config.py) whose
ValueErrors name the field and that flag. Tests: tests/rl/test_run_config.py.
"""

from __future__ import annotations

from typing import Any

from rl import config_tree as tree

# flat name (flag --a-b, flat YAML key, RunConfig(a_b=...), cfg.a_b) -> the one dotted path it stands for
FLAT = {
    "mesh": "mesh", "config": "model.config", "init": "model.init",
    **{k: "data." + k for k in ("task", "task_digits", "dataset", "tokenizer", "data_format", "prompt_field",
                                 "answer_field", "chat_template", "eval_dataset", "reward", "max_prompt_len",
                                 "on_bad_record", "on_overlong_prompt", "apply_chat_template", "system_prompt",
                                 "thinking")},
    "steps": "steps",
    **{k: "rollout." + k for k in ("prompts_per_step", "group_size", "max_new_tokens", "temperature", "top_p",
                                    "top_k")},
    "rollout_dtype": "rollout.dtype", "rollout_compute_dtype": "rollout.compute_dtype",
    "kv_cache_dtype": "rollout.kv_cache_dtype",
    "algo": "algo", "dapo_max_resample_batches": "dapo.max_resample_batches",
    "dapo_on_budget_exhausted": "dapo.on_budget_exhausted",
    "lr": "learner.lr", "warmup_steps": "learner.warmup_steps",
    **{k: "learner.loss." + k for k in ("kl_coef", "kl_estimator", "correction", "correction_level", "mis_low",
                                         "mis_high")},
    "tis_clip": "learner.loss.tis_clip_high",
    **{k: "learner." + k for k in ("routing_replay", "freeze_router", "micro_batch_size", "max_tokens_per_micro_batch",
                                    "logprob_chunk_size", "compute_dtype", "param_dtype", "offload_optimizer")},
    **{"eval_" + k: "eval." + k for k in ("every", "prompts", "samples", "only", "before_train")},
    "ckpt_dir": "ckpt.dir", "ckpt_every": "ckpt.every", "resume": "ckpt.resume",
    "allow_dataset_change": "ckpt.allow_dataset_change", "keep_checkpoints": "ckpt.keep",
    **{k: "log." + k for k in ("metrics_jsonl", "tensorboard_dir", "wandb_project")},
    "seed": "seed", "progress": "log.progress", "remat": "learner.remat", "scan_layers": "learner.scan_layers",
    "stream_optimizer": "learner.stream_optimizer", "ep_backend": "learner.ep_backend",
    "ep_capacity_factor": "learner.ep_capacity_factor",
    "rollout_slots": "rollout.slots", "max_staleness": "rollout.max_staleness",
    "prefill_chunk": "rollout.prefill_chunk",
    "async_rollout": "rollout.async_rollout", "partial_rollout": "rollout.partial_rollout",
    "push_timeout": "rollout.push_timeout",
    "rollout_address": "rollout.address", "rollout_job": "rollout.job", "actor_address": "rollout.actor_address",
    "rollout_restart_timeout": "rollout.restart_timeout",
    "exact_rollout": "rollout.exact",
}
_FLAT_OF = {v: k for k, v in FLAT.items()}


def flag(path: str) -> str:
    """The command-line flag of a path: its flat alias when it has one (`--group-size`), else `--a.b`."""
    flat = _FLAT_OF.get(path)
    return "--" + flat.replace("_", "-") if flat else "--" + path


def check_ints(section: str, obj: Any, names: tuple[str, ...], minimum: int) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{section}.{name} ({flag(section + '.' + name)}) must be an int >= {minimum}, "
                             f"got {v!r}")


def check_choices(section: str, obj: Any) -> None:
    """Every Literal-typed knob of the section holds one of its choices."""
    for path, leaf in tree.paths(type(obj), section + ".").items():
        v = getattr(obj, leaf.field.name)
        if leaf.owner is type(obj) and leaf.choices and v not in leaf.choices and not (leaf.optional and v is None):
            raise ValueError(f"{path} ({flag(path)}) must be {'|'.join(leaf.choices)}, got {v!r}")
