"""Sharded, streaming load of an official (or transformers-named) DeepSeek-V4 safetensors checkpoint.

The load is planned (`dsv4.io.plan`: which file tensors fill each leaf, validated before any read), then each leaf
is read and placed (`dsv4.io.read`); this module holds the entry points and `init_model` (the same sharded
placement for a random init).

`load_hf_checkpoint(path, *, dtype, config, mesh, rules, keep_quantized)`:
- With a `mesh`, every leaf ends in its rule-table sharding (`sharding.rules.param_shardings`, `rules=None` = the
  actor's) without ever being whole on a host: it is created with `jax.make_array_from_callback` in a row-split
  sharding over the *same* mesh axes (`dsv4.io.read.row_sharding`), whose callback, for each *addressable* shard,
  reads only that shard's rows from the file (`SafetensorsFile.read_region`: one `pread` per contiguous run), then
  a jitted identity reshards it on the devices. Stacked experts are assembled per shard from the per-expert file tensors
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
  (the rollout's FP8 weights come from here: `rl/rollout/init.py`).

Errors are `CheckpointError` (a ValueError) with one line naming the directory / file and the tensor: unreadable
directory, truncated or corrupt file, missing / unexpected tensors, wrong shape or dtype, NaN/inf, a config.json
that does not match the given config.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from dsv4.config import ConfigError, DSV4Config
from dsv4.io.convert import CheckpointError, hf_to_official
from dsv4.io.plan import check_config_matches, fp8_block, plan_leaves, scan_checkpoint, src_nbytes
from dsv4.io.read import Files, load_leaf
from dsv4.io.safetensors import bytes_read
from dsv4.model import DSV4ForCausalLM, abstract_model
from dsv4.names import param_key
from sharding.mesh import auto_axes
from sharding.rules import ACTOR_RULES, param_shardings

log = logging.getLogger(__name__)


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
    files = scan_checkpoint(pathlib.Path(path))
    if config.num_nextn_predict_layers and not any(hf_to_official(k).startswith("mtp.") for k in files):
        return dataclasses.replace(config, num_nextn_predict_layers=0,
                                   compress_ratios=config.compress_ratios[: config.num_hidden_layers])
    return config


def _load(path, *, dtype, config, mesh, rules, keep_quantized, compute_dtype, progress, dense=True):
    path = pathlib.Path(path)
    files = scan_checkpoint(path)
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
    abstract = abstract_model(cfg, param_dtype=dtype, dtype=compute_dtype)
    leaves = plan_leaves(path, cfg, abstract, files)
    shardings = None
    if mesh is not None:
        sh = param_shardings(nnx.state(abstract), mesh, ACTOR_RULES if rules is None else rules)
        shardings = {param_key(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
                     for p, v in nnx.to_flat_state(sh)}
    block = fp8_block(cfg)
    enabled = sys.stderr.isatty() if progress is None else progress
    total = sum(src_nbytes(s) for lf in leaves.values() for s in lf.srcs + (lf.scales or []))
    bar = _Progress(path, total, len(leaves), enabled)
    fh = Files()
    values, quantized = {}, {}
    try:
        for key, leaf in leaves.items():
            sharding = None if shardings is None else shardings[key]
            values[key], q = load_leaf(fh, leaf, sharding, mesh, block, cfg, keep_quantized, dense)
            if q is not None:
                quantized[key] = q
            bar.step(sum(src_nbytes(s) for s in leaf.srcs + (leaf.scales or [])))
    finally:
        fh.close()
        bar.close(path)
    return abstract, leaves, values, quantized


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
    graphdef, abstract = nnx.split(abstract_model(config, param_dtype=param_dtype, dtype=dtype or param_dtype))
    sh = param_shardings(abstract, mesh, ACTOR_RULES if rules is None else rules)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: nnx.state(make()), out_shardings=sh)()
    return nnx.merge(graphdef, state)


__all__ = ["CheckpointError", "check_config_matches", "init_model", "load_hf_checkpoint", "load_quantized_state",
           "loaded_config"]
