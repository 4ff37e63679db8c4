"""The routed experts' load the planner's roofline assumes: which capacity of the "sized" dispatch a step runs.

The sized EP backend (parallel/padded.py `sized_body`) compiles one branch per capacity of `capacity_buckets` and
runs, per call, the smallest that holds the busiest (source rank, expert) cell of that call's routing. The
optimized HLO holds every branch; launch/hlo_stats.py counts a conditional's costliest branch (the dropless top:
a conservative roofline) unless told which branch the routing picks. `peak_cell_load` says which, for a routing
model:
    worst      every token of a rank on the same experts: the top capacity (T_local: dropless)
    uniform    each token picks k distinct experts uniformly at random (an untrained router, or a perfectly
               load-balanced one in expectation): the busiest cell's load, the median over `trials` simulated steps
    balanced   every cell at its mean load ceil(T_local k / E) (the lower bound: the first capacity)
A trained router is skewed (benchmarks/README.md "EP dispatch rows": Zipf 0.6 routing needs 16x the mean), so
"uniform" is optimistic and "worst" pessimistic; the planner's default is "worst".
"""

from __future__ import annotations

import math

import numpy as np

ROUTING_LOADS = ("worst", "uniform", "balanced")


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
    peaks = []
    for _ in range(trials):
        picks = np.argsort(rng.random((ep * t_local, n_experts)), axis=1)[:, :k]  # k distinct experts per token
        counts = np.zeros((ep, n_experts), np.int64)
        np.add.at(counts, (np.repeat(np.arange(ep), t_local * k), picks.reshape(-1)), 1)
        peaks.append(int(counts.max()))
    return int(np.median(peaks))


def bucket_index(buckets: tuple[int, ...], peak: int) -> int:
    """The branch the sized dispatch runs for a busiest cell of `peak` rows: the smallest capacity holding it,
    else the last (as `sized_body` picks it)."""
    return min(sum(c < peak for c in buckets), len(buckets) - 1)
