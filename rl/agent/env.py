"""Environments: what a multi-turn rollout talks to between generations, and their registry.

An environment is a frozen description (`Environment`): its tools (OpenAI-format schemas, rendered on the system
message in DeepSeek-V4's format, rl/data/chat_dsv4.py), one Python function per tool, and a reward function. Three
calls, all pure functions of the environment and a row's `data` (the string the dataset carries as the row's reference),
so a trajectory is reproducible from its prompt and its sampled tokens (resume regenerates it bitwise):

    messages = reset(env, prompt, data)            # the conversation the prompt renders: [system + tools, user]
    result = step(env, completion_text, data)      # the model's turn -> tool messages (or done) + counters
    r = reward(env, final_text, data, first_turn)  # the last assistant turn (+ the first: shaping) -> [0, 1]

`step` parses the model's turn (`rl.data.chat_dsv4.parse_completion`): no call block -> done; calls -> each is run
(`handlers[name](arguments, data)`) and answered by one tool message, in call order; an unknown tool, arguments
that are not a JSON object, a malformed call block or a handler that raises become a tool message "error: ..."
that the model reads (counted in `errors`), never an exception: a tool cannot end the run. Tools that need
isolation (Python code) run it themselves (rl/agent/sandbox.py); the rollout runs `step` in a thread pool with a
per-call timeout (rl/rollout/multiturn.py).

The registry of named environments (`--rollout.env`) is rl/agent/registry.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping

from rl.data.chat_dsv4 import CALLS_START, EOS, ToolCallError, parse_completion

ToolFn = Callable[[dict, str], str]  # (arguments, row data) -> result text; raises ToolError for an error result


class ToolError(Exception):
    """A tool's own failure (bad argument, sandbox stop): its message becomes the tool result "error: ..."."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Environment:
    """name; tools: OpenAI-format schemas ({"type": "function", "function": {name, description, parameters}});
    handlers: tool name -> ToolFn; reward_fn: (final answer text, row data) -> float in [0, 1]; system: the system
    text before the tools section; thinking: the chat's thinking mode (DeepSeek-V4's `<think>` switch);
    shaping_fn: (first model turn text, special tokens kept, row data) -> float in [0, 1], a shaped credit for how
    the trajectory started (e.g. how much of the right tool call it wrote), weighted `shaping_weight` in [0, 1) in
    `reward`; terse_errors: every error result is the bare text "error" (a short environment turn for a task whose
    token budget is small; the counters still count the errors).
    Raises ValueError when a tool has no handler, or for a shaping_weight outside [0, 1) or without a shaping_fn."""

    name: str
    tools: tuple[dict, ...]
    handlers: Mapping[str, ToolFn]
    reward_fn: Callable[[str, str], float]
    system: str = ""
    thinking: bool = False
    shaping_fn: Callable[[str, str], float] | None = None
    shaping_weight: float = 0.0
    terse_errors: bool = False

    def __post_init__(self):
        if not 0.0 <= self.shaping_weight < 1.0 or (self.shaping_weight > 0) != (self.shaping_fn is not None):
            raise ValueError(f"Environment {self.name!r}: shaping_weight must be in [0, 1) and > 0 exactly when "
                             f"shaping_fn is set, got {self.shaping_weight}")
        names = [t["function"]["name"] for t in self.tools]
        missing = sorted(set(names) - set(self.handlers))
        if missing:
            raise ValueError(f"Environment {self.name!r}: tools {missing} have no handler")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn: `messages` (tool messages {"role": "tool", "tool_call_id",
    "content"} in call order; empty when done), `done` (the turn made no call: it is the final answer), `calls`
    (tool calls made), `errors` (calls answered with an error), `tool_s` (seconds spent in the handlers)."""

    messages: tuple[dict, ...]
    done: bool
    calls: int = 0
    errors: int = 0
    tool_s: float = 0.0

    @property
    def contents(self) -> list[str]:
        return [m["content"] for m in self.messages]


def reset(env: Environment, prompt: str, data: str = "") -> list[dict]:
    """The conversation of a prompt: [system (env.system + the tools), user (prompt)]. `data` is accepted for
    environments whose first turn depends on it (none today)."""
    del data
    return [{"role": "system", "content": env.system, "tools": list(env.tools)}, {"role": "user", "content": prompt}]


def error_result(message: str) -> str:
    """The content of a tool message that reports an error (one line)."""
    return "error: " + " ".join(str(message).split())


def _run_call(env: Environment, call: dict, data: str) -> tuple[str, bool]:
    fn = call["function"]
    handler = env.handlers.get(fn["name"])
    if handler is None:
        return error_result(f"unknown tool {fn['name']!r}; tools: {sorted(env.handlers)}"), True
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = None
    if not isinstance(args, dict):
        return error_result(f"arguments of {fn['name']!r} are not a JSON object: {fn['arguments'][:80]!r}"), True
    try:
        return handler(args, data), False
    except ToolError as e:
        return error_result(str(e)), True
    except Exception as e:  # noqa: BLE001  a handler's bug is the model's error result, not a dead run
        return error_result(f"{type(e).__name__}: {e}"), True


def step(env: Environment, completion: str, data: str = "") -> StepResult:
    """One model turn (its generated text, special tokens kept, ending with the EOS) -> the environment's answer
    (module docstring). Never raises for anything in `completion`."""
    try:
        message = parse_completion(completion, thinking=env.thinking)
    except ToolCallError as e:
        if CALLS_START not in completion:
            return StepResult(messages=(), done=True)  # not a tool call: the (malformed) final answer
        bad = {"role": "tool", "tool_call_id": "call_0", "content": error_result(e)}
        return StepResult(messages=(_terse(env, bad),), done=False, calls=1, errors=1)
    if not message["tool_calls"]:
        return StepResult(messages=(), done=True)
    t0, out, errors = time.perf_counter(), [], 0
    for k, call in enumerate(message["tool_calls"]):
        content, failed = _run_call(env, call, data)
        errors += failed
        out.append({"role": "tool", "tool_call_id": f"call_{k}", "content": content})
    return StepResult(messages=tuple(_terse(env, m) for m in out), done=False, calls=len(out), errors=errors,
                      tool_s=time.perf_counter() - t0)


def timed_out(env: Environment, seconds: float) -> StepResult:
    """The step of a model turn whose tools did not answer within `seconds` (the rollout stopped waiting): one
    tool error the model reads, as the environment writes errors (terse or not), counted as a call and an error."""
    message = {"role": "tool", "tool_call_id": "call_0", "content": error_result(f"tool timed out after {seconds:g} s")}
    return StepResult(messages=(_terse(env, message),), done=False, calls=1, errors=1, tool_s=seconds)


def _terse(env: Environment, message: dict) -> dict:
    """A tool message as the environment writes it: with `terse_errors`, an error result is just "error"."""
    if env.terse_errors and message["content"].startswith("error: "):
        return {**message, "content": "error"}
    return message


def final_answer(env: Environment, text: str) -> str:
    """The answer content of a final assistant turn (its reasoning and EOS removed); a turn that calls a tool, or
    starts a call block before any EOS, answered nothing: "" (cut by the turn or token budget while asking for a
    tool; any text before its calls is not an answer); another turn that does not parse (cut by the token budget) is
    its text up to any EOS."""
    head = text.split(EOS)[0]
    if CALLS_START in head:
        return ""
    try:
        return parse_completion(text, thinking=env.thinking)["content"]
    except ToolCallError:
        return head


def reward(env: Environment, final_text: str, data: str, first_turn: str | None = None) -> float:
    """The reward of a trajectory: `env.reward_fn` on the answer of its last assistant turn (`final_answer`); with
    a `shaping_fn`, s = `shaping_fn(first_turn, data)` (`first_turn`: the trajectory's first model turn, default
    `final_text`) and w x s + (1 - w) x [s == 1] x that (w = `shaping_weight`): the answer counts only once the
    shaped start is complete (key_lookup: the right call was made, so a value cannot be guessed for credit), and 1
    needs both."""
    r = float(env.reward_fn(final_answer(env, final_text), data))
    if env.shaping_fn is None:
        return r
    s = float(env.shaping_fn(final_text if first_turn is None else first_turn, data))
    return env.shaping_weight * s + (1.0 - env.shaping_weight) * r * (s >= 1.0)
