"""Frozen, kw-only configuration dataclasses for the RL stack, one per concern, validated on construction.

Every config is `@dataclass(frozen=True, kw_only=True)` and checks itself in `__post_init__`, raising
`ValueError` that names the offending field. Frozen dataclasses are hashable, so a config can be passed as a
static argument to `jax.jit` (e.g. `jax.jit(policy_loss, static_argnames="cfg")`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

# ---------------------------------------------------------------------------------------------------------------
# RL algorithm configs: advantages (rl/advantages.py) and policy loss (rl/losses.py).
# ---------------------------------------------------------------------------------------------------------------


def _check_real(owner: str, name: str, value: object) -> float:
    """`value` must be a finite real number (bools are rejected); returns it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")
    return float(value)


def _check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How per-sample rewards become advantages (`rl.advantages.compute_advantages`).

    estimator:
        "grpo": A_i = (r_i - mean(r_group)) / (std(r_group) + eps), DeepSeekMath (arXiv 2402.03300) §4.1.
                With `scale_by_std=False` this is Dr.GRPO (arXiv 2503.20783 §3): A_i = r_i - mean(r_group).
        "rloo": leave-one-out baseline, A_i = r_i - mean_{j != i} r_j (Ahmadian et al. 2024, arXiv 2402.14740).
    scale_by_std: divide by the group's unbiased std (ddof=1) + eps; GRPO only.
    eps: added to every std denominator.
    batch_norm: afterwards whiten advantages over the whole batch (REINFORCE++ / "batch" normalisation).
    dynamic_sampling: DAPO (arXiv 2503.14476 §3.2) — resample until `target` groups with non-constant rewards
        are collected, at most `dynamic_sampling_max_rounds` sampling rounds (see `rl.advantages.DynamicSampler`).
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
        if _check_real(owner, "eps", self.eps) < 0:
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
    """The policy loss of `rl.losses.policy_loss` (symbols as in the cited papers).

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
        "seq-mean-token-sum-norm" sum(l m) / (N * norm_length)                         (Dr.GRPO)
    kl_coef, kl_estimator, kl_clamp: KL(pi || pi_ref) penalty added to the loss, estimator k1/k2/k3 (Schulman,
        "Approximating KL divergence", 2020); log(pi/pi_ref) is clamped to [-kl_clamp, kl_clamp] and k3 to
        [-10, 10] (as verl's low_var_kl). kl_coef=0 disables it (no reference log-probs needed).
    correction: train/rollout mismatch correction with w_t = pi_old_train / pi_rollout per token:
        "none"; "tis" truncated importance sampling, weight min(w, tis_clip_high) (Yao et al. 2025, "Your
        efficient RL framework secretly brings you off-policy RL training"); "mis" masked importance sampling /
        IcePop (Ling team 2025): tokens with w outside [mis_low, mis_high] get zero loss.
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
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_clamp: float = 10.0
    correction: Correction = "none"
    correction_level: CorrectionLevel = "token"
    tis_clip_high: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
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
            value = _check_real(owner, name, getattr(self, name))
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{owner}.{name} must be in [0, 1), got {value!r}")
        for name in ("clip_eps_high", "gspo_clip_eps_high"):
            if _check_real(owner, name, getattr(self, name)) < 0.0:
                raise ValueError(f"{owner}.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.dual_clip_c is not None and _check_real(owner, "dual_clip_c", self.dual_clip_c) <= 1.0:
            raise ValueError(f"{owner}.dual_clip_c must be > 1 (or None), got {self.dual_clip_c!r}")
        for name in ("kl_coef", "entropy_coef"):
            if _check_real(owner, name, getattr(self, name)) < 0.0:
                raise ValueError(f"{owner}.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("kl_clamp", "tis_clip_high"):
            if _check_real(owner, name, getattr(self, name)) <= 0.0:
                raise ValueError(f"{owner}.{name} must be > 0, got {getattr(self, name)!r}")
        if _check_real(owner, "mis_low", self.mis_low) <= 0.0:
            raise ValueError(f"{owner}.mis_low must be > 0, got {self.mis_low!r}")
        if _check_real(owner, "mis_high", self.mis_high) <= self.mis_low:
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
