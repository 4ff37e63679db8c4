"""Give a dsv4 model non-trivial random values everywhere (sinks, ape, mHC base/scale, norms, router bias), so
tests exercise every term (the default init zeroes several of them, which hides bugs)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


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
