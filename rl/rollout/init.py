"""The rollout's first weights straight from an official checkpoint's own FP8 blocks (no dequantise/requantise).

`checkpoint_rollout_weights(sampler, path)` reads the checkpoint with `dsv4.io.load.load_quantized_state` on the
sampler's mesh and rules (each rollout process reads only its shards) and turns it into the sampler's weight
state (`Sampler.set_weights` format: {path key: QuantizedTensor | array}) inside one jit whose out_shardings are
the sampler's:
- FP8 tensors stored with the sampler's block keep their bytes (e4m3fnuz engines get the exact byte conversion,
  `QuantizedTensor.to_fp8_format`); f32 scales as stored (powers of two).
- FP4 experts become FP8 tiles with `dsv4.quant.fp4_to_fp8_blockwise` (exact when the 1x32 scales of a tile
  span <= 14 binades; bound in its docstring).
- Anything the sampler quantises but the file stores dense (a bf16 checkpoint) is quantised by
  `dsv4.quant.quantize_rollout_fp8`, the path every push takes; everything else is cast as
  `rl.rollout.weights.EngineWeights.quantize_fn` casts it.
Converted leaf by leaf with the input donated: the peak is the converted state plus one leaf's stored blocks.
Tests: tests/dsv4/test_load_sharded.py (same logprobs as the dense-loaded fp32 sampler).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from dsv4 import quant
from dsv4.io.load import load_quantized_state
from dsv4.lora import is_adapter_key
from dsv4.names import param_key
from dsv4.rollout_format import KEEP_F32


def _as_sampler_fp8(x, fmt: str, block):
    if isinstance(x, quant.QuantizedTensor):
        if x.kind == "fp4":
            q, s = quant.fp4_to_fp8_blockwise(x.q, x.scale, block=block, fp4_block=x.block[1])
            x = quant.QuantizedTensor(q=q, scale=s, kind="fp8", fmt="e4m3fn", block=block, shape=x.shape)
        elif tuple(x.block) != tuple(block):  # another block size: re-quantised by the one rollout path
            return quant.quantize_rollout_fp8(x.dequantize(jnp.float32), fmt=fmt, block=block)
        return x.to_fp8_format(fmt)
    return quant.quantize_rollout_fp8(x, fmt=fmt, block=block)  # stored dense: quantised as a push does


def checkpoint_rollout_weights(sampler, path, *, config=None, progress: bool | None = None) -> dict:
    """Weight state for `sampler.set_weights(state, version)` from the checkpoint directory `path`.

    Args:
      sampler: an `rl.rollout.engine.Sampler` (possibly built from an abstract model); its mesh, rules, fp8 format,
        block and compute dtype decide the result.
      config: the model config (default: the sampler's); checked against the file's config.json.
    Returns:
      {path key: QuantizedTensor | jax.Array} with the sampler's shardings.
    Raises:
      dsv4.io.load.CheckpointError as `load_hf_checkpoint` does.
    """
    stored = load_quantized_state(path, dtype=sampler.compute_dtype, config=config or sampler.config,
                                  mesh=sampler.mesh, rules=sampler.rules, progress=progress)
    abs_flat = sampler.weights.abstract_params
    for p, v in abs_flat:  # LoRA adapters (dsv4/lora.py) are not in a base checkpoint: zero (no delta) until a push
        if is_adapter_key(k := param_key(p)) and k not in stored:
            stored[k] = jnp.zeros(v.get_value().shape, jnp.float32)
    missing = [param_key(p) for p, _ in abs_flat if param_key(p) not in stored]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensors the rollout model needs, e.g. {missing[:3]}")

    out_sh = sampler.weights.state_shardings()
    cpu = sampler.mesh is not None and sampler.mesh.devices.flat[0].platform == "cpu"
    jits: dict = {}

    def convert(x, mode: str, dtype):
        if mode == "fp8":
            return _as_sampler_fp8(x, sampler.fmt, sampler.fp8_block)
        if isinstance(x, quant.QuantizedTensor):
            x = x.dequantize(jnp.float32)
        return x.astype(dtype)

    # one jit per leaf (cached by treatment; same shapes share executables), inputs donated: the peak is the
    # converted state plus one leaf's stored blocks, never two copies of the whole model
    out = {}
    for p, v in abs_flat:
        k = param_key(p)
        x = stored.pop(k)
        if sampler.weights.is_quantized(k, v.get_value()):
            mode, dtype = "fp8", None
        elif jnp.issubdtype(x.dtype if not isinstance(x, quant.QuantizedTensor) else jnp.float32, jnp.floating) \
                and not KEEP_F32.search(k):
            mode, dtype = "cast", jnp.dtype(sampler.compute_dtype)
        else:
            mode, dtype = "cast", jnp.dtype(v.get_value().dtype)
        sh = None if out_sh is None else out_sh[k]
        fn_key = (mode, dtype, sh)
        if fn_key not in jits:
            jits[fn_key] = jax.jit(lambda x, mode=mode, dtype=dtype: convert(x, mode, dtype), donate_argnums=0,
                                   **({} if sh is None else {"out_shardings": sh}))
        with warnings.catch_warnings():  # an FP4 pack cannot become an FP8 buffer in place: freed instead
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            if sampler.mesh is None:
                out[k] = jits[fn_key](x)
            else:
                with jax.set_mesh(sampler.mesh):
                    out[k] = jits[fn_key](x)
                if cpu:  # one multi-device program at a time: XLA:CPU may order concurrent ones differently per
                    jax.block_until_ready(out[k])  # device, and their collectives then wait on each other forever
    return out
