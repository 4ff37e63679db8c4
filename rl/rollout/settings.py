"""The rollout engine's settings, resolved once: one frozen object the engine (`rl.rollout.engine.Sampler`), the
planner (`launch.aot.compile_rollout`, `launch.plan`) and the run (`rl.run.wiring`, `launch.run`) all read.

    settings = EngineSettings.for_run(cfg.rollout, platform="cpu", max_prompt_len=64)   # a run's RolloutConfig
    settings = EngineSettings(weights="fp8", kv_cache_dtype="fp8", max_prompt_len=16)   # a library call
    settings.kv_layout        # "fp8" | "bf16": the cache layout the engine builds (--kv-cache-dtype resolved)
    settings.kv_bytes_format  # None | "e4m3fn": the FP8 layout's bytes for the KV-bytes arithmetic (fn / fnuz alike)

What is resolved here: `--rollout-dtype` (`dsv4.rollout_format.parse_rollout_dtype`), `--kv-cache-dtype` against it
(`kv_layout`, the one place: auto = fp8 for FP8-resident weights), the compute dtype (auto: float32 on
CPUs, whose bf16 matmuls are emulated, bfloat16 elsewhere; the weights' own dtype for fp32 weights), the dequant
and matmul modes and the slot count. What needs the model config (the prefill chunk, speculative decoding) or the
devices (the FP8 format, FP8 GEMMs, the expert dispatch) is checked by the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from dsv4.rollout_format import RolloutDtype, parse_rollout_dtype
from rl.config.run import DataConfig
from rl.config.rollout import RolloutConfig
from rl.config.tree import default, paths
from rl.rollout.layerwise import DEQUANT_MODES, MATMUL_MODES

KV_CACHE_DTYPES = paths(RolloutConfig)["kv_cache_dtype"].choices  # fp8 | bf16 | auto, declared by the knob


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Every knob of the rollout engine (docstring of `rl.rollout.engine.Sampler` for each one's meaning).

    weights: `--rollout-dtype`. max_prompt_len: the largest prompt bucket (`--max-prompt-len`). fp8_block: block of
    the FP8 scales. dequant: "per_layer" | "per_call" | "per_step". matmul: "auto" | "dequant" | "fp8".
    compute_dtype: matmul dtype (None: float32 for fp32 weights, else bfloat16). slots: 0 = static batching, N >= 1
    decode slots (`--rollout-slots`). kv_budget_bytes: KV-cache bytes per rollout device (None = unchecked).
    kv_cache_dtype: "fp8" | "bf16" | "auto" (`--kv-cache-dtype`; the one default, `RolloutConfig.kv_cache_dtype`;
    resolved by `kv_layout`). prefill_chunk, speculative, draft_tokens,
    ep_backend, ep_capacity_factor, ep_compact: `--prefill-chunk`, `--rollout.speculative`,
    `--rollout.draft_tokens`, `--rollout.ep_backend`, `--rollout.ep_capacity_factor`, `--rollout.ep_compact`.
    Raises ValueError (naming the knob) for an unknown weights / dequant / matmul / kv_cache_dtype or slots < 0.
    """

    weights: str = default(RolloutConfig, "dtype")
    max_prompt_len: int = default(DataConfig, "max_prompt_len")
    fp8_block: tuple[int, int] = (128, 128)
    dequant: str = "per_layer"
    matmul: str = default(RolloutConfig, "matmul")
    compute_dtype: Any = None
    slots: int = default(RolloutConfig, "slots")
    kv_budget_bytes: float | None = None
    kv_cache_dtype: str = default(RolloutConfig, "kv_cache_dtype")
    prefill_chunk: int = default(RolloutConfig, "prefill_chunk")
    speculative: str = default(RolloutConfig, "speculative")
    draft_tokens: int = default(RolloutConfig, "draft_tokens")
    ep_backend: str = default(RolloutConfig, "ep_backend")
    ep_capacity_factor: float | None = default(RolloutConfig, "ep_capacity_factor")
    ep_compact: bool = default(RolloutConfig, "ep_compact")

    def __post_init__(self):
        rdt = parse_rollout_dtype(self.weights)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be {' | '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dequant not in DEQUANT_MODES:
            raise ValueError(f"Sampler dequant={self.dequant!r}: expected {' | '.join(DEQUANT_MODES)}")
        if self.matmul not in MATMUL_MODES:
            raise ValueError(f"Sampler matmul={self.matmul!r}: expected {' | '.join(MATMUL_MODES)}")
        s = self.slots
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"Sampler slots={s!r} (--rollout-slots): expected an int >= 0 (0 = static batching)")
        cd = self.compute_dtype
        if cd is None:
            cd = jnp.float32 if self.weights == "fp32" else jnp.bfloat16
        object.__setattr__(self, "compute_dtype", jnp.dtype(cd))
        object.__setattr__(self, "slots", int(s))
        object.__setattr__(self, "fp8_block", tuple(self.fp8_block))

    @classmethod
    def for_run(cls, rollout: RolloutConfig, *, platform: str, max_prompt_len: int, slots: int = 0,
                kv_budget_bytes: float | None = None, compute_dtype=None) -> EngineSettings:
        """The engine of a run: its `RolloutConfig` (weights, compute dtype, FP8 GEMMs, KV cache, prefill chunk,
        speculative decoding, EP dispatch) on devices of `platform` ("cpu", "gpu", ...); `slots` / `kv_budget_bytes` as
        resolved by `rl.rollout.slots.plan_slots`; `compute_dtype` overrides the config's (the planner compiles
        in bf16 on CPU devices)."""
        if compute_dtype is None and rollout.dtype != "fp32":
            compute_dtype = rollout.compute_dtype
            if compute_dtype == "auto":
                compute_dtype = "float32" if platform == "cpu" else "bfloat16"
        return cls(weights=rollout.dtype, max_prompt_len=max_prompt_len, compute_dtype=compute_dtype, slots=slots,
                   kv_budget_bytes=kv_budget_bytes, kv_cache_dtype=rollout.kv_cache_dtype,
                   prefill_chunk=rollout.prefill_chunk, speculative=rollout.speculative,
                   draft_tokens=rollout.draft_tokens, ep_backend=rollout.ep_backend,
                   ep_capacity_factor=rollout.ep_capacity_factor, ep_compact=rollout.ep_compact,
                   matmul=rollout.matmul)

    @property
    def rdt(self) -> RolloutDtype:
        """The parsed `--rollout-dtype`."""
        return parse_rollout_dtype(self.weights)

    @property
    def kv_layout(self) -> str:
        """"fp8" | "bf16": the KV cache layout the engine builds, `--kv-cache-dtype` resolved for the weights (the
        one place it is): "auto" is fp8 for FP8 rollout weights (`--rollout-dtype fp8*`), else bf16 (the
        unquantised layout, entries in the compute dtype)."""
        if self.kv_cache_dtype == "auto":
            return "fp8" if self.rdt.fp8 else "bf16"
        return self.kv_cache_dtype

    @property
    def kv_bytes_format(self) -> str | None:
        """The FP8 format to count the KV cache's bytes with (`parallel.model_bytes.kv_cache_bytes`): "e4m3fn" for the FP8
        layout (e4m3fnuz has the same bytes), None for the unquantised one."""
        return "e4m3fn" if self.kv_layout == "fp8" else None
