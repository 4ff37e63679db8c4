"""Group-relative advantages (GRPO, Dr.GRPO, RLOO) and DAPO dynamic sampling: pure functions of rewards.

Layout: rewards are a flat [N] array, N = num_prompts * group_size, group-major (prompt 0's G samples first,
then prompt 1's, ...), so `rewards.reshape(num_prompts, group_size)` gives one row per prompt.

Choices:
- The group std is the *unbiased* one (ddof=1), as in the GRPO reference implementations; eps is added to it.
- A group whose rewards are all equal carries no learning signal; its advantages are set to exactly 0 (not
  to a float residue of r - mean(r)), and `rollout/zero_std_frac` reports how many such groups there were.
- Batch normalisation (REINFORCE++ style whitening) runs after the group step. After group centring the batch
  mean is already 0 in exact arithmetic, so subtracting it only removes rounding; zero-std groups stay 0.
- Everything except `DynamicSampler` is jittable (group_size and flags are static Python values).
  `DynamicSampler` is host-side bookkeeping over numpy arrays, called by the loop between sampling rounds.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_advantages.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from rl.config.algo import AdvantageConfig

Metrics = dict[str, jnp.ndarray]


def _groups(rewards: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """[N] -> [N/G, G] float32, validating the static shapes."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {rewards.shape}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"len(rewards)={rewards.shape[0]} is not a multiple of group_size={group_size}")
    return jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)  # -> [P, G]


def _zero_std(r_pg: jnp.ndarray) -> jnp.ndarray:
    """[P, G] -> [P] bool: True where every reward of the group equals the first one (exact comparison)."""
    return jnp.all(r_pg == r_pg[:, :1], axis=1)


def _finish(adv_pg: jnp.ndarray, zero_pg: jnp.ndarray, *, eps: float, batch_norm: bool) -> tuple[jnp.ndarray, Metrics]:
    """Zero the constant groups, optionally whiten over the batch, flatten and collect metrics."""
    adv_pg = jnp.where(zero_pg[:, None], 0.0, adv_pg)
    if batch_norm:
        adv = adv_pg.reshape(-1)
        # Per-sample whitening with the unbiased batch std (verl's masked_whiten also uses the unbiased variance,
        # but over tokens: a deliberate difference, see AdvantageConfig.batch_norm). Batch mean is ~0 already.
        adv_pg = (adv_pg - adv.mean()) / (jnp.std(adv, ddof=1) + eps)
        adv_pg = jnp.where(zero_pg[:, None], 0.0, adv_pg)
    zero = zero_pg.astype(jnp.float32)
    metrics = {
        "rollout/zero_std_frac": zero.mean(),
        "rollout/zero_std_groups": zero.sum(),
    }
    return adv_pg.reshape(-1), metrics  # -> [N]


def grpo_advantages(
    rewards: jnp.ndarray,
    group_size: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    batch_norm: bool = False,
) -> tuple[jnp.ndarray, Metrics]:
    """GRPO outcome advantages, DeepSeekMath (arXiv 2402.03300) §4.1.1; Dr.GRPO (arXiv 2503.20783 §3).

    A_i = (r_i - mean_g(r)) / (std_g(r, ddof=1) + eps)   if scale_by_std (GRPO)
    A_i =  r_i - mean_g(r)                               otherwise (Dr.GRPO: no std division)
    then, if batch_norm: A <- (A - mean(A)) / (std(A, ddof=1) + eps) over all N samples (REINFORCE++), each
    sample counted once (verl whitens per token instead: a deliberate difference).
    Groups with all-equal rewards get A = 0 exactly.

    Args:
        rewards: [N] float, N = P * G, group-major.
        group_size: G >= 2 (static).
    Returns:
        adv [N] float32; metrics {rollout/zero_std_frac, rollout/zero_std_groups} (scalars).
    """
    r_pg = _groups(rewards, group_size)  # [P, G]
    adv_pg = r_pg - r_pg.mean(axis=1, keepdims=True)
    if scale_by_std:
        adv_pg = adv_pg / (jnp.std(r_pg, axis=1, ddof=1, keepdims=True) + eps)
    return _finish(adv_pg, _zero_std(r_pg), eps=eps, batch_norm=batch_norm)


def rloo_advantages(
    rewards: jnp.ndarray, group_size: int, *, eps: float = 1e-6, batch_norm: bool = False
) -> tuple[jnp.ndarray, Metrics]:
    """RLOO advantages (Ahmadian et al. 2024, arXiv 2402.14740 §3): A_i = r_i - mean_{j != i} r_j.

    Equal to G/(G-1) * (r_i - mean_g(r)). Shapes and metrics as `grpo_advantages`.
    """
    r_pg = _groups(rewards, group_size)  # [P, G]
    loo_mean = (r_pg.sum(axis=1, keepdims=True) - r_pg) / (group_size - 1)
    return _finish(r_pg - loo_mean, _zero_std(r_pg), eps=eps, batch_norm=batch_norm)


def compute_advantages(rewards: jnp.ndarray, group_size: int, cfg: AdvantageConfig) -> tuple[jnp.ndarray, Metrics]:
    """Dispatch on `cfg.estimator`: rewards [N] -> (advantages [N], metrics). See the two functions above."""
    if cfg.estimator == "rloo":
        return rloo_advantages(rewards, group_size, eps=cfg.eps, batch_norm=cfg.batch_norm)
    return grpo_advantages(rewards, group_size, scale_by_std=cfg.scale_by_std, eps=cfg.eps, batch_norm=cfg.batch_norm)


def dynamic_sampling_filter(rewards: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2, eq. 11 constraint 0 < |correct| < G): keep a group only if
    its rewards are not all equal.

    Args:
        rewards: [N] float, group-major; group_size: G >= 2 (static).
    Returns:
        keep [N/G] bool.
    """
    return ~_zero_std(_groups(rewards, group_size))


class DynamicSampler:
    """Host-side accumulator for DAPO dynamic sampling across sampling rounds.

    The loop samples a round of groups, calls `add_round(rewards, groups)`, and repeats while `not done`.
    Groups with all-equal rewards are dropped; the kept ones accumulate in arrival order until `target_groups`
    are held (extras from the last round are discarded, as DAPO keeps exactly the batch size) or `max_rounds`
    rounds have been added. `result()` then returns what was kept (possibly fewer than the target when the
    budget ran out) and the metrics.

    Per-group payloads (`groups`) are opaque: anything the loop wants back (indices, dicts of numpy arrays).
    When omitted, the payload is the (round, group_index_in_round) pair.
    """

    def __init__(self, *, target_groups: int, group_size: int, max_rounds: int):
        if isinstance(target_groups, bool) or not isinstance(target_groups, int) or target_groups < 1:
            raise ValueError(f"target_groups must be an int >= 1, got {target_groups!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be an int >= 1, got {max_rounds!r}")
        self.target_groups = target_groups
        self.group_size = group_size
        self.max_rounds = max_rounds
        self.rounds = 0
        self.sampled_groups = 0
        self.kept: list[Any] = []
        self.kept_rewards: list[np.ndarray] = []

    @property
    def done(self) -> bool:
        """True once the target is reached or the round budget is spent."""
        return len(self.kept) >= self.target_groups or self.rounds >= self.max_rounds

    def add_round(self, rewards: np.ndarray, groups: Sequence[Any] | None = None) -> bool:
        """Add one sampling round. rewards: [n*G] group-major or [n, G]; groups: n payloads. Returns `done`."""
        if self.done:
            raise RuntimeError("DynamicSampler.add_round called after it is done; call result()")
        r_pg = np.asarray(rewards, dtype=np.float64).reshape(-1, self.group_size)  # -> [n, G]
        if groups is None:
            groups = [(self.rounds, i) for i in range(r_pg.shape[0])]
        if len(groups) != r_pg.shape[0]:
            raise ValueError(f"got {len(groups)} group payloads for {r_pg.shape[0]} groups of rewards")
        keep = ~np.all(r_pg == r_pg[:, :1], axis=1)
        for i in np.flatnonzero(keep)[: self.target_groups - len(self.kept)]:
            self.kept.append(groups[i])
            self.kept_rewards.append(r_pg[i])
        self.rounds += 1
        self.sampled_groups += r_pg.shape[0]
        return self.done

    def result(self) -> tuple[list[Any], dict[str, float]]:
        """(kept payloads, metrics). budget_hit = 1 when the round budget ended before the target was reached."""
        metrics = {
            "rollout/dynamic_sampling/rounds": float(self.rounds),
            "rollout/dynamic_sampling/budget_hit": float(len(self.kept) < self.target_groups),
            "rollout/dynamic_sampling/kept_groups": float(len(self.kept)),
            "rollout/dynamic_sampling/sampled_groups": float(self.sampled_groups),
        }
        return list(self.kept), metrics

    def kept_rewards_array(self) -> np.ndarray:
        """[K * G] float64 rewards of the kept groups, group-major, in the order of `result()`."""
        if not self.kept_rewards:
            return np.zeros((0,), np.float64)
        return np.concatenate(self.kept_rewards)
