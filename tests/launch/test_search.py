"""launch/search.py (`python -m launch.plan --search`): the actor meshes it enumerates, which collectives cross
nodes, and the arithmetic estimate's collective bytes against hand counts on the tiny config (no compile)."""

from __future__ import annotations

import dataclasses
import math

import dsv4
from launch import search
from launch.gpu_target import TARGETS
from launch.plan import main as plan_main
from parallel import plan as pl
from rl.config.algo import LearnerConfig
from sharding import rules as rl

TINY = dsv4.DSV4Config.preset("tiny")
LEARNER = LearnerConfig(ep_backend="padded", ep_capacity_factor=1.25)


def test_meshes_and_node_crossing():
    """4 devices over 6 axes: every ordered factorisation (2^2 over six axes: C(2 + 5, 5) = 21, none ruled out on
    the tiny config); stage is outermost, tensor innermost."""
    meshes = search.actor_meshes(4, TINY)
    assert len(meshes) == math.comb(2 + 5, 5) and all(math.prod(m.values()) == 4 for m in meshes)
    s = dict.fromkeys(search.AXES, 1)
    seed = {**s, rl.FSDP: 2, rl.EXPERT: 8}
    assert search.crosses((rl.FSDP,), seed, 8) and not search.crosses((rl.EXPERT,), seed, 8)
    piped = {**s, rl.STAGE: 2, rl.EXPERT: 8}
    assert search.crosses((rl.STAGE,), piped, 8) and not search.crosses((rl.DATA, rl.EXPERT), piped, 8)
    assert search.ep_rows(TINY, "padded", 1.25) == 1.25 * TINY.num_experts_per_tok
    assert search.ep_rows(TINY, "sized", None) == TINY.n_routed_experts
    row = search.Row(sizes=piped, mesh="actor:stage=2,expert=8/rollout:expert=8", stages=2, micro_batches=8, gib=1,
                     usable_gib=2, fits=True, bubble=1 / 9, intra=0, inter=0, compute_s=1, memory_s=1, step_s=1,
                     tok_s_per_gpu=1)
    assert row.actor == "stage=2,expert=8" and row.flags == ("--mesh actor:stage=2,expert=8/rollout:expert=8 "
                                                             "--learner.pipeline_stages 2 --learner.pipeline_micro_batches 8")


def test_estimate_collectives_by_hand():
    """expert=4 on one node: no FSDP, the EP all-to-all = T L rows x f k x D bf16 x 6 passes x 3/4, all inside the
    node, plus the non-expert gradients all-reduced over expert (2 x 3/4 of their bytes); on 2-GPU nodes the EP
    bytes cross."""
    sizes = {**dict.fromkeys(search.AXES, 1), rl.EXPERT: 4}
    report = pl.plan(TINY, "actor:expert=4/rollout:expert=4", "mi308x", learner=LEARNER, tokens_per_device=64,
                     rollout_seq_len=64)
    kw = dict(report=report, tokens=64, seq=64, micro_batches=1, target=TARGETS["mi308x"], flops_per_token=1e9,
              trained=lambda leaf: leaf.trained)
    row = search.estimate(TINY, sizes, gpus_per_node=8, **kw)
    ep = 64 * TINY.num_hidden_layers * 1.25 * TINY.num_experts_per_tok * TINY.hidden_size * 2 * 6 * 3 / 4
    _, _, _, _, allreduce = search.weight_bytes(TINY, sizes, None, range(0), lambda leaf: leaf.trained)
    assert allreduce > 0 and row.inter == 0 and math.isclose(row.intra, ep + allreduce)
    assert row.bubble == 0 and row.fits and math.isclose(row.tok_s_per_gpu, 64 / row.step_s)
    split = search.estimate(TINY, sizes, gpus_per_node=2, **kw)
    assert math.isclose(split.inter, ep + allreduce) and split.intra == 0 and split.step_s > row.step_s


def test_search_cli_tiny(capsys):
    """The CLI on the tiny config without a GPU target: the arithmetic table, no compile, the RESULT line last."""
    assert plan_main(["--config", "tiny", "--mesh", "actor:fsdp=2,expert=2/rollout:expert=4", "--gpu", "mi308x",
                      "--search"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("search: 14 actor meshes of 4 devices")
    assert out[-1].startswith("RESULT search_meshes=14 search_fit=14 ") and "compiled=no" in out[-1]
    assert any("--mesh actor:fsdp=2,expert=2/rollout:expert=4" in ln for ln in out)
    assert plan_main(["--config", "tiny", "--mesh", "actor:fsdp=2/rollout:expert=2", "--gpu", "h100", "--search",
                      "--gpus-per-node", "0"]) == 2
