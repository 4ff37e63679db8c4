"""Exact mode (`--exact-rollout`, rl/exact.py; issue 26 point 4): the rollout's logprobs, re-scored by the learner's
own forward in the fixed layout, are bitwise those the train step computes, for every row whatever its slot and
neighbours in the rollout and in the learner's batch. FP8 rollout (FP8 KV cache, continuous batching over 3 slots,
chunked prefill, routing recorded and replayed) and the FP8-aware learner; tiny model, 2 layers.

Run: `.venv/bin/python -m pytest -q tests/rl/test_exact.py`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from launch import run as launch_run
from rl.batch import concat_rollouts
from rl.config import LearnerConfig, LossConfig, RunConfig
from rl.exact import exact_layout, rescore
from rl.learner import Learner, TrainBatch
from rl.sampler import Sampler, SamplingParams

CFG = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
P, T = 24, 12  # max prompt length, max new tokens
LENS = (5, 13, 1, 20, 9, 17, 3, 11)  # prompt lengths
NEW = (12, 7, 12, 3, 10, 12, 5, 9)  # response length limits: rows end at different steps, slots are refilled
PERM = [6, 3, 0, 5, 7, 1, 4, 2]  # the rows generated again in this order: other slots, other neighbours


def test_exact_rollout_logprobs_are_the_learners_bitwise():
    model = DSV4ForCausalLM(CFG, rngs=nnx.Rngs(3))
    rs = np.random.RandomState(0)
    prompts = [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in LENS]
    sampler = Sampler(model, weights="fp8", compute_dtype=jnp.float32, max_prompt_len=P, slots=3, prefill_chunk=8,
                      kv_cache_dtype="fp8")
    sp = SamplingParams(temperature=1.0, max_new_tokens=T)
    full = sampler.generate(prompts, sp, seed=0, max_new_tokens_per_row=NEW)
    perm = sampler.generate([prompts[i] for i in PERM], sp, seed=0, prompt_index=PERM,
                            max_new_tokens_per_row=[NEW[i] for i in PERM])
    np.testing.assert_array_equal(perm.tokens, full.tokens[PERM])  # the same samples (per-row randomness)
    assert list(full.lengths) == list(NEW)

    cfg = LearnerConfig(lr=1e-3, compute_dtype="float32", routing_replay=True, fp8_forward=True,
                        loss=LossConfig(correction="tis"))
    layout = exact_layout(cfg, rows_per_step=len(LENS), max_prompt_len=P, max_new_tokens=T)
    assert layout == (8, 64)
    learner = Learner(model, cfg, rollout_dtype="fp8", exact_layout=layout)
    ex_full, ex_perm = (rescore(learner, rb, routing_replay=True) for rb in (full, perm))
    resp = np.arange(T)[None] < full.lengths[:, None]
    gap = np.abs(ex_full.logprobs - full.logprobs)[resp]
    print(f"sampled vs exact: mean {gap.mean():.2e} max {gap.max():.2e}")  # FP8 KV cache + decode path
    assert gap.mean() > 1e-3  # the sampler's own logprobs were replaced
    assert np.all(ex_full.logprobs[~resp] == 0)
    np.testing.assert_array_equal(ex_perm.logprobs, ex_full.logprobs[PERM])  # batch invariant, to the bit
    for a, b in ((ex_full, full), (ex_perm, perm)):  # nothing else changed
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.routing, b.routing)

    # the learner's batch: rows of both requests, in another order (other neighbours, other positions)
    mixed = concat_rollouts([(ex_perm, np.arange(4)), (ex_full, np.array([7, 2, 1, 4]))])
    adv = np.where(np.arange(len(LENS)) % 2, 1.0, -1.0).astype(np.float32)
    _, _, m = learner.loss_and_grads(learner.state, TrainBatch.from_rollout(mixed, adv))
    # old = the step's own forward: |old - rollout| = 0 means every off-policy (TIS) ratio exp(old - rollout) = 1
    assert float(m["train/train_rollout_logprob_abs_diff"]) == 0.0
    assert float(m["train/train_rollout_kl"]) == 0.0
    assert float(m["train/tis_clipfrac"]) == 0.0


def test_exact_rollout_is_a_flag():
    assert RunConfig().rollout.exact is False
    cfg, _ = launch_run.resolve(["--exact-rollout", "--learner.fp8_forward", "--ckpt-dir", ""])
    assert cfg.rollout.exact is True and cfg.learner.fp8_forward is True
    assert RunConfig(exact_rollout=True, rollout_dtype="fp32").rollout.exact is True
    with pytest.raises(ValueError, match="--exact-rollout with --rollout-dtype fp8 needs --learner.fp8_forward"):
        RunConfig(exact_rollout=True)
    with pytest.raises(ValueError, match="drop --max-staleness 1"):
        RunConfig(exact_rollout=True, rollout_dtype="fp32", async_rollout=True)
    with pytest.raises(ValueError, match="--exact-rollout: a row of 70 tokens is longer"):
        Learner(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), LearnerConfig(compute_dtype="float32"),
                exact_layout=(2, 64))._layout(2, 80, 70)
