"""rl/algo/learner.py with `--learner.pipeline_stages 2` (parallel/pipeline.py) on an `actor:stage=2,fsdp=2,expert=2`
mesh (the 8 CPU devices; the routed experts by the EP all-to-all inside the stages) against the unpipelined learner
on one device: the step's loss, metrics and every gradient agree (1e-5, fp32), with 4 micro-batches in a pipelined
pass of 3 and one of 1 (`pipeline_micro_batches`, gradients accumulated), routing replay, the on-policy MTP loss (the
MTP head after the pipeline) and remat "block" (each stage scans its 4 layers in the pipeline's hand-written
backward; the EP shard_map inside it made JAX refuse the step before the stage vmap moved inside the remat); the
pipelined group's state is split over `stage`, and with its optimizer state in host memory streamed by stage; stage
counts that do not divide the group or the mesh's stage axis are refused naming the flag.

Model: the tiny config with 10 main layers: 2 sliding hash layers (a group run before the pipeline), then 8 CSA
layers (the pipelined group: 4 per stage).
Run: `.venv/bin/python -m pytest -q tests/rl/test_learner_pipeline.py`.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import dsv4
from rl.config.algo import LearnerConfig
from rl.algo.learner import Learner
from sharding.mesh import build_mesh_plan

from ragged_batch import ragged_batch  # noqa: E402  (tests/rl on sys.path)

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=10, num_hash_layers=2, compress_ratios=(0, 0) + (4,) * 8 + (0,))
N, P, T = 8, 5, 5
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)


def _batch(model):
    return ragged_batch(model, N, P, T)


def _cfg(**kw) -> LearnerConfig:
    return LearnerConfig(lr=1e-3, compute_dtype="float32", micro_batch_size=2, routing_replay=True,
                         train_mtp=True, mtp_loss_weight=0.5, **kw)


def test_pipelined_learner_equals_unpipelined(model):
    """The pipelined learner's loss, metrics and every gradient equal the unpipelined learner's, its 4 micro-batches
    in a pass of 3 and a shorter pass of 1 (not a second pass of 3 padded with 2 neutral micro-batches). Its
    optimizer state in host memory, the pipelined group's stacked leaves (split over `stage`) are streamed with 2
    blocks, one layer per stage at a time (`rl.algo.learner_state.streamable`; before, their whole state went to
    the device; the streamed update itself: tests/rl/test_optim.py)."""
    batch = _batch(model)
    ref = Learner(model, _cfg())
    mesh = build_mesh_plan("actor:stage=2,fsdp=2,expert=2").actor
    piped = Learner(model, _cfg(pipeline_stages=2, pipeline_micro_batches=3, offload_optimizer=1.0), mesh=mesh)
    assert piped.pipeline.group == 1 and piped.cfg.remat == "block"
    assert piped.state.params["layers"][1][0]["attn"]["wq_a"]["weight"].get_value().sharding.spec[0] == "stage"
    assert piped.state.params["layers"][0][0]["attn"]["wq_a"]["weight"].get_value().sharding.spec[0] is None
    assert piped.streamed["layers/1/0/attn/wq_a/weight"] == 2 and piped.streamed["layers/0/0/attn/wq_a/weight"] == 1
    loss0, g0, m0 = ref.loss_and_grads(ref.state, batch)
    loss1, g1, m1 = piped.loss_and_grads(piped.state, batch)
    diffs = {"loss": abs(float(loss1) - float(loss0))}
    diffs["grads"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))
    diffs["metrics"] = max(abs(float(m1[k]) - float(m0[k])) for k in m0)
    print(f"pipelined learner (2 stages, 4 micro-batches in passes of 3 and 1) vs unpipelined: max abs diffs {diffs}")
    assert set(m1) == set(m0) and "train/mtp_loss" in m1 and all(v <= TOL for v in diffs.values()), diffs
    g_wq = g1["layers"][1][0]["attn"]["wq_a"]["weight"].get_value()  # [8 layers, ...]: every stage's layers
    assert float(jnp.min(jnp.max(jnp.abs(g_wq), axis=(1, 2)))) > 0
    assert float(jnp.max(jnp.abs(g1["mtp"][0]["e_proj"]["weight"].get_value()))) > 0


def test_pipeline_stages_refused(model):
    with pytest.raises(ValueError, match=r"--learner.pipeline_stages=3 does not divide the 8 repetitions"):
        Learner(model, _cfg(pipeline_stages=3))
    with pytest.raises(ValueError, match=r"--learner.pipeline_stages=1 does not spread over the mesh's stage=2"):
        Learner(model, _cfg(), mesh=build_mesh_plan("actor:stage=2").actor)
    with pytest.raises(ValueError, match=r"needs --learner.scan_layers"):
        _cfg(pipeline_stages=2, scan_layers=False)
