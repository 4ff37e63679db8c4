"""rl/agent/env.py, rl/agent/registry.py, rl/agent/key_lookup.py, rl/agent/pieces.py: the environment interface,
its registry and the key-lookup task (nothing compiles; no process is started)."""

from __future__ import annotations

import numpy as np
import pytest

from rl.agent import env as envlib
from rl.agent.key_lookup import (CALL_HEAD, CALL_TAIL, CALL_WEIGHT, FORMAT_CREDIT, KeyLookupTask, call_progress,
                                  key_lookup_tokenizer, value_blind_best, value_reward)
from rl.agent.pieces import PieceTokenizer
from rl.agent.registry import ENVIRONMENTS, make_env
from rl.data.chat_dsv4 import EOS, render_deepseek_v4, tool_result_turn

CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="lookup">\n<｜DSML｜parameter name="key" string="true">{key}'
        '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS)


def test_registry_names_and_one_line_error():
    assert sorted(ENVIRONMENTS) == ["key_lookup", "python_math"]
    assert make_env("key_lookup").name == "key_lookup"
    with pytest.raises(ValueError, match=r"--rollout.env must be one of key_lookup\|python_math, got 'nope'") as e:
        make_env("nope")
    assert "\n" not in str(e.value)


def test_key_lookup_episode():
    env = make_env("key_lookup")
    data = "7=4821"
    msgs = envlib.reset(env, "key 7", data)
    assert msgs[0]["tools"][0]["function"]["name"] == "lookup" and msgs[1] == {"role": "user", "content": "key 7"}
    res = envlib.step(env, CALL.format(key="7"), data)
    assert (res.done, res.calls, res.errors, res.contents) == (False, 1, 0, ["4821"])
    assert res.messages[0]["role"] == "tool"
    wrong = envlib.step(env, CALL.format(key="8"), data)
    assert (wrong.done, wrong.errors, wrong.contents) == (False, 1, ["error"])  # terse errors
    done = envlib.step(env, "4821" + EOS, data)
    assert (done.done, done.calls, done.messages) == (True, 0, ())
    call, w = CALL.format(key="7"), CALL_WEIGHT
    assert envlib.reward(env, "4821" + EOS, data, call) == 1.0
    f = FORMAT_CREDIT  # an answer of the value's length in digits, right or not
    assert envlib.reward(env, "4820" + EOS, data, call) == pytest.approx((1 - w) * (f + (1 - f) * 0.75) + w)  # 3/4
    assert envlib.reward(env, "48", data, call) == pytest.approx((1 - w) * (1 - f) * 0.25 + w)  # cut: 2/4 x 0.5
    assert envlib.reward(env, "48a1" + EOS, data, call) == pytest.approx((1 - w) * (1 - f) * 0.75 + w)  # not digits
    assert envlib.reward(env, call, data, call) == pytest.approx(w)  # calling again earns less than any answer
    assert envlib.reward(env, "4821" + call, data, call) == pytest.approx(w)  # text before a call is no answer
    assert envlib.reward(env, "4821" + CALL_HEAD + "7", data, call) == pytest.approx(w)  # nor before a cut call
    blind = np.mean([value_reward(f"{d:04d}", data) for d in range(10000)])  # every 4-digit answer, uniform
    assert w + (1 - w) * blind == pytest.approx(value_blind_best()) and value_blind_best() < 0.5
    assert envlib.reward(env, "4821" + EOS, data) == 0.0  # an answer without the right call: a guess, no credit
    assert envlib.reward(env, "4821" + EOS, data, CALL.format(key="8")) == 0.0  # a wrong key: no unit at all
    assert value_reward(" 4821\n", data) == 1.0
    # call_progress: units the call with the row's key, EOS; the matching prefix counts (a wrong key: nothing)
    assert call_progress(call, data) == 1.0 and call_progress("4821" + EOS, data) == 0.0
    assert call_progress(CALL_HEAD + "7" + CALL_TAIL + "4" + EOS, data) == pytest.approx(1 / 2)
    assert call_progress(CALL.format(key="8"), data) == 0.0
    assert envlib.reward(env, "4821" + EOS, data, CALL_HEAD + "7" + CALL_TAIL) == pytest.approx(w / 2)  # no EOS
    with pytest.raises(ValueError, match="shaping_weight"):
        envlib.Environment(name="x", tools=env.tools, handlers=env.handlers, reward_fn=value_reward, shaping_weight=0.5)


def test_tool_errors_are_results_not_exceptions():
    env = make_env("key_lookup")
    bad_args = CALL.replace('string="true">{key}', 'string="false">[1]').format()
    cases = {
        CALL.replace("lookup", "search").format(key="7"): "error: unknown tool 'search'",
        bad_args: "error: lookup needs a string argument 'key'",
        CALL.replace(CALL_TAIL, "</｜DSML｜parameter>").format(key="7"): "error: tool call",  # block cut
        CALL.replace('string="true">{key}', 'string="false">{{oops').format(): "error: arguments of 'lookup'",
    }
    verbose = envlib.Environment(name="v", tools=env.tools, handlers=env.handlers, reward_fn=value_reward)
    for text, start in cases.items():
        res = envlib.step(verbose, text, "7=1")
        assert not res.done and res.errors == 1 and res.contents[0].startswith(start), res.contents
        assert "\n" not in res.contents[0]
        assert envlib.step(env, text, "7=1").contents == ["error"]  # key_lookup's terse errors
    boom = envlib.Environment(name="b", tools=env.tools, handlers={"lookup": lambda a, d: 1 / 0},
                              reward_fn=value_reward)
    assert envlib.step(boom, CALL.format(key="7"), "7=1").contents == ["error: ZeroDivisionError: division by zero"]
    with pytest.raises(ValueError, match="no handler"):
        envlib.Environment(name="x", tools=env.tools, handlers={}, reward_fn=value_reward)


def test_key_lookup_task_tokens_round_trip():
    task, tok = KeyLookupTask(), key_lookup_tokenizer()
    (ids, data), = task.prompts(1, start=5)
    assert task.prompts(1, start=5)[0] == (ids, data) and data == task.data(5)  # reproducible alone
    key = data.split("=")[0]
    text = render_deepseek_v4(envlib.reset(make_env("key_lookup"), f"key {key}"))
    assert tok.decode_with_specials(ids) == text and ids[0] == tok.bos_id
    # 4 ids: BOS, tools, "<｜User｜>key ", the key merged with the prompt's closer (what the call is written after)
    assert len(ids) == 4 and tok.table[ids[-1]] == key + "<｜Assistant｜></think>" and len(key) == 1  # keys 0..9
    assert tok.vocab_size == 53 and key_lookup_tokenizer(4).vocab_size == 41  # one call / key piece per key
    call = tok.encode(CALL.format(key=key))  # the whole call with its key is one piece
    assert len(call) == 2 and call[-1] == tok.eos_id and tok.decode(call).endswith("</｜DSML｜tool_calls>")
    assert len({tok.encode(CALL_HEAD + k + CALL_TAIL)[0] for k in "0123456789"}) == 10
    # the tool result: opener, the value's digits, the last one merged with the closer (what the answer follows)
    result = tok.encode(tool_result_turn(["4821"]))
    assert len(result) == 5 and tok.decode(result[1:4]) == "482" and tok.table[result[-1]].startswith("1</tool_")
    assert len(tok.encode(tool_result_turn(["error"]))) == 3 and len(tok.encode(tool_result_turn(["4"]))) == 2
    assert tok.decode_with_specials(tok.encode(tool_result_turn(["4"], thinking=True))) == \
        tool_result_turn(["4"], thinking=True)  # the thinking-mode markup encodes too
    with pytest.raises(ValueError, match=r"KeyLookupTask.n_keys must be in 1..10, got 11"):
        KeyLookupTask(n_keys=11)
    assert tok.decode_with_specials([0, 9999]) == "\ufffd"
    assert tok.encode("k｜é") == tok.encode("???")  # an environment's text always encodes (a tool error quoting a call)
    with pytest.raises(ValueError, match="'é'"):
        PieceTokenizer(["ab"], "ab").encode("é")
    with pytest.raises(ValueError, match="unknown must be one of its characters"):
        PieceTokenizer(["ab"], "ab", unknown="?")
