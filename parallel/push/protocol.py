"""The one interface of the actor -> rollout weight push: `Pusher.push(params, version) -> PushStats`.

Three transports implement it (`local.py`: one process, between two meshes or colocated, or `SamplerPusher`
without a mesh plan; `mpmd.py`: across the processes of one run; `job.py`: between two jobs); every rollout
engine's `load_weights` calls its pusher the same way and logs `PushStats.metrics()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

METRICS = ("perf/weight_push_s", "perf/weight_push_gbps")  # what the loop logs of a push (metric names: contracts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PushStats:
    """What one push reports (on the process that called `push`).

    version: the weight version pushed. seconds: wall time of the whole push on this process (staging, quantisation,
    transfer, and verification when `verified`). bytes: wire bytes (global sizes x itemsize of what crossed: fp8 q +
    f32 scales for tensors quantised on the actor, bf16 for those quantised on arrival, the stored dtype for dense
    tensors; `SamplerPusher`: 2 B per parameter, bf16). n_tensors / n_params: tensors and parameters pushed (so
    `wire_bytes_per_param` = bytes / n_params). n_chunks: device_put groups (0: a transport that does not chunk).
    verified: the rollout copy was checked against the actor's (`verify.py`). colocated: no cross-mesh transfer
    happened. quantize_on: "actor" | "rollout", where FP8 blocks were quantised. Stage times of the in-process push
    (0 elsewhere), seconds: cast_s (actor jits: casts, actor-side quantisation), transfer_s (device_put),
    quantize_s (rollout jits: reshards, quantisation on arrival), verify_s.
    """

    version: int
    seconds: float
    bytes: int
    n_tensors: int = 0
    n_params: int = 0
    n_chunks: int = 0
    verified: bool = False
    colocated: bool = False
    quantize_on: str = "actor"
    cast_s: float = 0.0
    transfer_s: float = 0.0
    quantize_s: float = 0.0
    verify_s: float = 0.0

    @property
    def gbps(self) -> float:
        """Wire GB/s: bytes / seconds / 1e9."""
        return self.bytes / max(self.seconds, 1e-12) / 1e9

    @property
    def wire_bytes_per_param(self) -> float:
        return self.bytes / max(self.n_params, 1)

    def metrics(self) -> dict[str, float]:
        """The loop's metrics of a push: {"perf/weight_push_s": seconds, "perf/weight_push_gbps": gbps}."""
        return dict(zip(METRICS, (self.seconds, self.gbps)))


@runtime_checkable
class Pusher(Protocol):
    """An actor -> rollout weight push. Built once per run for one sampler (or, across processes, once per process)."""

    def push(self, params: Any, version: int) -> PushStats:
        """Make `params` (the learner's tensors, {key: array} / nnx.State, fp32 master weights on the actor mesh;
        None on a process that only receives) the sampler's weights as `version` (> the live version); the old
        version stays live when the push fails. Returns this process's `PushStats`."""
        ...


class PushVerificationError(RuntimeError):
    """A push whose rollout copy is not faithful. `failures`: [(tensor key, reason)]; the old version stays live."""

    def __init__(self, version: int, failures: list[tuple[str, str]]):
        self.version, self.failures = version, failures
        lines = "\n".join(f"  {k}: {r}" for k, r in failures[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        super().__init__(f"weight push of version {version} failed verification for {len(failures)} tensor(s); "
                         f"the sampler keeps version in use:\n{lines}{more}")
