"""The layer-by-layer rollout model: each main layer dequantised right before it runs (rl/rollout/engine.py).

Layer-wise dequantisation (`LayerwiseWeights`, the sampler's default `dequant="per_layer"`): the sampler's weight
state stays as it is stored (FP8 / FP4 blocks + scales, `{path key: QuantizedTensor | array}`, the push's
contract); inside the prefill and every decode step, layer i's weights are dequantised right before layer i runs.
A data dependence of layer i's quantised bytes and scales on the residual stream entering layer i (`tie_to`: a
`lax.cond` per layer on XLA:CPU, an `optimization_barrier` elsewhere) ties the dequantisation to it, so XLA can
neither hoist it (or a conversion of the bytes) out of the decode loop nor start it before layer i - 1 has produced
its output: at most one layer's dequantised weights (plus, on XLA:CPU, one layer's copied bytes) are alive at a
time, and the model outside the layers (embedding, head; never quantised) is used as stored. The layers run in a
Python loop (unrolled), not under `dsv4.scan`: scanning needs the weights stacked per layer group, i.e. either a
stacked resident state (the push and checkpoint paths, and every reader of `Sampler.weight_state()`, use per-layer
keys) or a stacked copy inside the program (one more copy of the FP8 weights, the bytes this module exists to save).

Activations as the release quantises them: the release's `linear` quantises a GEMM's input to FP8 per 1 x 128 block
with power-of-two (ue8m0) scales (`dsv4.quant.act_quant`) before every FP8 and FP4 GEMM. So the Linear projections
of the FP8 set that go through `dsv4.layers.linear` (attention wq_a, wq_b, wkv, wo_b, the indexer's wq_b (f32
out); shared experts w1, w2, w3: `GEMM_KEYS`), the grouped wo_a (`dsv4.fp8_gemm.grouped_quantized_linear`: its 8
groups as the experts of one FP8 expert GEMM; the release dequantises it to bf16 offline, its GEMM kernel having no
grouped form) and the routed experts (FP8 or FP4) stay `QuantizedTensor`s inside the layer, and the layer quantises
their inputs (`dsv4.fp8_gemm.quantized_linear`, `dsv4.moe.MoE`: the w1/w3 input and the w2 input). The MTP
projections are dequantised and multiply unquantised activations; the indexer's scores over an FP8 key cache run an
FP8 dot where the layer's GEMMs do (`dsv4.indexer.Indexer.scores`).

FP8 GEMMs (`matmul="auto"`): where XLA has FP8 GEMMs (`dsv4.fp8_gemm.fp8_gemm_available`: CUDA sm90+, ROCm
gfx942/gfx950) the `GEMM_KEYS` projections run as `dsv4.fp8_gemm.fp8_linear` (FP8 operands, f32 accumulation) by
the block-scaled GEMM kernel (`dsv4.fp8_kernel`); elsewhere (`matmul="dequant"`) the fake-quantised activations
multiply the dequantised weights (the same products, XLA's summation order). `matmul="kernel"` forces the kernel
(Pallas' interpreter on CPU), `matmul="fp8"` XLA's FP8 dots with K-block partials (also on CPU, where XLA upcasts:
a numerics check); the choice travels as the weights' `QuantizedTensor.matmul` (`select_fp8_matmul`).
The routed experts run FP8 GEMMs too where the expert dispatch has them (`parallel.expert.make_ep_dispatch` backends
"padded" / "sized", the GPU rollout's default on an expert mesh: `fp8_experts`): the layer keeps them quantised
(FP4 experts become FP8 blocks inside the layer, `dsv4.rollout_format.layer_value`) and the dispatch multiplies FP8
rows by the FP8 blocks (`dsv4.fp8_gemm.fp8_expert_matmul`) in its buffers of up to `parallel.padded.fp8_rows_limit`
rows per expert (dequantising the rank's experts in larger ones); any other dispatch dequantises them as before.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.fp8_gemm import fp8_gemm_available
from dsv4.names import param_key
from dsv4.rollout_format import layer_value

log = logging.getLogger(__name__)

DEQUANT_MODES = ("per_layer", "per_call", "per_step")
MATMUL_MODES = ("auto", "dequant", "fp8", "kernel")


def select_fp8_matmul(matmul: str, fp8: bool, devices=None) -> str:
    """How the FP8-set projections and the routed experts multiply (the `dsv4.quant.QuantizedTensor.matmul` they
    get): `matmul` "auto": the block-scaled FP8 GEMM kernel ("pallas", `dsv4.fp8_kernel`) where
    `fp8_gemm_available` (a GPU), else "dequant"; "kernel": the kernel, in Pallas' interpreter on CPU ("interpret":
    a numerics check, slow); "fp8": XLA's FP8 dots with K-block partials (on CPU XLA upcasts: a numerics check);
    "dequant". "dequant" for dense weights. Logs the choice and the reason. devices: default `jax.devices()`.
    Raises ValueError for an unknown `matmul`."""
    if matmul not in MATMUL_MODES:
        raise ValueError(f"Sampler matmul={matmul!r}: expected {' | '.join(MATMUL_MODES)}")
    if not fp8:
        return "dequant"
    if matmul == "auto":
        ok, why = fp8_gemm_available(devices)
        mode, reason = ("pallas" if ok else "dequant"), f"auto: {why}"
    else:
        cpu = list(jax.devices() if devices is None else devices)[0].platform == "cpu"
        mode = ("interpret" if cpu else "pallas") if matmul == "kernel" else matmul
        reason = f"configured: {matmul}"
    log.info("rollout matmuls: %s (%s)", mode, reason)
    return mode


TIE_MODES = ("cond", "barrier")


def default_tie(devices=None) -> str:
    """How `tie_to` makes a layer's quantised bytes depend on the residual stream: "cond" on XLA:CPU,
    "barrier" elsewhere (see `tie_to`). devices: default `jax.devices()`."""
    devs = list(jax.devices() if devices is None else devices)
    return "cond" if devs[0].platform == "cpu" else "barrier"


def tie_to(x: jax.Array, leaves: tuple, tie: str = "cond") -> tuple:
    """`leaves` (a tuple of arrays: one layer's FP8 / FP4 bytes and scales) given a data dependence on `x`,
    bitwise unchanged (cond: zeros when x's first element is NaN, whose output is NaN anyway). XLA can then
    neither hoist the layer's dequantisation (nor any conversion of its bytes) out of the decode loop by
    loop-invariant code motion, nor schedule it before x exists: at most one layer's dequantised weights are
    alive at a time.

    tie "cond": one `lax.cond` on (x_0 != x_0) per layer, whose taken branch returns the leaves: a copy of one
    layer's quantised bytes per call, and nothing left for XLA to hoist. On XLA:CPU every op on f8 bytes is
    rewritten through f16 and `optimization_barrier` is expanded before the loop passes, so an elementwise
    dependence (a select or OR on the bytes) leaves a q-only conversion that XLA hoists out of the decode loop:
    a converted copy of every layer's bytes held across the loop (u8: +0.22x the unquantised weights on
    `small`, f16: +0.40x; benchmarks/README.md, "Compiled memory of the generate program").
    tie "barrier" (the default off CPU): one `optimization_barrier` over (x, leaves): the leaves come out of it
    unchanged and no copy is made, and anything computed from them depends on x. XLA:GPU keeps the barrier through
    its loop passes. It replaced a `select(x_0 != x_0, 0, leaf)` per leaf, which fused into a dequantisation but, in
    front of an FP8 GEMM that reads the bytes as stored, copied every tied tensor per call: on the 4-layer seed
    rollout (MI308X proxy) temporaries 2.01 -> 1.27 GiB, decode step 33.15 -> 26.55 GiB of HBM traffic
    (benchmarks/README.md, "The decode step against its physical limit"); not yet run on a GPU
    (benchmarks/gpu_check.sh does).
    Raises ValueError for an unknown `tie`."""
    if tie not in TIE_MODES:
        raise ValueError(f"tie={tie!r}: expected {' | '.join(TIE_MODES)}")
    if not leaves:
        return leaves
    if tie == "barrier":
        return tuple(jax.lax.optimization_barrier((x, tuple(leaves)))[1])
    x0 = x.reshape(-1)[0]
    return jax.lax.cond(x0 != x0, lambda ls: tuple(jnp.zeros_like(v) for v in ls), lambda ls: tuple(ls), leaves)


class LayerwiseWeights:
    """Builds the rollout model from a weight state one main layer at a time (see the module docstring).

    Args:
      abstract_model: the sampler's `nnx.eval_shape`d DSV4ForCausalLM (graph and variable types).
      compute_dtype: dtype quantised weights are dequantised to. fp8_matmul: how `GEMM_KEYS` weights and the routed
        experts multiply (`dsv4.quant.MATMULS`, `select_fp8_matmul`; not "dequant": they stay quantised).
      tie: "cond" | "barrier", how each layer's quantised leaves are tied to its input (`tie_to`; the sampler
        passes `default_tie(devices)`).
    Use inside a jit: `shell = lw.shell(wstate)` (the model without its layers: embedding, hyper head, norm,
    head) and `layer_fn = lw.layer_fn(wstate)` for `dsv4.cache.prefill/decode_step(..., layer_fn=...)`.
    """

    def __init__(self, abstract_model, compute_dtype, *, fp8_matmul: str = "dequant", tie: str = "cond"):
        if tie not in TIE_MODES:
            raise ValueError(f"LayerwiseWeights tie={tie!r}: expected {' | '.join(TIE_MODES)}")
        self.compute_dtype = compute_dtype
        self.fp8_matmul = fp8_matmul
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
        flat = [(p, var.replace(layer_value(k, wstate[k], self.compute_dtype, matmul=self.fp8_matmul)))
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
        vals = [(p, var.replace(layer_value(k, leaves[k], self.compute_dtype, matmul=self.fp8_matmul)))
                for p, var, k in flat]
        return nnx.merge(lgd, nnx.from_flat_state(vals)), x

    def layer_fn(self, wstate: dict):
        return lambda i, x: self.layer(wstate, i, x)
