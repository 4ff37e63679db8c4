"""Tests for parallel/pipeline.py: the pipelined forward (layers split in stages over the `stage` mesh axis,
micro-batches passed between stages by a collective permute) gives the unpipelined step's loss, logits, MTP logits,
routing record and every gradient (fp32, 1e-5), with routing replay and left padding, on the 8 forced CPU devices;
the pipelined group's weights are split over `stage`; the plan refuses a stage count that does not divide the
group's repetitions; the bubble fraction is (P - 1) / (M + P - 1).

Two configs, so that each test compiles little: `FLASHLIKE`, the tiny config with 6 main layers in Flash's pattern
(2 sliding hash layers, then (CSA, HCA) x 2: the pipelined group has period 2, the hash layers run before the
pipeline), 2 stages of one repetition each; `UNIFORM`, 8 sliding layers (one group of period 1), 4 stages of two
repetitions each (the stage's scan under remat "block", its hand-written backward inside the stage vmap).
Run: .venv/bin/python -m pytest -q tests/parallel/test_pipeline.py
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4 import DSV4Config
from dsv4 import scan as sc
from dsv4.layers import Buffer
from parallel import pipeline as pp
from sharding.mesh import build_mesh_plan
from sharding.rules import ACTOR_RULES, param_shardings, use_rules

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import random_model  # noqa: E402

FLASHLIKE = DSV4Config.tiny(num_hidden_layers=6, num_hash_layers=2, compress_ratios=(0, 0, 4, 8, 4, 8, 0))
UNIFORM = DSV4Config.tiny(num_hidden_layers=8, num_hash_layers=0, compress_ratios=(0,) * 9)
B, S = 4, 16
_FAST = {"xla_backend_optimization_level": 0}
TOL = 1e-5


def test_plan_and_bubble():
    groups = sc.layer_groups(FLASHLIKE)
    assert groups == ((0, 1, 2), (2, 2, 2))
    plan = pp.pipeline_plan(groups, stages=2, micro_batches=8)
    assert (plan.group, plan.repeats, plan.iterations) == (1, 2, 9)
    assert plan.bubble == pp.bubble_fraction(2, 8) == 1 / 9
    assert pp.bubble_fraction(1, 5) == 0.0 and pp.bubble_fraction(4, 8) == 3 / 11
    assert sc.layer_groups(UNIFORM) == ((0, 1, 8),)
    with pytest.raises(ValueError, match=r"--learner.pipeline_stages=3 does not divide the 8 repetitions"):
        pp.pipeline_plan(sc.layer_groups(UNIFORM), stages=3, micro_batches=2)
    flash = sc.layer_groups(DSV4Config.flash())
    assert pp.pipeline_plan(flash, stages=4, micro_batches=8).group == 2  # the 20 x (HCA, CSA) group


def _loss(out, ids, mask):
    """Next-token NLL of the logits + the MTP head's (token t + 2) if computed, so the MTP block gets gradients."""
    m = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
    lp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    nll = -jnp.sum(jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0] * m) / jnp.sum(m)
    if out.mtp_logits is None:
        return nll
    mq = m[:, 1:] * mask[:, :-2]
    lq = jax.nn.log_softmax(out.mtp_logits[:, :-2], axis=-1)
    return nll - jnp.sum(jnp.take_along_axis(lq, ids[:, 2:, None], axis=-1)[..., 0] * mq) / jnp.sum(mq)


def _run(sdef, params, buffers, ids, mask, replay, remat, plan, mtp):
    shell, stack = sc.merge_stacked(sdef, params, buffers, remat=remat)
    if plan is not None:
        stack = pp.PipelineStack.of(stack, plan)
    out = shell(ids, attention_mask=mask, routing_replay=replay, return_mtp=mtp, layer_stack=stack)
    return _loss(out, ids, mask), out


def _batch():
    ids = jax.random.randint(jax.random.key(1), (B, S), 0, 256)
    mask = jnp.ones((B, S), jnp.int32).at[1, :5].set(0)  # row 1 left-padded by 5
    return ids, mask


@pytest.mark.parametrize("cfg,layout,stages,micro,remat,mtp", [
    (FLASHLIKE, "actor:stage=2,data=2,fsdp=2", 2, 2, None, False), (UNIFORM, "actor:stage=4", 4, 4, "block", True)],
    ids=["flashlike-2stages-8devices", "uniform-4stages-remat-mtp"])
def test_pipelined_equals_unpipelined(cfg, layout, stages, micro, remat, mtp):
    """Loss, logits, (MTP logits,) routing and every gradient (layers, embedding, head, MTP) of the pipelined step
    on the `layout` mesh equal the unpipelined scanned step's (one device, the whole batch at once), with a routing
    replay. Tolerances: loss and gradients 1e-5 absolute; logits 1e-5 of the largest logit (the unpipelined model
    alone moves its logits by 1.0e-5 of |logits| <= 5 when run row by row instead of 4 rows at once: XLA:CPU sums
    matmuls of other shapes in another order; measured 2026-12-05)."""
    model = random_model(cfg, seed=0)
    sdef = sc.stack_def(model)
    _, params, buffers = nnx.split(model, nnx.Param, Buffer)
    sp, sb = sc.stack_params(params, sdef.groups), sc.stack_params(buffers, sdef.groups)
    ids, mask = _batch()
    free = _run(sdef, sp, sb, ids, mask, None, None, None, False)[1].routing
    replay = jnp.roll(free, 3, axis=1)  # another token's routes, forced in every layer
    replay = jnp.where(replay < 0, 0, replay)

    def grads(plan, p, b):
        fn = jax.value_and_grad(lambda p: _run(sdef, p, b, ids, mask, replay, remat, plan, mtp), has_aux=True)
        exe = jax.jit(fn, compiler_options=_FAST).lower(p).compile()
        (loss, out), g = exe(p)
        return loss, out, g, exe.as_text()

    loss0, out0, g0, _ = grads(None, sp, sb)

    mesh = build_mesh_plan(layout).actor
    plan = pp.pipeline_plan(sdef.groups, stages=stages, micro_batches=micro)
    abs_p = sc.stack_params(nnx.state(nnx.eval_shape(lambda: model), nnx.Param), sdef.groups)
    shard = pp.stage_shardings(param_shardings(abs_p, mesh, ACTOR_RULES), plan, ACTOR_RULES)
    g = plan.group
    assert shard["layers"][g][0]["attn"]["wq_a"]["weight"].get_value().spec[0] == "stage"  # split over the stages
    if g:  # the hash layers in front of the pipeline: not split over the stages
        assert shard["layers"][0][0]["attn"]["wq_a"]["weight"].get_value().spec[0] is None
    with jax.set_mesh(mesh), use_rules(ACTOR_RULES, mesh):
        sp_m = jax.device_put(sp, shard)
        sb_m = jax.device_put(sb, NamedSharding(mesh, P()))
        loss1, out1, g1, hlo = grads(plan, sp_m, sb_m)
    assert "collective-permute" in hlo  # the stage -> stage + 1 shift (and back in the backward)

    np.testing.assert_array_equal(np.asarray(out1.routing), np.asarray(out0.routing))
    real = np.asarray(mask, bool)
    np.testing.assert_array_equal(np.asarray(out1.routing)[real], np.asarray(replay)[real])
    diffs = {"loss": abs(float(loss1) - float(loss0))}
    for name in ("logits", "mtp_logits")[:1 + mtp]:  # relative to the largest logit
        a, b = getattr(out1, name), getattr(out0, name)
        diffs[name] = float(jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(b))))
    worst, where = 0.0, None
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
        d = float(jnp.max(jnp.abs(a - b)))
        worst, where = max((worst, where), (d, jax.tree_util.keystr(path)))
    diffs["grads"] = worst
    print(f"stages={stages} micro={micro} remat={remat} max diffs {diffs} (worst grad at {where}; logits: relative "
          f"to max |logit| {float(jnp.max(jnp.abs(out0.logits))):.2f})")
    assert all(v <= TOL for v in diffs.values()), diffs
    g_wq = g1["layers"][g][0]["attn"]["wq_a"]["weight"].get_value()
    assert float(jnp.min(jnp.max(jnp.abs(g_wq), axis=(1, 2)))) > 0  # every stage's layers get a gradient
    if mtp:
        assert float(jnp.max(jnp.abs(g1["mtp"][0]["e_proj"]["weight"].get_value()))) > 0
