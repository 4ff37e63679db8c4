"""Give a dsv4 model non-trivial random values everywhere (sinks, ape, mHC base/scale, norms, router bias), so
tests exercise every term (the default init zeroes several of them, which hides bugs).

`randomize(model)` overwrites a built model in place; `random_model(cfg, seed)` builds one abstractly and fills it
from NumPy (no init compute). Their value streams differ; tests calibrated on one keep using it."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM, abstract_model


def randomize(model, seed: int = 0, scale: float = 0.15):
    rs = np.random.RandomState(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name = "/".join(str(p) for p in path)
        v = var.get_value() if hasattr(var, "get_value") else var.value
        if jnp.issubdtype(v.dtype, jnp.integer):
            continue
        shape = v.shape
        if name.endswith(("norm/weight",)):
            new = 1.0 + 0.2 * rs.randn(*shape)
        elif name.endswith(("attn_sink", "ape", "_base", "bias")):
            new = 0.5 * rs.randn(*shape)
        elif name.endswith("_scale"):
            new = 0.5 + rs.rand(*shape)
        elif name.endswith("_fn"):
            new = 0.1 * rs.randn(*shape)
        else:
            new = (scale if len(shape) >= 2 else 0.5) * rs.randn(*shape)
        var.set_value(jnp.asarray(new, v.dtype)) if hasattr(var, "set_value") else setattr(var, "value", jnp.asarray(new, v.dtype))
    nnx.update(model, nnx.state(model))
    return model


def random_model(cfg: DSV4Config, seed: int, *, param_dtype=jnp.float32, dtype=jnp.float32,
                 like: nnx.Module | None = None) -> DSV4ForCausalLM:
    """The model built abstractly (`nnx.eval_shape`: no init compute, ~0.5 s instead of ~6 s of eager init ops),
    then every leaf set from NumPy: non-trivial sinks / ape / mHC base+scale / norms / router bias, random
    weights (std 0.15), `tid2eid` distinct experts per token id. With `like`, the values are copied from that
    model instead (cast to this model's leaf dtypes)."""
    model = abstract_model(cfg, param_dtype=param_dtype, dtype=dtype)
    src = None if like is None else dict(nnx.to_flat_state(nnx.state(like)))
    rs = np.random.RandomState(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        sd = var.get_raw_value()
        name = ".".join(map(str, path))
        if src is not None:
            new = src[path][...]
        elif name.endswith("tid2eid"):
            new = np.stack([rs.permutation(cfg.n_routed_experts)[: cfg.num_experts_per_tok]
                            for _ in range(sd.shape[0])])
        elif "norm" in name:
            new = 1.0 + 0.2 * rs.randn(*sd.shape)
        elif name.endswith(("attn_sink", "ape", "_base", "gate.bias")):
            new = 0.5 * rs.randn(*sd.shape)
        elif name.endswith("_scale"):
            new = 0.5 + rs.rand(*sd.shape)
        elif name.endswith("_fn"):
            new = 0.1 * rs.randn(*sd.shape)
        else:
            new = 0.15 * rs.randn(*sd.shape)
        var.set_value(jnp.asarray(new).astype(sd.dtype))
    return model
