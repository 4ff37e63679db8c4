"""The routed experts' load the planner's roofline assumes: which capacity of the "sized" dispatch a step runs.

The sized EP backend (parallel/padded.py `sized_body`) compiles one branch per capacity of `capacity_buckets` and
runs, per call, the smallest that holds the busiest (source rank, expert) cell of that call's routing. The
optimized HLO holds every branch; launch/hlo_stats.py counts a conditional's costliest branch (the dropless top:
a conservative roofline) unless told which branch the routing picks. `peak_cell_load` says which, for a routing
model:
    worst      every token of a rank on the same experts: the top capacity (T_local: dropless)
    uniform    each token picks k distinct experts uniformly at random (an untrained router, or a perfectly
               load-balanced one in expectation): the busiest cell's load, the median over `trials` simulated steps
    zipf       each token picks k distinct experts with probability ~ 1 / rank^0.6 (a skew like a trained
               router's, as benchmarks/ep_dispatch.py draws it): the busiest cell of simulated steps
    balanced   every cell at its mean load ceil(T_local k / E) (the lower bound: the first capacity)
A trained router is skewed (benchmarks/README.md "EP dispatch rows": Zipf 0.6 routing needs 16x the mean), so
"uniform" is optimistic and "worst" pessimistic; the planner's default is "worst". `drop_fraction`: the share of
routed pairs a fixed capacity drops under a routing model (the padded backend's capacity factor). `peak_expert_load`:
the busiest local expert's rows after the all_to_all (the `compact` step's second switch).
"""

from __future__ import annotations

import math

import numpy as np

ROUTING_LOADS = ("worst", "uniform", "zipf", "balanced")
ZIPF_EXPONENT = 0.6


def cell_loads(t_local: int, k: int, n_experts: int, ep: int, routing: str, rng: np.random.Generator) -> np.ndarray:
    """[ep, n_experts] rows per (source rank, expert) of one simulated dispatch under `routing` ("uniform" or
    "zipf"): each of ep x t_local tokens picks k distinct experts (Gumbel top-k)."""
    logits = np.zeros(n_experts) if routing == "uniform" else -ZIPF_EXPONENT * np.log(np.arange(1, n_experts + 1))
    picks = np.argpartition(-(logits[None, :] + rng.gumbel(size=(ep * t_local, n_experts))), k - 1, axis=1)[:, :k]
    counts = np.zeros((ep, n_experts), np.int64)
    np.add.at(counts, (np.repeat(np.arange(ep), t_local * k), picks.reshape(-1)), 1)
    return counts


def peak_cell_load(t_local: int, k: int, n_experts: int, ep: int, routing: str, trials: int = 16,
                   seed: int = 0) -> int:
    """The busiest (source rank, expert) cell's rows in one dispatch of `t_local` tokens per rank on `ep` ranks,
    `k` of `n_experts` experts per token, under `routing` (module docstring). Raises ValueError naming
    --routing-load for an unknown model."""
    if routing not in ROUTING_LOADS:
        raise ValueError(f"--routing-load must be one of {'|'.join(ROUTING_LOADS)}, got {routing!r}")
    if routing == "worst":
        return t_local
    if routing == "balanced":
        return max(1, math.ceil(t_local * k / n_experts))
    rng = np.random.default_rng(seed)
    return int(np.median([cell_loads(t_local, k, n_experts, ep, routing, rng).max() for _ in range(trials)]))


def peak_expert_load(t_local: int, k: int, n_experts: int, ep: int, capacity: int, routing: str, trials: int = 16,
                     seed: int = 0) -> int:
    """The busiest expert's rows after the all_to_all of one dispatch at `capacity` rows per (source rank, expert):
    the rows it receives from all `ep` sources, each cell cut at `capacity` (what the sized dispatch's `compact`
    step sizes its second switch by, parallel/padded.py `_buffers_ffn`); routing models as `peak_cell_load`
    ("worst": ep x capacity, "balanced": ep x the mean cell). Raises ValueError naming --routing-load."""
    if routing not in ROUTING_LOADS:
        raise ValueError(f"--routing-load must be one of {'|'.join(ROUTING_LOADS)}, got {routing!r}")
    if routing == "worst":
        return ep * capacity
    if routing == "balanced":
        return ep * min(capacity, max(1, math.ceil(t_local * k / n_experts)))
    rng = np.random.default_rng(seed)
    return int(np.median([np.minimum(cell_loads(t_local, k, n_experts, ep, routing, rng), capacity).sum(0).max()
                          for _ in range(trials)]))


def drop_stats(t_local: int, k: int, n_experts: int, ep: int, capacity: int, routing: str, trials: int = 16,
               seed: int = 0) -> tuple[float, float]:
    """(drop probability, drop fraction) of a dispatch of `capacity` rows per (source rank, expert) under `routing`:
    the share of `trials` simulated dispatches (`cell_loads`, all `ep` ranks) that drop at least one pair, and the
    share of routed pairs dropped over them ("worst": every token of a rank on the same k experts, k cells of
    `t_local` rows; "balanced": every cell at its mean). Raises ValueError naming --routing-load."""
    if routing not in ROUTING_LOADS:
        raise ValueError(f"--routing-load must be one of {'|'.join(ROUTING_LOADS)}, got {routing!r}")
    if routing == "worst":
        frac = max(0, t_local - capacity) / t_local
        return float(frac > 0), frac
    if routing == "balanced":
        mean = t_local * k / n_experts
        frac = max(0.0, mean - capacity) / mean
        return float(frac > 0), frac
    rng = np.random.default_rng(seed)
    dropped = routed = hits = 0
    for _ in range(trials):
        c = cell_loads(t_local, k, n_experts, ep, routing, rng)
        d = int(np.maximum(c - capacity, 0).sum())
        dropped, routed, hits = dropped + d, routed + int(c.sum()), hits + (d > 0)
    return hits / trials, dropped / routed


def drop_fraction(t_local: int, k: int, n_experts: int, ep: int, capacity: int, routing: str, trials: int = 16,
                  seed: int = 0) -> float:
    """The share of routed pairs a dispatch of `capacity` rows per (source rank, expert) drops under `routing`
    (`drop_stats`' second figure; the padded backend's capacity factor f: capacity = ceil(f T_local k / E))."""
    return drop_stats(t_local, k, n_experts, ep, capacity, routing, trials, seed)[1]


def drop_line(t_local: int, k: int, n_experts: int, ep: int, capacity: int, factor: float, routing: str,
              trials: int = 8) -> str:
    """The planner's line for a learner dispatch that can drop (a capacity factor `factor` = f_max, `capacity` rows
    per (source rank, expert) of `t_local` tokens per rank and call): its drop probability and expected drop
    fraction per dispatch under uniform and Zipf routing and under `routing` (--routing-load) when another."""
    models = ["uniform", "zipf"] + ([routing] if routing not in ("uniform", "zipf") else [])
    parts = []
    for r in models:
        prob, frac = drop_stats(t_local, k, n_experts, ep, capacity, r, trials=trials)
        parts.append(f"{r}: P(drop) {prob:.2f}, expected drop fraction {frac:.4f}")
    return (f"learner EP dispatch can drop: f_max {factor:g} = {capacity} rows per (source rank, expert) of "
            f"{t_local} tokens per rank (k {k} of {n_experts} experts, ep {ep}; mean load "
            f"{t_local * k / n_experts:.0f}); per dispatch, {trials} simulated (parallel/routing_load.py): "
            + "; ".join(parts) + " (train/expert_drop_frac counts the real ones)")


def bucket_index(buckets: tuple[int, ...], peak: int) -> int:
    """The branch the sized dispatch runs for a busiest cell of `peak` rows: the smallest capacity holding it,
    else the last (as `sized_body` picks it)."""
    return min(sum(c < peak for c in buckets), len(buckets) - 1)
