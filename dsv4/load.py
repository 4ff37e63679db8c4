"""Sharded, streaming load of an official (or transformers-named) DeepSeek-V4 safetensors checkpoint.

`load_hf_checkpoint(path, *, dtype, config, mesh, rules, keep_quantized)`:
- With a `mesh`, every leaf ends in its rule-table sharding (`sharding.rules.param_shardings`, `rules=None` = the
  actor's) without ever being whole on a host: it is created with `jax.make_array_from_callback` in a row-split
  sharding over the *same* mesh axes (`_row_sharding`), whose callback, for each *addressable* shard, reads only
  that shard's rows from the file (`SafetensorsFile.read_region`: one `pread` per contiguous run), then a jitted
  identity reshards it on the devices. Stacked experts are assembled per shard from the per-expert file tensors
  (or sliced from transformers' fused ones); a shard replicated over several local devices is read once. A
  process therefore reads only as many bytes as its devices hold (plus whole copies of the tensors its rules
  replicate), in large contiguous reads.
- FP8 (e4m3fn/e4m3fnuz, 128x128 blocks, f32 or e8m0 scales) and FP4 (e2m1 packed in I8, 1x32 e8m0 scales) are
  placed as they are stored (the packed shard and the scale blocks covering it) and dequantised by a jitted
  function on the devices, whose out_shardings is the leaf's sharding (`dsv4.quant` jnp path).
- Host memory: one leaf's local shards at a time (a shard's bytes, then its device copy). NaN/inf checks run
  on the raw bytes of each shard as it is read (NaN floats, fp8 NaN bytes, the e8m0 NaN byte), on the host.
- Without a mesh the same reader fills whole tensors and the model lands on the default device (the old
  behaviour, for small models and notebooks).
- `keep_quantized=True`: without a mesh, returns `(model, {official per-file key: QuantizedTensor})` as stored
  (numpy, f32 scales). With a mesh, returns `{NNX path key "a/b/c": QuantizedTensor | jax.Array}`: the stored
  FP8 / FP4 blocks of the quantised tensors (q in the leaf's sharding, f32 scales aligned with it where the
  block grid allows, else replicated) and the dense arrays of all other tensors, with no dequantisation
  (the rollout's FP8 weights come from here: `rl/rollout_init.py`).

Errors are `CheckpointError` (a ValueError) with one line naming the directory / file and the tensor: unreadable
directory, truncated or corrupt file, missing / unexpected tensors, wrong shape or dtype, NaN/inf, a config.json
that does not match the given config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from dsv4 import quant
from dsv4.config import ConfigError, DSV4Config
from dsv4.convert import CheckpointError, hf_to_official
from dsv4.model import DSV4ForCausalLM
from dsv4.names import EXPERT_KEY, official_key, param_key
from dsv4.safetensors_io import DTYPES, SafetensorsFile, bytes_read, checkpoint_keys, region_bounds
from sharding.mesh import auto_axes
from sharding.rules import ACTOR_RULES, param_shardings

log = logging.getLogger(__name__)

_FP8 = ("F8_E4M3", "F8_E4M3FNUZ")
_FP4 = ("I8", "U8")
# Fields of the config that decide tensor shapes: a checkpoint's config.json must agree with the given config.
_ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
                "n_routed_experts", "moe_intermediate_size", "n_shared_experts", "num_hash_layers", "hc_mult")


@dataclasses.dataclass(frozen=True)
class _Src:
    """One file tensor, or the window of it (`offset` per dim) that a model leaf takes."""
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: tuple[int, ...] | None = None


@dataclasses.dataclass
class _Leaf:
    key: str                      # official key (experts stacked: layers.i.ffn.experts.w1)
    shape: tuple[int, ...]        # model shape
    dtype: np.dtype               # model dtype
    srcs: list[_Src]              # one (plain) or E (stacked per-expert)
    scales: list[_Src] | None     # same length as srcs when quantised
    stacked: bool
    kind: str                     # "plain" | "fp8" | "fp4"


class _Files:
    """Open SafetensorsFile handles of one load (closed by `close`); errors name file and tensor."""

    def __init__(self):
        self._open: dict[str, SafetensorsFile] = {}

    def read(self, src: _Src, bounds: list[tuple[int, int]]) -> np.ndarray:
        if src.offset is not None:
            bounds = [(a + o, b + o) for (a, b), o in zip(bounds, src.offset)]
        try:
            f = self._open.get(src.file)
            if f is None:
                f = self._open[src.file] = SafetensorsFile(src.file)
            a = f.read_region(src.name, tuple(slice(a, b) for a, b in bounds))
            return a.view(np.uint8) if src.dtype == "F8_E8M0" else a  # e8m0 bytes travel as uint8
        except (OSError, ValueError) as e:
            msg = _short(e)
            raise CheckpointError(msg if msg.startswith(src.file) else f"{src.file}: tensor {src.name!r}: {msg}") from None

    def close(self):
        for f in self._open.values():
            f.close()
        self._open.clear()


def _short(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e)


# ------------------------------------------------------------------------------------------------ planning


def _scan(path: pathlib.Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise CheckpointError(f"{path}: checkpoint directory {what}")
    try:
        return checkpoint_keys(path)
    except OSError as e:
        raise CheckpointError(f"{getattr(e, 'filename', None) or path}: cannot read ({_short(e)})") from None
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


def _plan(path: pathlib.Path, cfg: DSV4Config, abstract, files) -> dict[str, _Leaf]:
    """{NNX path key: _Leaf} for every model leaf; CheckpointError for missing/unexpected/orphan tensors."""
    by_name: dict[str, _Src] = {}
    scales: dict[str, _Src] = {}
    fused: dict[str, _Src] = {}
    for raw, (fname, dtype, shape) in files.items():
        name = hf_to_official(raw)
        src = _Src(fname, raw, dtype, tuple(shape))
        if name.endswith(".scale") and not name.endswith("compressor.ape"):
            scales[name[: -len(".scale")] + ".weight"] = src
        elif name.endswith((".ffn.experts.gate_up_proj", ".ffn.experts.down_proj")):
            fused[name] = src
        else:
            by_name[name] = src
    leaves: dict[str, _Leaf] = {}
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
            kind = "fp8" if dt in _FP8 else "fp4" if dt in _FP4 else None
            if kind is None:
                raise CheckpointError(f"{srcs[0].file}: tensor {srcs[0].name!r} has a scale but dtype {dt} is neither "
                                      f"FP8 e4m3 nor packed FP4 (I8)")
        elif srcs[0].dtype in _FP8:
            raise CheckpointError(f"{srcs[0].file}: tensor {srcs[0].name!r}: FP8 weight without a `.scale` / "
                                  f"`.weight_scale_inv` tensor")
        leaf = _Leaf(key, shape, dtype, srcs, sc if kind != "plain" else None, bool(m), kind)
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


def _fused_leaf(key, lyr, wn, shape, dtype, fused, cfg) -> _Leaf:
    i = cfg.moe_intermediate_size
    name = f"{lyr}.experts.{'down_proj' if wn == 'w2' else 'gate_up_proj'}"
    src = fused.get(name)
    if src is None:
        raise CheckpointError(f"{lyr}.experts: transformers' fused {name.rsplit('.', 1)[1]} is missing")
    want = (shape[0], shape[1], shape[2]) if wn == "w2" else (shape[0], 2 * i, shape[2])
    if src.shape != want or src.dtype in _FP8 + _FP4:
        raise CheckpointError(f"{src.file}: tensor {src.name!r}: expected shape {list(want)} (unquantised), "
                              f"found {list(src.shape)} {src.dtype}")
    off = (0, 0, 0) if wn in ("w1", "w2") else (0, i, 0)
    return _Leaf(key, shape, dtype, [dataclasses.replace(src, offset=off)], None, False, "plain")


def _packed_shape(leaf: _Leaf) -> tuple[int, ...]:
    """Shape of the stored q (per file tensor) that the model shape implies."""
    per = leaf.shape[1:] if leaf.stacked else leaf.shape
    return (*per[:-1], per[-1] // 2) if leaf.kind == "fp4" else tuple(per)


def _check_shapes(leaf: _Leaf, cfg: DSV4Config) -> None:
    per = leaf.shape[1:] if leaf.stacked else leaf.shape
    want = _packed_shape(leaf)
    for i, s in enumerate(leaf.srcs):
        if s.shape != want:
            shown = list(per) if leaf.kind == "plain" else f"{list(want)} ({leaf.kind} of {list(per)})"
            raise CheckpointError(f"{s.file}: tensor {s.name!r}: expected shape {shown}, found {list(s.shape)}")
        if leaf.kind == "plain" and not np.issubdtype(leaf.dtype, np.integer) and s.dtype in _FP4 + ("I64", "I32"):
            raise CheckpointError(f"{s.file}: tensor {s.name!r}: dtype {s.dtype} for a float parameter without a scale")
        if leaf.scales is not None:
            sc = leaf.scales[i]
            if leaf.kind == "fp8":
                b0, b1 = _fp8_block(cfg)
                grid = (*want[:-2], -(-want[-2] // b0), -(-want[-1] // b1))
            else:
                grid = (*per[:-1], per[-1] // quant.FP4_BLOCK)
            if sc.shape != grid or sc.dtype not in ("F8_E8M0", "F32", "U8"):
                raise CheckpointError(f"{sc.file}: tensor {sc.name!r}: expected a {leaf.kind} scale of shape "
                                      f"{list(grid)} (F8_E8M0 or F32), found {list(sc.shape)} {sc.dtype}")


def _fp8_block(cfg: DSV4Config) -> tuple[int, int]:
    return tuple((cfg.quantization_config or {}).get("weight_block_size", (128, 128)))


# ------------------------------------------------------------------------------------------------- reading


def _read_stacked(files: _Files, srcs: list[_Src], stacked: bool, bounds, dtype=None, check_for=None) -> np.ndarray:
    """The region `bounds` of a leaf (stacked: dim 0 picks the per-expert files) as one numpy array; each
    file region is checked by `check_for(src)` (a callable or None) before the cast to `dtype`."""
    def read(src, bnds):
        a = files.read(src, bnds)
        check = check_for(src) if check_for is not None else None
        if check is not None:
            check(a)
        return a

    if not stacked:
        a = read(srcs[0], bounds)
        return a if dtype is None else a.astype(dtype, copy=False)
    (e0, e1), rest = bounds[0], bounds[1:]
    out = None
    for j, e in enumerate(range(e0, e1)):
        a = read(srcs[e], rest)
        if out is None:
            out = np.empty((e1 - e0, *a.shape), dtype or a.dtype)
        out[j] = a
    if out is None:
        out = np.empty((0, *[b - a for a, b in rest]), dtype or np.float32)
    return out


def _aligned_spec(spec: PartitionSpec, shape, grid_block, mesh) -> PartitionSpec:
    """Keep a dim's mesh axes on the scale only where every q shard covers whole scale blocks."""
    out = []
    for d, (n, blk) in enumerate(zip(shape, grid_block)):
        entry = spec[d] if d < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts = math.prod(mesh.shape[a] for a in axes)
        ok = parts == 1 or (n % parts == 0 and (n // parts) % blk == 0)
        out.append(entry if ok else None)
    return PartitionSpec(*out)


def _fit_spec(spec: PartitionSpec, shape, mesh) -> PartitionSpec:
    """Drop mesh axes from dims they do not divide (the stored packed layout may be narrower)."""
    out = []
    for d, n in enumerate(shape):
        entry = spec[d] if d < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(entry if n % math.prod(mesh.shape[a] for a in axes) == 0 else None)
    return PartitionSpec(*out)


def _row_sharding(sharding: NamedSharding, shape) -> NamedSharding:
    """The sharding to *read* a leaf in: the mesh axes of `sharding` moved onto dim 0 (same axes, so every process
    still needs the same bytes), so each device's region is a run of whole rows: one `pread` per file tensor
    instead of one per row (and whole pages from disk). `sharding` itself when dim 0 does not divide."""
    axes = [a for e in sharding.spec if e for a in ((e,) if isinstance(e, str) else e)]
    parts = math.prod(sharding.mesh.shape[a] for a in axes)
    if not axes or not shape or shape[0] % parts:
        return sharding
    lead = axes[0] if len(axes) == 1 else tuple(axes)
    return NamedSharding(sharding.mesh, PartitionSpec(lead, *([None] * (len(shape) - 1))))


def _identity(x):
    return x


def _place(files: _Files, srcs, stacked, shape, sharding, dtype=None, check_for=None):
    """A jax.Array of `shape` in `sharding` (None: default device) whose shards are read by region: read in
    `_row_sharding` (contiguous runs), then resharded on the devices by a jitted identity if that differs."""
    if sharding is None:
        return jnp.asarray(_read_stacked(files, srcs, stacked, [(0, n) for n in shape], dtype, check_for))
    read_sh = _row_sharding(sharding, shape)
    x = _read_placed(files, srcs, stacked, shape, read_sh, dtype, check_for)
    if read_sh.is_equivalent_to(sharding, len(shape)):
        return x
    with jax.set_mesh(sharding.mesh):
        return _jit(("reshard",), _identity, sharding)(x)


def _read_placed(files: _Files, srcs, stacked, shape, sharding, dtype, check_for):
    where = f"{srcs[0].file}: tensor {srcs[0].name!r}"
    memo: dict = {}

    def cb(index):
        bounds = tuple(region_bounds(index, shape, where=where))
        if bounds not in memo:  # a shard replicated over local devices is read once
            memo[bounds] = _read_stacked(files, srcs, stacked, list(bounds), dtype, check_for)
        return memo[bounds]

    return jax.make_array_from_callback(shape, sharding, cb)


def _dequant_fn(kind, block, dtype):
    def f(q, s):
        if kind == "fp8":
            return quant.dequantize_fp8_blockwise(q, s, block=block, dtype=dtype)
        return quant.dequantize_fp4(q, s, dtype)
    return f


_JITS: dict = {}


def _jit(key, fn, out_shardings):
    k = (key, out_shardings)
    if k not in _JITS:
        _JITS[k] = jax.jit(fn, out_shardings=out_shardings)
    return _JITS[k]


class _Progress:
    """tensors / bytes / GB/s of a load on process 0's stderr (tqdm), else a closing log line only."""

    def __init__(self, path, total_bytes, n, enabled):
        self.t0, self.done, self.bytes, self.n, self.read0 = time.perf_counter(), 0, 0, n, bytes_read()
        self.bar = None
        if enabled and jax.process_index() == 0:
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr,
                            desc=f"loading {pathlib.Path(path).name}", dynamic_ncols=True)

    def step(self, nbytes):
        self.done += 1
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.done}/{self.n} tensors", refresh=False)

    def close(self, path):
        if self.bar is not None:
            self.bar.close()
        dt = time.perf_counter() - self.t0
        read = bytes_read() - self.read0
        log.info("loaded %s: %d tensors (%.2f GB) in %.1f s; process %d read %.2f GB of them (%.2f GB/s)",
                 path, self.done, self.bytes / 1e9, dt, jax.process_index(), read / 1e9, read / 1e9 / max(dt, 1e-9))


def _nbytes(src: _Src) -> int:
    return math.prod(src.shape) * DTYPES[src.dtype].itemsize


# ---------------------------------------------------------------------------------------------------- load


def load_hf_checkpoint(path, *, dtype=jnp.bfloat16, config: DSV4Config | None = None, mesh=None, rules=None,
                       keep_quantized: bool = False, compute_dtype=None, progress: bool | None = None):
    """Load an official-format (or transformers-named) DeepSeek-V4 safetensors checkpoint directory.

    Args:
      path: directory with `*.safetensors` (with or without `model.safetensors.index.json`) and, unless
        `config` is given, `config.json`.
      dtype: parameter dtype (float32 / bfloat16); mHC, sinks, ape and the router bias stay float32.
      config: the model config; when given and the directory has a `config.json`, their shape-deciding fields
        must agree (CheckpointError naming them otherwise).
      mesh / rules: place every leaf directly in `param_shardings(abstract, mesh, rules)` (`rules=None`: the
        actor's `sharding.rules.ACTOR_RULES`), reading only the addressable shards' bytes. Multi-process: every
        process calls this with the same arguments. Without a mesh: whole tensors on the default device.
      keep_quantized: see the module docstring (no mesh: `(model, {per-file key: QuantizedTensor})`; mesh:
        `{NNX path key: QuantizedTensor | jax.Array}` as `load_quantized_state` returns it).
      compute_dtype: the model's matmul dtype (default: `dtype`).
      progress: a tqdm bar on process 0's stderr (None: when stderr is a terminal).
    Returns:
      DSV4ForCausalLM (params in `dtype`, shapes of `config`), or per `keep_quantized`.
    Raises:
      CheckpointError: one line naming the directory/file and tensor (see the module docstring).
    """
    if keep_quantized and mesh is not None:
        return load_quantized_state(path, dtype=dtype, config=config, mesh=mesh, rules=rules, progress=progress)
    abstract, leaves, values, quantized = _load(path, dtype=dtype, config=config, mesh=mesh, rules=rules,
                                                keep_quantized=keep_quantized, compute_dtype=compute_dtype,
                                                progress=progress)
    graphdef, state = nnx.split(abstract)
    flat = [(p, v.replace(values[param_key(p)])) for p, v in nnx.to_flat_state(state)]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if not keep_quantized:
        return model
    per_file = {}
    for k, qt in quantized.items():
        lf = leaves[k]
        for e, src in enumerate(lf.srcs):
            per_file[hf_to_official(src.name)] = dataclasses.replace(
                qt, q=np.asarray(qt.q[e] if lf.stacked else qt.q), scale=np.asarray(qt.scale[e] if lf.stacked else qt.scale),
                shape=lf.shape[1:] if lf.stacked else lf.shape)
    return model, per_file


def load_quantized_state(path, *, dtype=jnp.bfloat16, config: DSV4Config | None = None, mesh=None, rules=None,
                         progress: bool | None = None) -> dict:
    """The checkpoint as stored: {NNX path key "layers/0/attn/wq_a/weight": QuantizedTensor | jax.Array}.

    Quantised tensors (FP8 blocks, FP4 packs; stacked experts `[E, ...]`) are `dsv4.quant.QuantizedTensor`s whose
    `q` holds the file's bytes (in the leaf's sharding when a mesh is given; FP4: the packed `[..., in/2]`
    int8) and whose `scale` is float32 (aligned with q's sharding where the block grid allows, else
    replicated); every other tensor is a dense array in `dtype` (f32 for the model's f32 leaves). Nothing is
    dequantised. Placement, reads, errors: as `load_hf_checkpoint`.
    """
    _, leaves, values, quantized = _load(path, dtype=dtype, config=config, mesh=mesh, rules=rules,
                                         keep_quantized=True, compute_dtype=None, progress=progress, dense=False)
    return {k: quantized.get(k, values.get(k)) for k in leaves}


def loaded_config(path, config: DSV4Config) -> DSV4Config:
    """The config of the model a load of the checkpoint directory `path` with `config` builds: `config` without the
    MTP block when the files hold no mtp.* tensors (transformers-saved checkpoints), else `config` itself. For a
    process that needs the loaded model's shapes without loading it (an MPMD rollout process, rl/roles.py).
    Raises CheckpointError as `load_hf_checkpoint` does for a directory without safetensors."""
    files = _scan(pathlib.Path(path))
    if config.num_nextn_predict_layers and not any(hf_to_official(k).startswith("mtp.") for k in files):
        return dataclasses.replace(config, num_nextn_predict_layers=0,
                                   compress_ratios=config.compress_ratios[: config.num_hidden_layers])
    return config


def _load(path, *, dtype, config, mesh, rules, keep_quantized, compute_dtype, progress, dense=True):
    path = pathlib.Path(path)
    files = _scan(path)
    if config is None:
        try:
            cfg = DSV4Config.from_hf(path)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    else:
        cfg = config
        check_config_matches(path, cfg)
    compute_dtype = compute_dtype or dtype
    mesh = auto_axes(mesh)  # a jax.make_mesh mesh (Explicit axes) works too: see sharding.mesh.auto_axes
    if cfg.num_nextn_predict_layers and not any(hf_to_official(k).startswith("mtp.") for k in files):
        log.warning("%s: no mtp.* tensors (a transformers checkpoint has none): loading without the MTP block", path)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0,
                                  compress_ratios=cfg.compress_ratios[: cfg.num_hidden_layers])
    abstract = nnx.eval_shape(lambda: DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=compute_dtype))
    leaves = _plan(path, cfg, abstract, files)
    shardings = None
    if mesh is not None:
        sh = param_shardings(nnx.state(abstract), mesh, ACTOR_RULES if rules is None else rules)
        shardings = {param_key(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
                     for p, v in nnx.to_flat_state(sh)}
    block = _fp8_block(cfg)
    enabled = sys.stderr.isatty() if progress is None else progress
    total = sum(_nbytes(s) for lf in leaves.values() for s in lf.srcs + (lf.scales or []))
    bar = _Progress(path, total, len(leaves), enabled)
    fh = _Files()
    values, quantized = {}, {}
    try:
        for key, leaf in leaves.items():
            sharding = None if shardings is None else shardings[key]
            values[key], q = _load_leaf(fh, leaf, sharding, mesh, block, cfg, keep_quantized, dense)
            if q is not None:
                quantized[key] = q
            bar.step(sum(_nbytes(s) for s in leaf.srcs + (leaf.scales or [])))
    finally:
        fh.close()
        bar.close(path)
    return abstract, leaves, values, quantized


def _finite_check(src: _Src):
    """Host check of the raw bytes just read (no device pass, no compile): NaN/inf floats, NaN fp8 bytes,
    the e8m0 NaN byte 255. CheckpointError naming file and tensor."""
    dt = src.dtype
    if dt in ("F32", "F16", "BF16", "F64"):
        bad = lambda a: not np.isfinite(a).all()  # noqa: E731
    elif dt in _FP8:
        nan = (0x80,) if dt == "F8_E4M3FNUZ" else (0x7F, 0xFF)
        bad = lambda a: bool(np.isin(a.view(np.uint8), nan).any())  # noqa: E731
    elif dt == "F8_E8M0":
        bad = lambda a: bool((a.view(np.uint8) == 255).any())  # noqa: E731
    else:
        return None

    def check(a):
        if a.size and bad(a):
            raise CheckpointError(f"{src.file}: tensor {src.name!r} contains NaN or inf")
    return check


def _load_leaf(fh, leaf: _Leaf, sharding, mesh, block, cfg, keep_quantized, dense=True):
    """-> (dense jax.Array, or None when only the stored blocks are wanted; QuantizedTensor or None)."""
    if leaf.kind == "plain":
        check_for = _finite_check
        if leaf.key.endswith("tid2eid"):
            n = cfg.n_routed_experts

            def check_for(src):
                def check(a):
                    if a.size and (a.min() < 0 or a.max() >= n):
                        raise CheckpointError(f"{src.file}: tensor {src.name!r}: expert ids outside [0, {n})")
                return check
        return _place(fh, leaf.srcs, leaf.stacked, leaf.shape, sharding, leaf.dtype, check_for), None
    # quantised: the stored q and its scales, then (unless only those are wanted) dequantised on the devices
    qshape = ((leaf.shape[0],) if leaf.stacked else ()) + _packed_shape(leaf)
    sc0 = leaf.scales[0]
    sshape = ((leaf.shape[0],) if leaf.stacked else ()) + sc0.shape
    lead = (1,) if leaf.stacked else ()
    q_sh = s_sh = None
    if sharding is not None:
        q_sh = NamedSharding(mesh, _fit_spec(sharding.spec, qshape, mesh))
        grid_block = lead + (block if leaf.kind == "fp8" else (1, quant.FP4_BLOCK // 2))
        s_sh = NamedSharding(mesh, _aligned_spec(q_sh.spec, qshape, grid_block, mesh))
    q = _place(fh, leaf.srcs, leaf.stacked, qshape, q_sh, None, _finite_check)
    s = _place(fh, leaf.scales, leaf.stacked, sshape, s_sh, None, _finite_check)
    qt = None
    if keep_quantized:
        with _mesh_ctx(mesh):
            s32 = _jit(("scale",), quant._scale_to_f32, s_sh)(s)
        if leaf.kind == "fp8":
            fmt = "e4m3fnuz" if leaf.srcs[0].dtype == "F8_E4M3FNUZ" else "e4m3fn"
            qt = quant.QuantizedTensor(q=q, scale=s32, kind="fp8", fmt=fmt, block=block, shape=leaf.shape)
        else:
            qt = quant.QuantizedTensor(q=q, scale=s32, kind="fp4", fmt="e2m1", block=(1, quant.FP4_BLOCK),
                                       shape=leaf.shape)
    if not dense:
        return None, qt
    fn = _dequant_fn(leaf.kind, block, leaf.dtype)
    with _mesh_ctx(mesh):
        return _jit(("dq", leaf.kind, block, str(leaf.dtype)), fn, sharding)(q, s), qt


def _mesh_ctx(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


__all__ = ["load_hf_checkpoint", "load_quantized_state", "check_config_matches", "CheckpointError"]


def init_model(config: DSV4Config, *, seed: int = 0, param_dtype=jnp.float32, dtype=None, mesh=None, rules=None):
    """A randomly initialised DSV4ForCausalLM, created sharded: `jax.jit` of the init with out_shardings =
    `param_shardings(abstract, mesh, rules)` (`rules=None`: the actor's), so no process ever holds the whole
    model and each device computes only its shards. Without a mesh: the plain eager init.
    The values equal the eager `DSV4ForCausalLM(config, rngs=nnx.Rngs(seed), param_dtype=...)` (jax's
    partitionable threefry: random bits do not depend on the sharding).
    """
    def make():
        return DSV4ForCausalLM(config, rngs=nnx.Rngs(seed), param_dtype=param_dtype, dtype=dtype or param_dtype)

    if mesh is None:
        return make()
    mesh = auto_axes(mesh)  # Explicit or Auto axes (sharding.mesh.auto_axes)
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    sh = param_shardings(abstract, mesh, ACTOR_RULES if rules is None else rules)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: nnx.state(make()), out_shardings=sh)()
    return nnx.merge(graphdef, state)
