"""rl/run/env_task.py: a --rollout.env run's prompts, tokenizer and reward (on each trajectory's last model turn), and
the layouts that refuse multi-turn rollouts with one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from rl.agent.key_lookup import CALL_HEAD, CALL_TAIL, CALL_WEIGHT, FORMAT_CREDIT, KeyLookupTask
from rl.algo.batch import RolloutBatch
from rl.config.run import RunConfig
from rl.run.env_task import ENV_KEYS, EVAL_START, TRAIN_PROMPTS, load_env_data, multiturn_request
from rl.agent.env import reset
from rl.agent.python_math import python_math_env
from rl.data.chat_dsv4 import BOS, EOS, parse_completion, render_deepseek_v4, render_tool_calls, tool_result_turn
from rl.run.wiring import build, load_data, prompt_bucket
from rl.rollout.engine import SamplingParams
from rl.rollout.service import RolloutRequest, run_request
from rl.run.stages import score


def _cfg(*over):
    return RunConfig.from_overrides([("rollout.env", "key_lookup"), *over])


def test_key_lookup_data_and_reward_on_the_final_turn():
    cfg = _cfg(("eval.prompts", 3), ("data.task_digits", 4))
    tok, task, train, ev_prompts, ev_refs, reward, ev_data = load_data(cfg)
    gen = KeyLookupTask(n_keys=ENV_KEYS, value_digits=4, seed=cfg.seed)
    assert task is None and ev_data is None and tok.vocab_size == 41 and len(train.references) == TRAIN_PROMPTS
    assert (train.prompt(5), train.references[5]) == tuple(gen.prompts(1, start=5)[0])
    assert list(zip(ev_prompts, ev_refs)) == [tuple(x) for x in gen.prompts(3, start=EVAL_START)]
    assert prompt_bucket(cfg, train, ev_prompts) == 4 + cfg.rollout.max_new_tokens  # later turns re-prefill
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
    assert r.tolist() == pytest.approx([w + (1 - w) * (1 - FORMAT_CREDIT) * 0.25])  # the right call, 2/4 digits, short
    assert score(SimpleNamespace(reward=reward), rb, ev_refs[:1] * 2)[0].tolist() == pytest.approx([1.0, w])
    assert reward(ev_refs[:1], rb.final_turns()[:1])[0].tolist() == [0.0]  # no trajectory: the final turn, no call
    mt = multiturn_request(cfg, ev_refs)
    assert (mt.env, mt.data, mt.max_turns) == ("key_lookup", tuple(ev_refs), cfg.rollout.max_turns)
    assert multiturn_request(RunConfig(), ev_refs) is None


@pytest.mark.parametrize("over, needle", [
    ((("rollout.env", "python_math"),), "python_math: its prompts come from a math --dataset"),
    ((("data.dataset", "x.jsonl"), ("data.tokenizer", "t.json")), "generates its own prompts; drop --dataset"),
])
def test_env_data_refusals(over, needle):
    with pytest.raises(ValueError, match=needle) as e:
        load_env_data(_cfg(*over))
    assert "\n" not in str(e.value)


def test_two_job_layout_refuses_multiturn():
    with pytest.raises(ValueError, match="the two-job layout .--rollout-address / --rollout-job. does not carry"):
        build(_cfg(("rollout.address", "127.0.0.1:1")))


def test_python_math_prompts_tools_and_reward(tmp_path):
    """--rollout.env python_math: GSM8K records rendered in DeepSeek-V4's chat format with the python tool section,
    encoded with --tokenizer (a byte-level BPE holding DeepSeek-V4's BOS / EOS); the reward (`--reward auto`: the
    gsm8k format's) reads the final turn's answer; the tool call in a turn parses from its decoded tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_file = tmp_path / "tokenizer.json"
    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(["Tom has 3 apples and 4 more"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.save(str(tok_file))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many?",
                                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a, b in ((3, 4), (12, 7), (25, 30))))
    cfg = _cfg(("rollout.env", "python_math"), ("data.dataset", str(data)), ("data.tokenizer", str(tok_file)),
               ("data.max_prompt_len", 4096), ("eval.prompts", 2))
    tok, task, train, ev_prompts, ev_refs, reward, ev_data = load_data(cfg)
    assert task is None and ev_data is None and train.references == ["7", "19", "55"] and ev_refs == ["7", "19"]
    text = tok.decode_with_specials(train.prompt(1))
    messages = reset(python_math_env(), "Tom has 12 apples and buys 7 more. How many?")
    assert text == render_deepseek_v4(messages) and text.startswith(BOS) and '"name": "python"' in text
    assert train.prompt(1)[0] == tok.token_id(BOS)
    call = render_tool_calls([{"type": "function", "function": {
        "name": "python", "arguments": json.dumps({"code": "print(12 + 7)"})}}]) + EOS
    assert parse_completion(tok.decode_with_specials(tok.encode(call)))["tool_calls"][0]["function"]["name"] == \
        "python"
    answers = [tok.encode(x + EOS) for x in ("So \\boxed{7}", "\\boxed{20}")]
    r, exact, _ = reward(ev_refs, answers, answers)
    assert r.tolist() == [1.0, 0.0] and exact.tolist() == [True, False]

    # one trajectory through the multi-turn rollout: a python call, the sandbox's output as the tool turn, the answer
    turns = iter([call, "\\boxed{19}" + EOS])

    class Engine:  # `generate` as the engine's: the scripted turns, one row
        max_prompt_len, weight_version, speculative = 4096, 1, "off"

        def generate(self, prompts, params, *, seed, step, prompt_index, sample_index, max_new_tokens_per_row,
                     token_offset):
            new, p, t = tok.encode(next(turns))[:max_new_tokens_per_row[0]], self.max_prompt_len, params.max_new_tokens
            pt, tokens = np.zeros((1, p), np.int32), np.zeros((1, t), np.int32)
            pt[0, :len(prompts[0])], tokens[0, :len(new)] = prompts[0], new  # left-aligned (rl/batch.py)
            return RolloutBatch(tokens=tokens, logprobs=np.full((1, t), -0.5, np.float32),
                                routing=np.zeros((1, p + t, 1, 1), np.int32), lengths=np.array([len(new)]),
                                finish_reasons=["stop"], prompt_tokens=pt, prompt_lengths=np.array([len(prompts[0])]),
                                weight_version=1)

    req = RolloutRequest(prompts=[train.prompt(1)], params=SamplingParams(max_new_tokens=1024), seed=0,
                         multiturn=multiturn_request(cfg, train.references[1:2]))
    res = run_request(Engine(), req, tok)
    env_turn = tok.encode(tool_result_turn(["19\n"]))  # what the code printed
    assert tok.decode_with_specials(res.rb.response_lists()[0]) == call + tool_result_turn(["19\n"]) + "\\boxed{19}" + EOS
    assert res.rb.response_lists()[0] == tok.encode(call) + env_turn + tok.encode("\\boxed{19}" + EOS)
    assert res.stats["rollout/tool_calls_per_traj"] == 1.0 and res.stats["rollout/tool_errors"] == 0.0
    assert reward(train.references[1:2], res.rb.final_turns(), res.rb.response_lists())[0].tolist() == [1.0]
