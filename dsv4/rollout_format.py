"""Rollout weight formats: how the rollout stores each weight of the model.

`--rollout-dtype` (`Sampler(weights=...)`, `parse_rollout_dtype`):
  fp8 | fp8_e4m3fn   FP8 e4m3fn 128x128 blocks (f32 scales) for the released FP8 set and the routed experts
  fp8_e4m3fnuz       the same, exactly converted to e4m3fnuz (AMD gfx942)
  auto               fp8 in the format of the device (`dsv4.quant.select_fp8_format`)
  fp8+fp4experts     FP8 blocks for the FP8 set, routed experts FP4 e2m1 with 1x32 power-of-two (ue8m0) scales,
                     as the official checkpoint stores them (half the expert bytes of FP8)
  bf16 | fp32        dense

The rule from learner weights to rollout weights (`RolloutFormat`, `layer_value`): what the rollout engine
(rl/rollout/engine.py) stores and what the FP8-aware learner's forward (`fp8_aware_params`) sees.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.fp8_gemm import FakeQuantWeight
from dsv4.names import param_key


ROLLOUT_DTYPES = ("fp8", "fp8_e4m3fn", "fp8_e4m3fnuz", "e4m3fn", "e4m3fnuz", "auto", "fp8+fp4experts", "bf16",
                  "fp32")
FP4_EXPERTS = "fp8+fp4experts"
# Quantised weights that run through `dsv4.layers.linear` (wo_a: `dsv4.fp8_gemm.grouped_quantized_linear`) and so can
# stay FP8 for an FP8 GEMM (the release's `linear`: FP8 activations times the FP8 blocks).
GEMM_KEYS = re.compile(r"(attn/(wq_a|wq_b|wkv|wo_a|wo_b|indexer/wq_b)/weight|ffn/shared_experts/w[123]/weight)$")
# Float leaves the rollout keeps in their own dtype (mHC, attention sinks, APE, the router's bias); every other
# float leaf that is not quantised is cast to the sampler's compute dtype.
KEEP_F32 = re.compile(r"(hc_|attn_sink|/ape$|gate/bias$)")


@dataclasses.dataclass(frozen=True)
class RolloutDtype:
    """A parsed `--rollout-dtype`: fp8 (FP8 blocks resident), fp8_name (the format name for
    `quant.select_fp8_format`, None when dense), fp4_experts (routed experts as FP4 e2m1)."""

    name: str
    fp8: bool
    fp8_name: str | None
    fp4_experts: bool


def parse_rollout_dtype(weights: str) -> RolloutDtype:
    """`--rollout-dtype` value -> RolloutDtype. Raises ValueError naming the flag and the accepted values."""
    if weights not in ROLLOUT_DTYPES:
        raise ValueError(f"--rollout-dtype / Sampler weights={weights!r}: expected one of {' | '.join(ROLLOUT_DTYPES)}")
    if weights in ("bf16", "fp32"):
        return RolloutDtype(weights, False, None, False)
    if weights == FP4_EXPERTS:
        return RolloutDtype(weights, True, "fp8", True)
    return RolloutDtype(weights, True, weights, False)


def layer_value(key: str, v, dtype, *, matmul: str):
    """One weight-state entry as a layer uses it: a dense array (`v` itself, or `v` dequantised to `dtype`), or for
    the release's quantised GEMMs (`GEMM_KEYS` FP8 weights, routed experts) the `QuantizedTensor` with its `matmul`
    set to `matmul` (`dsv4.quant.MATMULS`: "dequant", or how its FP8 GEMMs run); see the module docstring. FP4
    routed experts under FP8 GEMMs become FP8 128 x 128 blocks here, inside the layer
    (`quant.fp4_to_fp8_blockwise`: exact while a tile's 1 x 32 scales span <= 14 binades; one layer's experts as FP8
    bytes, not bf16), so they run the same FP8 expert GEMMs."""
    if not isinstance(v, quant.QuantizedTensor):
        return v
    if quant.ROUTED_EXPERT_RE.search(key):
        if matmul == "dequant":
            return dataclasses.replace(v, matmul="dequant")
        if v.kind == "fp4":
            q, s = quant.fp4_to_fp8_blockwise(v.q, v.scale, fp4_block=v.block[1])
            return quant.QuantizedTensor(q=q, scale=s, kind="fp8", fmt="e4m3fn", block=(128, 128), shape=v.shape,
                                         matmul=matmul)
        return dataclasses.replace(v, matmul=matmul)
    if v.kind == "fp8" and GEMM_KEYS.search(key):
        return dataclasses.replace(v, matmul=matmul)
    return v.dequantize(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutFormat:
    """How the rollout stores each learner weight (`Sampler.quantize_weights`, and the FP8-aware learner's forward,
    `fp8_aware_params`, read the same rule): rdt the parsed `--rollout-dtype`; fmt the resolved fp8 format
    ("e4m3fn" | "e4m3fnuz"; None for dense rollouts); block the FP8 scale block; compute_dtype the dtype dense
    weights are cast to (and quantised ones dequantised to)."""

    rdt: RolloutDtype
    fmt: str | None
    block: tuple[int, int] = (128, 128)
    compute_dtype: Any = jnp.bfloat16

    def kind(self, key: str, ndim: int) -> str | None:
        """"fp8" | "fp4" | None: how the rollout quantises the weight at path `key` (ndim: its rank): the released
        FP8 set and the routed experts when the rollout is FP8 (routed experts FP4 under fp8+fp4experts)."""
        if not (self.rdt.fp8 and ndim >= 2):
            return None
        if quant.ROUTED_EXPERT_RE.search(key):
            return "fp4" if self.rdt.fp4_experts else "fp8"
        return "fp8" if quant.FP8_WEIGHT_RE.search(key) else None

    def value(self, key: str, x: jax.Array, stored_dtype) -> Any:
        """One learner weight x (any float dtype, [..., out, in] for quantised keys) as the rollout stores it: a
        `QuantizedTensor` (FP8 by `dsv4.quant.quantize_rollout_fp8`; FP4 from the bf16-rounded values), a float
        cast to `compute_dtype` (except `KEEP_F32` leaves), or x cast to `stored_dtype` (the model's dtype)."""
        kind = self.kind(key, x.ndim)
        if kind == "fp4":  # bf16-rounded like the FP8 path, then e2m1 + 1x32 scales
            return quant.QuantizedTensor.from_fp4(x.astype(quant.ROLLOUT_FP8_SOURCE_DTYPE).astype(jnp.float32))
        if kind == "fp8":
            return quant.quantize_rollout_fp8(x, fmt=self.fmt, block=self.block)
        if jnp.issubdtype(x.dtype, jnp.floating) and not KEEP_F32.search(key):
            return x.astype(self.compute_dtype)
        return x.astype(stored_dtype)


def fp8_aware_params(params, rf: RolloutFormat):
    """The FP8-aware learner's weights (`LearnerConfig.fp8_forward`): nnx.State of Params (per layer or stacked by
    `dsv4.scan`; any float dtype) -> the same State whose values are the rollout's (`rf.value`, then `layer_value`:
    dequantised FP8 / FP4, dense weights cast to the compute dtype), each straight-through to its master
    (`dsv4.quant.straight_through`: the forward sees the rollout's values bitwise, the gradient reaches the master
    unchanged). Weights the rollout multiplies by quantised activations (`GEMM_KEYS`, routed experts) become
    `dsv4.fp8_gemm.FakeQuantWeight`s, so their layers quantise their inputs as the rollout's do. Jittable."""
    flat = []
    for p, var in nnx.to_flat_state(params):
        k, w = param_key(p), var.get_value()
        v = rf.value(k, w, w.dtype)
        if isinstance(v, quant.QuantizedTensor):
            lv = layer_value(k, v, rf.compute_dtype, matmul="dequant")
            if isinstance(lv, quant.QuantizedTensor):  # the routed experts quantise to e4m3fn whatever the weight
                fmt = "e4m3fn" if (lv.kind == "fp4" or quant.ROUTED_EXPERT_RE.search(k)) else lv.fmt
                new = FakeQuantWeight(w=quant.straight_through(w, lv.dequantize(rf.compute_dtype)), fmt=fmt)
            else:
                new = quant.straight_through(w, lv)
        elif v.dtype != w.dtype:
            new = quant.straight_through(w, v)
        else:
            new = w
        flat.append((p, var.replace(new)))
    return nnx.from_flat_state(flat)


def check_fp4_experts(wstate: dict, *, source: str = "weights") -> None:
    """ValueError unless every routed-expert tensor of `wstate` is an FP4 `QuantizedTensor` (what
    `--rollout-dtype fp8+fp4experts` runs on); names the first offending key and what it holds."""
    found = False
    for k, v in wstate.items():
        if quant.ROUTED_EXPERT_RE.search(k):
            found = True
            if not (isinstance(v, quant.QuantizedTensor) and v.kind == "fp4"):
                held = f"{v.kind} blocks" if isinstance(v, quant.QuantizedTensor) else f"dense {v.dtype}"
                raise ValueError(f"--rollout-dtype {FP4_EXPERTS}: {source} have no FP4 routed experts ({k} holds "
                                 f"{held}); use --rollout-dtype fp8, or a checkpoint with FP4 (e2m1) experts")
    if not found:
        raise ValueError(f"--rollout-dtype {FP4_EXPERTS}: {source} hold no routed-expert tensors")
