"""The learner's scale knobs on the run's command line reach the learner (issue 11): `--ep-backend` /
`--ep-capacity-factor` decide the expert-parallel dispatch it builds on an expert mesh, `--stream-optimizer` its
streamed update of the offloaded stacked state, `--scan-layers` (the default) its stacked state. Cheap: abstract
learners (`Learner(abstract=True)`: shapes and shardings only, nothing compiled) of the tiny model on a 4-device
actor mesh, built as `rl.run.wiring.build` builds the run's learner (the run's learner section, param dtype resolved).

Run: `.venv/bin/python -m pytest -q tests/rl/test_learner_knobs.py`.
"""

import dataclasses

import jax.numpy as jnp
from flax import nnx

import dsv4
from launch import run as launch_run
from parallel import expert as expert_lib
from rl.config import tree as config_tree
from rl.config.run import RunConfig
from rl.algo.learner import Learner
from sharding.mesh import build_mesh_plan

MESH = "actor:fsdp=2,expert=2/rollout:expert=2"
# 4 main layers: 2 sliding hash layers, 2 CSA layers: both scan groups stack 2 layers (streamable leading dim)
CFG = dsv4.DSV4Config.tiny(num_hidden_layers=4, num_hash_layers=2, compress_ratios=(0, 0, 4, 4, 0))


def _learner(argv):
    cfg, _ = launch_run.resolve(["--mesh", MESH, "--ckpt-dir", "", *argv])
    plan = build_mesh_plan(cfg.mesh, config=CFG)
    model = dsv4.abstract_model(CFG, param_dtype=jnp.float32)
    return Learner(model, dataclasses.replace(cfg.learner, param_dtype="float32"), mesh=plan.actor, abstract=True)


def test_ep_flags_choose_the_learners_dispatch(monkeypatch):
    calls = []
    real = expert_lib.make_ep_dispatch

    def spy(mesh, **kw):
        calls.append(kw)
        return real(mesh, **kw)

    monkeypatch.setattr(expert_lib, "make_ep_dispatch", spy)
    default = _learner([])
    assert calls[-1]["backend"] == "capacity" and calls[-1]["capacity_factor"] is None  # auto on XLA:CPU: dropless
    assert "(capacity)" in default.dispatch_fn.__doc__ and default.sdef is not None  # scanned by default
    padded = _learner(["--ep-backend", "padded", "--ep-capacity-factor", "1.25"])
    assert calls[-1]["backend"] == "padded" and calls[-1]["capacity_factor"] == 1.25
    assert "(padded)" in padded.dispatch_fn.__doc__
    # the run's choices are exactly parallel/expert.py's backends (+ auto)
    assert set(config_tree.paths(RunConfig)["learner.ep_backend"].choices) == {"auto", *expert_lib.BACKENDS}


def test_stream_and_scan_flags_reach_the_learner():
    on = _learner(["--offload-optimizer", "1"])
    off = _learner(["--offload-optimizer", "1", "--no-stream-optimizer"])
    assert on.offloaded and on.streamed and not off.streamed  # streamed by default (stacked layers, offloaded)
    unscanned = _learner(["--no-scan-layers"])
    assert unscanned.sdef is None and "layers/3/attn/wq_a/weight" in {
        "/".join(str(k) for k in p) for p, _ in nnx.to_flat_state(unscanned.state.params)}


def test_planner_reads_the_same_knobs(capsys):
    """`python -m launch.plan` takes the learner's knobs from the same definitions (choices incl. auto, the
    run's defaults, the run's one-line error for a bad value); its earlier flags keep working."""
    from launch.plan import main as plan_main

    base = ["--config", "tiny", "--mesh", MESH, "--gpu", "h200"]
    assert plan_main([*base, "--ep-capacity-factor", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(--ep-capacity-factor) must be > 0, or none (dropless)" in err[0], err
    for extra in (["--ep-backend", "auto"], ["--ep-backend", "padded", "--ep-capacity-factor", "1.25",
                                             "--no-stream-optimizer", "--no-scan-layers"]):
        assert plan_main([*base, *extra]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PLAN ")
