"""rl/env_task.py: a --rollout.env run's prompts, tokenizer and reward (on each trajectory's last model turn), and
the layouts that refuse multi-turn rollouts with one line."""

from __future__ import annotations

import numpy as np
import pytest

from rl.agent.key_lookup import KeyLookupTask
from rl.batch import RolloutBatch
from rl.config import RunConfig
from rl.env_task import EVAL_START, TRAIN_PROMPTS, load_env_data, multiturn_request
from rl.job import build, load_data, prompt_bucket


def _cfg(*over):
    return RunConfig.from_overrides([("rollout.env", "key_lookup"), *over])


def test_key_lookup_data_and_reward_on_the_final_turn():
    cfg = _cfg(("eval.prompts", 3), ("data.task_digits", 4))
    tok, task, train, ev_prompts, ev_refs, reward, ev_data = load_data(cfg)
    gen = KeyLookupTask(value_digits=4, seed=cfg.seed)
    assert task is None and ev_data is None and tok.vocab_size == 108 and len(train.references) == TRAIN_PROMPTS
    assert (train.prompt(5), train.references[5]) == tuple(gen.prompts(1, start=5)[0])
    assert list(zip(ev_prompts, ev_refs)) == [tuple(x) for x in gen.prompts(3, start=EVAL_START)]
    assert prompt_bucket(cfg, train, ev_prompts) == 12 + cfg.rollout.max_new_tokens  # later turns re-prefill
    value = ev_refs[0].split("=")[1]
    # row 0: call | tool result (environment) | the value; row 1: ends inside the environment's turn
    call, env, ans = [5, 6, 7], [8, 9, 10], tok.encode(value + "<｜end▁of▁sentence｜>")
    resp = [call + env + ans, call + env]
    t = np.zeros((2, 16), np.int32)
    mask = np.zeros((2, 16), np.int32)
    for i, r in enumerate(resp):
        t[i, :len(r)] = r
    mask[0, :len(resp[0])] = [1] * 3 + [0] * 3 + [1] * len(ans)
    mask[1, :3] = 1
    rb = RolloutBatch(tokens=t, logprobs=np.zeros((2, 16), np.float32), routing=np.zeros((2, 28, 1, 1), np.int32),
                      lengths=np.array([len(r) for r in resp], np.int32), finish_reasons=["stop", "length"],
                      prompt_tokens=np.zeros((2, 12), np.int32), prompt_lengths=np.array([12, 12]), loss_mask=mask)
    assert rb.final_turns() == [ans, []]
    r, exact, _ = reward(ev_refs[:1] * 3, rb.final_turns() + [tok.encode(value[:2] + "<｜end▁of▁sentence｜>")])
    assert r.tolist() == [1.0, 0.0, 0.25] and exact.tolist() == [True, False, False]  # 2 of 4 digits, short: x0.5
    mt = multiturn_request(cfg, ev_refs)
    assert (mt.env, mt.data, mt.max_turns) == ("key_lookup", tuple(ev_refs), cfg.rollout.max_turns)
    assert multiturn_request(RunConfig(), ev_refs) is None


@pytest.mark.parametrize("over, needle", [
    ((("rollout.env", "python_math"),), "builds prompts for key_lookup only"),
    ((("data.dataset", "x.jsonl"), ("data.tokenizer", "t.json")), "generates its own prompts; drop --dataset"),
])
def test_env_data_refusals(over, needle):
    with pytest.raises(ValueError, match=needle) as e:
        load_env_data(_cfg(*over))
    assert "\n" not in str(e.value)


def test_two_job_layout_refuses_multiturn():
    with pytest.raises(ValueError, match="the two-job layout .--rollout-address / --rollout-job. does not carry"):
        build(_cfg(("rollout.address", "127.0.0.1:1")))
