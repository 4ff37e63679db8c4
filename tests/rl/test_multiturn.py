"""rl/rollout/multiturn.py through the rollout contract (LocalRollout.submit/collect): a 2-turn key-lookup rollout
with a scripted engine (nothing compiles): the joined layout, loss masks, logprobs, routing and the metrics; and one
through the compiled tiny engine (its logprobs and routing against a full forward of the trajectory)."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from rl.agent.key_lookup import KeyLookupTask, key_lookup_env, key_lookup_tokenizer
from rl.agent.registry import ENVIRONMENTS
from rl.algo.batch import RolloutBatch, TrainBatch
from rl.data.chat_dsv4 import CALLS_START, RESULT_CLOSE, RESULT_OPEN, tool_result_turn
from rl.config.run import ENVS, RunConfig
from rl.rollout.engine import Sampler, SamplingParams
from rl.rollout.mpmd import RolloutServer
from rl.rollout.multiturn import MultiTurn
from rl.rollout.service import LocalRollout, RolloutRequest, run_request

TOK = key_lookup_tokenizer()
CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="lookup">\n<｜DSML｜parameter name="key" string="true">{}'
        '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>')
LP = -0.25


def wrong(key: str) -> str:
    """Another of the task's keys (its call is a piece of the task's tokenizer too)."""
    return str((int(key) + 1) % 10)


class ScriptedEngine:
    """`generate` as the engine's, with a policy per sample index: 0 looks the key up then copies the value, 1 asks
    a wrong key (`wrong`) then answers "0", 2 answers "0" at once, 3 calls forever. Routing of a token = its id (one
    layer, k=1)."""

    max_prompt_len, weight_version, speculative = 64, 7, "off"

    def __init__(self):
        self.calls = []

    def _turn(self, ctx: str, policy: int, key: str) -> str:
        seen = ctx.count(RESULT_OPEN)
        if policy == 2 or (policy in (0, 1) and seen):
            return (ctx.rsplit(RESULT_OPEN, 1)[1].split(RESULT_CLOSE)[0] if policy == 0 else "0") + \
                "<｜end▁of▁sentence｜>"
        return CALL.format(wrong(key) if policy == 1 else key)

    def generate(self, prompts, params, *, seed, step, prompt_index, sample_index, max_new_tokens_per_row,
                 token_offset):
        self.calls.append((list(sample_index), list(max_new_tokens_per_row), list(token_offset)))
        n, t, p = len(prompts), params.max_new_tokens, 64
        out = {"tokens": np.zeros((n, t), np.int32), "logprobs": np.zeros((n, t), np.float32),
               "routing": np.full((n, p + t, 1, 1), -1, np.int32), "prompt_tokens": np.zeros((n, p), np.int32)}
        lengths, reasons = [], []
        for j, ctx in enumerate(prompts):
            text = TOK.decode_with_specials(ctx)
            key = text.split("<｜User｜>key ")[1].split("<")[0]
            new = TOK.encode(self._turn(text, int(sample_index[j]), key))[:max_new_tokens_per_row[j]]
            out["tokens"][j, :len(new)], out["logprobs"][j, :len(new)] = new, LP
            out["prompt_tokens"][j, :len(ctx)] = ctx  # the joined row [prompt | response | pad] (rl/batch.py)
            out["routing"][j, : len(ctx) + len(new), 0, 0] = list(ctx) + new
            lengths.append(len(new))
            reasons.append("stop" if new[-1] == TOK.eos_id else "length")
        return RolloutBatch(lengths=np.array(lengths, np.int32), finish_reasons=reasons,
                            prompt_lengths=np.array([len(c) for c in prompts]), weight_version=self.weight_version,
                            **out)


def test_two_turn_key_lookup_masks_and_metrics():
    (prompt, data), = KeyLookupTask().prompts(1)
    value = data.split("=")[1]
    engine = ScriptedEngine()
    service = LocalRollout(engine, tokenizer=TOK)
    req = RolloutRequest(prompts=[prompt] * 4, params=SamplingParams(max_new_tokens=48), seed=0,
                         sample_index=[0, 1, 2, 3],
                         multiturn=MultiTurn(env="key_lookup", data=(data,) * 4, max_turns=2))
    res = service.collect(service.submit(req))
    rb = res.rb
    call, env_turn, answer = (TOK.encode(CALL.format(data.split("=")[0])), TOK.encode(tool_result_turn([value])),
                              TOK.encode(value + "<｜end▁of▁sentence｜>"))
    assert len(call) == 2 and len(env_turn) == 5 and len(answer) == 5
    # row 0: call (model) | tool result (environment) | answer (model)
    assert rb.response_lists()[0] == call + env_turn + answer
    assert rb.loss_mask[0, :12].tolist() == [1] * 2 + [0] * 5 + [1] * 5 and rb.loss_mask[0, 12:].sum() == 0
    assert np.all(rb.logprobs[0, :12] == np.array([LP] * 2 + [0.0] * 5 + [LP] * 5, np.float32))
    # row 1: a wrong key is a tool error the model reads, then it answers; row 2 answers at once
    err = TOK.encode(tool_result_turn(["error"]))  # key_lookup's terse errors
    bad = TOK.encode(CALL.format(wrong(data.split("=")[0])))
    assert rb.response_lists()[1] == bad + err + TOK.encode("0<｜end▁of▁sentence｜>")
    assert rb.response_lists()[2] == TOK.encode("0<｜end▁of▁sentence｜>") and rb.loss_mask[2, :2].all()
    # row 3 called in both turns: cut by the turn budget, its second call not answered
    assert rb.response_lists()[3] == call + env_turn + call and rb.finish_reasons == ["stop", "stop", "stop", "length"]
    # the learner's view: every token is context, only the model's are trained on, with their logprobs
    ids, attn, resp, rlp = rb.sequences()
    p = int(rb.prompt_lengths[0])
    assert attn[0, p:p + 12].all() and resp[0, p:].tolist()[:12] == rb.loss_mask[0, :12].tolist()
    assert np.all(rlp[resp == 0] == 0) and np.all(rlp[resp == 1] == LP)
    assert TrainBatch.from_rollout(rb, np.zeros(4)).rows()[0]["response"].tolist() == call + answer
    # routing covers the prompt, the model's and the environment's tokens (each token routed to its own id here)
    assert np.array_equal(rb.routing[0, p - len(prompt): p + 12, 0, 0], prompt + call + env_turn + answer)
    assert (rb.routing[0, p + 12:] == -1).all() and rb.weight_version == 7
    # turn 2 re-prefilled rows 0, 1, 3 with the budget left and the token offset of their first new token
    e1 = len(bad) + len(err)
    assert engine.calls == [([0, 1, 2, 3], [48] * 4, [0] * 4), ([0, 1, 3], [41, 48 - e1, 41], [7, e1, 7])]
    s = res.stats
    assert s["rollout/turns_mean"] == (2 + 2 + 1 + 2) / 4 and s["rollout/tool_calls_per_traj"] == 4 / 4
    assert s["rollout/tool_errors"] == 1 / 4 and s["rollout/turn_truncated_frac"] == 1 / 4
    assert s["rollout/env_token_frac"] == (5 + len(err) + 5) / (12 + e1 + 2 + 2 + 9) and s["rollout/tool_s"] >= 0


def test_token_budget_cuts_the_environment_turn_and_refusals():
    (prompt, data), = KeyLookupTask().prompts(1)
    mt = MultiTurn(env="key_lookup", data=(data,))
    rb, stats = run_request(ScriptedEngine(), RolloutRequest(prompts=[prompt], params=SamplingParams(max_new_tokens=6),
                                                             seed=0, sample_index=[0], multiturn=mt), TOK).rb, None
    assert rb.lengths[0] == 6 and rb.loss_mask[0].tolist() == [1] * 2 + [0] * 4 and rb.finish_reasons == ["length"]
    req = RolloutRequest(prompts=[prompt], params=SamplingParams(max_new_tokens=61), seed=0, multiturn=mt)
    with pytest.raises(ValueError, match="--max-prompt-len 64 < longest prompt 4 \\+ --max-new-tokens 61"):
        run_request(ScriptedEngine(), req, TOK)
    with pytest.raises(ValueError, match="without the run's tokenizer"):
        run_request(ScriptedEngine(), req)
    spec = ScriptedEngine()
    spec.speculative = "mtp"
    with pytest.raises(ValueError, match="not supported with --rollout.speculative mtp"):
        run_request(spec, req, TOK)
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurn(env="key_lookup", data=(), max_turns=0)


def test_run_config_env_knobs_and_refusals():
    assert sorted(ENVS) == sorted(ENVIRONMENTS)  # the flag's choices are the registry's names
    cfg = RunConfig.from_overrides([("rollout.env", "key_lookup"), ("rollout.max_turns", 3)])
    assert (cfg.rollout.env, cfg.rollout.max_turns, cfg.rollout.tool_timeout_s) == ("key_lookup", 3, 30.0)
    for over, needle in [({"rollout.env": "web"}, "rollout.env .--rollout.env. must be key_lookup|python_math"),
                         ({"rollout.env": "key_lookup", "rollout.exact": True}, "not combined with --exact-rollout"),
                         ({"rollout.env": "key_lookup", "rollout.speculative": "mtp"}, "--rollout.speculative mtp"),
                         ({"rollout.env": "key_lookup", "algo": "dapo"}, "--algo dapo"),
                         ({"rollout.max_turns": 0}, "max_turns")]:
        with pytest.raises(ValueError, match=needle) as e:
            RunConfig.from_overrides(list(over.items()))
        assert "\n" not in str(e.value)


class _ForcedCall:
    """The task's tokenizer, except that the engine's own first turn (`turn1`, ending with the id it uses as EOS)
    reads as a lookup call: random weights never write one, so the test makes the model's turn the call."""

    def __init__(self, turn1, call_text):
        self.turn1, self.call_text, self.eos_id = list(turn1), call_text, int(turn1[-1])
        self.encode = TOK.encode

    def decode_with_specials(self, ids):
        return self.call_text if list(ids) == self.turn1 else TOK.decode_with_specials(ids)


def test_two_turn_key_lookup_through_the_compiled_engine():
    """A real tiny Sampler (fp32 weights, random init): turn 1 is the engine's own sample, read as a call; the tool
    result is appended and prefilled; turn 2 is the engine's continuation. The trajectory equals one re-prefilled
    generation with the token offset, the model's logprobs and every token's routing (the environment's included)
    equal a full forward of the joined sequence, and the learner's mask holds the model's tokens only."""
    cfg = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8, 0), vocab_size=TOK.vocab_size)
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(3))
    sampler = Sampler(model, weights="fp32", max_prompt_len=48)
    (prompt, data), = KeyLookupTask().prompts(1)
    key, value = data.split("=")
    free = sampler.generate([prompt], SamplingParams(max_new_tokens=32), seed=0).tokens[0].tolist()
    j = next(j for j in range(1, 32) if free[j] not in free[:j])  # the first new id: the turn's "EOS"
    tok = _ForcedCall(free[:j + 1], CALL.format(key))
    sp = SamplingParams(max_new_tokens=32, stop_token_ids=(tok.eos_id,))
    res = run_request(sampler, RolloutRequest(prompts=[prompt], params=sp, seed=0, multiturn=MultiTurn(
        env="key_lookup", data=(data,), max_turns=2)), tok)
    rb, turn1, env_ids = res.rb, tok.turn1, TOK.encode(tool_result_turn([value]))
    ctx = prompt + turn1 + env_ids
    off = len(turn1) + len(env_ids)
    assert off < 32, off  # room left for the engine's second turn
    again = sampler.generate([ctx], sp, seed=0, max_new_tokens_per_row=[32 - off], token_offset=[off])
    turn2 = again.response_lists()[0]
    n = off + len(turn2)
    assert rb.response_lists()[0] == turn1 + env_ids + turn2 and rb.lengths[0] == n
    assert rb.loss_mask[0, :n].tolist() == [1] * len(turn1) + [0] * len(env_ids) + [1] * len(turn2)
    # turn 2 is the random model's own: in the task's small vocabulary it may write the call head (a broken call,
    # answered by nothing: the turn budget is spent, but counted)
    called2 = int(turn2[-1] == tok.eos_id and CALLS_START in TOK.decode_with_specials(turn2))
    assert res.stats["rollout/tool_calls_per_traj"] == 1 + called2
    assert res.stats["rollout/tool_errors"] == called2 / (1 + called2)
    assert rb.final_turns()[0] == turn2
    # the learner's view against a full forward of the joined sequence
    ids, attn, resp, rlp = rb.sequences()
    out = jax.jit(lambda m, i, a: (lambda o: (o.logits, o.routing))(m(i, attention_mask=a)))(
        model, jnp.asarray(ids), jnp.asarray(attn))
    lp = np.take_along_axis(np.asarray(jax.nn.log_softmax(out[0], -1))[:, :-1], ids[:, 1:, None], -1)[..., 0]
    model_tok = resp[:, 1:].astype(bool)
    assert model_tok.sum() == len(turn1) + len(turn2)
    np.testing.assert_allclose(rlp[:, 1:][model_tok], lp[model_tok], atol=1e-5)
    np.testing.assert_allclose(again.logprobs[0, :len(turn2)], rb.logprobs[0, off:n], atol=1e-6)
    assert np.all(rb.logprobs[0, len(turn1):off] == 0)
    real = attn.astype(bool)
    assert np.array_equal(rb.routing[real], np.asarray(out[1])[real]) and (rb.routing[~real] == -1).all()


def test_a_tool_that_never_returns_is_a_timed_out_tool_error(monkeypatch):
    """A tool blocked forever: the rollout stops waiting at `tool_timeout_s`, the row reads one tool error written
    as the environment writes errors (key_lookup's terse "error"), the turn after it runs, and the abandoned tool's
    thread does not hold the rollout."""
    release = threading.Event()
    hang = dataclasses.replace(key_lookup_env(), handlers={"lookup": lambda args, data: release.wait(60) and ""})
    monkeypatch.setitem(ENVIRONMENTS, "hang", lambda **_: hang)
    (prompt, data), = KeyLookupTask().prompts(1)
    req = RolloutRequest(prompts=[prompt] * 2, params=SamplingParams(max_new_tokens=48), seed=0, sample_index=[0, 2],
                         multiturn=MultiTurn(env="hang", data=(data,) * 2, max_turns=2, tool_timeout_s=0.3))
    t0 = time.perf_counter()
    try:
        res = run_request(ScriptedEngine(), req, TOK)
    finally:
        release.set()
    assert time.perf_counter() - t0 < 10
    call, err = TOK.encode(CALL.format(data.split("=")[0])), TOK.encode(tool_result_turn(["error"]))
    # row 0 called, waited 0.3 s, read "error", then answered what it read (policy 0 copies the result); row 2 answered
    assert res.rb.response_lists()[0] == call + err + TOK.encode("error<｜end▁of▁sentence｜>")
    assert res.rb.response_lists()[1] == TOK.encode("0<｜end▁of▁sentence｜>")
    assert res.stats["rollout/tool_errors"] == 1.0 and res.stats["rollout/tool_calls_per_traj"] == 1 / 2  # per call


def test_mpmd_rollout_server_runs_the_turns():
    """An MPMD rollout process (rl/rollout/mpmd.py `RolloutServer`) given the run's tokenizer serves a multi-turn
    request as the one-process service does: the same joined rows, masks and metrics published for the actor."""
    (prompt, data), = KeyLookupTask().prompts(1)
    req = RolloutRequest(prompts=[prompt] * 3, params=SamplingParams(max_new_tokens=48), seed=0,
                         sample_index=[0, 1, 2], multiturn=MultiTurn(env="key_lookup", data=(data,) * 3, max_turns=2))

    class Channel:  # the host channel of one rollout process: the actor's commands in order, results kept
        def __init__(self, cmds):
            self.cmds, self.published = cmds, {}

        def receive(self, key, role, what):
            return self.cmds[int(key.split("/")[1])]

        def publish(self, key, value):
            self.published[key] = value

    layout = types.SimpleNamespace(process=1, rollout_processes=(1,))
    channel = Channel([{"op": "generate", "request": req}, {"op": "stop"}])
    served = RolloutServer(ScriptedEngine(), layout, channel, pusher=None, tokenizer=TOK).serve()
    got = channel.published[f"result/{req.tag}"]["result"]
    ref = run_request(ScriptedEngine(), req, TOK)
    timing = "rollout/tool_s"
    assert served["generate"] == 1 and {k: v for k, v in got.stats.items() if k != timing} == \
        {k: v for k, v in ref.stats.items() if k != timing} and got.stats["rollout/turns_mean"] > 1
    for f in ("tokens", "logprobs", "loss_mask", "routing", "lengths"):
        np.testing.assert_array_equal(getattr(got.rb, f), getattr(ref.rb, f), err_msg=f)
    with pytest.raises(ValueError, match="without the run's tokenizer"):
        RolloutServer(ScriptedEngine(), layout, Channel([{"op": "generate", "request": req}]), pusher=None).serve()
