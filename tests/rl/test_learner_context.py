"""The learner under context parallelism (issue 25): the whole step on `actor:fsdp=2,expert=2,context=2` equals the
step on `actor:fsdp=2,expert=2` (context=1), and the token budget counts tokens per context shard.

Model: tiny cut to 2 layers (CSA m=4 with the indexer, HCA m=8; the sliding window in both; hash + learned top-k
routing), float32, remat off (it changes no value and costs 6 s of compile here; the default `block` with context=2
runs in the loop, benchmarks/README.md "Context parallelism"), the learner's defaults otherwise (scanned layers,
chunked logprobs, EP dispatch; routing replay under context parallelism is checked at the model level in
tests/dsv4/test_context.py). Rows: left-padded prompts + right-padded responses, S = 40 = the trimmed width (the
bucket 64 capped at S; not a multiple of 16 = context x ratio 8: the model pads it to 48 under context
parallelism). Two learner compiles.
Run: `.venv/bin/python -m pytest -q tests/rl/test_learner_context.py`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from rl.config.algo import LearnerConfig
from rl.algo.batch import TrainBatch
from rl.algo.learner import Learner
from sharding.mesh import build_mesh_plan

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8, 0))
N, P, T = 4, 12, 28


@pytest.fixture(scope="module")
def model():
    return dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)


@pytest.fixture(scope="module")
def batch(model):
    rng = np.random.default_rng(0)
    plen, rlen = np.array([12, 5, 9, 3]), np.array([25, 28, 11, 17])  # longest real row 37
    am, rm = np.zeros((N, P + T), np.int32), np.zeros((N, P + T), np.int32)
    for i in range(N):
        am[i, P - plen[i]:P + rlen[i]] = 1
        rm[i, P:P + rlen[i]] = 1
    ids = np.where(am > 0, rng.integers(1, CFG.vocab_size, (N, P + T)), 0).astype(np.int32)
    lp = np.where(rm > 0, -rng.uniform(0.5, 6.0, (N, P + T)), 0).astype(np.float32)  # a rollout's logprobs
    return TrainBatch(input_ids=ids, attention_mask=am, response_mask=rm, rollout_logprobs=lp,
                      advantages=rng.normal(size=N).astype(np.float32))


def _flat(tree):
    return {"/".join(str(k) for k in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(tree)}


def test_context2_train_step_equals_context1(model, batch):
    """Same layout (width 40, one micro-batch of 4 rows) from a budget of 32 tokens per context shard at context=2
    and 64 at context=1; loss, every metric and every gradient agree to 1e-5 (fp32)."""
    kw = dict(lr=1e-3, compute_dtype="float32", logprob_chunk_size=16, remat="none")
    ref = Learner(model, LearnerConfig(max_tokens_per_micro_batch=64, **kw),
                  mesh=build_mesh_plan("actor:fsdp=2,expert=2", config=CFG).actor)
    cp = Learner(model, LearnerConfig(max_tokens_per_micro_batch=32, **kw),
                 mesh=build_mesh_plan("actor:fsdp=2,expert=2,context=2", config=CFG).actor)
    assert cp.context_devices() == 2 and ref.context_devices() == 1
    assert cp.layout(N, P + T, 37) == ref.layout(N, P + T, 37)
    assert (cp.layout(N, P + T, 37).width, cp.layout(N, P + T, 37).micro_batches) == (40, 1)
    with pytest.raises(ValueError, match="max-tokens-per-micro-batch.*per context shard"):
        cp.layout(N, 128, 70)  # 35 tokens per shard > 32
    loss_r, grads_r, met_r = ref.loss_and_grads(ref.state, batch)
    loss_c, grads_c, met_c = cp.loss_and_grads(cp.state, batch)
    np.testing.assert_allclose(float(loss_c), float(loss_r), rtol=1e-5, atol=1e-5)
    for k, v in met_r.items():
        np.testing.assert_allclose(float(met_c[k]), float(v), rtol=1e-5, atol=1e-5, err_msg=k)
    gr, gc = _flat(grads_r), _flat(grads_c)
    assert gr.keys() == gc.keys()
    for k, v in gr.items():
        np.testing.assert_allclose(gc[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    assert sum(np.abs(v).max() > 0 for v in gr.values()) > 30
