"""The read plan of a checkpoint load: which file tensors (and scale tensors) fill each model leaf, validated.

`plan_leaves(path, config, abstract model, files)` maps every NNX leaf to a `Leaf`: its official key, model shape
and dtype, its source tensors (one, or E per-expert ones stacked on dim 0; a window of transformers' fused expert
tensors), its scales and its kind ("plain" | "fp8" | "fp4"). Shapes, dtypes, missing / unexpected / orphan
tensors and a config.json that disagrees with the given config fail here, before any data is read, with a
`CheckpointError` naming the directory / file and the tensor. Used by `dsv4.io.load`; the reads are
`dsv4.io.read`'s.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np
from flax import nnx

from dsv4 import fp4
from dsv4.config import ConfigError, DSV4Config
from dsv4.io.convert import CheckpointError, hf_to_official
from dsv4.io.safetensors import DTYPES, checkpoint_keys
from dsv4.names import EXPERT_KEY, official_key, param_key

FP8_DTYPES = ("F8_E4M3", "F8_E4M3FNUZ")
_FP4 = ("I8", "U8")
# Fields of the config that decide tensor shapes: a checkpoint's config.json must agree with the given config.
_ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
                "n_routed_experts", "moe_intermediate_size", "n_shared_experts", "num_hash_layers", "hc_mult")


@dataclasses.dataclass(frozen=True)
class Src:
    """One file tensor, or the window of it (`offset` per dim) that a model leaf takes."""
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: tuple[int, ...] | None = None


@dataclasses.dataclass
class Leaf:
    key: str                      # official key (experts stacked: layers.i.ffn.experts.w1)
    shape: tuple[int, ...]        # model shape
    dtype: np.dtype               # model dtype
    srcs: list[Src]              # one (plain) or E (stacked per-expert)
    scales: list[Src] | None     # same length as srcs when quantised
    stacked: bool
    kind: str                     # "plain" | "fp8" | "fp4"


def short_error(e: BaseException) -> str:
    """The OS error text of e (its `strerror`) or str(e): one line for a CheckpointError."""
    return getattr(e, "strerror", None) or str(e)


def scan_checkpoint(path: pathlib.Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """{file tensor name: (file, dtype, shape)} of the directory `path`; CheckpointError (one line) otherwise."""
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise CheckpointError(f"{path}: checkpoint directory {what}")
    try:
        return checkpoint_keys(path)
    except OSError as e:
        raise CheckpointError(f"{getattr(e, 'filename', None) or path}: cannot read ({short_error(e)})") from None
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def check_config_matches(path: pathlib.Path, config: DSV4Config) -> None:
    """CheckpointError naming the fields when `path/config.json` describes other tensor shapes than `config`."""
    f = path / "config.json"
    if not f.exists():
        return
    try:
        file_cfg = DSV4Config.from_hf(f)
    except ConfigError as e:
        raise CheckpointError(f"{f}: {e}") from None
    diff = [(k, getattr(file_cfg, k), getattr(config, k)) for k in _ARCH_FIELDS
            if getattr(file_cfg, k) != getattr(config, k)]
    n = config.num_hidden_layers
    if file_cfg.num_hidden_layers == n and file_cfg.layer_kinds != config.layer_kinds:
        diff.append(("layer kinds", file_cfg.layer_kinds, config.layer_kinds))
    if diff:
        raise CheckpointError(f"{f}: the checkpoint does not match the given config: "
                              + "; ".join(f"{k} {a} in the file vs {b} given" for k, a, b in diff))


def plan_leaves(path: pathlib.Path, cfg: DSV4Config, abstract, files) -> dict[str, Leaf]:
    """{NNX path key: Leaf} for every model leaf; CheckpointError for missing/unexpected/orphan tensors."""
    by_name: dict[str, Src] = {}
    scales: dict[str, Src] = {}
    fused: dict[str, Src] = {}
    for raw, (fname, dtype, shape) in files.items():
        name = hf_to_official(raw)
        src = Src(fname, raw, dtype, tuple(shape))
        if name.endswith(".scale") and not name.endswith("compressor.ape"):
            scales[name[: -len(".scale")] + ".weight"] = src
        elif name.endswith((".ffn.experts.gate_up_proj", ".ffn.experts.down_proj")):
            fused[name] = src
        else:
            by_name[name] = src
    leaves: dict[str, Leaf] = {}
    expected: set[str] = set()
    problems: list[str] = []
    for path_t, var in nnx.to_flat_state(nnx.state(abstract)):
        key = official_key(path_t)
        shape, dtype = tuple(var.get_value().shape), np.dtype(var.get_value().dtype)
        m = EXPERT_KEY.match(key)
        if m:
            prefix, wn = m.groups()
            lyr = prefix.rsplit(".experts", 1)[0]
            if f"{lyr}.experts.gate_up_proj" in fused or f"{lyr}.experts.down_proj" in fused:
                leaves[param_key(path_t)] = _fused_leaf(key, lyr, wn, shape, dtype, fused, cfg)
                expected.update(f"{lyr}.experts.{s}" for s in ("gate_up_proj", "down_proj"))
                continue
            names = [f"{prefix}.{e}.{wn}.weight" for e in range(shape[0])]
        else:
            names = [key]
        expected.update(names)
        srcs = [by_name.get(n) for n in names]
        if any(s is None for s in srcs):
            problems.extend(n for n, s in zip(names, srcs) if s is None)
            continue
        sc = [scales.get(n) for n in names]
        kind = "plain"
        if any(s is not None for s in sc):
            if any(s is None for s in sc):
                raise CheckpointError(f"{path}: {names[sc.index(None)]}: no scale tensor, but its siblings have one")
            dt = srcs[0].dtype
            kind = "fp8" if dt in FP8_DTYPES else "fp4" if dt in _FP4 else None
            if kind is None:
                raise CheckpointError(f"{srcs[0].file}: tensor {srcs[0].name!r} has a scale but dtype {dt} is neither "
                                      f"FP8 e4m3 nor packed FP4 (I8)")
        elif srcs[0].dtype in FP8_DTYPES:
            raise CheckpointError(f"{srcs[0].file}: tensor {srcs[0].name!r}: FP8 weight without a `.scale` / "
                                  f"`.weight_scale_inv` tensor")
        leaf = Leaf(key, shape, dtype, srcs, sc if kind != "plain" else None, bool(m), kind)
        _check_shapes(leaf, cfg)
        leaves[param_key(path_t)] = leaf
    present = set(by_name) | set(fused)
    unexpected = sorted(k for k in present - expected if not k.startswith("mtp."))
    if problems or unexpected:
        raise CheckpointError(f"{path}: checkpoint does not match the config: missing {len(problems)} tensor(s) "
                              f"{problems[:20]}; unexpected {len(unexpected)} {unexpected[:20]}")
    orphan = sorted(set(scales) - set(by_name))
    if orphan:
        raise CheckpointError(f"{path}: scale tensors without a weight: {orphan[:10]}")
    return leaves


def _fused_leaf(key, lyr, wn, shape, dtype, fused, cfg) -> Leaf:
    i = cfg.moe_intermediate_size
    name = f"{lyr}.experts.{'down_proj' if wn == 'w2' else 'gate_up_proj'}"
    src = fused.get(name)
    if src is None:
        raise CheckpointError(f"{lyr}.experts: transformers' fused {name.rsplit('.', 1)[1]} is missing")
    want = (shape[0], shape[1], shape[2]) if wn == "w2" else (shape[0], 2 * i, shape[2])
    if src.shape != want or src.dtype in FP8_DTYPES + _FP4:
        raise CheckpointError(f"{src.file}: tensor {src.name!r}: expected shape {list(want)} (unquantised), "
                              f"found {list(src.shape)} {src.dtype}")
    off = (0, 0, 0) if wn in ("w1", "w2") else (0, i, 0)
    return Leaf(key, shape, dtype, [dataclasses.replace(src, offset=off)], None, False, "plain")


def packed_shape(leaf: Leaf) -> tuple[int, ...]:
    """Shape of the stored q (per file tensor) that the model shape implies."""
    per = leaf.shape[1:] if leaf.stacked else leaf.shape
    return (*per[:-1], per[-1] // 2) if leaf.kind == "fp4" else tuple(per)


def _check_shapes(leaf: Leaf, cfg: DSV4Config) -> None:
    per = leaf.shape[1:] if leaf.stacked else leaf.shape
    want = packed_shape(leaf)
    for i, s in enumerate(leaf.srcs):
        if s.shape != want:
            shown = list(per) if leaf.kind == "plain" else f"{list(want)} ({leaf.kind} of {list(per)})"
            raise CheckpointError(f"{s.file}: tensor {s.name!r}: expected shape {shown}, found {list(s.shape)}")
        if leaf.kind == "plain" and not np.issubdtype(leaf.dtype, np.integer) and s.dtype in _FP4 + ("I64", "I32"):
            raise CheckpointError(f"{s.file}: tensor {s.name!r}: dtype {s.dtype} for a float parameter without a scale")
        if leaf.scales is not None:
            sc = leaf.scales[i]
            if leaf.kind == "fp8":
                b0, b1 = fp8_block(cfg)
                grid = (*want[:-2], -(-want[-2] // b0), -(-want[-1] // b1))
            else:
                grid = (*per[:-1], per[-1] // fp4.FP4_BLOCK)
            if sc.shape != grid or sc.dtype not in ("F8_E8M0", "F32", "U8"):
                raise CheckpointError(f"{sc.file}: tensor {sc.name!r}: expected a {leaf.kind} scale of shape "
                                      f"{list(grid)} (F8_E8M0 or F32), found {list(sc.shape)} {sc.dtype}")


def fp8_block(cfg: DSV4Config) -> tuple[int, int]:
    """The FP8 weight block (rows, cols) of the checkpoint's quantization_config (default 128 x 128)."""
    return tuple((cfg.quantization_config or {}).get("weight_block_size", (128, 128)))


# ------------------------------------------------------------------------------------------------- reading


def src_nbytes(src: Src) -> int:
    """Bytes of the file tensor `src` as stored."""
    return math.prod(src.shape) * DTYPES[src.dtype].itemsize

