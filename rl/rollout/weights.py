"""The rollout engine's weights: the abstract model's parameters, where each lives on the rollout mesh, and the one
rule that turns learner weights into the engine's weight state ({path key: QuantizedTensor | array}).

`EngineWeights` is built once per engine (`rl.rollout.engine.Sampler.weights`); the push (parallel/push/), the
checkpoint loader (`rl.rollout.init`) and the planner (`launch.aot`) read its public names:
`abstract_params` (the parameters' paths and abstract values), `dense_shardings` (where each dense weight lands),
`state_shardings()` (the stored state's placement, FP8 / FP4 scales included), `is_quantized(key, leaf)`,
`quantize(raw)` (the jitted quantisation) and `abstract_state(live)` (ShapeDtypeStructs of what the engine stores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dsv4 import fp4, quant
from dsv4.model import abstract_model
from dsv4.names import param_key
from dsv4.rollout_format import RolloutFormat, layer_value
from rl.rollout.layerwise import LayerwiseWeights
from sharding.rules import param_shardings


class EngineWeights:
    """The weight side of a rollout engine.

    Args:
      config: the model config. rformat: the rollout weight format (`dsv4.rollout_format.RolloutFormat`).
      mesh, rules: the rollout mesh and its rule table (None: unmeshed). fp8_matmul: how the FP8-set projections
        and the routed experts multiply (`dsv4.quant.MATMULS`; "dequant": dequantised; else they stay quantised for
        FP8 GEMMs). tie: `rl.rollout.layerwise.default_tie` of the devices. lora: the model's
        `dsv4.lora.LoraConfig` (None: no adapters): the engine then applies the adapters unmerged (base product +
        low-rank path, dsv4/lora.py); they are dense tensors of the weight state, pushed like any other.
    """

    def __init__(self, config, rformat: RolloutFormat, *, mesh=None, rules=None, fp8_matmul: str = "dequant",
                 tie: str = "cond", lora=None):
        self.rformat, self.mesh, self.fp8_matmul = rformat, mesh, fp8_matmul
        self.compute_dtype = rformat.compute_dtype
        abstract = abstract_model(config, param_dtype=jnp.float32, dtype=self.compute_dtype, lora=lora)
        self.layerwise = LayerwiseWeights(abstract, self.compute_dtype, fp8_matmul=fp8_matmul, tie=tie)
        self.graphdef, abs_state = nnx.split(abstract)
        self.abstract_params = list(nnx.to_flat_state(abs_state))  # [(path, abstract Variable)]
        self.dense_shardings = None  # {path key: NamedSharding} of the dense weights (what the push device_puts onto)
        if mesh is not None:
            sh = param_shardings(abs_state, mesh, rules)
            self.dense_shardings = {param_key(p): v.get_value() if isinstance(v, nnx.Variable) else v
                                    for p, v in nnx.to_flat_state(sh)}
        self._quantize_jit = jax.jit(self.quantize_fn, out_shardings=self.state_shardings())

    def is_quantized(self, key: str, leaf) -> bool:
        """Quantised on the rollout side (FP8 blocks, or FP4 for the routed experts under `fp8+fp4experts`)."""
        return self.rformat.kind(key, leaf.ndim) is not None

    def state_shardings(self) -> dict | None:
        """{path key: NamedSharding | QuantizedTensor of NamedShardings} of the stored weight state (FP8 scales
        replicated, FP4 scales split like their bytes); None without a mesh."""
        if self.mesh is None:
            return None
        rep = NamedSharding(self.mesh, PartitionSpec())
        out = {}
        for p, v in self.abstract_params:
            k, leaf = param_key(p), v.get_value()
            sh = self.dense_shardings[k]
            kind = self.rformat.kind(k, leaf.ndim)
            if kind == "fp4":  # scales [E, out, in/32]: split like q
                out[k] = quant.QuantizedTensor(q=sh, scale=sh, kind="fp4", fmt="e2m1", block=(1, fp4.FP4_BLOCK),
                                               shape=leaf.shape)
            elif kind == "fp8":
                out[k] = quant.QuantizedTensor(q=sh, scale=rep, kind="fp8", fmt=self.rformat.fmt,
                                               block=self.rformat.block, shape=leaf.shape)
            else:
                out[k] = sh
        return out

    def quantize_fn(self, raw: dict) -> dict:
        """{key: array} (any float dtype) -> {key: QuantizedTensor | array in the rollout dtype} (traceable)."""
        return {param_key(p): self.rformat.value(param_key(p), raw[param_key(p)], v.get_value().dtype)
                for p, v in self.abstract_params}

    def quantize(self, raw: dict) -> dict:
        """`quantize_fn` jitted with the state's shardings as outputs (call inside the rollout mesh)."""
        return self._quantize_jit(raw)

    def abstract_state(self, live: dict | None = None) -> dict:
        """ShapeDtypeStructs (with shardings) of the weight state: `live`'s, or the quantised layout of the
        abstract model's (no weights needed)."""
        if live is not None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), live)
        raw = {param_key(p): jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype)
               for p, v in self.abstract_params}
        w_abs = jax.eval_shape(self.quantize_fn, raw)
        sh = self.state_shardings()
        if sh is None:
            return w_abs
        return jax.tree.map(lambda a, d: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=d), w_abs, sh)

    def flat_params(self, params) -> dict:
        """nnx.State / Module / {key: array} -> {path key: array} covering every tensor of the model; ValueError
        naming the missing tensors otherwise."""
        if isinstance(params, nnx.Module):
            params = nnx.state(params)
        if isinstance(params, dict) and all(isinstance(k, str) for k in params):
            flat = params
        else:
            flat = {param_key(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
                    for p, v in nnx.to_flat_state(params)}
        missing = [param_key(p) for p, _ in self.abstract_params if param_key(p) not in flat]
        if missing:
            raise ValueError(f"update_weights: {len(missing)} tensors missing, e.g. {missing[:5]}")
        return flat

    def dense_model(self, wstate: dict):
        """The whole model with `wstate` dequantised at once (the `per_call` / `per_step` references; traceable)."""
        vals = {k: layer_value(k, v, self.compute_dtype, matmul=self.fp8_matmul) for k, v in wstate.items()}
        flat = [(p, var.replace(vals[param_key(p)])) for p, var in self.abstract_params]
        return nnx.merge(self.graphdef, nnx.from_flat_state(flat))

    def abstract_model(self):
        """The abstract model (graph and ShapeDtypeStructs), e.g. for cache shapes."""
        return nnx.merge(self.graphdef, nnx.from_flat_state(self.abstract_params))
