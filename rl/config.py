"""The run's configuration: one nested, frozen `RunConfig`, each knob declared once (default + help in the field).

    RunConfig
    ├── mesh, steps, seed, algo            the run itself
    ├── model      ModelConfig             config (tiny|small|flash|config.json), init (random|checkpoint dir)
    ├── data       DataConfig              built-in task or dataset + tokenizer, formats, templates, reward
    ├── rollout    RolloutConfig           prompts x group per step, sampling, rollout weights, push checks
    ├── dapo       DapoConfig              DAPO's dynamic-sampling budget
    ├── advantage  AdvantageConfig         rl/algo_config.py (filled by the algo preset)
    ├── learner    LearnerConfig           rl/algo_config.py, with learner.loss = LossConfig (algo preset)
    ├── eval       EvalConfig              held-out eval: every, prompts, samples (pass@k), only, before_train
    ├── ckpt       CheckpointConfig        dir, every, resume, keep, allow_dataset_change
    └── log        LogConfig               metrics JSONL, TensorBoard, W&B, progress bar

Precedence (`RunConfig.from_overrides`): defaults < the `algo` preset < overrides in order (launch/run.py passes
the YAML file, then the flat flags, then the dotted flags). Every knob has a dotted path (`learner.lr`); the
historic flat names (`lr`, `group_size`, `eval_every`, ...: `FLAT`) are spellings of one path each: they work as
`RunConfig(lr=...)`, `--lr` and flat YAML keys, and `cfg.flat()` lists them; the code reads the nested fields
(`cfg.learner.lr`). The run's defaults are the embedded default run (tiny
DeepSeek-V4 from random init on the built-in digit-copy task, on CPU). Library classes read the same
declarations: the learner section is `LearnerConfig` itself, and the run's learner (`DEFAULT_LEARNER`) changes only
its recipe values (lr 2e-3, b2 0.99, fp32 compute, routing replay, TIS; `RECIPE_KNOBS`, reasons next to it);
`Sampler`, `SamplingParams`, `PromptDataset.from_records` and the planner take their defaults of the rollout and
data knobs (`max_prompt_len`, `prefill_chunk`, `slots`, rollout dtype, sampling parameters, KV-cache dtype for the
planner) from the fields here
(`config_tree.default`).
Derived (not settable): `learner.temperature` = `rollout.temperature`; `advantage.dynamic_sampling_max_rounds`
= 1 + `dapo.max_resample_batches`. Impossible values raise ValueError naming the field and its flag.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from rl.algo_config import (AdvantageConfig, Correction, CorrectionLevel, DTypeName, KLEstimator,  # noqa: F401
                            LearnerConfig, LossAggMode, LossConfig, LRSchedule, PolicyLossKind, check_real,
                            speculative_preset)
from rl import config_tree as tree
from rl.config_tree import knob

ALGOS = ("grpo", "dr_grpo", "dapo", "gspo")
REWARDS = ("auto", "task", "gsm8k", "gsm8k+format", "math", "dapo", "aime")  # the reward table: rl/math_rewards.py
ROLLOUT_DTYPES = ("fp8", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8+fp4experts", "bf16", "fp32", "auto")


def _flag(path: str) -> str:
    """The command-line flag of a path: its flat alias when it has one (`--group-size`), else `--a.b`."""
    flat = _FLAT_OF.get(path)
    return "--" + flat.replace("_", "-") if flat else "--" + path


def _min(section: str, obj: Any, names: tuple[str, ...], minimum: int) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{section}.{name} ({_flag(section + '.' + name)}) must be an int >= {minimum}, "
                             f"got {v!r}")


def _choices(section: str, obj: Any) -> None:
    """Every Literal-typed knob of the section holds one of its choices."""
    for path, leaf in tree.paths(type(obj), section + ".").items():
        v = getattr(obj, leaf.field.name)
        if leaf.owner is type(obj) and leaf.choices and v not in leaf.choices and not (leaf.optional and v is None):
            raise ValueError(f"{path} ({_flag(path)}) must be {'|'.join(leaf.choices)}, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model: architecture and initial weights."""

    config: str = knob("tiny", "model config: tiny | small | flash | PATH/config.json")
    init: str = knob("random", "random, or an official-format DeepSeek-V4 checkpoint directory (safetensors + "
                               "config.json)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts and rewards: the built-in task (no dataset) or a dataset file + tokenizer (rl/data.py,
    rl/data_formats.py, rl/chat.py); the reward (rl/rewards.py, rl/math_rewards.py)."""

    task: Literal["copy", "reverse"] = knob("copy", "built-in verifiable task when no --dataset is given: copy | "
                                                    "reverse (3 digits, partial credit)")
    task_digits: int = knob(3, "digits per built-in task prompt")
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
                               "| dapo ('Answer:' line, else boxed) | aime (integer); rl/math_rewards.py")
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
        _choices("data", self)
        _min("data", self, ("task_digits", "max_prompt_len"), 1)
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
class RolloutConfig:
    """Sampling on the rollout mesh (rl/rollout/engine.py) and the weight push to it (parallel/push/)."""

    prompts_per_step: int = knob(32, "prompts per step")
    group_size: int = knob(16, "samples per prompt (G)")
    max_new_tokens: int = knob(4, "response length limit")
    temperature: float = knob(1.0, "sampling temperature (0 = greedy)")
    top_p: float = knob(1.0, "nucleus sampling")
    top_k: int = knob(0, "top-k sampling (0 = off)")
    dtype: str = knob("fp8", "rollout weights: fp8 | fp8_e4m3fnuz (MI300/MI308) | fp8+fp4experts (FP4 routed "
                              "experts, the release's format) | bf16 | fp32 | auto")
    compute_dtype: Literal["auto", "bfloat16", "float32"] = knob(
        "auto", "rollout matmul dtype: auto (fp32 on CPU, bf16 on GPU) | bfloat16 | float32")
    kv_cache_dtype: str = knob("auto", "rollout KV cache: fp8 (window ring, compressed entries and indexer keys in FP8 "
                                       "with ue8m0 scales, the release's layout) | bf16 (unquantised) | auto (fp8 "
                                       "for --rollout-dtype fp8*, else bf16)")
    push_verify_every: int = knob(10, "verify the pushed FP8 weights against the learner's every N-th push "
                                      "(0 = never)")
    slots: int | str = knob(0, "rollout batching: 0 = static (all rows until the longest ends) | N = continuous "
                               "batching over N decode slots refilled as samples finish (rl/rollout/slots.py) | auto = as "
                               "many slots as the memory plan's KV budget holds (capped by the rows)")
    prefill_chunk: int = knob(2048, "prompts longer than this prefill in chunks of this many tokens against the KV "
                                    "cache built so far (memory bounded by one chunk; dsv4/chunked.py); 0 = whole "
                                    "prompt; a multiple of the compression ratios' lcm (128 for Flash)")
    ep_backend: Literal["auto", "capacity", "ragged", "padded", "sized"] = knob(
        "auto", "the sampler's expert-parallel dispatch on an expert rollout mesh (parallel/expert.py): auto "
                "(capacity on XLA:CPU, sized on GPUs: `parallel.expert.rollout_backend`) | capacity | ragged | "
                "padded (per-expert buffers, dense batched matmuls) | sized (padded with the buffer chosen per call "
                "from the loads among a few compiled capacities: exact at the routed cost)")
    ep_capacity_factor: float | None = knob(
        None, "the sampler's EP buffer factor: none = dropless (padded: T_local rows per expert and source rank, "
              "bounded by the tokens per device of one call: use --rollout-slots) | f > 0 = capacity "
              "min(T_local, ceil(f T_local k / E)) (sized: its largest capacity), pairs past it dropped (first "
              "come in (token, pick) order; the token keeps its other experts and the shared one)")
    speculative: Literal["off", "mtp"] = knob(
        "off", "speculative decoding: off | mtp (DeepSeek-V4's MTP block drafts --rollout.draft_tokens tokens per "
               "step, one forward of the policy verifies them; the output distribution is plain sampling's; "
               "rl/rollout/speculative.py)")
    draft_tokens: int = knob(2, "tokens the MTP block drafts per step with --rollout.speculative mtp (1..3)")
    max_staleness: int = knob(0, "asynchronous rollout (rl/pipeline.py): K >= 1 generates the next batches while "
                                 "the actor trains, with weights at most K versions old (needs --correction tis|mis); "
                                 "0 = synchronous")
    async_rollout: bool = knob(False, "one-step-off asynchronous rollout: shorthand for --max-staleness 1")
    partial_rollout: bool = knob(False, "partial rollouts (rl/partial.py; needs --max-staleness K >= 1): generations "
                                        "run in segments of --rollout.partial_segment decode steps; a step's batch is "
                                        "the first groups that finished, the others continue after the next push "
                                        "under the new weights (re-prefilled from their tokens), every token "
                                        "recording its version; a sample spans at most K + 1 versions")
    partial_segment: int = knob(0, "with --partial-rollout: decode steps per segment (0 = ceil(max_new_tokens / "
                                   "(K + 1)), so no sample is cut short by the K + 1 version limit)")
    length_schedule: str | None = knob(None, "synthetic response lengths (benchmarks): FRAC:SHORT caps every "
                                             "response at SHORT new tokens except for a FRAC share of the prompts "
                                             "(evenly spread over the data index), which keep --max-new-tokens; "
                                             "e.g. 0.1:4; none = off")
    ignore_eos: bool = knob(False, "benchmarks: training samples do not stop at the tokenizer's eos, so every "
                                   "response runs to its limit (--max-new-tokens, or --rollout.length_schedule's); "
                                   "evaluation still stops at eos (vLLM's SamplingParams.ignore_eos)")
    exact: bool = knob(False, "exact mode (rl/rollout/exact.py): training samples are drawn from the learner's own forward "
                              "in a batch-invariant layout (a full forward per token), so "
                              "train/train_rollout_logprob_abs_diff is 0 (needs --max-staleness 0; with an FP8 "
                              "--rollout-dtype, --learner.fp8_forward)")
    push_timeout: float = knob(600.0, "MPMD runs (sharding/mpmd.py): a process whose heartbeat stopped for min(this, "
                                      "20) s, or never started within this, is dead (the others exit naming it); "
                                      "the weight transfer's timeout; the two-job layout: the heartbeat age after "
                                      "which the other job counts as dead")
    address: str | None = knob(None, "the two-job layout (rl/rollout/two_job.py): HOST:PORT this actor job listens on "
                                     "for a rollout job of its own (started with --rollout-job --actor-address "
                                     "HOST:PORT; a host the rollout can reach); unset: the rollout runs in this job")
    job: bool = knob(False, "this process is a rollout job of the two-job layout: it serves the actor job at "
                            "--actor-address (same run flags otherwise) and exits when the actor stops")
    actor_address: str | None = knob(None, "with --rollout-job: the actor job's --rollout-address (HOST:PORT)")
    restart_timeout: float = knob(1800.0, "the two-job layout: seconds the actor waits for a rollout job to "
                                          "register (at start, and after its rollout died) before exiting with an "
                                          "error naming it")

    def length_split(self) -> tuple[float, int]:
        """(long share, short cap) of `length_schedule` 'FRAC:SHORT'; ValueError naming the flag when malformed."""
        frac, _, short = str(self.length_schedule).partition(":")
        try:
            f, n = float(frac), int(short)
        except ValueError:
            f, n = -1.0, 0
        if not (0 <= f <= 1 and 1 <= n <= self.max_new_tokens):
            raise ValueError(f"rollout.length_schedule (--rollout.length_schedule) must be FRAC:SHORT with FRAC in "
                             f"[0, 1] and SHORT in 1..--max-new-tokens ({self.max_new_tokens}), got "
                             f"{self.length_schedule!r}")
        return f, n

    def length_caps(self, data_index) -> list[int] | None:
        """Per-prompt response length limits [n] of `length_schedule` for prompts of data indices `data_index`
        [n] (a function of the index alone: the same prompt gets the same limit in every schedule); None when
        unset. Prompt i is long (keeps max_new_tokens) iff floor((i + 1) FRAC) > floor(i FRAC)."""
        if self.length_schedule is None:
            return None
        f, short = self.length_split()
        return [self.max_new_tokens if math.floor((int(i) + 1) * f) > math.floor(int(i) * f) else short
                for i in data_index]

    def __post_init__(self):
        _choices("rollout", self)
        slots = self.slots
        if isinstance(slots, str) and slots.strip().lower() != "auto":
            try:
                slots = int(slots)
            except ValueError:
                slots = None
        elif isinstance(slots, str):
            slots = "auto"
        if slots is None or isinstance(slots, bool) or (slots != "auto" and (not isinstance(slots, int) or slots < 0)):
            raise ValueError(f"rollout.slots (--rollout-slots) must be auto or an int >= 0 (0 = static batching), "
                             f"got {self.slots!r}")
        object.__setattr__(self, "slots", slots)
        if not check_real("rollout", "push_timeout", self.push_timeout) > 0:
            raise ValueError(f"rollout.push_timeout (--push-timeout) must be > 0 seconds, got {self.push_timeout}")
        if not check_real("rollout", "restart_timeout", self.restart_timeout) > 0:
            raise ValueError(f"rollout.restart_timeout (--rollout-restart-timeout) must be > 0 seconds, "
                             f"got {self.restart_timeout}")
        for name, flag in (("address", "--rollout-address"), ("actor_address", "--actor-address")):
            value = getattr(self, name)
            host, sep, port = str(value).rpartition(":")
            if value is not None and not (sep and host and port.isdigit() and int(port) < 65536):
                raise ValueError(f"rollout.{name} ({flag}) must be HOST:PORT, got {value!r}")
        if self.job and self.actor_address is None:
            raise ValueError("rollout.job (--rollout-job) needs --actor-address HOST:PORT (the actor job's "
                             "--rollout-address)")
        if self.job and self.address is not None:
            raise ValueError("rollout: --rollout-job and --rollout-address name the two sides of the two-job "
                             "layout; give a process one of them")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness (--max-staleness) must be an int >= 0, "
                             f"got {self.max_staleness!r}")
        _min("rollout", self, ("prompts_per_step", "max_new_tokens"), 1)
        _min("rollout", self, ("partial_segment",), 0)
        if self.length_schedule is not None:
            self.length_split()
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or not 1 <= self.draft_tokens <= 3:
            raise ValueError(f"rollout.draft_tokens (--rollout.draft_tokens) must be an int in 1..3, "
                             f"got {self.draft_tokens!r}")
        _min("rollout", self, ("top_k", "push_verify_every", "prefill_chunk"), 0)
        f = self.ep_capacity_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f)
                              or f <= 0):
            raise ValueError(f"rollout.ep_capacity_factor (--rollout.ep_capacity_factor) must be > 0, or none "
                             f"(dropless), got {f!r}")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"rollout.group_size (--group-size) must be >= 2 for group advantages, "
                             f"got {self.group_size}")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout.dtype (--rollout-dtype) must be fp8|fp8_e4m3fnuz|fp8+fp4experts|bf16|fp32|auto, "
                             f"got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "bf16"):
            raise ValueError(f"rollout.kv_cache_dtype (--kv-cache-dtype) must be fp8|bf16|auto, "
                             f"got {self.kv_cache_dtype!r}")
        if check_real("rollout", "temperature", self.temperature) < 0 or not 0 < self.top_p <= 1:
            raise ValueError("rollout: --temperature must be >= 0 and --top-p in (0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DapoConfig:
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2; `rl.loop.dynamic_rollout`)."""

    max_resample_batches: int = knob(3, "DAPO: extra prompt batches sampled per step to fill the batch with "
                                        "groups whose rewards differ")
    on_budget_exhausted: Literal["train", "skip"] = knob(
        "train", "DAPO, fewer such groups than --prompts-per-step after the resampling budget: train (on the "
                 "kept groups) | skip (the step)")

    def __post_init__(self):
        _min("dapo", self, ("max_resample_batches",), 0)
        _choices("dapo", self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation (`rl.loop.evaluate`): greedy pass@1, sampled pass@1 and pass@k."""

    every: int = knob(20, "eval every N steps (0 = never)")
    prompts: int = knob(64, "held-out prompts")
    samples: int = knob(4, "k of pass@k (samples per eval prompt)")
    only: bool = knob(False, "no training: evaluate --init (or the newest checkpoint in --ckpt-dir) on the eval "
                             "prompts, print the table, write the metrics, exit")
    before_train: bool = knob(False, "evaluate once before the first step (veRL's val_before_train; ignored by "
                                     "--eval-only)")

    def __post_init__(self):
        _min("eval", self, ("prompts", "samples"), 1)
        _min("eval", self, ("every",), 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints (rl/checkpoint.py) and resuming."""

    dir: str | None = knob("runs/default/ckpt", "checkpoint directory ('' = none)")
    every: int = knob(20, "checkpoint every N steps")
    resume: Literal["auto", "never"] = knob("auto", "auto | never")
    allow_dataset_change: bool = knob(False, "resume although --dataset / --eval-dataset changed since the "
                                             "checkpoint (keeps the learner state, restarts the data order); "
                                             "otherwise that is an error")
    keep: int = knob(2, "checkpoints kept")

    def __post_init__(self):
        _choices("ckpt", self)
        _min("ckpt", self, ("keep",), 1)
        _min("ckpt", self, ("every",), 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Metric sinks (rl/sinks.py)."""

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
DERIVED = {"learner.temperature": "rollout.temperature",
           "advantage.dynamic_sampling_max_rounds": "dapo.max_resample_batches"}
# the loss knobs an algo preset sets (KL and the off-policy correction are the run's own knobs)
_PRESET_LOSS = ("policy_loss", "clip_eps_low", "clip_eps_high", "gspo_clip_eps_low", "gspo_clip_eps_high",
                "dual_clip_c", "loss_agg_mode", "norm_length", "entropy_coef")


def algo_preset(algo: str, max_new_tokens: int) -> dict[str, Any]:
    """The dotted knobs `algo` sets (rl/algo_config.py's presets): the loss shape and the advantage estimator.

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
                return ValueError(f"{prefix}{f.name} ({_flag(prefix + f.name)}) " + msg[len(old) + 1:])
    return e


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class RunConfig:
    """The whole GRPO job (launch/run.py); see the module docstring for the tree, the presets and precedence.

    `RunConfig(**kw)`: keys are top-level fields or whole sections (`learner=LearnerConfig(...)`), flat names
    (`lr=1e-6`, `FLAT`) or dotted paths given as a dict (`RunConfig(**{"learner.lr": 1e-6})`); later keys win,
    all of them over the `algo` preset. The code reads the nested fields (`cfg.learner.lr`).
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

        Keys: dotted paths, flat names (`FLAT`), or whole sections. Values must already have the knob's type
        (`rl.config_tree.convert` turns strings into it). ValueError names `source` and an unknown key."""
        leaves, secs = tree.paths(cls), tree.sections(cls)
        user: dict[str, Any] = {}
        for k, v in items:
            path = FLAT.get(k, k)
            if path in DERIVED:
                raise ValueError(f"{source}: {k} is derived from {DERIVED[path]} and cannot be set")
            if path not in leaves and path not in secs:
                raise ValueError(f"{source}: unknown key {k!r}")
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
        """K of the one-step-off asynchronous loop (rl/pipeline.py): `rollout.max_staleness`, or 1 for
        `rollout.async_rollout` alone; 0 = the synchronous loop."""
        return int(self.rollout.max_staleness) or int(bool(self.rollout.async_rollout))

    def flat(self) -> dict[str, Any]:
        """{flat name: value} of every flat name (the W&B config keys, the historic RunConfig fields)."""
        return {k: tree.get(self, p) for k, p in FLAT.items()}

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
