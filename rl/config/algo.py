"""The algorithm's configs: advantages (AdvantageConfig), policy loss (LossConfig), learner (LearnerConfig).

Frozen, kw-only dataclasses, one per concern, validated on construction; `rl.config.run` imports them as the
`advantage` and `learner` (with `learner.loss`) sections of the run config (`rl.config.run.RunConfig`); import them
from here.

Every config is `@dataclass(frozen=True, kw_only=True)` and checks itself in `__post_init__`, raising
`ValueError` that names the offending field. Frozen dataclasses are hashable, so a config can be passed as a
static argument to `jax.jit` (e.g. `jax.jit(policy_loss, static_argnames="cfg")`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from dsv4.lora import LoraConfig
from rl.config.tree import knob

# ---------------------------------------------------------------------------------------------------------------
# RL algorithm configs: advantages (rl/algo/advantages.py) and policy loss (rl/algo/losses.py).
# ---------------------------------------------------------------------------------------------------------------


def check_real(owner: str, name: str, value: object) -> float:
    """`value` must be a finite real number (bools are rejected); returns it as float. Raises ValueError naming
    `owner.name` (the config field) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")
    return float(value)


def _check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


def _check_remat(value: object) -> None:
    """`--remat` (LearnerConfig.remat / RunConfig.remat): one of block|dots|none, else a one-line ValueError."""
    if value not in ("block", "dots", "none"):
        raise ValueError(f"--remat must be one of block|dots|none, got {value!r}")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How per-sample rewards become advantages (`rl.algo.advantages.compute_advantages`).

    estimator:
        "grpo": A_i = (r_i - mean(r_group)) / (std(r_group) + eps), DeepSeekMath (arXiv 2402.03300) §4.1.
                With `scale_by_std=False` this is Dr.GRPO (arXiv 2503.20783 §3): A_i = r_i - mean(r_group).
        "rloo": leave-one-out baseline, A_i = r_i - mean_{j != i} r_j (Ahmadian et al. 2024, arXiv 2402.14740).
    scale_by_std: divide by the group's unbiased std (ddof=1) + eps; GRPO only.
    eps: added to every std denominator.
    batch_norm: afterwards whiten advantages over the whole batch (REINFORCE++ / "batch" normalisation),
        per sample: each response counts once. Deliberate difference: verl whitens the token-level advantages
        (`masked_whiten`), so there a long response weighs as many times as it has tokens.
    dynamic_sampling: DAPO (arXiv 2503.14476 §3.2) — resample until `target` groups with non-constant rewards
        are collected, at most `dynamic_sampling_max_rounds` sampling rounds (see `rl.algo.advantages.DynamicSampler`).
    """

    estimator: Literal["grpo", "rloo"] = "grpo"
    scale_by_std: bool = True
    eps: float = 1e-6
    batch_norm: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4

    def __post_init__(self):
        owner = type(self).__name__
        _check_choice(owner, "estimator", self.estimator, ("grpo", "rloo"))
        for name in ("scale_by_std", "batch_norm", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        if check_real(owner, "eps", self.eps) < 0:
            raise ValueError(f"{owner}.eps must be >= 0, got {self.eps!r}")
        _check_int(owner, "dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds, 1)

    @classmethod
    def grpo(cls) -> AdvantageConfig:
        """GRPO: group mean and unbiased group std."""
        return cls()

    @classmethod
    def dr_grpo(cls) -> AdvantageConfig:
        """Dr.GRPO: group mean only (no std division)."""
        return cls(scale_by_std=False)

    @classmethod
    def dapo(cls) -> AdvantageConfig:
        """DAPO: GRPO advantages plus dynamic sampling of groups with non-constant rewards."""
        return cls(dynamic_sampling=True)


PolicyLossKind = Literal["ppo", "gspo"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
Correction = Literal["none", "tis", "mis"]
CorrectionLevel = Literal["token", "sequence", "geometric"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss of `rl.algo.losses.policy_loss` (symbols as in the cited papers).

    policy_loss:
        "ppo":  per-token ratio r_t = pi/pi_old, PPO clip (Schulman et al. 2017) with asymmetric bounds
                [1 - clip_eps_low, 1 + clip_eps_high] ("clip-higher", DAPO arXiv 2503.14476 §3.1, eps_high=0.28).
        "gspo": sequence ratio s_i = exp(mean_t log r_t) (GSPO arXiv 2507.18071 §4), token form with
                stop-gradient, clipped to [1 - gspo_clip_eps_low, 1 + gspo_clip_eps_high] (paper: 3e-4 / 4e-4).
                The paper's objective is the sequence mean: use loss_agg_mode="seq-mean-token-mean".
    dual_clip_c: dual-clip constant c > 1 (Ye et al. 2019, arXiv 1912.09729): for A < 0 the per-token loss is
        bounded by -A * c. None disables it.
    loss_agg_mode: how per-token losses become a scalar (as verl's `agg_loss`):
        "token-mean"              sum(l m) / sum(m)                                  (DAPO token-level loss)
        "seq-mean-token-mean"     mean over non-empty sequences of sum_t(l m) / sum_t(m)   (GRPO paper)
        "seq-mean-token-sum-norm" sum(l m) / (N * norm_length)   (Dr.GRPO as TRL "dr_grpo" and Tunix; verl's
                                  mode of this name divides by norm_length only)
    kl_coef, kl_estimator, kl_clamp: KL(pi || pi_ref) penalty added to the loss, estimator k1/k2/k3 (Schulman,
        "Approximating KL divergence", 2020); log(pi/pi_ref) is clamped to [-kl_clamp, kl_clamp] and k3 to
        [-10, 10]; with the default kl_clamp=20 k3 equals verl's low_var_kl exactly (see `rl.algo.losses.kl_penalty`
        for the deliberate k1/k2 difference). kl_coef=0 disables it (no reference log-probs needed).
    correction: train/rollout mismatch correction with w_t = pi_old_train / pi_rollout per token:
        "none"; "tis" truncated importance sampling, weight min(w, tis_clip_high) (Yao et al. 2025, "Your
        efficient RL framework secretly brings you off-policy RL training"); "mis" masked importance sampling /
        IcePop (Ling team 2025): tokens with w inside [mis_low, mis_high] are weighted by w, the others get
        zero loss (they still count in the normaliser).
    correction_level: "token" (w_t), "sequence" (prod_t w_t), "geometric" (exp(mean_t log w_t)); sequence-level
        weights are broadcast to every token of the sequence.
    entropy_coef: weight of the entropy bonus (subtracted from the loss).
    norm_length: the constant of seq-mean-token-sum-norm; None uses the token axis length T of the batch.
    """

    policy_loss: PolicyLossKind = "ppo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    gspo_clip_eps_low: float = 3e-4
    gspo_clip_eps_high: float = 4e-4
    loss_agg_mode: LossAggMode = "token-mean"
    kl_coef: float = knob(0.0, "KL-to-reference coefficient (0: no reference model kept)")
    kl_estimator: KLEstimator = knob("k3", "k1 | k2 | k3")
    kl_clamp: float = 20.0
    correction: Correction = knob("none", "rollout/train mismatch correction: none | tis | mis (IcePop)")
    correction_level: CorrectionLevel = knob("token", "token | sequence | geometric")
    tis_clip_high: float = knob(2.0, "TIS weight clamp C")
    mis_low: float = knob(0.5, "MIS lower bound")
    mis_high: float = knob(2.0, "MIS upper bound")
    entropy_coef: float = 0.0
    norm_length: int | None = None

    def __post_init__(self):
        owner = type(self).__name__
        _check_choice(owner, "policy_loss", self.policy_loss, ("ppo", "gspo"))
        _check_choice(owner, "loss_agg_mode", self.loss_agg_mode,
                      ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
        _check_choice(owner, "kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        _check_choice(owner, "correction", self.correction, ("none", "tis", "mis"))
        _check_choice(owner, "correction_level", self.correction_level, ("token", "sequence", "geometric"))
        # The lower clip bound 1 - eps must stay a positive ratio.
        for name in ("clip_eps_low", "gspo_clip_eps_low"):
            value = check_real(owner, name, getattr(self, name))
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{owner}.{name} must be in [0, 1), got {value!r}")
        for name in ("clip_eps_high", "gspo_clip_eps_high"):
            if check_real(owner, name, getattr(self, name)) < 0.0:
                raise ValueError(f"{owner}.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.dual_clip_c is not None and check_real(owner, "dual_clip_c", self.dual_clip_c) <= 1.0:
            raise ValueError(f"{owner}.dual_clip_c must be > 1 (or None), got {self.dual_clip_c!r}")
        for name in ("kl_coef", "entropy_coef"):
            if check_real(owner, name, getattr(self, name)) < 0.0:
                raise ValueError(f"{owner}.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("kl_clamp", "tis_clip_high"):
            if check_real(owner, name, getattr(self, name)) <= 0.0:
                raise ValueError(f"{owner}.{name} must be > 0, got {getattr(self, name)!r}")
        if check_real(owner, "mis_low", self.mis_low) <= 0.0:
            raise ValueError(f"{owner}.mis_low must be > 0, got {self.mis_low!r}")
        if check_real(owner, "mis_high", self.mis_high) <= self.mis_low:
            raise ValueError(f"{owner}.mis_high must be > mis_low={self.mis_low!r}, got {self.mis_high!r}")
        if self.norm_length is not None:
            _check_int(owner, "norm_length", self.norm_length, 1)

    @classmethod
    def grpo(cls, *, kl_coef: float = 0.04) -> LossConfig:
        """GRPO (DeepSeekMath §4.1): symmetric clip 0.2, per-sequence mean, k3 KL to the reference."""
        return cls(loss_agg_mode="seq-mean-token-mean", kl_coef=kl_coef, kl_estimator="k3")

    @classmethod
    def dapo(cls) -> LossConfig:
        """DAPO: clip-higher (0.2 / 0.28), token-level loss, no KL."""
        return cls(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg_mode="token-mean")

    @classmethod
    def dr_grpo(cls, *, norm_length: int | None = None) -> LossConfig:
        """Dr.GRPO: token sums normalised by a constant length, no KL."""
        return cls(loss_agg_mode="seq-mean-token-sum-norm", norm_length=norm_length)

    @classmethod
    def gspo(cls) -> LossConfig:
        """GSPO: sequence-level ratio, clip 3e-4 / 4e-4, per-sequence mean."""
        return cls(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")


# ---------------------------------------------------------------------------------------------------------------
# Learner config: the optimizer and update step of rl/algo/learner.py.
# ---------------------------------------------------------------------------------------------------------------

LRSchedule = Literal["constant", "cosine"]
DTypeName = Literal["bfloat16", "float32"]


# The on-policy MTP loss weight of a `--rollout.speculative mtp` run (`speculative_preset`): the draft learns the
# policy's own samples by default. The head's gradient is clipped by its own norm and reaches no trunk weight, so
# the weight only scales the head's loss next to its clip (benchmarks/speculative.py trains with 1 too).
SPECULATIVE_MTP_LOSS_WEIGHT = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """One optimizer update per `rl.algo.learner.Learner.train_step` (AdamW on fp32 master weights).

    Every knob is defined here once, with its default; the run's learner (`rl.config.run.DEFAULT_LEARNER`, the
    `learner` section of `RunConfig`) is this class with only its recipe values changed (lr, b2, compute dtype,
    routing replay, TIS: see there), and the planner (`python -m launch.plan`) reads the same fields, so
    `Learner(model, LearnerConfig())`, the run and the plan agree on every structural knob (scanned layers, param
    dtype, streamed offload, EP backend and capacity, trained MTP / router).

    Optimizer (optax docs: `optax.adamw`, `optax.clip_by_global_norm`, `optax.multi_transform`):
        lr: peak learning rate. warmup_steps: linear warmup, lr * (u + 1) / warmup_steps for update u <
            warmup_steps (the first update already moves). schedule: "constant" after warmup, or "cosine" decay
            from lr to lr * min_lr_ratio at update `total_steps` (required for cosine, > warmup_steps).
        weight_decay: decoupled AdamW decay (Loshchilov & Hutter, arXiv 1711.05101), applied to matrices only
            (ndim >= 2; norms, scales and biases are not decayed). b1, b2, eps: Adam (Kingma & Ba, arXiv 1412.6980).
        max_grad_norm: clip the global gradient norm of the trained params to this (None: no clipping).
    Batch:
        micro_batch_size: rows per forward/backward; the batch's N must be a multiple. None = the whole batch.
            Accumulation is exact (sum losses with the full batch's normalisers, `rl.algo.losses.loss_normalizers`).
    loss: the policy loss (`rl.algo.losses.policy_loss`); `loss.kl_coef > 0` makes the learner keep a frozen reference.
    lora: LoRA (`dsv4.lora.LoraConfig`, `--learner.lora.rank|alpha|targets`); rank > 0: only the adapters train
        (gradients and optimizer state for them alone), every base weight is frozen (rl/algo/learner.py "LoRA").
    MoE:
        routing_replay: force the sampler's recorded experts (`TrainBatch.routing`) in the learner's forward
            ("rollout routing replay", R3, arXiv 2510.11370); the batch must then carry routing.
        freeze_router: no update for the router weights `layers/*/ffn/gate/weight` (and `mtp/*/ffn/gate/weight`).
            The selection bias is a `Buffer` and is never updated by the optimizer in any case.
        train_mtp: update the multi-token-prediction module `mtp/*`. The RL loss does not use it, so its gradient
            is 0 and only weight decay would move it; False (default) leaves it exactly as loaded.
        mtp_loss_weight: w > 0 adds w x the MTP block's next-next-token cross-entropy on the batch's response
            tokens (`--learner.mtp_loss_weight`; on-policy MTP training for speculative rollouts,
            `--rollout.speculative mtp`). The MTP head reads the trunk through `stop_gradient` (the policy's
            gradient is bitwise unchanged) and its gradient is clipped by its own global norm. Needs train_mtp.
    Precision:
        compute_dtype: matmul dtype of the learner's forward/backward; master params, gradients and Adam state
            are always float32. ref_dtype: storage dtype of the reference copy's matrices (kl_coef > 0 only).
        fp8_forward: the FP8-aware learner (`--learner.fp8_forward`): the forward (policy, old logprobs and
            reference alike) uses the rollout's weights, the FP8 (FP4 experts) values of `--rollout-dtype` built by
            the rollout's own rule (`dsv4.rollout_format.fp8_aware_params`), and quantises the activations of the
            same linears as the rollout (`dsv4.quant.act_fake_quant`, ue8m0 1 x 128 blocks), with straight-through
            gradients to the masters (`dsv4.quant.straight_through`). Needs an FP8 `--rollout-dtype`. Cost and
            effect: benchmarks/README.md "Train/rollout mismatch".
    temperature: the sampler's temperature; training logits are divided by it (0 = greedy, treated as 1).
    logprob_chunk_size: sequence chunk of the head + log-softmax (`rl.algo.logprobs.token_logprobs`); None = whole
        (the full [N, S, V] float32 logits). Default 1024: never the full logits of a long row.
    Input size (rl/algo/learner.py "Input size"):
        trim: cut the batch's columns to its longest real row (bucketed to powers of two, at most S), so the step
            runs at the real length; exact (padding never reaches a real token).
        max_tokens_per_micro_batch: token budget B of one micro-batch per device of the batch axes (as Miles'
            --max-tokens-per-gpu): micro-batches of floor(B / W) rows per device at the trimmed width W. Error
            when the longest real row is longer than B. None = no budget (micro_batch_size or the whole batch);
            when set, it decides the micro-batches and micro_batch_size is not used.
    State (rl/algo/optim.py):
        param_dtype: dtype of the on-device params and gradients. "float32": fp32 params are their own masters.
            "bfloat16": bf16 params and grads on device; the optimizer keeps fp32 master copies of them and fp32
            Adam moments (mixed-precision optimizer, Megatron-style). Leaves the model keeps in fp32 (mHC, sinks,
            ...) stay fp32 params without a master. "auto" (default): bfloat16 on accelerators, float32 on CPU
            (where bf16 matmuls are emulated), decided by the `Learner` from its devices' platform.
        offload_optimizer: fraction in [0, 1] of the optimizer state (fp32 masters + Adam moments, by bytes,
            whole parameters largest first; `sharding.offload.select_offloaded`) kept in host memory
            (`pinned_host`) when the backend has host memory kinds.
    remat: per-layer rematerialisation of the learner's forward (`--remat`): "block" (default: keep each layer's
        input, recompute the layer in the backward), "dots" (also keep the weight matmuls' outputs) or "none"
        (`dsv4.model.REMAT_POLICIES`; same gradients, less activation memory).
    scan_layers: run the decoder layers under `jax.lax.scan` per group of identical layers (`dsv4/scan.py`;
        `--scan-layers`), so the step's compile time does not grow with depth. The learner then holds params,
        buffers, optimizer state and reference in the stacked layout (`params_for_push()` is per layer; its
        checkpoints load only with the same setting). Default True (the run's and the planner's too); False: the
        Python loop over the layers.
    pipeline_stages: P > 1 splits the largest scanned layer group into P contiguous stages over the `stage` mesh axis
        and runs the step's micro-batches through them (GPipe: all forwards, then all backwards;
        `parallel/pipeline.py`): the loss and gradients of `train_step` and the logprobs of `compute_logprobs` come
        from one pipelined forward over all M micro-batches (bubble (P - 1) / (M + P - 1)). P must divide that
        group's repetitions; needs scan_layers. Default 1: no pipeline.
    pipeline_micro_batches: with pipeline_stages > 1, the micro-batches of one pipelined pass: the step's M
        micro-batches run in floor(M / this) passes of this many and, when this does not divide M, one shorter
        pass of the rest (its own pipeline: no padded micro-batch computed), gradients accumulated over the passes
        as over micro-batches. GPipe keeps every micro-batch's saved stage inputs of a
        pass, so this bounds the pipeline's activation memory (the planner's M, `--pipeline-micro-batches`);
        bubble (P - 1) / (this + P - 1) per pass. None (default): one pass of all M.
    stream_optimizer: with `offload_optimizer`, update the offloaded state of stacked params (ndim >= 3, leading
        dim unsplit: the scanned layers) one leading-dim slice at a time in a loop (`rl.algo.optim.update_streamed`),
        so only one layer's masters + moments are on the device at once; otherwise the step moves the whole
        offloaded state to the device for the update (XLA's memory analysis of the Flash step: that was its
        peak). Same values up to f32 rounding (the loop's fusions round differently). Default True (what the
        planner's arithmetic assumes); no effect without `offload_optimizer`.
    Expert parallelism (experts split over an `expert` mesh axis > 1; `parallel.expert.default_dispatch`):
        ep_backend: "auto" (default: "capacity" on XLA:CPU, which lacks ragged all-to-all; on GPUs "padded" with an
            ep_capacity_factor, else "ragged": `parallel.expert.auto_backend`, from XLA:GPU's figures),
            "capacity", "ragged", "padded" or "sized" (`parallel.expert.make_ep_dispatch`'s backends).
        ep_capacity_factor: None = dropless (default); f > 0 bounds the dispatch buffers (pairs past a rank's or
            expert's capacity are dropped: they contribute 0).
    """

    lr: float = knob(1e-6, "peak learning rate")
    warmup_steps: int = knob(0, "linear LR warmup")
    schedule: LRSchedule = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    weight_decay: float = knob(0.0, "AdamW decoupled weight decay (matrices only)")
    b1: float = knob(0.9, "Adam beta1")
    b2: float = knob(0.999, "Adam beta2")
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    micro_batch_size: int | None = knob(None, "rows per micro-batch (exact accumulation)")
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    routing_replay: bool = knob(False, "force the rollout's experts in training")
    freeze_router: bool = knob(False, "freeze router weights")
    train_mtp: bool = False
    mtp_loss_weight: float = knob(0.0, "weight of the on-policy MTP loss (next-next-token cross-entropy of the MTP "
                                       "head on the rollout's responses, stop-gradient into the trunk; needs "
                                       "train_mtp); trains the draft of --rollout.speculative mtp (which sets it to "
                                       f"{SPECULATIVE_MTP_LOSS_WEIGHT} and train_mtp on unless they are given)")
    compute_dtype: DTypeName = knob("bfloat16", "learner matmul dtype")
    ref_dtype: DTypeName = "bfloat16"
    fp8_forward: bool = knob(False, "FP8-aware forward: the rollout's quantised weights and activations, "
                                    "straight-through gradients to the masters (needs an FP8 --rollout-dtype)")
    temperature: float = 1.0
    logprob_chunk_size: int | None = knob(1024, "sequence chunk of the head + log-softmax (none = whole)")
    trim: bool = True
    max_tokens_per_micro_batch: int | None = knob(None, "token budget of one micro-batch per device (none = no "
                                                        "budget)")
    param_dtype: Literal["auto", "bfloat16", "float32"] = knob(
        "auto", "params on device: auto (bfloat16 + fp32 masters off CPU, float32 on CPU) | bfloat16 | float32")
    offload_optimizer: float = knob(0.0, "fraction of the optimizer state (masters + moments) in host memory")
    remat: Literal["block", "dots", "none"] = knob("block", "per-layer rematerialisation of the learner: block | "
                                                   "dots | none")
    scan_layers: bool = knob(True, "run the learner's layers under lax.scan per group of identical layers "
                                    "(compile time flat in depth; the learner state and its checkpoints are then "
                                    "in the stacked layout)")
    pipeline_stages: int = knob(1, "pipeline stages over the stage mesh axis (GPipe over the step's micro-batches, "
                                   "parallel/pipeline.py); 1 = no pipeline")
    pipeline_micro_batches: int | None = knob(None, "micro-batches per pipelined pass (pipeline_stages > 1): the "
                                                      "step's micro-batches in passes of this many, gradients "
                                                      "accumulated; bounds GPipe's saved activations; none = one "
                                                      "pass of all")
    stream_optimizer: bool = knob(True, "with --offload-optimizer: update the offloaded state of the scanned "
                                         "(stacked) layers one layer at a time (rl.algo.optim.update_streamed), so "
                                         "only one layer's masters + moments are on the device at once")
    ep_backend: Literal["auto", "capacity", "ragged", "padded", "sized"] = knob(
        "auto", "expert-parallel dispatch of the routed experts on an expert mesh (parallel/expert.py): auto "
                "(capacity on XLA:CPU; on GPUs padded with an ep_capacity_factor, else ragged) | capacity | "
                "ragged | padded (per-expert capacity buffers, no ragged_dot) | sized (padded, the buffer chosen "
                "per step from the loads up to the factor, drops counted: train/expert_drop_frac)")
    ep_capacity_factor: float | None = knob(None, "EP buffer factor f > 0 (pairs past the capacity are dropped); "
                                                  "none = dropless")

    def __post_init__(self):
        owner = type(self).__name__
        _check_remat(self.remat)
        if check_real(owner, "lr", self.lr) <= 0.0:
            raise ValueError(f"{owner}.lr must be > 0, got {self.lr!r}")
        _check_int(owner, "warmup_steps", self.warmup_steps, 0)
        _check_choice(owner, "schedule", self.schedule, ("constant", "cosine"))
        if self.total_steps is not None:
            _check_int(owner, "total_steps", self.total_steps, 1)
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"{owner}.total_steps must be > warmup_steps={self.warmup_steps} for the cosine "
                             f"schedule, got {self.total_steps!r}")
        if not 0.0 <= check_real(owner, "min_lr_ratio", self.min_lr_ratio) <= 1.0:
            raise ValueError(f"{owner}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if check_real(owner, "weight_decay", self.weight_decay) < 0.0:
            raise ValueError(f"{owner}.weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("b1", "b2"):
            if not 0.0 <= check_real(owner, name, getattr(self, name)) < 1.0:
                raise ValueError(f"{owner}.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if check_real(owner, "eps", self.eps) <= 0.0:
            raise ValueError(f"{owner}.eps must be > 0, got {self.eps!r}")
        if self.max_grad_norm is not None and check_real(owner, "max_grad_norm", self.max_grad_norm) <= 0.0:
            raise ValueError(f"{owner}.max_grad_norm must be > 0 (or None), got {self.max_grad_norm!r}")
        for name in ("micro_batch_size", "logprob_chunk_size", "max_tokens_per_micro_batch"):
            if getattr(self, name) is not None:
                _check_int(owner, name, getattr(self, name), 1)
        if not isinstance(self.loss, LossConfig):
            raise ValueError(f"{owner}.loss must be a LossConfig, got {type(self.loss).__name__}")
        if not isinstance(self.lora, LoraConfig):
            raise ValueError(f"{owner}.lora must be a dsv4.lora.LoraConfig, got {type(self.lora).__name__}")
        for name in ("routing_replay", "freeze_router", "train_mtp", "fp8_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        if not check_real(owner, "mtp_loss_weight", self.mtp_loss_weight) >= 0.0:
            raise ValueError(f"{owner}.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight!r}")
        if self.mtp_loss_weight > 0 and not self.train_mtp:
            raise ValueError(f"{owner}.mtp_loss_weight {self.mtp_loss_weight} needs {owner}.train_mtp (the MTP loss "
                             f"trains only the MTP head)")
        _check_choice(owner, "compute_dtype", self.compute_dtype, ("bfloat16", "float32"))
        _check_choice(owner, "ref_dtype", self.ref_dtype, ("bfloat16", "float32"))
        _check_choice(owner, "param_dtype", self.param_dtype, ("auto", "bfloat16", "float32"))
        if not isinstance(self.trim, bool):
            raise ValueError(f"{owner}.trim must be a bool, got {self.trim!r}")
        if not 0.0 <= check_real(owner, "offload_optimizer", self.offload_optimizer) <= 1.0:
            raise ValueError(f"{owner}.offload_optimizer (--offload-optimizer) must be in [0, 1], "
                             f"got {self.offload_optimizer!r}")
        if check_real(owner, "temperature", self.temperature) < 0.0:
            raise ValueError(f"{owner}.temperature must be >= 0, got {self.temperature!r}")
        for name in ("scan_layers", "stream_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        _check_int(owner, "pipeline_stages", self.pipeline_stages, 1)
        if self.pipeline_micro_batches is not None:
            _check_int(owner, "pipeline_micro_batches", self.pipeline_micro_batches, 1)
        if self.pipeline_stages > 1 and not self.scan_layers:
            raise ValueError(f"{owner}.pipeline_stages (--learner.pipeline_stages) {self.pipeline_stages} splits the "
                             f"scanned layers: it needs --learner.scan_layers")
        _check_choice(owner, "ep_backend", self.ep_backend, ("auto", "capacity", "ragged", "padded", "sized"))
        if self.ep_capacity_factor is not None and not (
                not isinstance(self.ep_capacity_factor, bool) and isinstance(self.ep_capacity_factor, (int, float))
                and math.isfinite(self.ep_capacity_factor) and self.ep_capacity_factor > 0):
            raise ValueError(f"{owner}.ep_capacity_factor (--ep-capacity-factor) must be > 0, or none (dropless), "
                             f"got {self.ep_capacity_factor!r}")


def speculative_preset(user: dict) -> dict:
    """The learner knobs a `--rollout.speculative mtp` run sets unless they are given (a preset under the user's
    values, as the `algo` presets): `learner.train_mtp` True and, unless train_mtp is given False,
    `learner.mtp_loss_weight` = SPECULATIVE_MTP_LOSS_WEIGHT, so the MTP draft is trained on the run's own samples
    (without it the random or loaded head's acceptance stays where it starts: 1.06 tokens per step in issue 42).
    user: {dotted path or section name: value} as given. Returns {dotted path: value} ({} without speculation)."""
    rollout = user.get("rollout")
    spec = user.get("rollout.speculative", getattr(rollout, "speculative", "off"))
    if spec != "mtp" or user.get("learner.train_mtp", True) is not True:
        return {}
    return {"learner.train_mtp": True, "learner.mtp_loss_weight": SPECULATIVE_MTP_LOSS_WEIGHT}
