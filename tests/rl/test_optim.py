"""rl/algo/optim.py: the streamed update (`update_streamed`) equals the on-device update (`update` with `train_tx`'s
clip) on every kind of streamed leaf: a stacked leaf split over `stage` in 2 blocks (a pipelined group: each slice
is every stage's own layer), a 2-D leaf in `ROW_STEPS` chunks of rows (the embedding), a stacked leaf of the MTP
head (clipped apart from the policy's leaves: the streamed update clipped it by the one global norm before), with
the clip active. No model, one small jit per side on the 8 CPU devices.
Run: .venv/bin/python -m pytest -q tests/rl/test_optim.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4.names import tree_key
from rl.algo import optim
from rl.config.algo import LearnerConfig
from sharding.mesh import build_mesh_plan
from sharding.offload import ROW_STEPS


def test_streamed_update_equals_on_device_update():
    mesh = build_mesh_plan("actor:stage=2,fsdp=2,expert=2").actor
    keys = iter(jax.random.split(jax.random.key(0), 8))
    shapes = {"layers": {"w": (4, 8, 16)}, "embed": {"weight": (8 * ROW_STEPS, 16)}, "mtp": {"w": (2, 8, 16)},
              "norm": (16,)}
    params = jax.tree.map(lambda s: jax.random.normal(next(keys), s), shapes, is_leaf=lambda s: isinstance(s, tuple))
    grads = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape) * 1e-2, params)
    specs = {"layers": {"w": P("stage")}, "embed": {"weight": P()}, "mtp": {"w": P()}, "norm": P()}
    place = lambda t: jax.device_put(t, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))  # noqa: E731
    params, grads = place(params), place(grads)
    matrix = {tree_key(p): x.ndim >= 2 for p, x in jax.tree_util.tree_leaves_with_path(params)}
    cfg = LearnerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=1e-2, mtp_loss_weight=0.5, train_mtp=True)
    trained = {k: True for k in matrix}
    opt = optim.init(optim.train_tx(cfg, matrix), params, trained)
    streamed = {"layers/w": 2, "embed/weight": 1, "mtp/w": 1}

    def norm(mtp):
        return optax.tree.norm([g for p, g in jax.tree_util.tree_leaves_with_path(grads)
                                if optim.is_mtp_key(tree_key(p)) == mtp])

    want_p, want_o = jax.jit(lambda g, o, p: optim.update(optim.train_tx(cfg, matrix), g, o, p))(grads, opt, params)
    got_p, got_o = jax.jit(lambda g, o, p: optim.update_streamed(
        optim.train_tx(cfg, matrix, clip=False), g, o, p, streamed, finite=jnp.bool_(True), g_norm=norm(False),
        max_norm=cfg.max_grad_norm, apart_norm=norm(True)))(grads, opt, params)
    assert float(norm(False)) > cfg.max_grad_norm and float(norm(True)) > cfg.max_grad_norm  # both clips active
    for a, b in zip(jax.tree.leaves((want_p, want_o)), jax.tree.leaves((got_p, got_o))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    assert got_p["layers"]["w"].sharding.spec[0] == "stage"  # each stage updated its own layers
