"""FP8 GEMM on block-scaled weights: y = x W^T with W = q * S (128x128 blocks) without dequantising W.

`fp8_linear(x, w)` quantises the activation per (row, 128-column block) to e4m3 as the DeepSeek-V4 release does
(`dsv4.quant.act_quant`: amax floored at 1e-4, power-of-two "ue8m0" scales by default; exact f32 scales as an
option), runs one `dot_general` on FP8 operands with `preferred_element_type=float32`, batched over the K blocks, and
combines the per-block partial sums with both scales:

    y[t, o] = sum_kb  sx[t, kb] * S[o // b0, kb] * sum_{c in kb} qx[t, c] q[o, c]

(the DeepSeek-V3 / DeepGEMM "fine-grained" scaling: 1x128 activation tiles, 128x128 weight tiles; f32 partials
per K block). The [KB, T, O] f32 partials are KB times the output (KB = in / 128): fine for decode batches, the
case the rollout spends its time in. Where XLA has FP8 GEMMs (CUDA sm90+, ROCm gfx942 / gfx950) the dot runs in
FP8; elsewhere (CPU) XLA upcasts the operands, so the result is the same math at FP8 operand precision.

Error against the dequantised reference `x @ dequant(W)^T`: only the activation is rounded (weights are used
exactly as stored); e4m3 has a relative rounding error <= 2^-4 per element, so |y - y_ref| <= 2^-4 * sum_i
|x_i| |W_oi| (a loose bound; typical errors are ~2^-4 / sqrt(K) relative). tests/rl/test_rollout_weights.py.
The routed experts' form (`fp8_expert_matmul`, the padded EP dispatch's expert FFN, parallel/padded.py): rows of
every local expert quantised per 1x128 (`quantize_rows` -> `Fp8Rows`), the stacked expert weights [E, O, K] kept as
FP8 128x128 blocks, and one `dot_general` per K block batched over the experts, [E, R, 128] x [E, O, 128] ->
[E, R, O] f32, on slices of the stored bytes; the per-block partials are combined with both scales in one fusion.
Where a kernel can be compiled (a GPU: `dsv4.fp8_kernel`, Pallas' Triton backend), the routed experts' form runs as
one block-scaled GEMM kernel instead, which applies the scales inside and writes no partial sum (`kernel=`).
Why per-K-block dots rather than one dot batched over (expert, K block) as `fp8_linear` does: that batch order is
not the weights' layout, so XLA:GPU copies (transposes) the whole [E, O, K] expert tensor before its batched GEMM on
every call (a layer's experts read twice and written once more); a K-block slice of the last dim fuses into the
Triton GEMM's operand (no copy; benchmarks/README.md "FP8 expert GEMMs"). What stays in f32 between the two expert
GEMMs is the scheme's own: the KB partials [E, R, O] of w1 and w3 (KB x their outputs; in the compute dtype under
the padded dispatch, bf16 on GPUs), each read once by the fusion that applies the scales (and the SwiGLU); the w2
input is FP8 again.
Sources: DeepSeek-V3 report §3.3 (fine-grained FP8 quantisation); OCP OFP8 spec (e4m3 ranges).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dsv4.fp8_kernel import BLOCK, block_scaled_matmul
from dsv4.quant import (ACT_BLOCK, ACT_SCALE_FMT, FP8_FORMATS, KERNEL_MATMULS, QuantizedTensor, act_fake_quant,
                        act_fake_quant_ste, act_quant)

# Backends whose XLA runs dot_general on f8 operands as an FP8 GEMM.
_FP8_ROCM_MARKERS = ("gfx942", "gfx950", "mi300", "mi308", "mi325", "mi350", "mi355")


def fp8_gemm_available(devices=None) -> tuple[bool, str]:
    """(True, why) when every device has FP8 GEMMs in XLA (CUDA compute capability >= 9.0, or ROCm gfx942 /
    gfx950 device kinds or architectures), else (False, why). devices: default `jax.devices()`; the abstract devices
    of a deviceless XLA:GPU target (launch/gpu_target.py) count as what they describe (the H200 spec: 9.0)."""
    devs = list(jax.devices() if devices is None else devices)
    d = devs[0]
    if d.platform == "cpu":
        return False, "CPU: XLA:CPU has no FP8 GEMM (it upcasts f8 dots)"
    kind = d.device_kind.lower()
    cc = getattr(d, "compute_capability", None)
    # ROCm first: its devices may report a gfx architecture name as their "compute capability"
    if any(m in kind or m in str(cc).lower() for m in _FP8_ROCM_MARKERS):
        return True, f"ROCm {d.device_kind} (gfx942 / gfx950 FP8)"
    if cc is not None:
        try:
            major = int(str(cc).split(".")[0])
        except ValueError:
            major = 0
        if major >= 9:
            return True, f"CUDA compute capability {cc} ({d.device_kind}) >= 9.0"
        return False, f"CUDA compute capability {cc} ({d.device_kind}) < 9.0"
    return False, f"{d.platform} {d.device_kind}: no FP8 GEMM known"


def fp8_linear(x: jax.Array, w: QuantizedTensor, dtype, *, scale_fmt: str = ACT_SCALE_FMT) -> jax.Array:
    """y[..., o] = sum_i x[..., i] W[o, i] for a block-FP8 `w` (kind 'fp8', q [O, K], scale [ceil(O/b0),
    ceil(K/b1)] f32), in `dtype`. x [..., K] any float dtype, rounded to `dtype` (the compute dtype) and then
    quantised to w's fp8 format per 1 x b1 tile by the release's rule (`dsv4.quant.act_quant`, `scale_fmt`
    "ue8m0" by default, or "f32"); the weight bytes are used as stored (no dequantised copy). Jittable.
    A kernel `w.matmul` ("pallas" / "interpret") with 128 x 128 blocks and whole-block K and O runs the block-scaled
    GEMM kernel instead (`dsv4.fp8_kernel`: no [KB, T, O] partials, no transposed copy of the weight).
    Source: DeepSeek-V4 `inference/model.py` (`linear`: act_quant, then fp8_gemm).

    Raises ValueError for a non-fp8 or non-2-d weight.
    """
    if w.kind != "fp8" or len(w.shape) != 2:
        raise ValueError(f"fp8_linear needs a 2-d fp8 QuantizedTensor, got kind={w.kind} shape={w.shape}")
    o, k = w.shape
    b0, b1 = w.block
    kb = -(-k // b1)
    lead = x.shape[:-1]
    # quantised from x in the compute dtype, as the release's act_quant reads its bf16 input
    qx, sx = act_quant(x.reshape(-1, k).astype(dtype), fmt=w.fmt, block=b1, scale_fmt=scale_fmt)  # [T, K], [T, KB]
    assert qx.dtype == FP8_FORMATS[w.fmt]
    q = w.q
    if kb * b1 != k:  # zero-pad K to whole blocks (zeros add nothing to either dot)
        qx = jnp.pad(qx, ((0, 0), (0, kb * b1 - k)))
        q = jnp.pad(q, ((0, 0), (0, kb * b1 - k)))
    t = qx.shape[0]
    if _kernel_fits(w):  # the block-scaled kernel, as one expert of T rows
        y = block_scaled_matmul(qx[None], sx[None], q[None], w.scale[None], dtype, interpret=w.matmul == "interpret")
        return y[0].reshape(*lead, o)
    part = jax.lax.dot_general(qx.reshape(t, kb, b1), q.reshape(o, kb, b1), (((2,), (2,)), ((1,), (1,))),
                               preferred_element_type=jnp.float32)  # [KB, T, O]
    sw = jnp.repeat(w.scale.astype(jnp.float32), b0, axis=0)[:o]  # [O, KB]
    y = jnp.einsum("kto,tk,ok->to", part, sx, sw)
    return y.reshape(*lead, o).astype(dtype)


class Fp8Rows(NamedTuple):
    """Activation rows quantised per 1 x 128 block (`quantize_rows`): q [..., K] fp8, s [..., ceil(K / 128)] f32
    (ue8m0 powers of two by default), x ~= q * s per block. A pytree: gathers, all_to_alls and switches map over
    both leaves."""
    q: jax.Array
    s: jax.Array


def quantize_rows(x: jax.Array, fmt: str = "e4m3fn", *, scale_fmt: str = ACT_SCALE_FMT) -> Fp8Rows:
    """x [..., K] (the compute dtype) -> `Fp8Rows` by the release's rule (`dsv4.quant.act_quant`, 1 x 128 blocks)."""
    return Fp8Rows(*act_quant(x, fmt=fmt, block=ACT_BLOCK, scale_fmt=scale_fmt))


def dequantize_rows(x: Fp8Rows, dtype) -> jax.Array:
    """q * s per 1 x 128 block: `Fp8Rows` [..., K] -> [..., K] in `dtype` (exact for ue8m0 scales: the values
    `act_fake_quant` gives)."""
    *lead, k = x.q.shape
    kb = x.s.shape[-1]
    qf = jnp.pad(x.q.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, kb * ACT_BLOCK - k)])
    return (qf.reshape(*lead, kb, ACT_BLOCK) * x.s[..., None]).reshape(*lead, kb * ACT_BLOCK)[..., :k].astype(dtype)


def _kernel_fits(w: QuantizedTensor) -> bool:
    """Whether `w` runs the block-scaled kernel: a kernel `matmul`, 128 x 128 blocks, K and O whole blocks."""
    o, k = w.q.shape[-2:]
    return w.matmul in KERNEL_MATMULS and w.block == (BLOCK, BLOCK) and not (k % BLOCK or o % BLOCK)


def fp8_expert_matmul(x: Fp8Rows, w: QuantizedTensor, partial_dtype=jnp.float32, *, out_dtype=jnp.float32
                      ) -> jax.Array:
    """y[e, r, o] = sum_kb s_x[e, r, kb] S[e, o // b0, kb] sum_{c in kb} q_x[e, r, c] q[e, o, c]: every local expert's
    rows times its FP8 block weight, on FP8 operands with f32 accumulation (module docstring).

    x: `Fp8Rows` q [E, R, K] in w's fp8 format, s [E, R, ceil(K / 128)]; w: a kind 'fp8' QuantizedTensor q [E, O, K],
    scale [E, ceil(O / b0), ceil(K / 128)] (block (b0, 128)). Returns [E, R, O] in `out_dtype`.
    w.matmul "pallas" / "interpret" (`dsv4.quant.KERNEL_MATMULS`): the block-scaled GEMM kernel (`dsv4.fp8_kernel`;
    compiled for a GPU, or Pallas' interpreter) where the blocks are 128 x 128 and K, O whole blocks: the scales
    applied inside it, no partial sum written. Else (or "fp8") XLA's dots: one dot_general per K block,
    batched over E, on slices of the stored bytes (a last block shorter than 128 is sliced, not padded: no copy),
    accumulating in f32 and returning its partial sum in `partial_dtype` (float32, or bfloat16: half the bytes
    between the GEMMs and the fusion that scales and sums them in f32, at one bf16 rounding per K block).
    Raises ValueError for a non-fp8 or non-3-d weight, a K block other than the activations' 128, or mismatched
    shapes / formats."""
    if w.kind != "fp8" or len(w.shape) != 3 or w.block[1] != ACT_BLOCK:
        raise ValueError(f"fp8_expert_matmul needs a 3-d fp8 QuantizedTensor with {ACT_BLOCK}-wide K blocks, got "
                         f"kind={w.kind} shape={w.shape} block={w.block}")
    e, o, k = w.q.shape
    if x.q.ndim != 3 or x.q.shape[0] != e or x.q.shape[2] != k or x.q.dtype != w.q.dtype:
        raise ValueError(f"fp8_expert_matmul: rows {x.q.shape} {x.q.dtype} do not match weight {w.q.shape} "
                         f"{w.q.dtype}")
    b0, b1 = w.block
    if _kernel_fits(w):
        return block_scaled_matmul(x.q, x.s, w.q, w.scale, out_dtype, interpret=w.matmul == "interpret")
    sw = jnp.repeat(w.scale.astype(jnp.float32), b0, axis=1)[:, :o]  # [E, O, KB]
    batch = (((2,), (2,)), ((0,), (0,)))  # [E, R, c] x [E, O, c] -> [E, R, O]
    y = None
    for j in range(-(-k // b1)):
        blk = slice(j * b1, min(k, (j + 1) * b1))
        part = jax.lax.dot_general(x.q[:, :, blk], w.q[:, :, blk], batch, preferred_element_type=partial_dtype)
        term = part.astype(jnp.float32) * x.s[:, :, j, None] * sw[:, None, :, j]
        y = term if y is None else y + term
    return y.astype(out_dtype)


def runs_fp8_dots(w) -> bool:
    """Whether a layer with weight `w` runs FP8 dots: an fp8 `QuantizedTensor` whose `matmul` is not "dequant" (the
    rollout's `--rollout.matmul` choice). The layer's other products on FP8 data follow it (the indexer's scores
    over the FP8 keys, `dsv4.indexer.Indexer.scores`)."""
    return isinstance(w, QuantizedTensor) and w.kind == "fp8" and w.matmul != "dequant"


def grouped_quantized_linear(x: jax.Array, w, dtype) -> jax.Array:
    """The grouped low-rank projection (wo_a, spec §5.6) on a quantised weight: x [..., G, K], w [G * O, K] (a
    `QuantizedTensor`, or the FP8-aware learner's `FakeQuantWeight`) -> [..., G, O] in `dtype`, group g's rows times
    w's rows [g O, (g + 1) O), activations quantised per 1 x 128 block as the release's `linear` does.

    FP8 dots (`runs_fp8_dots`) with O a whole number of weight blocks: the groups are experts of one FP8 expert GEMM
    (`fp8_expert_matmul`: the block-scaled kernel where `w.matmul` picks it), no dequantised copy of the weight.
    Else the fake-quantised x times the dequantised weight (`FakeQuantWeight`: straight-through), the same products
    in the same einsum (the FP8-aware learner's forward is the CPU rollout's, bitwise)."""
    *lead, g, k = x.shape
    if runs_fp8_dots(w) and (w.shape[0] // g) % w.block[0] == 0:
        o = w.shape[0] // g
        rows = quantize_rows(x.astype(dtype).reshape(-1, g, k).swapaxes(0, 1), w.fmt)  # [G, T, K]
        wg = dataclasses.replace(w, q=w.q.reshape(g, o, k), scale=w.scale.reshape(g, o // w.block[0], -1),
                                 shape=(g, o, k))
        y = fp8_expert_matmul(rows, wg, out_dtype=dtype)  # [G, T, O]
        return y.swapaxes(0, 1).reshape(*lead, g, o)
    if isinstance(w, FakeQuantWeight):
        xq, wd = act_fake_quant_ste(x.astype(dtype), fmt=w.fmt), w.w.astype(dtype)
    else:
        xq = act_fake_quant(x.astype(dtype), fmt="e4m3fn" if w.kind == "fp4" else w.fmt)
        wd = w.dequantize(dtype)
    out = jnp.float32 if jnp.dtype(dtype) == jnp.float32 else None
    return jnp.einsum("...gi,goi->...go", xq, wd.reshape(g, -1, k), preferred_element_type=out).astype(dtype)


def quantized_linear(x: jax.Array, w: QuantizedTensor, dtype, *, scale_fmt: str = ACT_SCALE_FMT) -> jax.Array:
    """The release's `linear` for a quantised weight: x [..., K] -> [..., O] in `dtype`, activations quantised per
    1 x 128 block (`act_quant`). w.matmul "fp8": `fp8_linear` (FP8 operands); "dequant": the fake-quantised x times
    the dequantised weight in `dtype` (the same products; for backends without FP8 GEMMs and for FP4 weights,
    which the release runs as an FP8 x FP4 GEMM). Jittable. Raises ValueError for a non-2-d weight."""
    if len(w.shape) != 2:
        raise ValueError(f"quantized_linear needs a 2-d weight, got shape {w.shape}")
    if w.kind == "fp8" and w.matmul != "dequant":
        return fp8_linear(x, w, dtype, scale_fmt=scale_fmt)
    xq = act_fake_quant(x.astype(dtype), fmt="e4m3fn" if w.kind == "fp4" else w.fmt, scale_fmt=scale_fmt)
    wd = w.dequantize(dtype)
    out = jnp.float32 if jnp.dtype(dtype) == jnp.float32 else None
    return jnp.einsum("...i,oi->...o", xq, wd, preferred_element_type=out).astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FakeQuantWeight:
    """A weight of the FP8-aware learner (`LearnerConfig.fp8_forward`, `dsv4.rollout_format.fp8_aware_params`) in a
    slot where the rollout holds a `QuantizedTensor` that multiplies quantised activations (the `GEMM_KEYS`
    projections, the routed experts). A jax pytree: `w` (the leaf) is the rollout's dequantised weight [..., out, in]
    in the compute dtype, straight-through to the master (`dsv4.quant.straight_through`); `fmt` (static) is the fp8
    format the layer quantises its input to, as the rollout's layer does (`quantized_linear`, `dsv4.moe.MoE`)."""

    w: Any
    fmt: str = "e4m3fn"


jax.tree_util.register_dataclass(FakeQuantWeight, data_fields=["w"], meta_fields=["fmt"])


def fake_quant_linear(x: jax.Array, w: FakeQuantWeight, dtype, *, scale_fmt: str = ACT_SCALE_FMT) -> jax.Array:
    """`quantized_linear`'s "dequant" path with straight-through gradients: x [..., K] -> [..., O] in `dtype`, x
    fake-quantised per 1 x 128 block (`act_fake_quant_ste`) times w.w [O, K]. The same ops as the rollout's
    (bitwise the same products for the same weights), differentiable to x and to the master behind w.w."""
    xq = act_fake_quant_ste(x.astype(dtype), fmt=w.fmt, scale_fmt=scale_fmt)
    out = jnp.float32 if jnp.dtype(dtype) == jnp.float32 else None
    return jnp.einsum("...i,oi->...o", xq, w.w.astype(dtype), preferred_element_type=out).astype(dtype)
