"""The KV-cache budget of a rollout on XLA:CPU: the host's memory, not an assumed GPU's.

On a CPU host every XLA device (`--xla_force_host_platform_device_count`) lives in the same RAM, so the memory plan
of parallel/plan.py, made for a GPU's HBM per device, is re-read for the host: what each role holds per device
(weights, optimizer state, activations: the plan's items, whatever the GPU) times its devices, out of the host's
memory (physical RAM, or the cgroup's limit when lower) with the plan's usable fraction and rollout reserve; what
is left is split over the rollout devices (`cpu_kv_budget`). `rl.rollout.slots.kv_budget_from_plan` uses it on CPU, so
`--rollout-slots N` is checked against the RAM the run really has.
"""

from __future__ import annotations

import os

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def host_memory_bytes() -> int:
    """Bytes of memory this process may use: physical RAM, or the cgroup's memory limit when lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def cpu_kv_budget(report, host_bytes: float) -> float:
    """KV-cache bytes per rollout device on a CPU host of `host_bytes` (>= 0), from a `parallel.plan.PlanReport`
    of the run's mesh: host_bytes x usable fraction, less the rollout reserve (its fraction of that), less every
    device's planned contents (actor: `gpu_total`; rollout: its items but the GPU-sized reserve and, colocated,
    the actor state counted with the actor), split over the rollout devices."""
    a, r, o = report.actor, report.rollout, report.options
    usable = host_bytes * o["usable_fraction"]
    held = sum(v for k, v in r.items.items() if not k.startswith(("reserve", "actor state resident")))
    need = a.devices * a.gpu_total + r.devices * held  # one RAM: colocated or not, every device's contents add up
    free = usable * (1 - o["rollout_reserve"]) - need
    return max(0.0, free / max(1, r.devices))
