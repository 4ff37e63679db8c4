"""Which parameters carry optimizer state, and which of it lives in host memory: one rule for the learner
(rl/algo/learner.py, rl/algo/optim.py) and the planner (parallel/plan.py), so the plan describes what the learner holds.

Optimizer state of one trained parameter of n elements (rl/algo/optim.py): Adam moments 2 x n fp32, plus an fp32
master copy (n x 4 bytes) when the parameter itself is not fp32. Frozen parameters (the MTP module unless
`train_mtp`; router weights with `freeze_router`) have none. `offload_optimizer = F` keeps the whole state of
the parameters `select_offloaded` picks in host memory: largest parameters first (ties by name), each taken while
the running total stays <= F x the total state bytes (F = 1: all of it; F = 0: none). Whole parameters move
(master and both moments together), so the offloaded bytes are <= F x total, equal at F in {0, 1}.
Streaming (`ROW_STEPS`, `ROW_STREAM_MIN`): which offloaded state the learner's streamed update moves in slices.
Host memory kind: `pinned_host` (JAX memory kinds; XLA:CPU reports it, so CPU tests exercise the real path).
Tests: tests/rl/test_learner_scale.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

HOST_MEMORY_KIND = "pinned_host"
# the streamed update (rl.algo.optim.update_streamed) moves an offloaded 2-D leaf of >= ROW_STREAM_MIN elements (the
# embedding, the head) through the device in ROW_STEPS chunks of rows; stacked leaves one leading slice at a time
ROW_STEPS = 8
ROW_STREAM_MIN = 1 << 24
_ROUTER = re.compile(r"(layers|mtp)[./]\d+[./]ffn[./]gate[./]weight")


def is_trained(path: str, *, train_mtp: bool, freeze_router: bool) -> bool:
    """Whether the parameter at `path` ('layers/1/ffn/gate/weight' or 'layers.1.ffn.gate.weight') is updated."""
    if not train_mtp and (path.startswith("mtp/") or path.startswith("mtp.")):
        return False
    return not (freeze_router and _ROUTER.fullmatch(path))


def state_bytes(n_elements: int, param_dtype: str) -> int:
    """Optimizer-state bytes of one trained parameter: 2 fp32 moments + an fp32 master unless it is fp32."""
    return n_elements * (8 if str(param_dtype) == "float32" else 12)


def select_offloaded(sizes: Iterable[tuple[str, int]], fraction: float) -> frozenset[str]:
    """Names of the parameters whose optimizer state goes to host memory.

    Args:
      sizes: (parameter name, optimizer-state bytes) pairs; names only need to be unique (callers normalise
        '/' vs '.').
      fraction: in [0, 1].
    Returns:
      the largest-first prefix (ties by name) whose bytes stay <= fraction x total.
    Raises:
      ValueError: fraction outside [0, 1].
    """
    if not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"offload_optimizer (--offload-optimizer) must be in [0, 1], got {fraction}")
    items = sorted(((int(b), name) for name, b in sizes), key=lambda t: (-t[0], t[1]))
    budget = float(fraction) * sum(b for b, _ in items)
    chosen, used = [], 0
    for b, name in items:
        if used + b <= budget:
            chosen.append(name)
            used += b
    return frozenset(chosen)


def normalise(path: str) -> str:
    """'layers/1/ffn/w1' and 'layers.1.ffn.w1' -> 'layers.1.ffn.w1' (the planner's spelling)."""
    return path.replace("/", ".")
