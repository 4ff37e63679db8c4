"""Exact mode (`--exact-rollout`, rl/rollout/exact.py; issue 26 point 4): the training samples are drawn from the
learner's own forward in the fixed layout, so the distribution each token was drawn from is the one the train step
scores, to the bit, for every row whatever its neighbours in the request and in the learner's batch. FP8-aware learner (the FP8
rollout's weights and activation quantisation), routing recorded and replayed; tiny model, 2 layers (CSA, HCA).

Run: `.venv/bin/python -m pytest -q tests/rl/test_exact.py`.
"""

import pathlib
import sys

import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from launch import run as launch_run
from rl.rollout import exact
from rl.algo.batch import TrainBatch, concat_rollouts
from rl.config.algo import LearnerConfig, LossConfig
from rl.config.run import RunConfig
from rl.algo.learner import Learner
from rl.rollout.engine import SamplingParams
from rl.rollout.service import RolloutRequest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fake_rollout import FakeRollout  # noqa: E402  (tests/rl/fake_rollout.py)

sys.path.pop(0)

CFG = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
P, T = 24, 12  # max prompt length, max new tokens
LENS = (5, 13, 1, 20, 9, 17, 3, 11)  # prompt lengths
PERM = [6, 3, 0, 5, 7, 1, 4, 2]  # the rows drawn again in this order: other neighbours, other positions
STOP = tuple(range(24, 40))  # 16 stop tokens (~6% of the vocabulary): rows end at different steps


def test_exact_rollout_draws_from_the_learners_forward_bitwise(monkeypatch):
    draw = exact.draw_tokens
    model = DSV4ForCausalLM(CFG, rngs=nnx.Rngs(3))
    rs = np.random.RandomState(0)
    prompts = [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in LENS]
    cfg = LearnerConfig(lr=1e-3, compute_dtype="float32", routing_replay=True, fp8_forward=True,
                        logprob_chunk_size=16, loss=LossConfig(correction="tis"))  # 4 head chunks per row
    layout = exact.exact_layout(cfg, rows_per_step=len(LENS), max_prompt_len=P, max_new_tokens=T)
    assert layout == (8, 64)
    learner = Learner(model, cfg, rollout_dtype="fp8", exact_layout=layout)
    sp = SamplingParams(temperature=1.0, max_new_tokens=T, stop_token_ids=STOP)
    drawn = []  # the tempered logits z [N, V] of every draw
    monkeypatch.setattr(exact, "draw_tokens", lambda z, *a: drawn.append(np.asarray(z)) or draw(z, *a))
    full, stats = exact.generate(learner, prompts, sp, seed=0, weight_version=3, routing_replay=True)
    assert stats["rollout/exact_forwards"] == T == len(drawn)
    assert full.weight_version == 3 and full.tokens.shape == (8, T) and len(set(full.lengths.tolist())) > 1
    for i, n in enumerate(full.lengths):  # a row ends at its stop token or at max_new_tokens
        assert (full.tokens[i, n - 1] in STOP) == (full.finish_reasons[i] == "stop") and (n == T or
                                                                                       full.tokens[i, n - 1] in STOP)
        assert not np.any(full.tokens[i, n:]) and not np.any(full.logprobs[i, n:])
    assert np.all(full.response_half(full.routing)[np.arange(T)[None] < full.lengths[:, None]] >= 0)  # recorded
    # each draw's z is the learner's z of the finished rows (causal to the bit), and the batch's logprob is the
    # log-softmax of that z at the drawn token (up to the normaliser's reduction order in the draw's own shape)
    lens, width = np.array(LENS), layout[1]
    ids = np.zeros((8, width), np.int32)
    for i, q in enumerate(prompts):
        ids[i, : len(q) + full.lengths[i]] = q + full.tokens[i, : full.lengths[i]].tolist()
    mask = (np.arange(width)[None] < (lens + full.lengths)[:, None]).astype(np.int32)
    for g in range(T):
        live = g < full.lengths
        last = np.zeros((8, width), np.int32)
        last[np.arange(8), np.minimum(lens + g, width - 1) - 1] = 1
        z = np.asarray(learner.next_logits(learner.state, TrainBatch(
            input_ids=ids, attention_mask=mask, response_mask=last, rollout_logprobs=np.zeros((8, width), np.float32),
            advantages=np.zeros(8, np.float32))))
        np.testing.assert_array_equal(z[live], drawn[g][live])
        lse = np.log(np.exp(z[live].astype(np.float64)).sum(-1))
        np.testing.assert_allclose(z[live, full.tokens[live, g]] - lse, full.logprobs[live, g], atol=2e-6)

    # the rows drawn again in another order and in two requests (other neighbours, a half-empty micro-batch)
    perm, _ = exact.generate(learner, [prompts[i] for i in PERM], sp, seed=0, prompt_index=PERM, weight_version=3,
                             routing_replay=True)
    # (the second through the service contract: `ExactRollout` draws training requests, evaluation goes to the engine)
    trace = []
    service = exact.ExactRollout(learner, FakeRollout(CFG.vocab_size, 1, trace, version=3), routing_replay=True)
    res = service.collect(service.submit(RolloutRequest(prompts=[prompts[i] for i in (1, 4, 7)], params=sp, seed=0,
                                                        prompt_index=[1, 4, 7], tag="train/0/0", train=True)))
    half = res.rb
    assert half.weight_version == 3 and res.stats["rollout/exact_forwards"] > 0 and trace == []
    service.collect(service.submit(RolloutRequest(prompts=prompts[:2], params=sp, seed=0, tag="eval/0")))
    assert service.load_weights(4) == {"perf/weight_push_s": 0.0} and service.weight_version == 4
    assert trace == [("generate", "eval/0", 3), ("push", 4)]
    for got, idx in ((perm, PERM), (half, [1, 4, 7])):
        np.testing.assert_array_equal(got.tokens, full.tokens[idx])
        np.testing.assert_array_equal(got.logprobs, full.logprobs[idx])
        np.testing.assert_array_equal(got.response_half(got.routing), full.response_half(full.routing)[idx])

    # the learner's batch: rows of both requests, in another order: the step scores every token as drawn
    mixed = concat_rollouts([(perm, np.arange(4)), (full, np.array([7, 2, 1, 4]))])
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
    assert RunConfig(**{"rollout.exact": True, "rollout.dtype": "fp32"}).rollout.exact is True
    with pytest.raises(ValueError, match="--exact-rollout with --rollout-dtype fp8 needs --learner.fp8_forward"):
        RunConfig(**{"rollout.exact": True})
    with pytest.raises(ValueError, match="drop --max-staleness 1"):
        RunConfig(**{"rollout.exact": True, "rollout.dtype": "fp32", "rollout.async_rollout": True})
    with pytest.raises(ValueError, match="--exact-rollout: a row of 70 tokens is longer"):
        Learner(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), LearnerConfig(compute_dtype="float32"),
                exact_layout=(2, 64)).layout(2, 80, 70)
