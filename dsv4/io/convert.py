"""Official DeepSeek-V4 checkpoint in and out: the name table, streaming load with FP8/FP4 dequantisation, export.

Name table (spec §9): our NNX paths mirror the official keys, so `layers/3/attn/wq_a/weight` <->
`layers.3.attn.wq_a.weight`. Exceptions, handled here:
- routed experts are stacked in the model (`ffn.experts.w1` [E, I, D]) and per-expert in the file
  (`ffn.experts.{e}.w1.weight` [I, D]); transformers fuses them (`mlp.experts.gate_up_proj` [E, 2I, D] =
  concat(w1, w3), `down_proj` [E, D, I]);
- transformers' names (`model.layers.3.self_attn.q_a_proj.weight`, ...; `_HF_RULES`) are accepted on load.
Quantised tensors: an FP8 `F8_E4M3` weight with a sibling `.scale` (official, e8m0 or f32) or
`.weight_scale_inv` (transformers) is block-dequantised (128x128 unless `quantization_config` says otherwise);
an `I8`/`U8` weight with a scale is an FP4 e2m1 pack (1x32 e8m0 scales) (spec §9.2, §12 item 23).

Load: `dsv4/io/load.py` (sharded, region reads, on-device dequantisation). Export (`save_hf_checkpoint`) streams
one tensor at a time from the possibly sharded model (quantised on its devices, then gathered), one writer
process, into a temp directory renamed into place, with a `config.json` that transformers 5.23 loads with no
missing or unexpected keys.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dsv4 import fp4, quant, scales
from dsv4.io.safetensors import save_sharded_checkpoint
from dsv4.model import DSV4ForCausalLM
from dsv4.names import EXPERT_KEY, official_key


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensors, expected and found shapes/dtypes."""


# transformers name -> official name (regex, replacement), applied in order after stripping nothing.
_HF_RULES = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.attn_hc\.(fn|base|scale)$", r"layers.\1.hc_attn_\2"),
    (r"^model\.layers\.(\d+)\.ffn_hc\.(fn|base|scale)$", r"layers.\1.hc_ffn_\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.sinks$", r"layers.\1.attn.attn_sink"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", r"layers.\1.attn.indexer.weights_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.q_b_proj\.", r"layers.\1.attn.indexer.wq_b."),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.", r"layers.\1.attn.indexer.compressor."),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.", r"layers.\1.attn.compressor."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"layers.\1.attn."),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers.\1.ffn.gate.bias"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.", r"layers.\1.ffn.shared_experts.w1."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.", r"layers.\1.ffn.shared_experts.w3."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.", r"layers.\1.ffn.shared_experts.w2."),
    (r"^model\.layers\.(\d+)\.mlp\.", r"layers.\1.ffn."),
    # transformers 5.23 `save_pretrained` writes official names with a `model.` prefix and `attn.norm` for the
    # attention kv_norm (its reverse mapping is lossy); accept that layout too.
    (r"^model\.layers\.(\d+)\.attn\.norm\.weight$", r"layers.\1.attn.kv_norm.weight"),
    (r"^model\.(layers\..*)$", r"\1"),
]
# Leaf renames inside attention / compressor modules (transformers -> official).
_HF_LEAF = {
    "q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv", "o_a_proj": "wo_a",
    "o_b_proj": "wo_b", "gate_proj": "wgate", "position_bias": "ape", "kv_norm": "norm",
}
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def hf_to_official(name: str) -> str:
    """A transformers (or official) tensor name -> the official name. Unknown names are returned unchanged."""
    if name.endswith(".weight_scale_inv"):
        return hf_to_official(name[: -len(".weight_scale_inv")] + ".weight")[: -len(".weight")] + ".scale"
    if not name.startswith(("model.", "lm_head.")):
        return name
    for pat, rep in _HF_RULES:
        new, n = re.subn(pat, rep, name)
        if n:
            name = new
            break
    if ".attn." in name:
        parts = name.split(".")
        i = parts.index("attn")
        # only the module name right after attn / compressor / indexer is renamed
        for j in range(i + 1, len(parts)):
            if parts[j] in _HF_LEAF and parts[j - 1] in ("attn", "compressor", "indexer"):
                if not (parts[j] == "kv_norm" and parts[j - 1] == "attn"):
                    parts[j] = _HF_LEAF[parts[j]]
        name = ".".join(parts)
        name = re.sub(r"\.ape\.weight$", ".ape", name)
    return name


def official_tensors(model_or_abstract) -> dict[str, jax.Array]:
    """Model state as {official key: array}, experts still stacked under `layers.i.ffn.experts.w1` etc."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model_or_abstract)):
        out[official_key(path)] = v.get_value()
    return out


# ------------------------------------------------------------------------------------------------ export

_FP8_KEYS = quant.FP8_WEIGHT_RE  # the released FP8 set (routed experts are matched separately)


def _gather(x) -> np.ndarray:
    """One array -> host numpy, identical on every process (`process_allgather` when it spans processes)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.partial(jax.jit, static_argnames=("kind", "block"))
def _quantize_on_device(x, kind: str, block):
    """Sharded x [..., out, in] -> (q, e8m0 scale bytes uint8) in the release's format, on x's devices."""
    x = x.astype(jnp.float32)
    if kind == "fp4":
        return fp4.quantize_fp4(x)
    q, sc = quant.quantize_fp8_blockwise(x, fmt="e4m3fn", block=block, scale_fmt="ue8m0")
    return q, scales.f32_to_e8m0(sc)


def _expert_slices(x):
    """Yield x[e] (numpy) for e in range(E) of a stacked [E, ...] array, one expert on the host at a time when
    x is fully addressable (copied from the shards that hold it: no device gather of the stack); a stack that
    spans processes is gathered once (`process_allgather`) and sliced on the host."""
    if isinstance(x, jax.Array) and x.is_fully_addressable and len(x.sharding.device_set) > 1:
        shards = [(s.index, s.data) for s in x.addressable_shards]
        for e in range(x.shape[0]):
            out, done = np.empty(x.shape[1:], x.dtype), set()
            for idx, data in shards:
                lo = idx[0].start or 0
                hi = x.shape[0] if idx[0].stop is None else idx[0].stop
                key = tuple((sl.start, sl.stop) for sl in idx[1:])
                if lo <= e < hi and key not in done:
                    out[idx[1:]] = np.asarray(data[e - lo])
                    done.add(key)
            yield out
    else:
        full = _gather(x)
        for e in range(full.shape[0]):
            yield full[e]


def iter_export_tensors(model: DSV4ForCausalLM, *, quantize: str | None = None, block=(128, 128)):
    """(official name, numpy array) pairs of the whole model, one tensor on the host at a time.

    With quantize="fp8" the FP8 set of the release and the routed experts are written as e4m3fn + e8m0
    `.scale` tensors (FP8 "mixed"); with "fp8_fp4" the routed experts are FP4 e2m1 with 1x32 e8m0 scales,
    exactly the released Flash layout. Quantisation runs jitted on the model's devices (sharded arrays stay
    sharded); then one per-file tensor (one expert of a stack) is gathered to the host. Multi-process: every
    process must iterate (the gathers are collectives); all of them see the same arrays.
    """
    if quantize not in (None, "fp8", "fp8_fp4"):
        raise ValueError(f"quantize must be None, 'fp8' or 'fp8_fp4', got {quantize!r}")
    for key, val in official_tensors(model).items():
        if key.endswith("tid2eid"):
            yield key, _gather(val).astype(np.int64)
            continue
        m = EXPERT_KEY.match(key)
        kind = None
        if quantize and m:
            kind = "fp4" if quantize == "fp8_fp4" else "fp8"
        elif quantize and _FP8_KEYS.search(key):
            kind = "fp8"
        parts = _quantize_on_device(val, kind, tuple(block)) if kind else (val,)
        if m:
            per_expert = [f"{m.group(1)}.{e}.{m.group(2)}.weight" for e in range(val.shape[0])]
            per_part = zip(per_expert, *[_expert_slices(x) for x in parts])
        else:
            per_part = [(key, *[_gather(x) for x in parts])]
        for name, *got in per_part:
            yield name, got[0]
            if kind:
                yield name[: -len(".weight")] + ".scale", got[1].view(ml_dtypes.float8_e8m0fnu)


def save_hf_checkpoint(model: DSV4ForCausalLM, path, *, quantize: str | None = None,
                       max_shard_bytes: int = 2 * 2**30, overwrite: bool = False) -> pathlib.Path:
    """Write the official safetensors layout + `config.json` (loadable by transformers 5.23 and by us).

    Args:
      quantize: None (tensors as stored in the model), "fp8" (FP8 e4m3fn 128x128 blocks with e8m0 scales for
        the released FP8 set and the experts) or "fp8_fp4" (experts FP4 as released).
      overwrite: replace an existing directory (the old one is removed only after the new one is complete).
    Written to a temp directory beside `path`, then renamed into place: a crash leaves no half checkpoint.
    Streams tensor by tensor from the (possibly sharded) model (`iter_export_tensors`): one tensor gathered at
    a time, at most one output shard (`max_shard_bytes`) held. Multi-process runs: every process calls this
    (the gathers are collectives), process 0 alone writes (`path` must be on a file system it can reach), and
    all return after the rename.
    Raises:
      FileExistsError: `path` exists and `overwrite` is False.
    """
    path = pathlib.Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    if jax.process_index() != 0:
        for _ in iter_export_tensors(model, quantize=quantize):
            pass
        _barrier("dsv4_save_hf_checkpoint")
        return path
    try:
        _write_hf_checkpoint(model, path, quantize=quantize, max_shard_bytes=max_shard_bytes)
    finally:
        _barrier("dsv4_save_hf_checkpoint")
    return path


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _write_hf_checkpoint(model, path, *, quantize, max_shard_bytes) -> None:
    cfg = model.config
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        staged = tmp_root / "ckpt"
        save_sharded_checkpoint(staged, iter_export_tensors(model, quantize=quantize),
                                max_shard_bytes=max_shard_bytes)
        d = cfg.to_hf_dict(quantized=bool(quantize))
        if quantize:
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
            d["expert_dtype"] = "fp4" if quantize == "fp8_fp4" else "fp8"
        pdt = model.embed.weight.get_value().dtype
        d["torch_dtype"] = "bfloat16" if pdt == jnp.bfloat16 else "float32"
        with open(staged / "config.json", "w") as f:
            json.dump(d, f, indent=2)
        if path.exists():
            old = tmp_root / "old"
            os.replace(path, old)
        os.replace(staged, path)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
