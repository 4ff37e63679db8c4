"""Sampler -> learner hand-off: routing replay against the sampler's recorded routing, and the train/rollout
logprob mismatch for fp32 / BF16 / FP8 rollout weights (issue: GRPO learner)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from rl.config.algo import LearnerConfig, LossConfig
from rl.algo.batch import TrainBatch
from rl.algo.learner import Learner
from rl.rollout.engine import Sampler, SamplingParams

CFG = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)


@pytest.fixture(scope="module")
def setup():
    model = DSV4ForCausalLM(CFG, rngs=nnx.Rngs(3))
    rs = np.random.RandomState(0)
    prompts = [list(map(int, rs.randint(2, CFG.vocab_size, n))) for n in (6, 9, 4, 11)]
    return model, prompts


def _batch(rb, adv):
    ids, mask, resp, rlp = rb.sequences()
    return TrainBatch(input_ids=ids, attention_mask=mask, response_mask=resp, rollout_logprobs=rlp,
                      advantages=np.asarray(adv, np.float32), routing=rb.routing)


def test_replay_reproduces_the_samplers_routing_and_logprobs(setup):
    model, prompts = setup
    sampler = Sampler(model, weights="fp32", max_prompt_len=16)
    rb = sampler.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12), seed=0)
    lcfg = LearnerConfig(lr=3e-2, compute_dtype="float32", routing_replay=True, max_grad_norm=None,
                         loss=LossConfig(loss_agg_mode="token-mean"))
    learner = Learner(model, lcfg)
    batch = _batch(rb, [1.0, -1.0, 0.5, -0.5])
    res, m = learner.compute_logprobs(learner.state, batch)
    resp = batch.response_mask.astype(bool)
    err = np.abs(np.asarray(res.logprobs) - batch.rollout_logprobs)[resp].max()
    assert err <= 1e-5, f"learner (replay) vs sampler logprobs: {err:.2e}"
    real = batch.attention_mask.astype(bool)
    np.testing.assert_array_equal(np.asarray(res.routing)[real], rb.routing[real])
    for _ in range(3):  # updates that move the router
        learner.update(batch)
    free, _ = learner.compute_logprobs(learner.state, batch, routing_replay=False)
    forced, _ = learner.compute_logprobs(learner.state, batch, routing_replay=True)
    changed = int((np.asarray(free.routing)[real] != rb.routing[real]).sum())
    assert changed > 0, "the updates did not change any free route: the test would be vacuous"
    assert (np.asarray(forced.routing)[real] == rb.routing[real]).all()


def test_train_rollout_mismatch_fp32_bf16_fp8(setup):
    model, prompts = setup
    learner = Learner(model, LearnerConfig(lr=1e-3, compute_dtype="float32", routing_replay=True))
    diffs = {}
    for weights in ("fp32", "bf16", "fp8"):
        rb = Sampler(model, weights=weights, max_prompt_len=16, kv_cache_dtype="bf16").generate(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=12), seed=1)
        _, m = learner.compute_logprobs(learner.state, _batch(rb, np.zeros(4)))
        diffs[weights] = float(m["train/train_rollout_logprob_abs_diff"])
        assert np.isfinite(float(m["train/train_rollout_kl"]))
    print("train/train_rollout_logprob_abs_diff:", diffs)
    assert diffs["fp32"] < 1e-5
    assert diffs["fp32"] < diffs["bf16"] < 0.05
    assert diffs["fp8"] > diffs["bf16"]
