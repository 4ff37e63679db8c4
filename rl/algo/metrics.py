"""Metric math for the RL loop: masked means, reward and response-length statistics, pass@k, host conversion.

Choices:
- Metric names are `rollout/...` for sampling-side statistics and `train/...` for the learner (rl/algo/losses.py).
- `masked_mean` returns 0 where the mask is empty instead of NaN, so empty micro-batches log cleanly.
- `pass_at_k` is the unbiased estimator of Chen et al. 2021 (Codex, arXiv 2107.03374 §2.1) in its numerically
  stable product form; it is host-side numpy, as are `response_stats` (it reads finish-reason strings) and
  `to_python`. `masked_mean` and `reward_stats` are jnp and jittable.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_metrics.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def masked_mean(x: jnp.ndarray, mask: jnp.ndarray, axis: int | tuple[int, ...] | None = None) -> jnp.ndarray:
    """sum(x * mask) / sum(mask) over `axis` (all axes when None); 0 where sum(mask) == 0.

    Args:
        x: [...] values; mask: same shape (bool or float weights).
    Returns:
        float32 array with `axis` reduced.
    """
    m = jnp.asarray(mask, jnp.float32)
    total = jnp.sum(x * m, axis=axis)
    count = jnp.sum(m, axis=axis)
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)


def reward_stats(rewards: jnp.ndarray, group_size: int) -> dict[str, jnp.ndarray]:
    """Batch reward statistics.

    Args:
        rewards: [N] float, N = P * G group-major.
        group_size: G (static).
    Returns:
        {rollout/reward_mean, rollout/reward_std (population std over the batch, ddof=0),
         rollout/zero_std_frac (fraction of groups whose G rewards are all equal)}.
    """
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1 or r.shape[0] % group_size:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size}, got {r.shape}")
    r_pg = r.reshape(-1, group_size)  # -> [P, G]
    zero = jnp.all(r_pg == r_pg[:, :1], axis=1)
    return {
        "rollout/reward_mean": r.mean(),
        "rollout/reward_std": r.std(),
        "rollout/zero_std_frac": zero.astype(jnp.float32).mean(),
    }


def response_stats(
    lengths: np.ndarray, max_new_tokens: int, finish_reasons: Sequence[str] | None = None
) -> dict[str, float]:
    """Response-length statistics (host side).

    Args:
        lengths: [N] int, generated tokens per response.
        max_new_tokens: the sampling budget.
        finish_reasons: N strings; a response is truncated when its reason is "length". When None, a response
            is truncated when lengths >= max_new_tokens.
    Returns:
        {rollout/response_len_mean, rollout/response_len_max, rollout/response_len_min, rollout/truncated_ratio}.
    """
    lengths = np.asarray(jax.device_get(lengths), dtype=np.float64).reshape(-1)
    if lengths.size == 0:
        raise ValueError("response_stats needs at least one response")
    if finish_reasons is None:
        truncated = lengths >= max_new_tokens
    else:
        if len(finish_reasons) != lengths.size:
            raise ValueError(f"{len(finish_reasons)} finish_reasons for {lengths.size} lengths")
        truncated = np.array([reason == "length" for reason in finish_reasons])
    return {
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/response_len_min": float(lengths.min()),
        "rollout/truncated_ratio": float(truncated.mean()),
    }


def pass_at_k(n: int, c: int | np.ndarray, k: int) -> float | np.ndarray:
    """Unbiased pass@k (Chen et al. 2021, arXiv 2107.03374 §2.1): 1 - C(n-c, k) / C(n, k).

    Product form: C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), which never forms large binomials.

    Args:
        n: samples per problem; c: correct samples, an int or an int array [P] (one per problem); k: 1 <= k <= n.
    Returns:
        float for scalar c, else float64 array [P].
    """
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    cs = np.asarray(c)
    if np.any(cs < 0) or np.any(cs > n):
        raise ValueError(f"need 0 <= c <= n={n}, got {c!r}")

    def one(ci: int) -> float:
        if n - ci < k:  # every k-subset contains a correct sample
            return 1.0
        return float(1.0 - np.prod(1.0 - k / np.arange(n - ci + 1, n + 1, dtype=np.float64)))

    if cs.ndim == 0:
        return one(int(cs))
    return np.array([one(int(ci)) for ci in cs.reshape(-1)], dtype=np.float64).reshape(cs.shape)


def to_python(metrics: Mapping[str, jnp.ndarray | np.ndarray | float]) -> dict[str, float]:
    """Fetch a metrics dict to the host (one device_get) and turn every scalar into a Python float."""
    host = jax.device_get(dict(metrics))
    return {name: float(np.asarray(value)) for name, value in host.items()}


def format_eval_table(metrics: Mapping[str, float], *, n_prompts: int, source: str, weights: str = "") -> str:
    """The metrics of `rl.run.loop.evaluate` as a text table (printed by --eval-only, logged by --eval-before-train).

    Rows: greedy pass@1, sampled pass@1 and pass@k (unbiased, `pass_at_k`), the mean reward of each; keys that
    are absent are left out.
    """
    k = int(metrics.get("eval/k", 0))
    rows = [("greedy pass@1", "eval/greedy_pass@1"), ("greedy reward mean", "eval/greedy_reward"),
            ("pass@1 (sampled)", "eval/pass@1"), (f"pass@{k} (sampled)", "eval/pass@k"),
            ("sampled reward mean", "eval/reward_mean")]
    head = f"eval: {n_prompts} prompts of {source}, k={k} samples each" + (f", weights {weights}" if weights else "")
    lines = [head, f"  {'metric':<22}{'value':>8}"]
    lines += [f"  {label:<22}{float(metrics[key]):>8.4f}" for label, key in rows if key in metrics]
    return "\n".join(lines)
