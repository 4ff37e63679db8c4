"""The run's configuration: one nested, frozen `RunConfig`, each knob declared once (default + help in the field).

    RunConfig
    ├── mesh, steps, seed, algo            the run itself
    ├── model      ModelConfig             config (tiny|small|flash|config.json), init (random|checkpoint dir)
    ├── data       DataConfig              built-in task or dataset + tokenizer, formats, templates, reward
    ├── rollout    RolloutConfig           rl/config/rollout.py: prompts x group per step, sampling, rollout weights
    ├── dapo       DapoConfig              DAPO's dynamic-sampling budget
    ├── advantage  AdvantageConfig         rl/config/algo.py (filled by the algo preset)
    ├── learner    LearnerConfig           rl/config/algo.py, with learner.loss = LossConfig (algo preset)
    ├── eval       EvalConfig              held-out eval: every, prompts, samples (pass@k), only, before_train
    ├── ckpt       CheckpointConfig        dir, every, resume, keep, allow_dataset_change
    └── log        LogConfig               metrics JSONL, TensorBoard, W&B, progress bar

Precedence (`RunConfig.from_overrides`): defaults < the `algo` preset < overrides in order (launch/run.py passes
the YAML file, then the flat flags, then the dotted flags). Every knob has one name, its dotted path
(`learner.lr`): `RunConfig(**{"learner.lr": 1e-6})`, `--learner.lr`, YAML `learner: {lr: ...}`; the code reads the
nested fields (`cfg.learner.lr`). The historic flat flags (`--lr`, `--group-size`, ...) are spellings that only
launch/run.py's argparse knows (`launch.run.FLAT`). The run's defaults are the embedded default run (tiny
DeepSeek-V4 from random init on the built-in digit-copy task, on CPU). Library classes read the same declarations:
the learner section is `LearnerConfig` itself, and the run's learner (`DEFAULT_LEARNER`) changes only its recipe
values (lr 2e-3, b2 0.99, fp32 compute, routing replay, TIS; `RECIPE_KNOBS`, reasons next to it); `Sampler`
(`EngineSettings`), `SamplingParams` and `PromptDataset.from_records` take their defaults of the rollout and
data knobs (`max_prompt_len`, `prefill_chunk`, `slots`, rollout and KV-cache dtypes, sampling parameters) from the
fields of the sections (`config_tree.default`); the planner (`python -m launch.plan`) reads the run's config itself.
Derived (not settable): `learner.temperature` = `rollout.temperature`; `advantage.dynamic_sampling_max_rounds`
= 1 + `dapo.max_resample_batches`. Impossible values raise ValueError naming the field and its flag.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rl.config import tree
from rl.config.algo import AdvantageConfig, LearnerConfig, LossConfig, check_real, speculative_preset
from rl.config.flags import check_choices, check_ints, flag
from rl.config.tree import knob
from rl.config.rollout import RolloutConfig

ALGOS = ("grpo", "dr_grpo", "dapo", "gspo")
REWARDS = ("auto", "task", "gsm8k", "gsm8k+format", "math", "dapo", "aime")  # the reward table: rl/data/math_rewards.py
ENVS = ("key_lookup", "python_math")  # multi-turn environments: rl/agent/registry.py


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model: architecture and initial weights."""

    config: str = knob("tiny", "model config: tiny | small | flash | PATH/config.json")
    init: str = knob("random", "random, or an official-format DeepSeek-V4 checkpoint directory (safetensors + "
                               "config.json)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts and rewards: the built-in task (no dataset) or a dataset file + tokenizer (rl/data/prompts.py,
    rl/data/formats.py, rl/data/chat.py); the reward (rl/data/rewards.py, rl/data/math_rewards.py)."""

    task: Literal["copy", "reverse"] = knob("copy", "built-in verifiable task when no --dataset is given: copy | "
                                                    "reverse (3 digits, partial credit)")
    task_digits: int = knob(3, "digits per built-in task prompt (--rollout.env key_lookup: digits per value)")
    dataset: str | None = knob(None, "prompt dataset (jsonl or parquet; GSM8K layout by default)")
    tokenizer: str | None = knob(None, "Hugging Face tokenizer.json (required with --dataset)")
    data_format: Literal["gsm8k", "verl", "miles"] = knob(
        "gsm8k", "dataset layout: gsm8k (question, answer '... #### n') | verl (prompt = chat messages, "
                 "reward_model.ground_truth) | miles (prompt, label); sets field defaults and --reward auto")
    prompt_field: str | None = knob(None, "dataset field of the prompt: a string or a list of chat messages; "
                                          "dotted path (default: the --data-format's)")
    answer_field: str | None = knob(None, "dataset field of the answer, dotted path, e.g. "
                                          "reward_model.ground_truth (default: the --data-format's)")
    chat_template: str | None = knob(None, "python format string for the prompt, e.g. "
                                           "'Question: {prompt}\\nAnswer:'")
    eval_dataset: str | None = knob(None, "held-out prompts for eval (default: the first --eval-prompts training "
                                          "prompts)")
    reward: str = knob("auto", "auto (the --data-format's) | task | gsm8k | gsm8k+format | math (last \\boxed{}) "
                               "| dapo ('Answer:' line, else boxed) | aime (integer); rl/data/math_rewards.py")
    reward_timeout_s: float = knob(5.0, "per-response time limit of a dataset reward (worker process), seconds")
    max_prompt_len: int = knob(256, "longest prompt in tokens")
    on_bad_record: Literal["skip", "fail"] = knob("fail", "malformed dataset record: fail (error with file:line) "
                                                          "| skip (counted)")
    on_overlong_prompt: Literal["drop", "fail"] = knob(
        "drop", "prompt longer than --max-prompt-len: drop (counted: log + metric data/dropped_overlong) | fail")
    apply_chat_template: bool = knob(
        False, "render each prompt as a one-turn conversation with the tokenizer folder's Jinja chat template "
               "(tokenizer_config.json or chat_template.jinja), as transformers does; DeepSeek-V4's format when "
               "the folder ships encoding/encoding_dsv4.py")
    system_prompt: str | None = knob(None, "system message of the conversation (with --apply-chat-template)")
    thinking: Literal["auto", "on", "off"] = knob("auto", "with --apply-chat-template: on | off sets the "
                                                          "template's enable_thinking / thinking switch; auto "
                                                          "leaves the template's default")

    def __post_init__(self):
        check_choices("data", self)
        check_ints("data", self, ("task_digits", "max_prompt_len"), 1)
        if self.reward not in REWARDS:
            raise ValueError(f"data.reward (--reward) must be {'|'.join(REWARDS)}, got {self.reward!r}")
        if check_real("data", "reward_timeout_s", self.reward_timeout_s) <= 0:
            raise ValueError(f"data.reward_timeout_s must be > 0, got {self.reward_timeout_s!r}")
        if self.dataset is not None and self.tokenizer is None:
            raise ValueError(f"data.tokenizer (--tokenizer) is required with --dataset {self.dataset}")
        if (self.system_prompt is not None or self.thinking != "auto") and not self.apply_chat_template:
            raise ValueError("data: --system-prompt and --thinking apply to chat templates; add "
                             "--apply-chat-template")
        if self.apply_chat_template and self.dataset is None and self.eval_dataset is None:
            raise ValueError("data.apply_chat_template (--apply-chat-template) needs --dataset and --tokenizer "
                             "(the built-in task has no chat template)")
        if self.eval_dataset is not None and self.dataset is None and self.tokenizer is None:
            raise ValueError(f"data.tokenizer (--tokenizer) is required with --eval-dataset {self.eval_dataset}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DapoConfig:
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2; `rl.run.loop.dynamic_rollout`)."""

    max_resample_batches: int = knob(3, "DAPO: extra prompt batches sampled per step to fill the batch with "
                                        "groups whose rewards differ")
    on_budget_exhausted: Literal["train", "skip"] = knob(
        "train", "DAPO, fewer such groups than --prompts-per-step after the resampling budget: train (on the "
                 "kept groups) | skip (the step)")

    def __post_init__(self):
        check_ints("dapo", self, ("max_resample_batches",), 0)
        check_choices("dapo", self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation (`rl.run.loop.evaluate`): greedy pass@1, sampled pass@1 and pass@k."""

    every: int = knob(20, "eval every N steps (0 = never)")
    prompts: int = knob(64, "held-out prompts")
    samples: int = knob(4, "k of pass@k (samples per eval prompt)")
    only: bool = knob(False, "no training: evaluate --init (or the newest checkpoint in --ckpt-dir) on the eval "
                             "prompts, print the table, write the metrics, exit")
    before_train: bool = knob(False, "evaluate once before the first step (veRL's val_before_train; ignored by "
                                     "--eval-only)")

    def __post_init__(self):
        check_ints("eval", self, ("prompts", "samples"), 1)
        check_ints("eval", self, ("every",), 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints (rl/run/checkpoint.py) and resuming."""

    dir: str | None = knob("runs/default/ckpt", "checkpoint directory ('' = none)")
    every: int = knob(20, "checkpoint every N steps")
    resume: Literal["auto", "never"] = knob("auto", "auto | never")
    allow_dataset_change: bool = knob(False, "resume although --dataset / --eval-dataset changed since the "
                                             "checkpoint (keeps the learner state, restarts the data order); "
                                             "otherwise that is an error")
    keep: int = knob(2, "checkpoints kept")

    def __post_init__(self):
        check_choices("ckpt", self)
        check_ints("ckpt", self, ("keep",), 1)
        check_ints("ckpt", self, ("every",), 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Metric sinks (rl/run/sinks.py)."""

    metrics_jsonl: str | None = knob("runs/default/metrics.jsonl", "per-step metrics file ('' = none)")
    tensorboard_dir: str | None = knob("runs/default/tb", "TensorBoard dir ('' = none)")
    wandb_project: str | None = knob(None, "Weights & Biases project (optional extra: pip install -e '.[wandb]'; "
                                           "WANDB_MODE=offline needs no network)")
    progress: bool = knob(True, "progress bar")


# The default run's learner: LearnerConfig (every knob and its default defined there once) with the run's recipe
# values, and nothing else (tests/rl/test_run_config.py pins the list):
# - lr 2e-3, b2 0.99: the embedded default run trains a tiny random-init model on the digit task in 80 steps
#   (docs/grpo-from-scratch.md); the library's 1e-6 / 0.999 are post-training values for a real checkpoint.
# - compute_dtype float32: the embedded default runs on CPU, where bf16 matmuls are emulated (slower, no gain).
# - routing_replay + TIS: the run samples with an FP8 rollout whose routing and logprobs differ from the learner's;
#   R3 and the TIS weights correct that. A library Learner may be fed batches without recorded routing.
# Structural knobs (scan_layers, param_dtype, stream_optimizer, ep_backend, ep_capacity_factor, train_mtp,
# freeze_router, offload_optimizer, remat, ...) are LearnerConfig's defaults, which the planner reads too.
DEFAULT_LEARNER = LearnerConfig(lr=2e-3, b2=0.99, compute_dtype="float32", routing_replay=True,
                                loss=LossConfig(correction="tis"))
RECIPE_KNOBS = ("lr", "b2", "compute_dtype", "routing_replay", "loss")  # where DEFAULT_LEARNER differs

DERIVED = {"learner.temperature": "rollout.temperature",
           "advantage.dynamic_sampling_max_rounds": "dapo.max_resample_batches"}
# the loss knobs an algo preset sets (KL and the off-policy correction are the run's own knobs)
_PRESET_LOSS = ("policy_loss", "clip_eps_low", "clip_eps_high", "gspo_clip_eps_low", "gspo_clip_eps_high",
                "dual_clip_c", "loss_agg_mode", "norm_length", "entropy_coef")


def algo_preset(algo: str, max_new_tokens: int) -> dict[str, Any]:
    """The dotted knobs `algo` sets (rl/config/algo.py's presets): the loss shape and the advantage estimator.

    grpo: clip 0.2, per-sequence mean (DeepSeekMath §4.1). dr_grpo: token sums / max_new_tokens, no std
    (arXiv 2503.20783). dapo: clip-higher 0.2 / 0.28, token-level loss, dynamic sampling (arXiv 2503.14476).
    gspo: sequence ratio, clip 3e-4 / 4e-4 (arXiv 2507.18071)."""
    loss = {"grpo": LossConfig.grpo, "dapo": LossConfig.dapo, "gspo": LossConfig.gspo,
            "dr_grpo": lambda: LossConfig.dr_grpo(norm_length=max_new_tokens)}[algo]()
    adv = {"grpo": AdvantageConfig.grpo, "dr_grpo": AdvantageConfig.dr_grpo, "dapo": AdvantageConfig.dapo,
           "gspo": AdvantageConfig.grpo}[algo]()
    out = {"learner.loss." + k: getattr(loss, k) for k in _PRESET_LOSS}
    out.update({"advantage." + f.name: getattr(adv, f.name) for f in dataclasses.fields(adv)
                if "advantage." + f.name not in DERIVED})
    return out


def _rename(owner: type, e: ValueError) -> ValueError:
    """Reword `Owner.field ...` errors of LearnerConfig / LossConfig to name the run's path and flag."""
    msg = str(e)
    prefix = {LearnerConfig: "learner.", LossConfig: "learner.loss.", AdvantageConfig: "advantage."}.get(owner)
    if prefix:
        for f in dataclasses.fields(owner):
            old = f"{owner.__name__}.{f.name}"
            if msg.startswith(old + " ") and not msg.startswith(old + " (--"):
                return ValueError(f"{prefix}{f.name} ({flag(prefix + f.name)}) " + msg[len(old) + 1:])
    return e


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class RunConfig:
    """The whole GRPO job (launch/run.py); see the module docstring for the tree, the presets and precedence.

    `RunConfig(**kw)`: keys are top-level fields (`steps=3`), whole sections (`learner=LearnerConfig(...)`) or
    dotted paths given as a dict (`RunConfig(**{"learner.lr": 1e-6})`); later keys win, all of them over the
    `algo` preset. The code reads the nested fields (`cfg.learner.lr`).
    Raises ValueError naming the field and flag for impossible values and unknown keys.
    """

    mesh: str = knob("auto", "device meshes: 'auto', or e.g. actor:fsdp=2,expert=2/rollout:expert=2,tensor=2 "
                             "(actor only = colocated)")
    steps: int = knob(80, "GRPO steps")
    seed: int = knob(0, "seed of data order, sampling and init")
    algo: str = knob("grpo", "grpo | dr_grpo | dapo | gspo (a preset of learner.loss and advantage)")
    model: ModelConfig = knob(factory=ModelConfig)
    data: DataConfig = knob(factory=DataConfig)
    rollout: RolloutConfig = knob(factory=RolloutConfig)
    dapo: DapoConfig = knob(factory=DapoConfig)
    advantage: AdvantageConfig = knob(factory=AdvantageConfig)
    learner: LearnerConfig = knob(factory=lambda: DEFAULT_LEARNER)
    eval: EvalConfig = knob(factory=EvalConfig)
    ckpt: CheckpointConfig = knob(factory=CheckpointConfig)
    log: LogConfig = knob(factory=LogConfig)

    def __init__(self, **kw):
        cfg = RunConfig.from_overrides(kw.items(), source="RunConfig")
        for f in dataclasses.fields(RunConfig):
            object.__setattr__(self, f.name, getattr(cfg, f.name))

    @classmethod
    def from_overrides(cls, items, source: str = "RunConfig") -> RunConfig:
        """Resolve (key, value) pairs in precedence order (later wins) over defaults + the algo preset.

        Keys: dotted paths or whole sections. Values must already have the knob's type (`rl.config.tree.convert`
        turns strings into it). ValueError names `source` and an unknown key (and the paths ending in it)."""
        leaves, secs = tree.paths(cls), tree.sections(cls)
        user: dict[str, Any] = {}
        for path, v in items:
            if path in DERIVED:
                raise ValueError(f"{source}: {path} is derived from {DERIVED[path]} and cannot be set")
            if path not in leaves and path not in secs:
                near = [p for p in leaves if p.endswith("." + path)]
                raise ValueError(f"{source}: unknown key {path!r}" + (f" (a dotted path: {' or '.join(near)}?)"
                                                                      if near else ""))
            user.pop(path, None)  # re-inserted last: dict order = precedence
            user[path] = v
        algo = user.get("algo", cls.__dataclass_fields__["algo"].default)
        if algo not in ALGOS:
            raise ValueError(f"algo (--algo) must be one of {ALGOS}, got {algo!r}")
        mnt = user.get("rollout.max_new_tokens", user["rollout"].max_new_tokens if "rollout" in user
                       else RolloutConfig().max_new_tokens)
        whole = [p for p in user if p in secs]  # a whole section replaces the preset's values in it
        values = {p: v for p, v in {**algo_preset(algo, mnt), **speculative_preset(user)}.items()
                  if not any(p.startswith(w + ".") for w in whole)}
        values.update(user)
        self = object.__new__(cls)
        top = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
               for f in dataclasses.fields(cls)}
        direct, grouped = tree.split_paths(values)
        top.update(direct)
        for head, sub in grouped.items():
            top[head] = tree.build(top[head], sub, _rename)
        for name, v in top.items():
            object.__setattr__(self, name, v)
        self._derive()
        self._check()
        return self

    def _derive(self) -> None:
        object.__setattr__(self, "learner", tree.build(self.learner, {"temperature": self.rollout.temperature},
                                                        _rename))
        rounds = 1 + self.dapo.max_resample_batches
        object.__setattr__(self, "advantage", tree.build(self.advantage, {"dynamic_sampling_max_rounds": rounds}))

    def _check(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps (--steps) must be an int >= 1, got {self.steps!r}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo (--algo) must be one of {ALGOS}, got {self.algo!r}")
        if self.staleness() > 0 and self.learner.loss.correction == "none":
            raise ValueError(f"RunConfig: --max-staleness {self.staleness()} (--async-rollout) trains on samples of "
                             f"older weights and needs an off-policy correction: --correction tis or --correction "
                             f"mis, not --correction none")
        if self.learner.fp8_forward and self.rollout.dtype in ("bf16", "fp32"):
            raise ValueError(f"RunConfig: --learner.fp8_forward reproduces an FP8 rollout, but --rollout-dtype is "
                             f"{self.rollout.dtype}: use an fp8 --rollout-dtype or drop --learner.fp8_forward")
        r = self.rollout
        if r.partial_rollout and self.staleness() == 0:
            raise ValueError("RunConfig: --partial-rollout continues generations across weight updates and needs "
                             "--max-staleness K >= 1 (or --async-rollout)")
        if r.partial_rollout and self.advantage.dynamic_sampling:
            raise ValueError(f"RunConfig: --partial-rollout forms a batch from the groups that finished; DAPO's "
                             f"dynamic sampling (--algo {self.algo}) is not combined with it")
        if r.exact and r.length_schedule is not None:
            raise ValueError("RunConfig: --exact-rollout draws every row up to --max-new-tokens; "
                             "--rollout.length_schedule is not combined with it")
        if r.env is not None:
            if r.env not in ENVS:
                raise ValueError(f"rollout.env (--rollout.env) must be {'|'.join(ENVS)}, got {r.env!r}")
            for on, flag in ((r.exact, "--exact-rollout"), (r.speculative != "off", "--rollout.speculative mtp"),
                             (r.partial_rollout, "--partial-rollout"),
                             (r.length_schedule is not None, "--rollout.length_schedule"),
                             (self.advantage.dynamic_sampling, f"--algo {self.algo} (dynamic sampling)")):
                if on:
                    raise ValueError(f"RunConfig: multi-turn rollouts (--rollout.env {r.env}) are not combined with "
                                     f"{flag}")
        if r.partial_rollout and r.speculative != "off":
            raise ValueError("RunConfig: --partial-rollout is not supported with --rollout.speculative mtp")
        if self.rollout.exact and self.staleness() > 0:
            raise ValueError(f"RunConfig: --exact-rollout draws each batch with the learner's current weights, "
                             f"which the schedule samples with only in the synchronous loop: drop --max-staleness {self.staleness()} "
                             f"(--async-rollout) or --exact-rollout")
        if self.rollout.exact and self.rollout.dtype not in ("bf16", "fp32") and not self.learner.fp8_forward:
            raise ValueError(f"RunConfig: --exact-rollout with --rollout-dtype {self.rollout.dtype} needs "
                             f"--learner.fp8_forward (the learner's forward on the rollout's FP8 weights)")
        d = self.data
        if d.eval_dataset is not None and d.dataset is None and not self.eval.only:
            raise ValueError("RunConfig: --eval-dataset without --dataset is for --eval-only runs (training on the "
                             "built-in task would evaluate on another vocabulary)")

    def staleness(self) -> int:
        """K of the one-step-off asynchronous loop (rl/run/pipeline.py): `rollout.max_staleness`, or 1 for
        `rollout.async_rollout` alone; 0 = the synchronous loop."""
        return int(self.rollout.max_staleness) or int(bool(self.rollout.async_rollout))

    def knobs(self) -> dict[str, Any]:
        """{dotted path: value} of every settable knob (the W&B config keys)."""
        return {p: tree.get(self, p) for p in tree.paths(RunConfig) if p not in DERIVED}

    def to_tree(self) -> dict:
        """The resolved config as nested dicts, derived knobs left out: a YAML of it loads back
        (`launch/run.py --config-file`) to an equal RunConfig."""
        return tree.to_tree(self, frozenset(DERIVED))

    def loss_config(self) -> LossConfig:
        """The policy loss: `learner.loss` (the algo preset + the run's KL and correction knobs)."""
        return self.learner.loss

    def advantage_config(self) -> AdvantageConfig:
        """The advantage estimator: `advantage` (the algo preset; DAPO's max rounds from `dapo`)."""
        return self.advantage
