"""rl/algo/learner.py with `LearnerConfig.scan_layers=True` (layers under lax.scan, state held stacked, dsv4/scan.py)
against the default Python layer loop: one update (routing replay, micro-batches, weight decay, KL reference)
gives the same params per layer and the same metrics; `params_for_push()` is the per-layer tree; compute_logprobs
agrees; the state is really stacked; the stacked checkpoint does not load into an unscanned learner; the sharded
scanned step equals the one-device one.

Model: the tiny config with 4 main layers (2 sliding hash layers, 2 CSA layers), so both scan groups repeat (x2).
Run: `.venv/bin/python -m pytest -q tests/rl/test_learner_scan.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from dsv4 import scan as sc
from dsv4.names import tree_key
from rl.config.algo import LearnerConfig, LossConfig
from rl.algo.batch import TrainBatch
from rl.algo.learner import Learner
from parallel.expert import make_ep_dispatch
from sharding import offload as so
from sharding.mesh import build_mesh_plan

from ragged_batch import ragged_batch  # noqa: E402  (tests/rl on sys.path)

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=4, num_hash_layers=2, compress_ratios=(0, 0, 4, 4, 0))
N, P, T = 8, 5, 5
TOL = 1e-6


@pytest.fixture(scope="module")
def model():
    return dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)


@pytest.fixture(scope="module")
def batch(model):
    return ragged_batch(model, N, P, T)


def _flat(tree):
    return {"/".join(str(k) for k in path): np.array(v[...]) for path, v in nnx.to_flat_state(tree)}


def _cfg(scan_layers: bool, **kw) -> LearnerConfig:
    """eps=1e-4: Adam's first step is lr * g / (|g| + eps); with eps=1e-8 a near-zero gradient entry whose last
    bits differ (the scan is fused differently by XLA) moves by up to ~lr, which would test rounding, not the
    scan (measured: 1 element in 16384 off by 2e-6). With eps=1e-4 the update is at most lr / eps = 10 times as
    sensitive to the gradient, so <= 1e-6 on the params tests the gradients to ~1e-7."""
    return LearnerConfig(lr=1e-3, eps=1e-4, compute_dtype="float32", micro_batch_size=4, routing_replay=True,
                         weight_decay=0.1, loss=LossConfig(kl_coef=0.05), scan_layers=scan_layers, **kw)


@pytest.fixture(scope="module")
def pair(model, batch):
    """(unscanned learner, scanned learner, their update metrics) after one update each on `batch`."""
    plain, scanned = Learner(model, _cfg(False)), Learner(model, _cfg(True))
    return plain, scanned, plain.update(batch), scanned.update(batch)


def test_scanned_state_is_stacked(pair):
    _, scanned, _, _ = pair
    groups = sc.layer_groups(CFG)
    assert groups == ((0, 1, 2), (2, 1, 2))
    flat = _flat(scanned.state.params)
    assert not any(k.startswith("layers/2/") for k in flat)  # group indices only: 0 and 1
    w = flat["layers/1/0/attn/wq_a/weight"]  # group 1 (layers 2, 3), sub-layer 0
    assert w.shape[0] == 2 and w.ndim == 3
    assert _flat(scanned.state.buffers)["layers/0/0/ffn/gate/tid2eid"].shape[0] == 2
    assert _flat(scanned.state.ref_params)["layers/1/0/attn/wq_a/weight"].dtype == jnp.bfloat16  # matrix
    assert _flat(scanned.state.ref_params)["layers/1/0/attn_norm/weight"].dtype == jnp.float32  # vector


def test_scanned_update_equals_unscanned(model, pair):
    """Same metrics and, per layer (after unstack), the same params after the step (<= 1e-6, fp32); the step
    moves the params (so equality is not vacuous)."""
    plain, scanned, m_plain, m_scanned = pair
    assert set(m_plain) == set(m_scanned)
    for name, value in m_plain.items():
        np.testing.assert_allclose(float(m_scanned[name]), float(value), rtol=TOL, atol=TOL, err_msg=name)
    assert float(m_scanned["train/replay_layers"]) == CFG.num_hidden_layers
    push_plain, push_scanned = _flat(plain.params_for_push()), _flat(scanned.params_for_push())
    assert push_plain.keys() == push_scanned.keys()
    for name, value in push_plain.items():
        assert push_scanned[name].shape == value.shape and push_scanned[name].dtype == value.dtype, name
        np.testing.assert_allclose(push_scanned[name], value, rtol=TOL, atol=TOL, err_msg=name)
    start = np.asarray(model.layers[3].attn.wq_a.weight[...])
    assert np.abs(push_scanned["layers/3/attn/wq_a/weight"] - start).max() > 1e-5


def test_params_for_push_has_the_unscanned_structure(pair):
    plain, scanned, _, _ = pair
    a, b = plain.params_for_push(), scanned.params_for_push()
    assert jax.tree.structure(a) == jax.tree.structure(b)
    nnx.merge(scanned.graphdef, b)  # the per-layer model graph takes it as it is


def test_scanned_compute_logprobs_equal(pair, batch):
    plain, scanned, _, _ = pair
    (a, ma), (b, mb) = plain.compute_logprobs(plain.state, batch), scanned.compute_logprobs(scanned.state, batch)
    np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(b.entropy), np.asarray(a.entropy), rtol=TOL, atol=TOL)
    np.testing.assert_array_equal(np.asarray(b.routing), np.asarray(a.routing))
    for name, value in ma.items():
        np.testing.assert_allclose(float(mb[name]), float(value), rtol=TOL, atol=TOL, err_msg=name)


def test_stacked_state_dict_round_trips_and_rejects_the_other_layout(pair):
    plain, scanned, _, _ = pair
    d = scanned.state_dict()
    before = _flat(scanned.state.params)
    scanned.load_state_dict(d)
    after = _flat(scanned.state.params)
    assert all(np.array_equal(after[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="structure differs"):
        plain.load_state_dict(d)


@pytest.mark.slow
def test_scanned_bf16_masters_equal_unscanned(model, batch):
    """bf16 params + fp32 masters (rl.algo.optim.MasterState keyed by stacked paths): the same update."""
    kw = dict(lr=1e-3, eps=1e-4, compute_dtype="float32", param_dtype="bfloat16", routing_replay=True)
    plain = Learner(model, LearnerConfig(scan_layers=False, **kw))
    scanned = Learner(model, LearnerConfig(scan_layers=True, **kw))
    assert any(k.startswith("layers/1/0/") for k in scanned.state.opt_state.master)
    m_plain, m_scanned = plain.update(batch), scanned.update(batch)
    for name, value in m_plain.items():
        np.testing.assert_allclose(float(m_scanned[name]), float(value), rtol=TOL, atol=TOL, err_msg=name)
    a, b = _flat(plain.params_for_push()), _flat(scanned.params_for_push())
    for name, value in a.items():  # bf16 leaves: their fp32 masters agree to ~1e-7, so at most 1 bf16 ulp
        assert b[name].dtype == value.dtype, name
        tol = 2.0 ** -7 if value.dtype == jnp.bfloat16 else TOL
        np.testing.assert_allclose(b[name].astype(np.float32), value.astype(np.float32), rtol=tol, atol=TOL,
                                   err_msg=name)


def test_sharded_scanned_step_equals_one_device(model, batch, pair):
    """The scanned step on the actor mesh (fsdp=2, expert=2, tensor=2; EP dispatch) vs the one-device scanned
    step. Tolerances as tests/rl/test_learner.py::test_sharded_step_equals_unsharded (sharded sums run in another
    order; Adam's first step amplifies rounding of near-zero gradients): metrics 1e-5 relative, params 5e-5 of
    their global norm. Stacked leaves get the per-layer spec with an unsharded leading (layer) dim."""
    _, one, _, m_one = pair
    plan = build_mesh_plan("actor:fsdp=2,expert=2,tensor=2", config=CFG)
    sharded = Learner(model, _cfg(True), mesh=plan.actor, dispatch_fn=make_ep_dispatch(plan.actor))
    w1 = sharded.state.params["layers"][1][0]["ffn"]["experts"]["w1"][...]
    assert w1.ndim == 4 and w1.sharding.spec[0] is None and w1.sharding.spec[1] == "expert"
    m_sharded = sharded.update(batch)
    for name, value in m_one.items():
        np.testing.assert_allclose(float(m_sharded[name]), float(value), rtol=1e-5, atol=1e-6, err_msg=name)
    a, b = _flat(one.params_for_push()), _flat(sharded.params_for_push())
    diff = np.sqrt(sum(np.sum((b[k] - v) ** 2) for k, v in a.items()))
    norm = np.sqrt(sum(np.sum(v ** 2) for v in a.values()))
    assert diff <= 5e-5 * norm, diff / norm


def test_scan_layers_flag_config_and_fingerprint():
    """RunConfig.scan_layers is the run's default (issue 11: layers under lax.scan); `--no-scan-layers` (or
    `--scan-layers false` as a dotted flag) turns it off, `--scan-layers` still works (help text present); the
    run's checkpoint fingerprint records it only when on (unscanned fingerprints as before), so a stacked
    checkpoint is refused by an unscanned run and vice versa (rl/run/checkpoint.py compares every key)."""
    from launch import run as launch_run
    from rl.config.run import RunConfig
    from rl.run.wiring import fingerprint, resolve_model_config

    default, _ = launch_run.resolve(["--ckpt-dir", ""])
    off, _ = launch_run.resolve(["--ckpt-dir", "", "--no-scan-layers"])
    on, _ = launch_run.resolve(["--ckpt-dir", "", "--scan-layers"])
    dotted_off, _ = launch_run.resolve(["--ckpt-dir", "", "--learner.scan_layers", "false"])
    assert (RunConfig().learner.scan_layers, default.learner.scan_layers, on.learner.scan_layers) == (True, True, True)
    assert not off.learner.scan_layers and not dotted_off.learner.scan_layers
    assert "lax.scan" in launch_run.parser().format_help().replace("\n", " ")
    mc = resolve_model_config(off, 16)
    assert "scan_layers" not in fingerprint(off, mc) and fingerprint(on, mc)["scan_layers"] is True


# The offload tests' update: bf16 params with fp32 masters, a global-norm clip that triggers, weight decay on
# matrices only, on a [2, 8] batch of full rows; the on-device learner of this config is built once for both.
_OFFLOAD_KW = dict(lr=1e-3, eps=1e-4, compute_dtype="float32", param_dtype="bfloat16", scan_layers=True,
                   max_grad_norm=1e-3, weight_decay=0.1)


@pytest.fixture(scope="module")
def offload_batch():
    ids = jnp.asarray(np.random.default_rng(2).integers(1, CFG.vocab_size, (2, 8)), jnp.int32)
    return TrainBatch(input_ids=ids, attention_mask=jnp.ones_like(ids), response_mask=jnp.ones_like(ids),
                      rollout_logprobs=jnp.zeros((2, 8)), advantages=jnp.array([1.0, -1.0]))


@pytest.fixture(scope="module")
def on_device(model, offload_batch):
    """(on-device learner with `_OFFLOAD_KW` after one update on `offload_batch`, its metrics)."""
    dev = Learner(model, LearnerConfig(**_OFFLOAD_KW))
    return dev, dev.update(offload_batch)


@pytest.mark.slow
def test_scanned_offload_selects_stacked_leaves_and_equals_on_device(model, offload_batch, on_device):
    """scan_layers + offload_optimizer: whole stacked leaves (all layers of a group's tensor) are chosen, their
    optimizer state lives in pinned_host memory before and after the step, and the update (`_OFFLOAD_KW`) equals
    the on-device one (moving memory changes no value: bitwise)."""
    dev, _ = on_device
    off = Learner(model, LearnerConfig(offload_optimizer=0.5, stream_optimizer=False, **_OFFLOAD_KW))  # moved whole
    assert any(k.startswith("layers/1/0/") for k in off.offloaded)  # a stacked path: group 1, sub-layer 0
    assert "pinned_host" in {x.sharding.memory_kind for x in jax.tree.leaves(off.state.opt_state)}
    off.update(offload_batch)
    assert "pinned_host" in {x.sharding.memory_kind for x in jax.tree.leaves(off.state.opt_state)}
    for x, y in zip(jax.tree.leaves(dev.state.opt_state), jax.tree.leaves(off.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(dev.params_for_push()), jax.tree.leaves(off.params_for_push())):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_streamed_offloaded_update_equals_on_device(model, offload_batch, on_device, monkeypatch):
    """stream_optimizer: the offloaded state of the stacked params is updated one layer slice at a time
    (rl.algo.optim.update_streamed), that of the large 2-D leaves (the embedding, the head: `ROW_STREAM_MIN` lowered
    to the tiny embedding's size) in `ROW_STEPS` chunks of rows, with the global-norm clip applied elementwise, and
    stays in pinned_host memory; params and state equal the on-device update (`_OFFLOAD_KW`) up to f32 rounding (the
    loop's fusions round differently)."""
    dev, m_dev = on_device
    monkeypatch.setattr(so, "ROW_STREAM_MIN", CFG.vocab_size * CFG.hidden_size)
    st = Learner(model, LearnerConfig(offload_optimizer=1.0, stream_optimizer=True, **_OFFLOAD_KW))
    assert {"embed/weight", "head/weight"} <= set(st.streamed)
    flat = {tree_key(p): x for p, x in jax.tree_util.tree_leaves_with_path(st.state.params)}
    assert all(k.startswith("layers/") or (flat[k].ndim == 2 and flat[k].size >= so.ROW_STREAM_MIN)
               for k in st.streamed)
    st.update(offload_batch)
    assert float(m_dev["train/grad_norm"]) > 1e-3  # the clip was active
    assert {x.sharding.memory_kind for x in jax.tree.leaves(st.state.opt_state) if x.ndim} == {"pinned_host"}
    for x, y in zip(jax.tree.leaves(dev.state.opt_state), jax.tree.leaves(st.state.opt_state)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-8)
    for x, y in zip(jax.tree.leaves(dev.params_for_push()), jax.tree.leaves(st.params_for_push())):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x, np.float32), rtol=1e-2, atol=1e-6)
