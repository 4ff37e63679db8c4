"""Tests for parallel/pipeline.py: the pipelined forward (layers split in stages over the `stage` mesh axis,
micro-batches passed between stages by a collective permute) gives the unpipelined step's loss, logits, routing
record and every gradient (fp32, 1e-5), with routing replay and left padding; the pipelined group's weights are split
over `stage`; the plan refuses a stage count that does not divide the group's repetitions; the bubble fraction is
(P - 1) / (M + P - 1). The learner-level test (tests/rl/test_learner_pipeline.py) runs 4 stages over 8 devices, the
remat-"block" scan inside a stage, the MTP head and a group in front of the pipeline.

`CFG`: the tiny config with 5 main layers, (CSA, HCA) x 2 then a sliding layer: the pipelined group has period 2
(each stage runs a CSA and an HCA layer) and a group runs after the pipeline. One test compiles little (2 stages of
one repetition, experts split over `expert`); `FLASHLIKE` checks the group choice on Flash's pattern.
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
from parallel.expert import make_ep_dispatch
from sharding.mesh import build_mesh_plan
from sharding.rules import ACTOR_RULES, param_shardings, use_rules

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import random_model  # noqa: E402

CFG = DSV4Config.tiny(num_hidden_layers=5, num_hash_layers=0, compress_ratios=(4, 8, 4, 8, 0, 0))
FLASHLIKE = DSV4Config.tiny(num_hidden_layers=6, num_hash_layers=2, compress_ratios=(0, 0, 4, 8, 4, 8, 0))
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
    assert sc.layer_groups(CFG) == ((0, 2, 2), (4, 1, 1))
    with pytest.raises(ValueError, match=r"--learner.pipeline_stages=4 does not divide the 2 repetitions"):
        pp.pipeline_plan(sc.layer_groups(CFG), stages=4, micro_batches=2)
    flash = sc.layer_groups(DSV4Config.flash())
    assert pp.pipeline_plan(flash, stages=4, micro_batches=8).group == 2  # the 20 x (HCA, CSA) group


def _loss(out, ids, mask):
    """Next-token NLL of the logits (mean over real pairs)."""
    m = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
    lp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    return -jnp.sum(jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0] * m) / jnp.sum(m)


def _run(sdef, params, buffers, ids, mask, replay, plan, dispatch_fn=None):
    shell, stack = sc.merge_stacked(sdef, params, buffers)
    if plan is not None:
        stack = pp.PipelineStack.of(stack, plan)
    out = shell(ids, attention_mask=mask, routing_replay=replay, layer_stack=stack, dispatch_fn=dispatch_fn)
    return _loss(out, ids, mask), out


def _batch():
    ids = jax.random.randint(jax.random.key(1), (B, S), 0, 256)
    mask = jnp.ones((B, S), jnp.int32).at[1, :5].set(0)  # row 1 left-padded by 5
    return ids, mask


def test_pipelined_equals_unpipelined():
    """Loss, logits, routing and every gradient (layers, embedding, head) of the pipelined step (2 stages, 2
    micro-batches) on `actor:stage=2,expert=2,fsdp=2` (the routed experts by the EP all-to-all) equal the unpipelined
    scanned step's (one device, the whole batch at once), with a routing replay. Tolerances: loss and gradients
    1e-5 absolute; logits 1e-5 of the largest logit (the unpipelined model alone moves its logits by 1.0e-5 of
    |logits| <= 5 when run row by row instead of 4 rows at once: XLA:CPU sums matmuls of other shapes in another
    order; measured 2026-12-05)."""
    model = random_model(CFG, seed=0)
    sdef = sc.stack_def(model)
    _, params, buffers = nnx.split(model, nnx.Param, Buffer)
    sp, sb = sc.stack_params(params, sdef.groups), sc.stack_params(buffers, sdef.groups)
    ids, mask = _batch()
    free = _run(sdef, sp, sb, ids, mask, None, None)[1].routing
    replay = jnp.roll(free, 3, axis=1)  # another token's routes, forced in every layer
    replay = jnp.where(replay < 0, 0, replay)

    def grads(plan, p, b, dispatch_fn=None):
        fn = jax.value_and_grad(lambda p: _run(sdef, p, b, ids, mask, replay, plan, dispatch_fn), has_aux=True)
        exe = jax.jit(fn, compiler_options=_FAST).lower(p).compile()
        (loss, out), g = exe(p)
        return loss, out, g, exe.as_text()

    loss0, out0, g0, _ = grads(None, sp, sb)

    mesh = build_mesh_plan("actor:stage=2,expert=2,fsdp=2").actor
    plan = pp.pipeline_plan(sdef.groups, stages=2, micro_batches=2)
    abs_p = sc.stack_params(nnx.state(nnx.eval_shape(lambda: model), nnx.Param), sdef.groups)
    shard = pp.stage_shardings(param_shardings(abs_p, mesh, ACTOR_RULES), plan, ACTOR_RULES)
    assert plan.group == 0
    assert shard["layers"][0][1]["attn"]["wq_a"]["weight"].get_value().spec[0] == "stage"  # split over the stages
    assert shard["layers"][1][0]["attn"]["wq_a"]["weight"].get_value().spec[0] is None  # the layer after: whole
    with jax.set_mesh(mesh), use_rules(ACTOR_RULES, mesh):
        sp_m = jax.device_put(sp, shard)
        sb_m = jax.device_put(sb, NamedSharding(mesh, P()))
        ep = make_ep_dispatch(mesh, check_vma=False)  # the experts' all-to-all inside the stages
        loss1, out1, g1, hlo = grads(plan, sp_m, sb_m, ep)
    assert "collective-permute" in hlo  # the stage -> stage + 1 shift (and back in the backward)
    assert "all-to-all" in hlo  # the expert dispatch

    np.testing.assert_array_equal(np.asarray(out1.routing), np.asarray(out0.routing))
    real = np.asarray(mask, bool)
    np.testing.assert_array_equal(np.asarray(out1.routing)[real], np.asarray(replay)[real])
    diffs = {"loss": abs(float(loss1) - float(loss0))}
    diffs["logits"] = float(jnp.max(jnp.abs(out1.logits - out0.logits)) / jnp.maximum(1.0, jnp.max(jnp.abs(
        out0.logits))))  # relative to the largest logit
    worst, where = 0.0, None
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
        d = float(jnp.max(jnp.abs(a - b)))
        worst, where = max((worst, where), (d, jax.tree_util.keystr(path)))
    diffs["grads"] = worst
    print(f"2 stages, 2 micro-batches: max diffs {diffs} (worst grad at {where}; logits: relative "
          f"to max |logit| {float(jnp.max(jnp.abs(out0.logits))):.2f})")
    assert all(v <= TOL for v in diffs.values()), diffs
    for j in (0, 1):  # the CSA and the HCA layer of every stage get a gradient
        g_wq = g1["layers"][0][j]["attn"]["wq_a"]["weight"].get_value()
        assert float(jnp.min(jnp.max(jnp.abs(g_wq), axis=(1, 2)))) > 0
