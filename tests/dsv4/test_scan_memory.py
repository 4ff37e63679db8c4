"""dsv4/scan.py's block-rematerialised scanned train step reads its stacked weights in place: XLA's compiled temp
memory does not grow with the number of scanned layers. Split from tests/dsv4/test_scan.py (both are compile-heavy;
two files let pytest-xdist's --dist loadfile run them on both workers).

Run: .venv/bin/python -m pytest -q tests/dsv4/test_scan_memory.py
"""

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import DSV4Config
from dsv4 import scan as sc
from dsv4.layers import Buffer
from randomize import random_model


def _block_remat_step(repeats: int):
    """(temp bytes of the compiled bf16 train step under "block" remat, bytes of the stacked bf16 weights)."""
    cfg = DSV4Config.tiny(num_hidden_layers=2 + 2 * repeats, num_hash_layers=2,
                          compress_ratios=(0, 0) + (4, 8) * repeats + (0,), hidden_size=128,
                          moe_intermediate_size=256)
    model = random_model(cfg, seed=2, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    sdef = sc.stack_def(model)
    assert sdef.groups[-1].repeats == repeats
    params, buffers = nnx.state(model, nnx.Param), nnx.state(model, Buffer)
    sp, sb = sc.stack_params(params, sdef.groups), sc.stack_params(buffers, sdef.groups)
    ids = jnp.ones((1, 16), jnp.int32)

    def loss(p):
        shell, stack = sc.merge_stacked(sdef, p, sb, remat="block")
        return jnp.sum(shell(ids, layer_stack=stack).logits.astype(jnp.float32))

    temp = jax.jit(jax.grad(loss)).lower(sp).compile().memory_analysis().temp_size_in_bytes
    stacked = [a for a in jax.tree.leaves(sp["layers"][1]) if a.dtype == jnp.bfloat16]
    return temp, sum(a.size * a.dtype.itemsize for a in stacked)


def test_block_remat_step_holds_no_copy_of_the_stacked_weights():
    """The scanned, block-rematerialised train step reads its stacked bf16 weights in place: its temp memory
    does not grow with the number of scanned layers (4 more repetitions add under a quarter of their weights'
    bytes). Before `block_remat.take` / `.scan_block_remat`, XLA:CPU kept an f32 copy of every stacked bf16 weight and
    of the saved inputs (more than 2x the weights per layer: 103 GiB per device on the Flash seed layout)."""
    t4, w4 = _block_remat_step(4)
    t8, w8 = _block_remat_step(8)
    assert t8 - t4 < 0.25 * (w8 - w4), (t4, t8, w4, w8)
