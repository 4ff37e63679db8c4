"""rl/algo/learner.py at scale (issue 11 items 3-6): trimmed rows + token-budget micro-batches equal the full batch,
bf16 params with fp32 masters, optimizer state offloaded to host memory (memory kinds asserted; the update equals
the on-device one; the planner's host bytes equal the learner's), `Learner.lower` on abstract batches, and the
expert-parallel all-to-all chosen by default on an expert mesh (compiled HLO checked; equal to unsharded).

Model: the tiny config cut to 2 layers (hash + learned top-k; sliding + CSA), float32 compute unless stated.
Run: `.venv/bin/python -m pytest -q tests/rl/test_learner_scale.py`.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from rl.config.algo import LearnerConfig, LossConfig
from rl.config.run import RunConfig
from rl.algo.batch import TrainBatch
from rl.algo.learner import Learner
from rl.algo.logprobs import token_logprobs
from sharding import offload as so
from sharding.mesh import build_mesh_plan

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(0, 4, 0))
N, P, T = 5, 8, 8  # S = 16; real rows are at most 3 + 4 = 7 tokens -> trimmed width 8


def _lc(**kw) -> LearnerConfig:
    """The per-layer learner these tests inspect (state keyed `layers/<i>/...`, the whole offloaded state moved in
    one piece): LearnerConfig with scan_layers and stream_optimizer off. The scanned, streamed default is compared
    with it in tests/rl/test_learner_scan.py."""
    return LearnerConfig(**{"scan_layers": False, "stream_optimizer": False, **kw})


@pytest.fixture(scope="module")
def model():
    return dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)


def _batch(model, n=N, p=P, t=T, max_prompt=3, max_resp=4, seed=0):
    """Rows [left-padded prompt | response, right-padded] with much padding; routing/rollout lps from the model."""
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(1, max_prompt + 1, n), rng.integers(1, max_resp + 1, n)
    rlen[0], plen[0] = max_resp, max_prompt
    am, rm = np.zeros((n, p + t), np.int32), np.zeros((n, p + t), np.int32)
    for i in range(n):
        am[i, p - plen[i]:p + rlen[i]] = 1
        rm[i, p:p + rlen[i]] = 1
    ids = np.where(am > 0, rng.integers(1, CFG.vocab_size, (n, p + t)), 0).astype(np.int32)
    lp, _, routing = jax.jit(lambda i, m: token_logprobs(model, i, m))(ids, am)
    return TrainBatch(input_ids=ids, attention_mask=am, response_mask=rm, rollout_logprobs=np.asarray(lp) * rm,
                      advantages=rng.normal(size=n).astype(np.float32), routing=np.asarray(routing))


@pytest.fixture(scope="module")
def batch(model):
    return _batch(model)


def _host(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def _flat(tree):
    return {"/".join(str(k) for k in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(tree)}


def test_trimmed_token_budget_micro_batches_equal_the_full_batch(model, batch):
    """Reference: no trimming, one micro-batch of 5 rows x 16. Trimmed (width 8) with a budget of 16 tokens:
    3 micro-batches of 2 rows (one padding row). Loss, grads, metrics (Dr.GRPO: S-length normaliser kept) and
    per-token logprobs/entropy/routing (put back at their columns) agree to fp32 rounding."""
    loss_cfg = LossConfig(loss_agg_mode="seq-mean-token-sum-norm", correction="tis")
    ref = Learner(model, _lc(lr=1e-3, compute_dtype="float32", trim=False, logprob_chunk_size=None,
                                       loss=loss_cfg, routing_replay=True))
    lay = ref.layout(N, P + T, 7)
    assert (lay.width, lay.micro_batches, lay.rows) == (16, 1, 5)
    new = Learner(model, _lc(lr=1e-3, compute_dtype="float32", max_tokens_per_micro_batch=16,
                                       logprob_chunk_size=3, loss=loss_cfg, routing_replay=True))
    _, lay, shift = new.fit_batch(batch)
    assert (lay.width, lay.micro_batches, lay.rows) == (8, 3, 2) and shift.max() > 0
    (l_ref, g_ref, m_ref), (l_new, g_new, m_new) = (lr.loss_and_grads(lr.state, batch) for lr in (ref, new))
    np.testing.assert_allclose(float(l_new), float(l_ref), rtol=1e-5, atol=1e-7)
    assert max(float(np.abs(g).max()) for g in _host(g_ref)) > 1e-3
    for a, b in zip(_host(g_new), _host(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name, value in m_ref.items():
        np.testing.assert_allclose(float(m_new[name]), float(value), rtol=1e-5, atol=1e-6, err_msg=name)
    (r_ref, _), (r_new, _) = ref.compute_logprobs(ref.state, batch), new.compute_logprobs(new.state, batch)
    assert r_new.logprobs.shape == (N, P + T)
    np.testing.assert_allclose(np.asarray(r_new.logprobs), np.asarray(r_ref.logprobs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(r_new.entropy), np.asarray(r_ref.entropy), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(r_new.routing), np.asarray(r_ref.routing))


def test_token_budget_below_the_longest_row_is_an_error(model, batch):
    learner = Learner(model, _lc(compute_dtype="float32", max_tokens_per_micro_batch=6))
    with pytest.raises(ValueError, match=r"--max-tokens-per-micro-batch .* = 6 is smaller than the batch's "
                                         r"longest row \(7 tokens\)"):
        learner.train_step(learner.state, batch)
    assert not learner._jits
    with pytest.raises(ValueError, match=r"--offload-optimizer\) must be in \[0, 1\]"):
        _lc(offload_optimizer=1.5)
    with pytest.raises(ValueError, match=r"--offload-optimizer\) must be in \[0, 1\]"):
        RunConfig(**{"learner.offload_optimizer": -0.1})
    with pytest.raises(ValueError, match="--learner.max_tokens_per_micro_batch"):  # the dotted flag
        RunConfig(**{"learner.max_tokens_per_micro_batch": 0})


def test_bf16_params_fp32_masters_and_offloaded_state(model, batch):
    """param_dtype=bfloat16: matrices bf16 on device, grads bf16, fp32 masters + moments in the optimizer.
    offload 1.0: every master/moment lives in pinned_host memory before and after the step, and the step is
    bitwise the on-device one. offload 0.5: whole params, largest first, <= half the bytes; the planner's host
    bytes for the same model, mesh and frozen set are exactly the learner's."""
    base = dict(lr=1e-4, compute_dtype="float32", param_dtype="bfloat16", max_grad_norm=None)
    dev, host = (Learner(model, _lc(**base, offload_optimizer=f)) for f in (0.0, 1.0))
    params = _flat(dev.state.params)
    assert params["layers/1/ffn/experts/w1"].dtype == jnp.bfloat16 and params["layers/1/hc_attn_fn"].dtype == np.float32
    master = dev.state.opt_state.master
    assert "layers/1/ffn/experts/w1" in master and "layers/1/hc_attn_fn" not in master  # fp32 params: no copy
    assert all(not k.startswith("mtp/") for k in master)  # frozen (train_mtp=False): no state
    assert {x.dtype for x in jax.tree.leaves(dev.state.opt_state) if x.ndim} == {np.dtype(np.float32)}  # (+ int32 counts)
    _, grads, _ = dev.loss_and_grads(dev.state, batch)
    assert _flat(grads)["layers/1/ffn/experts/w1"].dtype == jnp.bfloat16

    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(host.state.opt_state) if x.ndim}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host.state.params)} == {"device"}
    m_dev, m_host = dev.update(batch), host.update(batch)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host.state.opt_state) if x.ndim} == {"pinned_host"}
    for name, value in m_dev.items():
        assert float(m_host[name]) == float(value), name
    for a, b in zip(_host(host.state), _host(dev.state)):
        np.testing.assert_array_equal(a, b)
    w = _flat(dev.state.params)["layers/1/ffn_norm/weight"]  # initialised to exactly 1.0
    wm = np.asarray(dev.state.opt_state.master["layers/1/ffn_norm/weight"])
    assert w.dtype == jnp.bfloat16 and np.abs(wm - 1.0).max() > 5e-5  # the master moved ...
    assert np.all(w.astype(np.float32) == wm.astype(jnp.bfloat16).astype(np.float32))  # ... params = its rounding

    half = Learner(model, _lc(**base, offload_optimizer=0.5))
    state_bytes = lambda leaves: sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)  # noqa: E731
    on_host = state_bytes(x for x in jax.tree.leaves(half.state.opt_state) if x.sharding.memory_kind == "pinned_host")
    total = state_bytes(x for x in jax.tree.leaves(half.state.opt_state) if x.ndim)
    assert 0 < on_host <= 0.5 * total and half.offloaded and len(half.offloaded) < len(master)
    from parallel import plan as pl

    report = pl.plan(CFG, "actor:data=1", "h200", learner=_lc(offload_optimizer=0.5))
    assert report.actor.host == on_host


def test_lower_on_abstract_batch_is_the_update(model, batch):
    """`Learner.lower` with ShapeDtypeStructs lowers the same program as a concrete batch whose rows fill S."""
    learner = Learner(model, _lc(lr=1e-3, compute_dtype="float32", max_tokens_per_micro_batch=16))
    full = _batch(model, n=4, p=4, t=4, max_prompt=4, max_resp=4, seed=1)
    full = full.replace(attention_mask=np.ones_like(full.attention_mask))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), full)
    lowered = learner.lower(abstract)
    assert isinstance(lowered, jax.stages.Lowered)
    assert lowered.as_text() == learner.lower(full).as_text()
    assert lowered.compile().memory_analysis().temp_size_in_bytes > 0
    before = learner.state.step
    assert not before.is_deleted()  # lowering donates nothing


def test_expert_mesh_uses_the_all_to_all_and_equals_unsharded(model, batch):
    """actor:data=2,expert=4: the learner's default dispatch is parallel/expert.py's EP; its compiled step holds
    all-to-alls and no all-gather of routed-expert weights; one step equals the one-device learner."""
    plan = build_mesh_plan("actor:data=2,expert=4", config=CFG)
    cfg = _lc(lr=1e-3, compute_dtype="float32", routing_replay=True)
    batch8 = _batch(model, n=8)
    sharded = Learner(model, cfg, mesh=plan.actor)
    assert sharded.dispatch_fn is not None and "EP dispatch (capacity) over expert=4" in sharded.dispatch_fn.__doc__
    hlo = sharded.lower(batch8).compile().as_text()
    assert "all-to-all" in hlo
    e, i, d = CFG.n_routed_experts, CFG.moe_intermediate_size, CFG.hidden_size
    gathered = re.findall(r"= \w+\[([\d,]+)\]\S* all-gather", hlo)
    expert_shapes = {f"{e},{i},{d}", f"{e},{d},{i}", f"{e // 4},{i},{d}", f"{e // 4},{d},{i}"}
    assert not expert_shapes & set(gathered), gathered
    plain = Learner(model, cfg)
    m_plain, m_sharded = plain.update(batch8), sharded.update(batch8)
    for name, value in m_plain.items():
        np.testing.assert_allclose(float(m_sharded[name]), float(value), rtol=1e-5, atol=1e-6, err_msg=name)
    fp, fs = _flat(plain.state.params), _flat(sharded.state.params)
    diff = np.sqrt(sum(np.sum((fs[k] - v) ** 2) for k, v in fp.items()))
    norm = np.sqrt(sum(np.sum(v ** 2) for v in fp.values()))
    assert diff <= 5e-5 * norm, diff / norm  # tolerance as tests/rl/test_learner.py's sharded step
    assert so.HOST_MEMORY_KIND == "pinned_host"
