"""FP8 (e4m3fn / e4m3fnuz) 128x128-block weight and 1x128 activation quantisation, pure functions.

What the DeepSeek-V4 checkpoint stores (docs/dsv4-architecture.md §9.2, §12 items 23-24):
- FP8 weights `F8_E4M3` (OCP e4m3fn, max 448) with one scale per 128x128 tile, W = Q * S (S is a
  *multiplier*, shape [ceil(out/128), ceil(in/128)], stored as `F8_E8M0`, i.e. a power of two).
- FP4 routed experts stored as `I8` [out, in/2] with one e8m0 scale per 32 inputs: packed, unpacked and
  (de)quantised in `dsv4.fp4`; here only their exact conversion to FP8 tiles and their `QuantizedTensor` form.
- e8m0 scales (OCP MX spec: a byte b with value 2^(b-127)) and the numpy / jax helpers: `dsv4.scales`.

Choices:
- Every function takes numpy arrays (eager, used by the checkpoint loader; returns numpy) or jax arrays
  and tracers (jittable, used by the sampler; returns jax arrays). Static arguments (`fmt`, `block`,
  `scale_fmt`, `dtype`) are Python values: close over them or mark them static under `jax.jit`.
- Values are clipped to +-fmax *before* the cast to fp8: an overflowing cast gives NaN, not saturation
  (ml_dtypes and XLA alike; docs/jax-stack.md §4.1).
- Power-of-two scales are computed exactly (`dsv4.scales.pow2_ceil`): every scale is a *normal* f32 (XLA:CPU
  flushes subnormals to zero, which would turn a division by a tiny scale into inf).
- The MI300 (gfx942) path converts e4m3fn checkpoints to e4m3fnuz by reinterpreting bytes and doubling
  the scale (`fp8_fn_to_fnuz`), never by a value cast.

Sources: OCP 8-bit Floating Point Specification (OFP8) rev 1.0 and OCP Microscaling Formats (MX) v1.0
(e4m3fn, e8m0 encodings); ml_dtypes 0.6 (`float8_e4m3fnuz`: bias 8, 0x80 = NaN, no -0); DeepSeek-V4
`inference/convert.py` (`cast_e2m1fn_to_e4m3fn`). Tests: tests/dsv4/test_quant.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.fp4 import FP4_BLOCK, dequantize_fp4, quantize_fp4
from dsv4.scales import array_module, bitcast, e8m0_to_f32, pow2_ceil, scale_times_pow2, scale_to_f32

logger = logging.getLogger(__name__)

FP8_FORMATS: dict[str, Any] = {"e4m3fn": jnp.float8_e4m3fn, "e4m3fnuz": jnp.float8_e4m3fnuz}
KERNEL_MATMULS = ("pallas", "interpret")  # `QuantizedTensor.matmul`s that run the block-scaled FP8 GEMM kernel
MATMULS = ("fp8", "dequant") + KERNEL_MATMULS
FP8_MAX: dict[str, float] = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}
# Names accepted by `select_fp8_format` / `canonical_fp8_format` besides "auto". "fp8" means the OCP format.
FP8_ALIASES: dict[str, str] = {
    "fp8": "e4m3fn",
    "e4m3fn": "e4m3fn",
    "fp8_e4m3fn": "e4m3fn",
    "float8_e4m3fn": "e4m3fn",
    "e4m3fnuz": "e4m3fnuz",
    "fp8_e4m3fnuz": "e4m3fnuz",
    "float8_e4m3fnuz": "e4m3fnuz",
}
# NaN bytes per format: e4m3fn S.1111.111 (0x7f, 0xff); e4m3fnuz only the "negative zero" pattern 0x80.
_FP8_NAN_BYTES = {"e4m3fn": (0x7F, 0xFF), "e4m3fnuz": (0x80,)}
# Device-kind substrings of AMD CDNA3 (gfx942: MI300X, MI300A, MI308X, MI325X), whose native fp8 is fnuz.
_GFX942_MARKERS = ("gfx942", "mi300", "mi308", "mi325")

# Which model tensors are stored quantised (names with "." or "/" separators, official keys or NNX paths):
# the released checkpoint's FP8 set (spec §9.1, §12 item 24) and the routed experts (FP4 in the release).
FP8_WEIGHT_RE = re.compile(r"(attn[./](wq_a|wq_b|wkv|wo_a|wo_b)[./]weight|attn[./]indexer[./]wq_b[./]weight|"
                           r"ffn[./]shared_experts[./]w[123][./]weight|(e_proj|h_proj)[./]weight)$")
ROUTED_EXPERT_RE = re.compile(r"ffn[./]experts[./](\d+[./])?w[123]([./]weight)?$")


# -------------------------------------------------------------------------------------- format names


def canonical_fp8_format(fmt: str) -> str:
    """'e4m3fn' | 'e4m3fnuz' for any name in `FP8_ALIASES`; ValueError naming the value otherwise."""
    try:
        return FP8_ALIASES[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown fp8 format {fmt!r}; accepted: 'auto', {', '.join(map(repr, FP8_ALIASES))}") from None


def fp8_format_of(dtype) -> str:
    """'e4m3fn' | 'e4m3fnuz': the format name of an fp8 dtype; ValueError for any other dtype."""
    for name, dt in FP8_FORMATS.items():
        if np.dtype(dtype) == np.dtype(dt):
            return name
    raise ValueError(f"expected an fp8 array of {sorted(FP8_FORMATS)}, got dtype {dtype}")


# ---------------------------------------------------------------------------------------- FP8 blocks


def saturating_cast_fp8(x, fmt: str = "e4m3fn"):
    """Clip x to +-fmax, then cast to FP8_FORMATS[fmt] (a plain cast of |x| > fmax gives NaN). Jittable."""
    fmt = canonical_fp8_format(fmt)
    xp = array_module(x)
    return xp.clip(x.astype(xp.float32), -FP8_MAX[fmt], FP8_MAX[fmt]).astype(FP8_FORMATS[fmt])


def quantize_fp8_blockwise(w, *, fmt: str = "e4m3fn", block: tuple[int, int] = (128, 128), scale_fmt: str = "f32"):
    """Block-scaled fp8 quantisation over the last two dims: w [..., out, in] -> (q, scale).

    q: [..., out, in] in FP8_FORMATS[fmt]; scale: float32 [..., ceil(out/b0), ceil(in/b1)], a multiplier
    (W ~= q * scale). Per block, amax = max|w|; scale_fmt "f32": s = amax / fmax; "ue8m0": s =
    2^ceil(log2(amax / fmax)) (a power of two, storable as e8m0). All-zero blocks get s = 1; f32 scales are
    floored at the smallest normal f32. q = cast(clip(w / s, -fmax, fmax)). Shapes that are not multiples
    of `block` are zero-padded internally (zeros do not change amax) and cropped. Jittable (static kwargs).
    Errors: ValueError for ndim < 2, an empty array, an unknown fmt/scale_fmt, or (numpy path) non-finite w.
    """
    fmt = canonical_fp8_format(fmt)
    if scale_fmt not in ("f32", "ue8m0"):
        raise ValueError(f"scale_fmt must be 'f32' or 'ue8m0', got {scale_fmt!r}")
    xp = array_module(w)
    if w.ndim < 2 or w.size == 0:
        raise ValueError(f"quantize_fp8_blockwise needs a non-empty array with ndim >= 2, got shape {w.shape}")
    w = w.astype(xp.float32)
    if xp is np and not np.isfinite(w).all():
        raise ValueError("quantize_fp8_blockwise: w has NaN or inf values")
    fmax, (b0, b1) = FP8_MAX[fmt], block
    *lead, rows, cols = w.shape
    nb0, nb1 = -(-rows // b0), -(-cols // b1)
    wp = xp.pad(w, [(0, 0)] * len(lead) + [(0, nb0 * b0 - rows), (0, nb1 * b1 - cols)])
    wb = wp.reshape(*lead, nb0, b0, nb1, b1)
    amax = xp.max(xp.abs(wb), axis=(-3, -1))  # -> [..., nb0, nb1]
    if scale_fmt == "ue8m0":
        scale = pow2_ceil(xp, amax / fmax)
    else:
        scale = xp.maximum(amax / fmax, np.finfo(np.float32).tiny)
    scale = xp.where(amax > 0, scale, 1.0).astype(xp.float32)
    qb = saturating_cast_fp8(wb / scale[..., :, None, :, None], fmt)
    q = qb.reshape(*lead, nb0 * b0, nb1 * b1)[..., :rows, :cols]
    return q, scale


# ------------------------------------------------------------------------------ activation quantisation

# The release's activation quantiser (`act_quant` of DeepSeek-V4 `inference/kernel.py`, called by its `linear` before
# every FP8 and FP4 GEMM): per 1 x 128 block of the last dim, amax = max(max|x|, 1e-4); s = amax * f32(1 / fmax),
# rounded up to a power of two when `scale_fmt` is "ue8m0" (the V4 config's `scale_fmt`); q = cast(clip(x / s)).
ACT_BLOCK = 128
ACT_AMAX_FLOOR = 1e-4
ACT_SCALE_FMTS = ("ue8m0", "f32")
ACT_SCALE_FMT = "ue8m0"  # the default: the release's (V4 `ModelArgs.scale_fmt`)


def act_quant(x, *, fmt: str = "e4m3fn", block: int = ACT_BLOCK, scale_fmt: str = ACT_SCALE_FMT):
    """Activation quantisation as the DeepSeek-V4 release does it: x [..., K] -> (q [..., K] in FP8_FORMATS[fmt],
    s float32 [..., ceil(K / block)]), x ~= q * s per block. Jittable (static kwargs); numpy in, numpy out.

    Per 1 x `block` block of the last dim: amax = max(max|x|, 1e-4) (an all-zero block stores the floored scale,
    not 1); s = amax * f32(1 / fmax); scale_fmt "ue8m0" (default, the release's): s rounded up to a power of two
    (exactly, from the f32 bits, as the release's `fast_round_scale`); "f32": s as is (the release kernel's other
    mode; it uses the whole e4m3 range, so its rounding error is smaller; see benchmarks/README.md). q =
    cast(clip(x / s, -fmax, fmax)) rounding to nearest even, so the signs of zero follow x's. K not a multiple of
    `block` is zero-padded internally (zeros do not change amax). Source: DeepSeek-V4 `inference/kernel.py`
    (`act_quant_kernel`, `fast_round_scale`), `inference/model.py` (`linear`, `ModelArgs.scale_fmt = "ue8m0"`).
    fmt "e4m3fnuz" (MI300-class FP8): the e4m3fn result converted exactly (`fp8_fn_to_fnuz`, scale doubled), so
    both formats give the same values. Raises ValueError for an unknown fmt / scale_fmt.
    """
    fmt = canonical_fp8_format(fmt)
    if scale_fmt not in ACT_SCALE_FMTS:
        raise ValueError(f"activation scale_fmt must be one of {ACT_SCALE_FMTS}, got {scale_fmt!r}")
    if fmt == "e4m3fnuz":  # the e4m3fn rule, then the exact fn -> fnuz conversion (2 * s): the same values as fn,
        # as the weights' conversion keeps them, so an fnuz engine computes what the fn engine computes
        return fp8_fn_to_fnuz(*act_quant(x, fmt="e4m3fn", block=block, scale_fmt=scale_fmt), name="activation")
    xp = array_module(x)
    xf = x.astype(xp.float32)
    *lead, k = xf.shape
    nb = -(-k // block)
    if nb * block != k:
        xf = xp.pad(xf, [(0, 0)] * len(lead) + [(0, nb * block - k)])
    xb = xf.reshape(*lead, nb, block)
    amax = xp.maximum(xp.max(xp.abs(xb), axis=-1), np.float32(ACT_AMAX_FLOOR))  # -> [..., nb]
    s = (amax * np.float32(1.0 / FP8_MAX[fmt])).astype(xp.float32)
    if scale_fmt == "ue8m0":
        s = pow2_ceil(xp, s)
    q = saturating_cast_fp8(xb / s[..., None], fmt).reshape(*lead, nb * block)[..., :k]
    return q, s


def act_fake_quant(x, *, fmt: str = "e4m3fn", block: int = ACT_BLOCK, scale_fmt: str = ACT_SCALE_FMT):
    """`act_quant` then back: x [..., K] -> q * s [..., K] in x's dtype (exact in bf16 and f32 for "ue8m0": an e4m3
    value times a power of two). What the release's FP8 / FP4 GEMMs see of x, for paths that multiply by
    dequantised weights instead of running the quantised GEMM. Jittable."""
    q, s = act_quant(x, fmt=fmt, block=block, scale_fmt=scale_fmt)
    xp = array_module(x)
    k = x.shape[-1]
    nb = s.shape[-1]
    qf = q.astype(xp.float32)
    if nb * block != k:
        qf = xp.pad(qf, [(0, 0)] * (qf.ndim - 1) + [(0, nb * block - k)])
    y = (qf.reshape(*qf.shape[:-1], nb, block) * s[..., None]).reshape(*qf.shape[:-1], nb * block)[..., :k]
    return y.astype(x.dtype)


def straight_through(x, q):
    """The straight-through estimator: the value of `q` (a rounding of x: fake-quantised weights or activations) with
    the identity's gradient to `x` (Bengio et al., arXiv 1308.3432): x' + stop_gradient(q - x'), x' = x in q's dtype,
    any shape. Bitwise q in the forward: q - x' and x' + (q - x') are exact when q = 0 or q lies within a factor 2 of
    x' with its sign (Sterbenz), which every FP8 / FP4 / dtype rounding here satisfies. Jittable."""
    xc = x.astype(q.dtype)
    return xc + jax.lax.stop_gradient(q - xc)


def act_fake_quant_ste(x, *, fmt: str = "e4m3fn", block: int = ACT_BLOCK, scale_fmt: str = ACT_SCALE_FMT):
    """`act_fake_quant` in the forward (x [..., K] -> [..., K], x's dtype), the identity's gradient in the backward
    (`straight_through`): the FP8-aware learner's activations (`rl.algo.learner`, `LearnerConfig.fp8_forward`)."""
    return straight_through(x, act_fake_quant(x, fmt=fmt, block=block, scale_fmt=scale_fmt))


# The precision learner weights are rounded to before FP8 rollout quantisation: the learner's compute precision,
# and what the actor -> rollout push sends FP8-stored tensors as (parallel/push/transfer.py FP8_SOURCE_DTYPE).
ROLLOUT_FP8_SOURCE_DTYPE = jnp.bfloat16


def quantize_rollout_fp8(w, *, fmt: str = "e4m3fn", block: tuple[int, int] = (128, 128)) -> QuantizedTensor:
    """The one path from learner weights to rollout FP8 weights (every rollout version goes through it).

    w [..., out, in] (any float dtype) is rounded to `ROLLOUT_FP8_SOURCE_DTYPE` (bf16; exact for bf16 input, so
    a pushed bf16 copy and the fp32 master give the same result), quantised to e4m3fn blocks
    (`quantize_fp8_blockwise`, f32 scales), and for fmt "e4m3fnuz" converted exactly (`fp8_fn_to_fnuz`: bytes
    reinterpreted, 0x80 -> 0x00, scales x 2), so fn and fnuz engines hold numerically identical weights.
    Jittable (static fmt/block). Returns a QuantizedTensor in `fmt`.
    """
    fmt = canonical_fp8_format(fmt)
    x = w.astype(ROLLOUT_FP8_SOURCE_DTYPE).astype(jnp.float32)
    return QuantizedTensor.from_fp8(x, fmt="e4m3fn", block=block).to_fp8_format(fmt)


def dequantize_fp8_blockwise(q, scale, *, block: tuple[int, int] = (128, 128), dtype=jnp.float32):
    """W = q * scale repeated over `block` tiles and cropped: q [..., out, in], scale [..., ceil(out/b0),
    ceil(in/b1)] (float, or e8m0 bytes uint8 / float8_e8m0fnu) -> [..., out, in] in `dtype`. Jittable.

    ValueError if scale's shape does not match q's block grid.
    """
    xp = array_module(q, scale)
    b0, b1 = block
    *lead, rows, cols = q.shape
    grid = (*lead, -(-rows // b0), -(-cols // b1))
    if tuple(scale.shape) != grid:
        raise ValueError(f"fp8 scale shape {tuple(scale.shape)} does not match q {tuple(q.shape)} "
                         f"with block {block} (expected {grid})")
    s = xp.repeat(xp.repeat(scale_to_f32(scale), b0, axis=-2), b1, axis=-1)[..., :rows, :cols]
    return (q.astype(xp.float32) * s).astype(dtype)


def check_fp8_finite(q, *, name: str = "tensor") -> None:
    """numpy-side check: ValueError naming `name` when an fp8 array holds NaN bytes.

    e4m3fn NaN bytes are 0x7f/0xff; e4m3fnuz NaN is 0x80. A NaN in a checkpoint is an error, not data.
    """
    fmt = fp8_format_of(q.dtype)
    b = np.asarray(q).view(np.uint8)
    bad = np.isin(b, _FP8_NAN_BYTES[fmt])
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: {int(bad.sum())} NaN byte(s) in {fmt} data, first at index {idx} "
                         f"(byte {int(b[idx]):#04x})")


def fp8_fn_to_fnuz(q_fn, scale, *, name: str = "tensor"):
    """Exact e4m3fn -> e4m3fnuz conversion: (q_fn, scale) -> (q_fnuz, 2 * scale).

    Bytes are reinterpreted, not value-cast: for all 253 patterns finite in both formats
    value_fn == 2 * value_fnuz (fnuz has exponent bias 8, fn bias 7), so q_fnuz * (2 * scale) == q_fn * scale
    exactly. Byte 0x80 (-0 in fn, NaN in fnuz) becomes 0x00. fn's NaN bytes 0x7f/0xff would read as
    +-240 in fnuz: the numpy path raises ValueError naming `name` (`check_fp8_finite`); the jnp path just
    maps (no data-dependent checks under jit). `scale` keeps its dtype (e8m0 bytes: exponent + 1).
    """
    if fp8_format_of(q_fn.dtype) != "e4m3fn":
        raise ValueError(f"{name}: fp8_fn_to_fnuz expects e4m3fn, got {q_fn.dtype}")
    xp = array_module(q_fn)
    if xp is np:
        check_fp8_finite(q_fn, name=name)
    b = bitcast(q_fn, xp.uint8)
    b = xp.where(b == 0x80, np.uint8(0), b).astype(xp.uint8)
    return bitcast(b, FP8_FORMATS["e4m3fnuz"]), scale_times_pow2(scale, up=True)


def fp8_fnuz_to_fn(q_fnuz, scale, *, name: str = "tensor"):
    """Inverse of `fp8_fn_to_fnuz`: (q_fnuz, scale) -> (q_fn, scale / 2), bytes reinterpreted.

    Exact for every byte except 0x7f/0xff (+-240 in fnuz = +-480 in fn units, above fn's 448) and the
    fnuz NaN 0x80. numpy path: ValueError naming `name` if any of those is present (requantise from the
    high-precision weights instead; `quantize_fp8_blockwise(fmt="e4m3fnuz")` puts each block's amax at
    exactly 240). jnp path: 0x7f/0xff saturate to +-448 (0x7e/0xfe, the only lossy case) and 0x80 -> 0x7f
    (NaN stays NaN).
    """
    if fp8_format_of(q_fnuz.dtype) != "e4m3fnuz":
        raise ValueError(f"{name}: fp8_fnuz_to_fn expects e4m3fnuz, got {q_fnuz.dtype}")
    xp = array_module(q_fnuz)
    b = bitcast(q_fnuz, xp.uint8)
    if xp is np:
        check_fp8_finite(q_fnuz, name=name)
        over = (b == 0x7F) | (b == 0xFF)
        if over.any():
            raise ValueError(f"{name}: {int(over.sum())} e4m3fnuz value(s) of +-240 (bytes 0x7f/0xff) are not "
                             "representable in e4m3fn after the exact conversion; requantise instead")
    b = xp.where(b == 0x80, np.uint8(0x7F), xp.where((b & 0x7F) == 0x7F, b - np.uint8(1), b)).astype(xp.uint8)
    return bitcast(b, FP8_FORMATS["e4m3fn"]), scale_times_pow2(scale, up=False)


# -------------------------------------------------------------------------------- format selection


def fp8_format_for_device_kind(platform: str, device_kind: str) -> str:
    """The fp8 weight format for one device: 'e4m3fnuz' on AMD gfx942 (MI300X/MI300A/MI308X/MI325X, whose
    hardware fp8 is fnuz), 'e4m3fn' everywhere else (gfx950 MI350/MI355X, NVIDIA, TPU, CPU). Pure.

    platform: jax `Device.platform` ('cpu', 'gpu', 'rocm', 'cuda', 'tpu'); device_kind: `Device.device_kind`
    (e.g. 'AMD Instinct MI300X', 'gfx942', 'NVIDIA H200'). Matching is by case-insensitive substring.
    """
    kind = device_kind.lower()
    if platform.lower() != "cpu" and any(m in kind for m in _GFX942_MARKERS):
        return "e4m3fnuz"
    return "e4m3fn"


def select_fp8_format(fmt: str = "auto", devices=None) -> str:
    """Resolve a configured fp8 format to 'e4m3fn' | 'e4m3fnuz' and log the choice.

    fmt: 'auto' (from `devices[0]`, default `jax.devices()[0]`, via `fp8_format_for_device_kind`) or an
    explicit name in `FP8_ALIASES` ('fp8' = 'e4m3fn'). ValueError naming the value and the accepted ones.
    """
    if fmt != "auto":
        chosen = canonical_fp8_format(fmt)
        logger.info("fp8 weight format %s (configured as %r)", chosen, fmt)
        return chosen
    dev = (jax.devices() if devices is None else list(devices))[0]
    chosen = fp8_format_for_device_kind(dev.platform, dev.device_kind)
    logger.info("fp8 weight format %s (auto: platform %r, device kind %r)", chosen, dev.platform, dev.device_kind)
    return chosen


# ------------------------------------------------------------------------------------------ FP4 -> FP8


def fp4_to_fp8_blockwise(packed, scale, *, block: tuple[int, int] = (128, 128), fp4_block: int = FP4_BLOCK):
    """FP4 e2m1 (1 x fp4_block scales) -> FP8 e4m3fn with one power-of-two f32 scale per `block` tile. Jittable.

    packed [..., out, in/2] int8, scale [..., out, in/fp4_block] (e8m0 bytes or f32 powers of two) ->
    (q e4m3fn [..., out, in], S f32 [..., ceil(out/b0), ceil(in/b1)]). Per tile, S = s_max / 64 where s_max is
    the largest 1x32 scale in the tile, so the largest e2m1 magnitude (6 * s_max) lands on 384 <= 448; then
    q = cast(W / S) with W the exact dense FP4 values.
    Error bound (e4m3fn: 3 mantissa bits, smallest subnormal 2^-9): an e2m1 value c * s_j (c in {0.5, 1, 1.5,
    2, 3, 4, 6}) becomes c * 2^(6 - d) * S with d = log2(s_max / s_j); that is exactly representable whenever
    d <= 14. So the conversion is exact when every 1x32 scale of a tile lies within 14 binades of the tile's
    largest; otherwise the small values round to the nearest multiple of 2^-9 * S, |error| <= 2^-10 * S =
    s_max * 2^-16 per element. Zeros are written as +0 (byte 0x00), as the release's `cast_e2m1fn_to_e4m3fn`
    (`inference/convert.py`, whose e2m1 table maps code 8 to +0.0) writes them. Tests: tests/dsv4/test_load_sharded.py.
    """
    xp = array_module(packed, scale)
    w = dequantize_fp4(packed, scale, xp.float32, block=fp4_block)  # exact in f32
    s = scale_to_f32(scale)
    *lead, rows, cols = w.shape
    b0, b1 = block
    nb0, nb1 = -(-rows // b0), -(-cols // b1)
    per = b1 // fp4_block if b1 % fp4_block == 0 else None
    if per is None:
        raise ValueError(f"fp4_to_fp8_blockwise: fp8 block {block} is not a multiple of the fp4 block {fp4_block}")
    sp = xp.pad(s, [(0, 0)] * len(lead) + [(0, nb0 * b0 - rows), (0, nb1 * per - s.shape[-1])])
    smax = xp.max(sp.reshape(*lead, nb0, b0, nb1, per), axis=(-3, -1))  # -> [..., nb0, nb1]
    tile = (smax / 64.0).astype(xp.float32)
    full = xp.repeat(xp.repeat(tile, b0, axis=-2), b1, axis=-1)[..., :rows, :cols]
    return saturating_cast_fp8(xp.where(w == 0, xp.float32(0.0), w / full), "e4m3fn"), tile


# ------------------------------------------------------------------------------------ stored tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedTensor:
    """A quantised weight as the sampler stores it (a jax pytree: `q`, `scale` are leaves, the rest static).

    kind 'fp8': q [..., out, in] in FP8_FORMATS[fmt], scale f32 [..., ceil(out/b0), ceil(in/b1)],
    block (b0, b1). kind 'fp4': q packed int8 [..., out, in/2], scale [..., out, in/32] (f32 powers of two
    or e8m0 bytes), fmt 'e2m1', block (1, 32). shape: the logical (dequantised) shape.
    """

    q: Any
    scale: Any
    kind: str
    fmt: str
    block: tuple[int, ...]
    shape: tuple[int, ...]
    # How a layer multiplies by this weight (`dsv4.layers.linear`, the routed experts): all quantise the activations
    # as the release does (`act_quant`); "fp8" runs XLA's dots on FP8 operands (`dsv4.fp8_gemm.fp8_linear`),
    # "pallas" / "interpret" the block-scaled FP8 GEMM kernel (`dsv4.fp8_kernel`: compiled for a GPU, or Pallas'
    # interpreter), "dequant" multiplies the fake-quantised activations by the dequantised weight (same products,
    # XLA's summation order).
    matmul: str = "fp8"

    def __post_init__(self):
        if self.matmul not in MATMULS:
            raise ValueError(f"QuantizedTensor matmul must be one of {MATMULS}, got {self.matmul!r}")
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.kind == "fp8":
            if self.fmt not in FP8_FORMATS or len(self.block) != 2:
                raise ValueError(f"fp8 QuantizedTensor needs fmt in {sorted(FP8_FORMATS)} and a 2-d block, "
                                 f"got fmt={self.fmt!r} block={self.block}")
        elif self.kind == "fp4":
            if self.fmt != "e2m1" or len(self.block) != 2 or self.block[0] != 1:
                raise ValueError(f"fp4 QuantizedTensor needs fmt 'e2m1' and block (1, n), "
                                 f"got fmt={self.fmt!r} block={self.block}")
        else:
            raise ValueError(f"QuantizedTensor kind must be 'fp8' or 'fp4', got {self.kind!r}")

    @classmethod
    def from_fp8(cls, w, *, fmt="e4m3fn", block=(128, 128), scale_fmt="f32") -> QuantizedTensor:
        """Quantise a dense w [..., out, in] with `quantize_fp8_blockwise`."""
        q, scale = quantize_fp8_blockwise(w, fmt=fmt, block=block, scale_fmt=scale_fmt)
        return cls(q=q, scale=scale, kind="fp8", fmt=canonical_fp8_format(fmt), block=block, shape=w.shape)

    @classmethod
    def from_fp4(cls, w, *, block: int = FP4_BLOCK) -> QuantizedTensor:
        """Quantise a dense w [..., out, in] with `quantize_fp4`; the scale is kept as f32."""
        packed, scale = quantize_fp4(w, block=block)
        return cls(q=packed, scale=e8m0_to_f32(scale), kind="fp4", fmt="e2m1", block=(1, block), shape=w.shape)

    def dequantize(self, dtype=jnp.bfloat16):
        """Dense weight of `self.shape` in `dtype`. Jittable."""
        if self.kind == "fp8":
            return dequantize_fp8_blockwise(self.q, self.scale, block=self.block, dtype=dtype)
        return dequantize_fp4(self.q, self.scale, dtype, block=self.block[1])

    def to_fp8_format(self, fmt: str) -> QuantizedTensor:
        """The same fp8 weight in another fp8 format by the exact byte conversion (no requantisation)."""
        fmt = canonical_fp8_format(fmt)
        if self.kind != "fp8":
            raise ValueError(f"to_fp8_format needs an fp8 tensor, this one is {self.kind}")
        if fmt == self.fmt:
            return self
        convert = fp8_fn_to_fnuz if fmt == "e4m3fnuz" else fp8_fnuz_to_fn
        q, scale = convert(self.q, self.scale)
        return dataclasses.replace(self, q=q, scale=scale, fmt=fmt)


jax.tree_util.register_dataclass(
    QuantizedTensor, data_fields=["q", "scale"], meta_fields=["kind", "fmt", "block", "shape", "matmul"]
)
