"""rl/algo/learner.py: routing replay, freezing, exact micro-batch accumulation, non-finite guard, KL reference,
fp32 masters under bf16 compute, a GRPO improvement check and the sharded step.

Model: the tiny config cut to 2 layers (layer 0 hash-routed, layer 1 learned top-k; sliding + CSA attention) to
keep compiles short on CPU; float32 compute unless a test is about bf16.
Run: `.venv/bin/python -m pytest -q tests/rl/test_learner.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from rl.algo.advantages import grpo_advantages
from rl.config.algo import LearnerConfig, LossConfig
from rl.algo.batch import TrainBatch
from rl.algo.learner import Learner
from rl.algo.learner_step import METRIC_NAMES
from rl.algo.logprobs import token_logprobs
from parallel.expert import make_ep_dispatch
from sharding.mesh import build_mesh_plan

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(0, 4, 0))
N, P, T = 8, 5, 5


def _lc(**kw) -> LearnerConfig:
    """The per-layer learner these tests inspect (state keyed `layers/<i>/...`, the whole offloaded state moved in
    one piece): LearnerConfig with scan_layers and stream_optimizer off. The scanned, streamed default is compared
    with it in tests/rl/test_learner_scan.py."""
    return LearnerConfig(**{"scan_layers": False, "stream_optimizer": False, **kw})


@pytest.fixture(scope="module")
def model():
    return dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)


def _layout(rng, n, p, t):
    """Ragged rows [left-padded prompt (p) | response (t), right-padded] -> (attention_mask, response_mask)."""
    plen, rlen = rng.integers(1, p + 1, n), rng.integers(1, t + 1, n)
    rlen[0] = t  # at least one full-length response
    am, rm = np.zeros((n, p + t), np.int32), np.zeros((n, p + t), np.int32)
    for i in range(n):
        am[i, p - plen[i]:p + rlen[i]] = 1
        rm[i, p:p + rlen[i]] = 1
    return am, rm


@pytest.fixture(scope="module")
def batch(model):
    """N ragged rows; routing and rollout logprobs recorded from the model's own forward; random advantages."""
    rng = np.random.default_rng(0)
    am, rm = _layout(rng, N, P, T)
    ids = np.where(am > 0, rng.integers(1, CFG.vocab_size, (N, P + T)), 0).astype(np.int32)
    lp, _, routing = jax.jit(lambda i, m: token_logprobs(model, i, m))(ids, am)
    return TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(am), response_mask=jnp.asarray(rm),
                      rollout_logprobs=lp * rm, advantages=jnp.asarray(rng.normal(size=N), jnp.float32),
                      routing=routing)


def _flat(state_tree):
    return {"/".join(str(k) for k in path): np.array(v[...]) for path, v in nnx.to_flat_state(state_tree)}


def _host(tree):
    return [np.array(x) for x in jax.tree.leaves(tree)]


def test_routing_replay_reproduces_recorded_routes(model, batch):
    learner = Learner(model, _lc(lr=1e-2, compute_dtype="float32", routing_replay=True))
    pre, pre_metrics = learner.compute_logprobs(learner.state, batch)
    # Replay on the pre-update params reproduces the recorded logprobs (and routes).
    mask = np.asarray(batch.response_mask) > 0
    np.testing.assert_allclose(np.asarray(pre.logprobs)[mask], np.asarray(batch.rollout_logprobs)[mask], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(pre.routing), np.asarray(batch.routing))
    assert float(pre_metrics["train/train_rollout_logprob_abs_diff"]) < 1e-5

    metrics = learner.update(batch)
    assert float(metrics["train/skipped_nonfinite"]) == 0
    assert float(metrics["train/train_rollout_logprob_abs_diff"]) < 1e-5  # on-policy: old = learner's own
    router = _flat(learner.state.params)["layers/1/ffn/gate/weight"]
    assert not np.allclose(router, np.asarray(model.layers[1].ffn.gate.weight[...]))  # the router moved

    replayed, _ = learner.compute_logprobs(learner.state, batch)
    free, _ = learner.compute_logprobs(learner.state, batch, routing_replay=False)
    real = np.asarray(batch.attention_mask) > 0
    recorded = np.asarray(batch.routing)
    assert int((np.asarray(replayed.routing) != recorded)[real].sum()) == 0
    assert int((np.asarray(free.routing) != recorded)[real].sum()) > 0


def test_replay_without_or_with_misshaped_routing_raises_before_the_step(model, batch):
    learner = Learner(model, _lc(lr=1e-3, compute_dtype="float32", routing_replay=True))
    state = learner.state
    with pytest.raises(ValueError, match="routing is None"):
        learner.train_step(state, batch.replace(routing=None))
    with pytest.raises(ValueError, match="routing replay needs"):
        learner.train_step(state, batch.replace(routing=batch.routing[:, :, :1]))
    with pytest.raises(ValueError, match="routing"):
        learner.compute_logprobs(state, batch.replace(routing=None))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # nothing was donated: the step never ran
    assert not learner._jits  # nothing was even compiled
    with pytest.raises(ValueError, match="micro_batch_size"):
        Learner(model, _lc(micro_batch_size=3, compute_dtype="float32")).train_step(state, batch)


def test_freeze_router_and_nonfinite_guard(model, batch):
    learner = Learner(model, _lc(lr=1e-3, compute_dtype="float32", freeze_router=True))
    assert learner.state.ref_params is None and "ref_params" not in learner.state_dict()  # kl_coef = 0: no copy
    before = _flat(learner.state.params)
    buffers_before = _flat(learner.state.buffers)
    metrics = learner.update(batch)
    assert set(METRIC_NAMES) <= set(metrics) and float(metrics["train/skipped_nonfinite"]) == 0
    after = _flat(learner.state.params)
    for name in ("layers/0/ffn/gate/weight", "layers/1/ffn/gate/weight"):
        np.testing.assert_array_equal(after[name], before[name])
    for name, value in after.items():  # MTP is frozen by default (train_mtp=False)
        if name.startswith("mtp/"):
            np.testing.assert_array_equal(value, before[name])
    for name in ("embed/weight", "layers/1/ffn/experts/w1", "layers/1/attn/wq_a/weight", "layers/0/attn_norm/weight"):
        assert not np.array_equal(after[name], before[name]), name
    for name, value in _flat(learner.state.buffers).items():
        np.testing.assert_array_equal(value, buffers_before[name])
    assert int(learner.state.step) == 1

    # Non-finite loss (a NaN advantage) -> skipped: every state leaf bitwise unchanged, metric 1.
    snapshot = _host(learner.state)
    bad = batch.replace(advantages=batch.advantages.at[3].set(jnp.nan))
    metrics = learner.update(bad)
    assert float(metrics["train/skipped_nonfinite"]) == 1
    for a, b in zip(_host(learner.state), snapshot):
        np.testing.assert_array_equal(a, b)
    assert int(learner.state.step) == 1
    # A finite batch afterwards updates again.
    assert float(learner.update(batch)["train/skipped_nonfinite"]) == 0 and int(learner.state.step) == 2


def test_micro_batches_accumulate_to_the_full_batch(model, batch):
    """micro_batch_size 2 (4 micro-batches, ragged responses) vs the whole batch of 8: loss and grads <= 1e-5."""
    results = {}
    for mbs in (None, 2):
        cfg = _lc(lr=1e-3, compute_dtype="float32", micro_batch_size=mbs,
                            loss=LossConfig(loss_agg_mode="seq-mean-token-mean", correction="tis"))
        learner = Learner(model, cfg)
        loss, grads, metrics = learner.loss_and_grads(learner.state, batch)
        results[mbs] = (float(loss), _host(grads), {k: float(v) for k, v in metrics.items()})
    (loss_full, g_full, m_full), (loss_mb, g_mb, m_mb) = results[None], results[2]
    np.testing.assert_allclose(loss_mb, loss_full, rtol=1e-5, atol=1e-7)
    assert max(float(np.abs(g).max()) for g in g_full) > 1e-3
    for a, b in zip(g_mb, g_full):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name, value in m_full.items():
        np.testing.assert_allclose(m_mb[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_kl_reference_is_kept_only_when_used(model, batch):
    cfg = _lc(lr=1e-3, compute_dtype="float32", ref_dtype="float32", loss=LossConfig(kl_coef=0.1))
    learner = Learner(model, cfg)
    ref_before = _host(learner.state.ref_params)
    m1 = learner.update(batch)
    assert abs(float(m1["train/kl_loss"])) < 1e-6  # policy == reference at the first step
    m2 = learner.update(batch)
    assert float(m2["train/kl_loss"]) > 1e-7  # the policy moved, the reference did not
    for a, b in zip(_host(learner.state.ref_params), ref_before):
        np.testing.assert_array_equal(a, b)
    assert "ref_params" in learner.state_dict()
    # bf16 reference (the default): matrices stored in bf16, vectors kept in fp32.
    ref = Learner(model, _lc(loss=LossConfig(kl_coef=0.1))).state.ref_params
    dtypes = {x.ndim >= 2: x.dtype for x in jax.tree.leaves(ref)}
    assert dtypes == {True: jnp.bfloat16, False: jnp.float32}


def test_fp32_masters_keep_updates_below_bf16_resolution(model, batch):
    cfg = _lc(lr=1e-4, compute_dtype="bfloat16", max_grad_norm=None)
    learner = Learner(model, cfg)
    metrics = learner.update(batch)
    assert float(metrics["train/skipped_nonfinite"]) == 0
    w = _flat(learner.state.params)["layers/1/ffn_norm/weight"]  # initialised to exactly 1.0
    assert w.dtype == np.float32
    delta = np.abs(w - 1.0)
    assert delta.max() > 5e-5 and delta.max() < 2e-4  # one Adam step of ~lr moved the fp32 master ...
    assert np.all(w.astype(jnp.bfloat16).astype(np.float32) == 1.0)  # ... by less than bf16 can represent at 1.0
    assert float(metrics["train/lr"]) == pytest.approx(1e-4)


def _sample(forward, params, buffers, prompts, n_new, key):
    """Tiny local sampler: full forward per step, categorical draw at the last real position."""
    n, p = prompts.shape
    ids = jnp.concatenate([prompts, jnp.zeros((n, n_new), jnp.int32)], axis=1)
    am = jnp.concatenate([jnp.ones((n, p), jnp.int32), jnp.zeros((n, n_new), jnp.int32)], axis=1)
    for j in range(n_new):
        logits = forward(params, buffers, ids, am)[:, p + j - 1]
        key, sub = jax.random.split(key)
        ids = ids.at[:, p + j].set(jax.random.categorical(sub, logits).astype(jnp.int32))
        am = am.at[:, p + j].set(1)
    return ids, am


def test_grpo_steps_raise_the_reward_of_a_fixed_batch(model):
    """Reward = fraction of response tokens in a target set (ids < 64, a quarter of the vocabulary); 2 prompts x 8
    samples from the model itself, GRPO advantages, 8 updates on that fixed batch. Under the new policy the
    expected reward of the batch, estimated by self-normalised importance weights pi_new(y) / pi_old(y) over the
    sampled responses, rises; rewarded responses become more likely and unrewarded ones less likely."""
    g, n_prompts, p, t_new = 8, 2, 3, 4
    learner = Learner(model, _lc(lr=2e-3, compute_dtype="float32"))
    forward = jax.jit(lambda w, b, i, m: nnx.merge(learner.graphdef, w, b)(i, attention_mask=m).logits)
    prompts = jnp.repeat(jax.random.randint(jax.random.key(1), (n_prompts, p), 1, CFG.vocab_size), g, axis=0)
    ids, am = _sample(forward, learner.state.params, learner.state.buffers, prompts, t_new, jax.random.key(2))
    rm = am.at[:, :p].set(0)
    rewards = ((ids < 64) * rm).sum(axis=1) / t_new
    adv, _ = grpo_advantages(rewards, g)
    assert float(jnp.abs(adv).sum()) > 0
    batch = TrainBatch(input_ids=ids, attention_mask=am, response_mask=rm, rollout_logprobs=jnp.zeros(ids.shape),
                       advantages=adv)

    def seq_logprob(state):  # log pi(y_i | prompt_i) [N]
        return (learner.compute_logprobs(state, batch)[0].logprobs * rm).sum(axis=1)

    old = seq_logprob(learner.state)
    for _ in range(8):
        assert float(learner.update(batch)["train/skipped_nonfinite"]) == 0
    new = seq_logprob(learner.state)
    w = jax.nn.softmax((new - old).reshape(n_prompts, g), axis=1)  # self-normalised IS weights per prompt
    expected_before = float(rewards.mean())
    expected_after = float((w * rewards.reshape(n_prompts, g)).sum(axis=1).mean())
    assert expected_after > expected_before + 0.2, (expected_before, expected_after)
    delta = np.asarray(new - old)
    assert delta[np.asarray(adv) > 0].mean() > 0 > delta[np.asarray(adv) < 0].mean()


def test_expert_drop_frac_is_logged_when_the_dispatch_can_drop(model, batch):
    """With a capacity factor (here "sized" capped at f_max = 0.5: 2 rows per expert and token shard) the step logs
    `train/expert_drop_frac`: pairs dropped / pairs routed over the main MoE layers and both micro-batches, from the
    forward's `DSV4Output.expert_drops` (counted by hand: tests/sharding/test_expert.py); dropless runs omit it."""
    plan = build_mesh_plan("actor:fsdp=2,expert=2,tensor=2", config=CFG)
    fn = make_ep_dispatch(plan.actor, backend="sized", capacity_factor=0.5)
    m = Learner(model, _lc(compute_dtype="float32", micro_batch_size=4), mesh=plan.actor, dispatch_fn=fn).update(batch)
    assert 0 < float(m["train/expert_drop_frac"]) < 1 and not [k for k in m if not k.startswith("train/")]


_SHARDED_CFG = _lc(lr=1e-3, compute_dtype="float32", micro_batch_size=4, routing_replay=True)


@pytest.fixture(scope="module")
def one_device_step(model, batch):
    """test_sharded_step_equals_unsharded's one-device reference, built once for both dispatches: (params before,
    metrics, params after) of one update on `batch` with `_SHARDED_CFG`."""
    plain = Learner(model, _SHARDED_CFG)
    start = _flat(plain.state.params)
    metrics = {k: float(v) for k, v in plain.update(batch).items()}
    return start, metrics, _flat(plain.state.params)


@pytest.mark.parametrize("dispatch", ["ep", pytest.param("auto", marks=pytest.mark.slow)])
def test_sharded_step_equals_unsharded(model, batch, one_device_step, dispatch):
    """One step on the actor mesh (fsdp=2, expert=2, tensor=2; batch over fsdp x expert) vs one device, with the
    expert-parallel dispatch of parallel/expert.py ("ep", what the loop uses) or XLA's own partitioning of the
    single-program ragged_dot path ("auto", slow). The one-device learner uses its CPU default,
    `dsv4.moe.routed_experts_cpu`, so this also checks that path against both.

    Tolerances: metrics (loss, grad norm, ...) 1e-5 relative; all params after the step 1e-5 relative (global
    norm). Per leaf, the *update* must agree to 1% of its norm: fp32 reduction-order noise in the gradients of the
    mHC scalars (measured up to 5e-5 relative, the same between micro-batch sizes on one device) is turned by
    Adam's first step, lr * g / (|g| + eps), into per-element update noise, so a per-leaf 1e-5 would test rounding
    (measured: <= 3e-4 of the update norm), while a mis-sharded or missing update differs by O(1).
    """
    plan = build_mesh_plan("actor:fsdp=2,expert=2,tensor=2", config=CFG)
    dispatch_fn = make_ep_dispatch(plan.actor) if dispatch == "ep" else None
    sharded = Learner(model, _SHARDED_CFG, mesh=plan.actor, dispatch_fn=dispatch_fn)
    emb = sharded.state.params["embed"]["weight"][...]
    assert emb.sharding.mesh.shape == plan.actor.shape and emb.sharding.spec == jax.P("tensor", "fsdp")
    start, m_plain, flat_plain = one_device_step
    m_sharded = sharded.update(batch)
    for name, value in m_plain.items():
        np.testing.assert_allclose(float(m_sharded[name]), float(value), rtol=1e-5, atol=1e-6, err_msg=name)
    flat_sharded = _flat(sharded.state.params)
    diff = np.sqrt(sum(np.sum((flat_sharded[k] - v) ** 2) for k, v in flat_plain.items()))
    norm = np.sqrt(sum(np.sum(v ** 2) for v in flat_plain.values()))
    # Adam's first step is elementwise g / sqrt(g^2): rounding-level gradient differences of near-zero entries
    # (sharded sums run in another order) move those entries by up to ~lr, so the parameters after the step agree
    # to a few 1e-5 relative (measured 1.2e-5), while a mis-sharded update is off by O(1). The gradients themselves
    # are compared at 1e-5 in tests/sharding/test_sharded_model.py.
    assert diff <= 5e-5 * norm, diff / norm
    for name, value in flat_plain.items():
        step_plain, step_sharded = value - start[name], flat_sharded[name] - start[name]
        # per leaf: 5% of the update (mHC fn gradients are ~1e-5, where Adam amplifies rounding); wrong = O(100%)
        assert np.linalg.norm(step_sharded - step_plain) <= 5e-2 * np.linalg.norm(step_plain) + 1e-12, name
    assert sharded.state.params["embed"]["weight"][...].sharding.spec == jax.P("tensor", "fsdp")


def test_state_dict_roundtrip_and_push_params(model, batch):
    cfg = _lc(lr=1e-3, compute_dtype="float32")
    a, b = Learner(model, cfg), Learner(model, cfg)
    b.load_state_dict(jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, a.state_dict()))
    for x, y in zip(jax.tree.leaves(b.state_dict()), jax.tree.leaves(a.state_dict())):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y) + (1 if x.dtype == jnp.float32 else 0))
    with pytest.raises(ValueError, match="structure"):
        b.load_state_dict({**a.state_dict(), "params": b.state.buffers})
    pushed = _flat(a.params_for_push())
    assert "layers/0/ffn/gate/tid2eid" in pushed and "layers/1/ffn/gate/bias" in pushed  # buffers included
    assert len(pushed) == len(_flat(a.state.params)) + len(_flat(a.state.buffers))
    m = nnx.merge(a.graphdef, a.params_for_push())
    assert isinstance(m, dsv4.DSV4ForCausalLM)


def test_replay_refuses_invalid_routes_and_counts_unknown(model, batch):
    # Issue 15 class 1: a route outside [0, E) (other than the unknown marker -1), a repeated expert, a float
    # dtype or a hash-layer route that is not tid2eid[token] is refused before anything runs, naming row,
    # position and layer; unknown routes (-1) are counted in train/replay_unknown_frac. The config (lr included)
    # is test_routing_replay_reproduces_recorded_routes's, so its step loads from the compile cache.
    learner = Learner(model, _lc(lr=1e-2, compute_dtype="float32", routing_replay=True))
    routing = np.array(batch.routing)
    real = np.argwhere(np.asarray(batch.attention_mask) > 0)
    i, t = (int(x) for x in real[0])
    e = CFG.n_routed_experts

    def bad(layer, value):
        r = routing.copy()
        r[i, t, layer] = value
        return batch.replace(routing=jnp.asarray(r))

    cases = [
        (bad(1, [e] + list(routing[i, t, 1, 1:])), "outside"),
        (bad(1, [-3] + list(routing[i, t, 1, 1:])), "outside"),
        (bad(1, [routing[i, t, 1, 1]] * CFG.num_experts_per_tok), "repeats an expert"),
        (bad(1, [-1] + list(routing[i, t, 1, 1:])), "mixes"),
        (batch.replace(routing=jnp.asarray(routing, jnp.float32)), "dtype"),
        (bad(0, np.roll(np.arange(e), 1)[np.asarray(routing[i, t, 0])]), "hash-routed"),  # other experts
    ]
    for b, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            learner.update(b)
        if message != "dtype":
            assert f"row {i}, position {t}, layer" in str(err.value)
    assert int(learner.state.step) == 0  # nothing ran
    # Unknown routes: the whole of layer 1 for the first real token -> 1 of (real tokens * 2 layers) pairs.
    r = routing.copy()
    r[i, t, 1] = -1
    metrics = learner.update(batch.replace(routing=jnp.asarray(r)))
    n_real = int((np.asarray(batch.attention_mask) > 0).sum())
    np.testing.assert_allclose(float(metrics["train/replay_unknown_frac"]), 1 / (2 * n_real), rtol=1e-6)
    assert float(metrics["train/replay_layers"]) == 2.0


def test_step_on_a_make_mesh_mesh_equals_the_auto_mesh(model, batch):
    """`Learner` and `make_ep_dispatch` take a `jax.make_mesh` mesh (Explicit axes by default): one step gives
    bitwise the metrics and params of the step on the Auto mesh of the same devices. (A `make_mesh` mesh with Auto
    axes is equal to that Auto mesh, `==` and hash, so it would compare the reference with itself: not a case.)"""
    names = ("data", "fsdp", "expert", "tensor")
    mesh = jax.make_mesh((1, 2, 2, 2), names, axis_types=(jax.sharding.AxisType.Explicit,) * 4)
    auto = jax.sharding.Mesh(mesh.devices, names, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    assert mesh != auto
    cfg = LearnerConfig(lr=1e-3, compute_dtype="float32", micro_batch_size=4, routing_replay=True)
    got, ref = (Learner(model, cfg, mesh=m, dispatch_fn=make_ep_dispatch(m)) for m in (mesh, auto))
    m_got, m_ref = got.update(batch), ref.update(batch)
    assert {k: float(v) for k, v in m_got.items()} == {k: float(v) for k, v in m_ref.items()}
    flat_got, flat_ref = _flat(got.state.params), _flat(ref.state.params)
    for k, v in flat_ref.items():
        np.testing.assert_array_equal(flat_got[k], v, err_msg=k)
