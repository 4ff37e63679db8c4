"""rl/env_task.py: a --rollout.env run's prompts, tokenizer and reward (on each trajectory's last model turn), and
the layouts that refuse multi-turn rollouts with one line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rl.agent.key_lookup import CALL_HEAD, CALL_TAIL, CALL_WEIGHT, KeyLookupTask
from rl.batch import RolloutBatch
from rl.config import RunConfig
from rl.env_task import ENV_KEYS, EVAL_START, TRAIN_PROMPTS, load_env_data, multiturn_request
from rl.chat_dsv4 import EOS, tool_result_turn
from rl.job import build, load_data, prompt_bucket
from rl.stages import score


def _cfg(*over):
    return RunConfig.from_overrides([("rollout.env", "key_lookup"), *over])


def test_key_lookup_data_and_reward_on_the_final_turn():
    cfg = _cfg(("eval.prompts", 3), ("data.task_digits", 4))
    tok, task, train, ev_prompts, ev_refs, reward, ev_data = load_data(cfg)
    gen = KeyLookupTask(n_keys=ENV_KEYS, value_digits=4, seed=cfg.seed)
    assert task is None and ev_data is None and tok.vocab_size == 35 and len(train.references) == TRAIN_PROMPTS
    assert (train.prompt(5), train.references[5]) == tuple(gen.prompts(1, start=5)[0])
    assert list(zip(ev_prompts, ev_refs)) == [tuple(x) for x in gen.prompts(3, start=EVAL_START)]
    assert prompt_bucket(cfg, train, ev_prompts) == 7 + cfg.rollout.max_new_tokens  # later turns re-prefill
    key, value = ev_refs[0].split("=")
    assert {r.split("=")[0] for r in train.references} == {str(k) for k in range(ENV_KEYS)}
    # row 0: the right call | tool result (environment) | the value; row 1: ends inside the environment's turn
    call = tok.encode(CALL_HEAD + key + CALL_TAIL + EOS)
    env, ans = tok.encode(tool_result_turn([value])), tok.encode(value + EOS)
    resp = [call + env + ans, call + env[:3]]
    t, mask = np.zeros((2, 24), np.int32), np.zeros((2, 24), np.int32)
    for i, r in enumerate(resp):
        t[i, :len(r)] = r
    mask[0, :len(resp[0])] = [1] * len(call) + [0] * len(env) + [1] * len(ans)
    mask[1, :len(call)] = 1
    rb = RolloutBatch(tokens=t, logprobs=np.zeros((2, 24), np.float32), routing=np.zeros((2, 32, 1, 1), np.int32),
                      lengths=np.array([len(r) for r in resp], np.int32), finish_reasons=["stop", "length"],
                      prompt_tokens=np.zeros((2, 8), np.int32), prompt_lengths=np.array([8, 8]), loss_mask=mask)
    assert rb.final_turns() == [ans, []]
    short = tok.encode(value[:2] + EOS)
    r, exact, _ = reward(ev_refs[:1] * 3, rb.final_turns() + [short], rb.response_lists() + [short])
    w = CALL_WEIGHT  # row 1: the right call, no answer; row 2: no call, so its 2 of 4 digits earn nothing
    assert r.tolist() == pytest.approx([1.0, w, 0.0]) and exact.tolist() == [True, False, False]
    r = reward(ev_refs[:1], [short], [call + env + short])[0]
    assert r.tolist() == pytest.approx([w + (1 - w) * 0.25])  # the right call, 2 of 4 digits, short: x0.5
    assert score(SimpleNamespace(reward=reward), rb, ev_refs[:1] * 2)[0].tolist() == pytest.approx([1.0, w])
    assert reward(ev_refs[:1], rb.final_turns()[:1])[0].tolist() == [0.0]  # no trajectory: the final turn, no call
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
