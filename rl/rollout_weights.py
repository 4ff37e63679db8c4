"""Rollout weight formats and the layer-by-layer model the sampler runs (rl/sampler.py).

`--rollout-dtype` (`Sampler(weights=...)`, `parse_rollout_dtype`):
  fp8 | fp8_e4m3fn   FP8 e4m3fn 128x128 blocks (f32 scales) for the released FP8 set and the routed experts
  fp8_e4m3fnuz       the same, exactly converted to e4m3fnuz (AMD gfx942)
  auto               fp8 in the format of the device (`dsv4.quant.select_fp8_format`)
  fp8+fp4experts     FP8 blocks for the FP8 set, routed experts FP4 e2m1 with 1x32 power-of-two (ue8m0) scales,
                     as the official checkpoint stores them (half the expert bytes of FP8)
  bf16 | fp32        dense

Layer-wise dequantisation (`LayerwiseWeights`, the sampler's default `dequant="per_layer"`): the sampler's weight
state stays as it is stored (FP8 / FP4 blocks + scales, `{path key: QuantizedTensor | array}`, the push's
contract); inside the prefill and every decode step, layer i's weights are dequantised right before layer i runs.
A data dependence of layer i's quantised bytes and scales on the residual stream entering layer i (`tie_to`: a
`lax.cond` per layer on XLA:CPU) ties the dequantisation to it, so XLA can neither hoist it (or a conversion of the
bytes) out of the decode loop nor start it before layer i - 1 has produced its output: at most one layer's
dequantised weights (plus one layer's copied bytes) are alive at a time, and the model outside the layers
(embedding, head; never quantised) is used as stored. The layers run in a Python loop (unrolled), not
under `dsv4.scan`: scanning needs the weights stacked per layer group, i.e. either a stacked resident state (the
push and checkpoint paths, and every reader of `Sampler.weight_state()`, use per-layer keys) or a stacked copy
inside the program (one more copy of the FP8 weights, the bytes this module exists to save).

Activations as the release quantises them: the release's `linear` quantises a GEMM's input to FP8 per 1 x 128 block
with power-of-two (ue8m0) scales (`dsv4.quant.act_quant`) before every FP8 and FP4 GEMM. So the Linear projections
of the FP8 set that go through `dsv4.layers.linear` (attention wq_a, wq_b, wkv, wo_b; shared experts w1, w2, w3:
`GEMM_KEYS`) and the routed experts (FP8 or FP4) stay `QuantizedTensor`s inside the layer, and the layer quantises
their inputs (`dsv4.fp8_gemm.quantized_linear`, `dsv4.moe.MoE`: the w1/w3 input and the w2 input). The grouped
wo_a (a bf16 einsum in the release too), the indexer's wq_b (f32 here; an FP8 GEMM in the release) and the MTP
projections are dequantised and multiply unquantised activations.

FP8 GEMMs (`matmul="auto"`): where XLA has FP8 GEMMs (`dsv4.fp8_gemm.fp8_gemm_available`: CUDA sm90+, ROCm
gfx942/gfx950) the `GEMM_KEYS` projections run as `dsv4.fp8_gemm.fp8_linear` (FP8 operands, f32 accumulation);
elsewhere (`matmul="dequant"`) the fake-quantised activations multiply the dequantised weights (the same products,
XLA's summation order). `matmul="fp8"` forces the FP8 GEMMs (also on CPU, where XLA upcasts: a numerics check).
The routed experts always take the dequantised path (there is no grouped FP8 GEMM in XLA).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.cache import resolve_kv_cache_dtype
from dsv4.fp8_gemm import FakeQuantWeight, fp8_gemm_available
from dsv4.names import param_key

log = logging.getLogger(__name__)

ROLLOUT_DTYPES = ("fp8", "fp8_e4m3fn", "fp8_e4m3fnuz", "e4m3fn", "e4m3fnuz", "auto", "fp8+fp4experts", "bf16",
                  "fp32")
DEQUANT_MODES = ("per_layer", "per_call", "per_step")
MATMUL_MODES = ("auto", "dequant", "fp8")
FP4_EXPERTS = "fp8+fp4experts"
# Quantised weights that run through `dsv4.layers.linear` and so can stay FP8 for an FP8 GEMM.
GEMM_KEYS = re.compile(r"(attn/(wq_a|wq_b|wkv|wo_b)/weight|ffn/shared_experts/w[123]/weight)$")
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


def kv_cache_layout(kv_cache_dtype: str, rollout_dtype: str) -> str:
    """`--kv-cache-dtype` resolved for `--rollout-dtype`: "fp8" | "bf16" (`dsv4.cache.resolve_kv_cache_dtype` with
    `parse_rollout_dtype(rollout_dtype).fp8`: auto = fp8 for FP8-resident weights). The one place the run, the
    planner and the slot sizing ask which cache layout the sampler will build. Raises ValueError naming the flag
    for a bad value of either."""
    return resolve_kv_cache_dtype(kv_cache_dtype, parse_rollout_dtype(rollout_dtype).fp8)


def select_fp8_matmul(matmul: str, fp8: bool, devices=None) -> bool:
    """Whether the FP8-set projections run as FP8 GEMMs: `matmul` "auto" (where `fp8_gemm_available`),
    "fp8" (always), "dequant" (never); always False for dense weights. Logs the choice and the reason.
    Raises ValueError for an unknown `matmul`."""
    if matmul not in MATMUL_MODES:
        raise ValueError(f"Sampler matmul={matmul!r}: expected {' | '.join(MATMUL_MODES)}")
    if not fp8:
        return False
    if matmul != "auto":
        log.info("rollout matmuls: %s (configured)", "FP8 GEMM" if matmul == "fp8" else "dequantise per layer")
        return matmul == "fp8"
    ok, why = fp8_gemm_available(devices)
    log.info("rollout matmuls: %s (auto: %s)", "FP8 GEMM" if ok else "dequantise per layer", why)
    return ok


TIE_MODES = ("cond", "select")


def default_tie(devices=None) -> str:
    """How `tie_to` makes a layer's quantised bytes depend on the residual stream: "cond" on XLA:CPU,
    "select" elsewhere (see `tie_to`). devices: default `jax.devices()`."""
    devs = list(jax.devices() if devices is None else devices)
    return "cond" if devs[0].platform == "cpu" else "select"


def tie_to(x: jax.Array, leaves: tuple, tie: str = "cond") -> tuple:
    """`leaves` (a tuple of arrays: one layer's FP8 / FP4 bytes and scales) given a data dependence on `x`,
    bitwise unchanged (zeros only when x's first element is NaN, whose output is NaN anyway). XLA can then
    neither hoist the layer's dequantisation (nor any conversion of its bytes) out of the decode loop by
    loop-invariant code motion, nor schedule it before x exists: at most one layer's dequantised weights are
    alive at a time.

    tie "cond": one `lax.cond` on (x_0 != x_0) per layer, whose taken branch returns the leaves: a copy of one
    layer's quantised bytes per call, and nothing left for XLA to hoist. On XLA:CPU every op on f8 bytes is
    rewritten through f16 and `optimization_barrier` is expanded before the loop passes, so an elementwise
    dependence (a select or OR on the bytes) leaves a q-only conversion that XLA hoists out of the decode loop:
    a converted copy of every layer's bytes held across the loop (u8: +0.22x the unquantised weights on
    `small`, f16: +0.40x; benchmarks/README.md, "Compiled memory of the generate program").
    tie "select": `select(x_0 != x_0, 0, leaf)` per leaf (no copy, fuses into the dequantisation) for backends
    with native f8 elementwise ops; unverified on a GPU so far (benchmarks/gpu_check.sh compiles it there).
    Raises ValueError for an unknown `tie`."""
    if tie not in TIE_MODES:
        raise ValueError(f"tie={tie!r}: expected {' | '.join(TIE_MODES)}")
    if not leaves:
        return leaves
    x0 = x.reshape(-1)[0]
    bad = x0 != x0
    if tie == "cond":
        return jax.lax.cond(bad, lambda ls: tuple(jnp.zeros_like(v) for v in ls), lambda ls: tuple(ls), leaves)
    return tuple(jax.lax.select(jnp.broadcast_to(bad, v.shape), jnp.zeros_like(v), v) for v in leaves)


def layer_value(key: str, v, dtype, *, fp8_gemm: bool):
    """One weight-state entry as a layer uses it: a dense array (`v` itself, or `v` dequantised to `dtype`), or for
    the release's quantised GEMMs (`GEMM_KEYS` FP8 weights, routed experts) the `QuantizedTensor` with its `matmul`
    set ("fp8" for the FP8-GEMM projections when `fp8_gemm`, else "dequant"); see the module docstring."""
    if not isinstance(v, quant.QuantizedTensor):
        return v
    if quant.ROUTED_EXPERT_RE.search(key):
        return dataclasses.replace(v, matmul="dequant")
    if v.kind == "fp8" and GEMM_KEYS.search(key):
        return dataclasses.replace(v, matmul="fp8" if fp8_gemm else "dequant")
    return v.dequantize(dtype)


class LayerwiseWeights:
    """Builds the rollout model from a weight state one main layer at a time (see the module docstring).

    Args:
      abstract_model: the sampler's `nnx.eval_shape`d DSV4ForCausalLM (graph and variable types).
      compute_dtype: dtype quantised weights are dequantised to. fp8_gemm: keep `GEMM_KEYS` weights quantised.
      tie: "cond" | "select", how each layer's quantised leaves are tied to its input (`tie_to`; the sampler
        passes `default_tie(devices)`).
    Use inside a jit: `shell = lw.shell(wstate)` (the model without its layers: embedding, hyper head, norm,
    head) and `layer_fn = lw.layer_fn(wstate)` for `dsv4.cache.prefill/decode_step(..., layer_fn=...)`.
    """

    def __init__(self, abstract_model, compute_dtype, *, fp8_gemm: bool = False, tie: str = "cond"):
        if tie not in TIE_MODES:
            raise ValueError(f"LayerwiseWeights tie={tie!r}: expected {' | '.join(TIE_MODES)}")
        self.compute_dtype = compute_dtype
        self.fp8_gemm = fp8_gemm
        self.tie = tie
        gd, st = nnx.split(abstract_model)
        shell = nnx.merge(gd, st)
        shell.layers = nnx.List([])
        self._shell_gd, shell_state = nnx.split(shell)
        self._shell_flat = list(nnx.to_flat_state(shell_state))
        self._layers = []
        for i, layer in enumerate(abstract_model.layers):
            lgd, lst = nnx.split(layer)
            self._layers.append((lgd, [(p, var, f"layers/{i}/{param_key(p)}") for p, var in nnx.to_flat_state(lst)]))

    def shell(self, wstate: dict):
        """The model without its main layers, from `wstate` ({path key: QuantizedTensor | array})."""
        flat = [(p, var.replace(layer_value(k, wstate[k], self.compute_dtype, fp8_gemm=self.fp8_gemm)))
                for p, var in self._shell_flat for k in (param_key(p),)]
        return nnx.merge(self._shell_gd, nnx.from_flat_state(flat))

    def layer(self, wstate: dict, i: int, x: jax.Array):
        """(Block i with dense (or FP8-GEMM) weights, x): the dequantisation starts only once x is known
        (`tie_to`: the layer's quantised bytes and scales depend on x)."""
        lgd, flat = self._layers[i]
        leaves = {k: wstate[k] for _, _, k in flat}
        qkeys = [k for _, _, k in flat if isinstance(leaves[k], quant.QuantizedTensor)]
        tied = tie_to(x, tuple(a for k in qkeys for a in (leaves[k].q, leaves[k].scale)), self.tie)
        for j, k in enumerate(qkeys):
            leaves[k] = dataclasses.replace(leaves[k], q=tied[2 * j], scale=tied[2 * j + 1])
        vals = [(p, var.replace(layer_value(k, leaves[k], self.compute_dtype, fp8_gemm=self.fp8_gemm)))
                for p, var, k in flat]
        return nnx.merge(lgd, nnx.from_flat_state(vals)), x

    def layer_fn(self, wstate: dict):
        return lambda i, x: self.layer(wstate, i, x)


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
            lv = layer_value(k, v, rf.compute_dtype, fp8_gemm=False)
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
