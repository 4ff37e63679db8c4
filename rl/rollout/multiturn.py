"""Multi-turn rollout: generation interleaved with an environment's tool calls, turn-synchronous, behind the rollout
contract (`RolloutRequest.multiturn`, rl/rollout/service.py::run_request).

    turn 1   generate every row from its prompt (the engine's `generate`, jitted as always)
             rows that ended with EOS: decode the turn (special tokens kept) and `rl.agent.env.step` it in a thread
             pool, one task per row, each waited for at most `tool_timeout_s` (a late one is the tool error
             "error: tool timed out"); a row whose turn made no call is done
             rows with calls: append the tool results as the release encodes them (`rl.data.chat_dsv4.tool_result_turn`)
    turn 2.. generate the rows with calls again from prompt + everything so far (a re-prefill of the joined
             context), up to `max_turns` model turns and the request's token budget (`params.max_new_tokens` counts
             every response-side token, the environment's included)

Result: one RolloutBatch row per trajectory in the one layout (rl/algo/batch.py): the response side holds the model's
turns and the environment's turns in order; `loss_mask` [N, T] is 1 on the model's tokens, 0 on the environment's
(their rollout logprob is 0 and they count in no loss term); routing covers every token the rollout prefilled or
generated, the environment's included (each row's routes come from its last generation, whose prefill read them);
a trajectory cut by the token budget or the turn budget finishes as "length". Randomness: turn k of a row draws
with `token_offset` = the response-side tokens before it, so a row's samples do not depend on the other rows.

Stats (`rollout/...`, as rl/algo/metrics.py names the rollout's): turns_mean, tool_calls_per_traj, tool_errors (errors
per call made), tool_s (seconds in tools, summed over rows), turn_truncated_frac (rows stopped by the turn budget
with a call pending), env_token_frac (response-side tokens the environment wrote).

Not here: continuous batching's paused slots (every turn is one `generate`, so a row waiting for its tool holds no
slot), exact mode and speculative decoding (refused with one line), partial rollouts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

import numpy as np

from rl.agent import env as envlib
from rl.agent.registry import make_env
from rl.algo.batch import RolloutBatch
from rl.data.chat_dsv4 import tool_result_turn


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiTurn:
    """What makes a request multi-turn: `env` (a `--rollout.env` name), `data` [N] (each row's data, the dataset's
    reference), `max_turns` >= 1 model turns, `tool_timeout_s` > 0 per row and turn, `workers` >= 1 tool threads.
    Raises ValueError naming the field."""

    env: str
    data: tuple[str, ...]
    max_turns: int = 4
    tool_timeout_s: float = 30.0
    workers: int = 8

    def __post_init__(self):
        object.__setattr__(self, "data", tuple(self.data))
        if self.max_turns < 1:
            raise ValueError(f"MultiTurn.max_turns (--rollout.max_turns) must be >= 1, got {self.max_turns}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"MultiTurn.tool_timeout_s (--rollout.tool_timeout_s) must be > 0, got "
                             f"{self.tool_timeout_s}")
        if self.workers < 1:
            raise ValueError(f"MultiTurn.workers must be >= 1, got {self.workers}")


def _decode(tokenizer, ids) -> str:
    dec = getattr(tokenizer, "decode_with_specials", None)
    return dec(ids) if dec is not None else tokenizer.decode(ids)


def _routes(rb: RolloutBatch, j: int, ctx_len: int) -> np.ndarray:
    """Row j of a generation's routing, unpadded: [ctx_len + its new tokens, L, k]."""
    return rb.routing[j, : ctx_len + int(rb.lengths[j])]  # the joined row's first columns (rl/batch.py)


def generate_multiturn(sampler, tokenizer, prompts: Sequence[Sequence[int]], params, mt: MultiTurn, *, seed: int,
                       step: int = 0, prompt_index=None, sample_index=None) -> tuple[RolloutBatch, dict]:
    """Multi-turn generation (module docstring) -> (RolloutBatch with `loss_mask`, stats).

    sampler: anything with the engine's `generate` (rl/rollout/engine.py) and `max_prompt_len`; tokenizer: the
    run's (`encode`, `eos_id`, and `decode_with_specials` where it has one). Raises ValueError when a prompt plus
    the token budget exceeds the sampler's `max_prompt_len` (a later turn re-prefills the whole context) or when
    `mt.data` does not have one entry per row.
    """
    n, budget = len(prompts), params.max_new_tokens
    if len(mt.data) != n:
        raise ValueError(f"MultiTurn.data has {len(mt.data)} rows for {n} prompts")
    longest = max(len(p) for p in prompts)
    if longest + budget > sampler.max_prompt_len:
        raise ValueError(f"multi-turn rollout: a later turn re-prefills prompt + response; --max-prompt-len "
                         f"{sampler.max_prompt_len} < longest prompt {longest} + --max-new-tokens {budget}")
    env = make_env(mt.env)
    pi = np.arange(n) if prompt_index is None else np.asarray(prompt_index)
    si = np.zeros(n, np.int64) if sample_index is None else np.asarray(sample_index)
    hist = [[] for _ in range(n)]
    mask, lps = [[] for _ in range(n)], [[] for _ in range(n)]
    routes: list[np.ndarray | None] = [None] * n
    turns, calls, errors, tool_s = np.zeros(n, int), 0, 0, 0.0
    turn_cut = np.zeros(n, bool)
    reason = ["length"] * n
    active, first = list(range(n)), None
    # not `with`: its exit waits for every task, so a tool that never returns would hold the rollout past its
    # timeout; a late task is abandoned instead (its thread ends when the tool does)
    pool = ThreadPoolExecutor(max_workers=mt.workers, thread_name_prefix="tools")
    try:
        for turn in range(mt.max_turns):
            if not active:
                break
            ctx = [list(prompts[i]) + hist[i] for i in active]
            rb = sampler.generate(ctx, params, seed=seed, step=step, prompt_index=pi[active],
                                  sample_index=si[active], max_new_tokens_per_row=[budget - len(hist[i]) for i in active],
                                  token_offset=[len(hist[i]) for i in active])
            first = rb if first is None else first
            ended = []
            for j, i in enumerate(active):
                new = rb.tokens[j, :rb.lengths[j]].tolist()
                routes[i] = _routes(rb, j, len(ctx[j]))
                hist[i] += new
                mask[i] += [1] * len(new)
                lps[i] += rb.logprobs[j, :len(new)].tolist()
                turns[i] += 1
                if rb.finish_reasons[j] == "stop" and new and new[-1] == tokenizer.eos_id:
                    ended.append((i, _decode(tokenizer, new)))
            t0 = time.perf_counter()
            futures = [(i, pool.submit(envlib.step, env, text, mt.data[i])) for i, text in ended]
            active = []
            for i, fut in futures:  # each row's tools get tool_timeout_s from their submission
                try:
                    res = fut.result(timeout=max(0.0, t0 + mt.tool_timeout_s - time.perf_counter()))
                except FutureTimeout:
                    res = envlib.timed_out(env, mt.tool_timeout_s)
                calls, errors, tool_s = calls + res.calls, errors + res.errors, tool_s + res.tool_s
                if res.done:
                    reason[i] = "stop"
                    continue
                if turn == mt.max_turns - 1:
                    turn_cut[i] = True  # a call pending when the turn budget ran out
                    continue
                env_ids = tokenizer.encode(tool_result_turn(res.contents, thinking=env.thinking))
                room = budget - len(hist[i])
                hist[i] += env_ids[:room]
                mask[i] += [0] * min(room, len(env_ids))
                lps[i] += [0.0] * min(room, len(env_ids))
                if len(env_ids) < room:
                    active.append(i)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return _batch(first, prompts, budget, hist, mask, lps, routes, reason, sampler), {
        "rollout/turns_mean": float(turns.mean()), "rollout/tool_calls_per_traj": calls / n,
        "rollout/tool_errors": errors / max(calls, 1), "rollout/tool_s": tool_s,
        "rollout/turn_truncated_frac": float(turn_cut.mean()),
        "rollout/env_token_frac": sum(len(m) - sum(m) for m in mask) / max(1, sum(len(m) for m in mask))}


def _batch(first: RolloutBatch, prompts, budget, hist, mask, lps, routes, reason, sampler) -> RolloutBatch:
    """The trajectories in the one layout (rl/batch.py): prompts as the first generation laid them out
    (left-aligned), responses [N, budget], each row's routes at the start of its joined row."""
    n, p = len(prompts), first.prompt_tokens.shape[1]
    tokens, loss_mask = np.zeros((n, budget), np.int32), np.zeros((n, budget), np.int32)
    logprobs = np.zeros((n, budget), np.float32)
    routing = np.full((n, p + budget) + first.routing.shape[2:], -1, np.int32)
    for i in range(n):
        t = len(hist[i])
        tokens[i, :t], loss_mask[i, :t], logprobs[i, :t] = hist[i], mask[i], lps[i]
        r = routes[i]  # prompt + everything up to the end of its last generation
        routing[i, : len(r)] = r
    return RolloutBatch(tokens=tokens, logprobs=logprobs, routing=routing,
                        lengths=np.array([len(h) for h in hist], np.int32), finish_reasons=list(reason),
                        prompt_tokens=first.prompt_tokens, prompt_lengths=first.prompt_lengths,
                        weight_version=sampler.weight_version, loss_mask=loss_mask)
