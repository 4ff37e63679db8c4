"""rl/algo/batch.py: the one layout from the sampler to the learner. `TrainBatch.from_rollout` keeps every row's
prompt, response, logprobs and routing (round trip through `TrainBatch.rows`), marks DAPO fillers out of the
loss, stays host numpy. Host arrays only: nothing compiles."""

import numpy as np

from rl.algo.batch import RolloutBatch, TrainBatch, concat_rollouts
from rl.data.rewards import RewardFn, TextReward
from rl.data.tasks import DigitTask, TaskReward

L, K = 3, 2


def fake_rollout(n=5, p=6, t=4, seed=0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    plen, lens = rng.integers(1, p + 1, n), rng.integers(0, t + 1, n)
    prompt = np.zeros((n, p), np.int32)
    for i in range(n):
        prompt[i, : plen[i]] = rng.integers(1, 50, plen[i])  # left-aligned (rl/batch.py)
    tokens = np.where(np.arange(t)[None] < lens[:, None], rng.integers(1, 50, (n, t)), 0).astype(np.int32)
    logprobs = np.where(tokens > 0, -rng.random((n, t)), 0).astype(np.float32)
    real = np.arange(p + t)[None] < (plen + lens)[:, None]  # [prompt | response | pad]
    routing = np.where(real[..., None, None], rng.integers(0, 8, (n, p + t, L, K)), -1).astype(np.int32)
    return RolloutBatch(tokens=tokens, logprobs=logprobs, routing=routing, lengths=lens.astype(np.int32),
                        finish_reasons=["stop"] * n, prompt_tokens=prompt, prompt_lengths=plen.astype(np.int32))


def test_layout_round_trip():
    rb = fake_rollout()
    adv = np.linspace(-1, 1, 5)
    tb = TrainBatch.from_rollout(rb, adv)
    n, p = rb.prompt_tokens.shape
    s = p + rb.tokens.shape[1]
    assert tb.input_ids.shape == tb.attention_mask.shape == tb.response_mask.shape == (n, s)
    assert tb.routing.shape == (n, s, L, K) and tb.old_logprobs is None
    for x in (tb.input_ids, tb.attention_mask, tb.response_mask, tb.rollout_logprobs, tb.advantages, tb.routing):
        assert isinstance(x, np.ndarray)  # host until the learner places it
    assert tb.rollout_logprobs.dtype == tb.advantages.dtype == np.float32 and tb.input_ids.dtype == np.int32
    np.testing.assert_array_equal(tb.advantages, adv.astype(np.float32))
    for i, row in enumerate(tb.rows()):
        pl, tl = rb.prompt_lengths[i], rb.lengths[i]
        np.testing.assert_array_equal(row["prompt"], rb.prompt_tokens[i, :pl])  # [prompt | ...
        np.testing.assert_array_equal(row["response"], rb.tokens[i, :tl])   # ... | response | pad]
        assert tb.attention_mask[i, 0] == (pl + tl > 0)  # left-aligned
        np.testing.assert_array_equal(row["response_logprobs"], rb.logprobs[i, :tl])
        np.testing.assert_array_equal(row["routing"], rb.routing[i][rb.routing[i, :, 0, 0] >= 0])
        assert tb.attention_mask[i].sum() == pl + tl and tb.response_mask[i].sum() == tl
        real = np.flatnonzero(tb.attention_mask[i])
        assert real.size == 0 or (real == np.arange(real[0], real[0] + real.size)).all()  # contiguous


def test_train_rows_and_replay_off():
    rb = concat_rollouts([(fake_rollout(seed=1), np.array([4, 0])), (fake_rollout(p=9, t=2, seed=2), [1, 2])])
    keep = np.array([True, False, True, False])
    tb = TrainBatch.from_rollout(rb, np.ones(4), routing=False, train_rows=keep)
    assert tb.routing is None
    assert (tb.response_mask[~keep] == 0).all()
    np.testing.assert_array_equal(tb.response_mask[keep].sum(1), rb.lengths[keep])
    assert [len(r["prompt"]) for r in tb.rows()] == list(rb.prompt_lengths)  # prompts still in place


def _has_7(text: str, reference: str) -> float:
    return float("7" in text)


def test_one_reward_interface():
    task = DigitTask(kind="copy", n_digits=3, seed=0)
    tok = task.tokenizer
    refs = [p.answer for p in task.prompts("eval", 2)]
    responses = [[*tok.encode(refs[0]), tok.eos_id], tok.encode("7")]
    rewards: list[RewardFn] = [TaskReward(task), TextReward(_has_7, tok, timeout_s=None)]
    for reward in rewards:  # the loop calls either the same way
        r, exact, m = reward(refs, responses)
        assert r.dtype == np.float32 and r.shape == (2,) and exact.shape == (2,) and isinstance(m, dict)
    r, exact, _ = rewards[0](refs, responses)
    assert r[0] == 1.0 and exact.tolist() == [True, refs[1] == "7"]
    r, exact, m = rewards[1](refs, responses)
    np.testing.assert_array_equal(r, [float("7" in refs[0]), 1.0])
    assert exact[1] and m == {"reward/errors": 0.0, "reward/timeouts": 0.0}
