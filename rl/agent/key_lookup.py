"""Key lookup: the prompt names a key, a `lookup` tool returns its value, the reward checks the value is copied.

The smallest task where a tool is the only way to the reward: every prompt draws its own random value (seeded by
the prompt's index), so nothing in the prompt or the weights predicts it; a model must call `lookup` and then copy
the tool's answer. Transcript of a perfect trajectory, in DeepSeek-V4's chat format (rl/data/chat_dsv4.py), chat mode:

    <bos>{tools section}<｜User｜>key 7<｜Assistant｜></think>                                    (prompt)
    \\n\\n<｜DSML｜tool_calls>...name="key" string="true">7</｜DSML｜parameter>...</｜DSML｜tool_calls><eos>    (model)
    <｜User｜><tool_result>4</tool_result><｜Assistant｜></think>                                  (environment)
    4<eos>                                                                                        (model)

Sized so the tiny model learns it from random init (benchmarks/README.md, "Multi-turn agentic rollouts"):
- `key_lookup_tokenizer()` (rl/agent/pieces.py), 35 ids: the markup as whole pieces, "key " and "error" as pieces,
  the call head alone and the call head followed by each digit (10 pieces, as a BPE trained on calls would merge
  them), the digits and "?" as characters.
- Keys are digits: "0".."9" for up to 10 keys (zero-padded "00".."99" up to 100). The prompt is 7 ids; the right
  call is 3 (call head with the key, call tail, EOS), so the model's first free choice is already the key: a
  random policy writes the right call head 1 time in 35, and the copy it has to learn (the key's id, 3 positions
  back, to the head piece of that key) is where the signal is. The environment's turn is 5 + the value's digits,
  the answer the digits + EOS; the key and the value are both 3 ids before the position that writes them.
- Errors are terse (`Environment.terse_errors`: a broken call is answered by the one-piece "error").
- The training run's side (not this module): 4 keys (`rl.run.env_task.ENV_KEYS`), and benchmarks/agentic.py's defaults
  of 12 new tokens (a perfect trajectory is 3 + 6 + 2) and an entropy bonus 0.02 (without one the first lesson,
  "write a call head", spread to every position and every row of a group wrote the same turn).
History: keys "k0".."k9" as "k" + a digit (a 5-id call: head, "k", digit, tail, EOS) let the policy learn the
constant units (head, "k") and collapse before the key's digit, the first unit to copy, was ever sampled right.

Reward, shaped (as gsm8k+format is; `rl.agent.env.reward`): `CALL_WEIGHT x call_progress + (1 - CALL_WEIGHT) x
[call_progress == 1] x value_reward`, in [0, 1], 1 only for the right call followed by the exact value; an answer
without the right call earns nothing (it can only be a guess: without the gate a guessed value's partial credit
outweighs the first steps of the call and the policy learned to stop calling).
- `value_reward` (per-position partial credit like the built-in digit task, rl/data/tasks.py) on the final answer:
  (right digits at their positions / n) x (0.5 + 0.5 x [answer has exactly n characters]);
- `call_progress` on the first model turn: how much of the right call it wrote, in order (call head, the key, call
  tail, EOS; one unit each, the prefix that matches / all units). A credit for calling right, not for the value:
  the value is still only in the tool's answer. The key comes before the tail and the EOS on purpose: a wrong key
  earns the head's unit only, so the call's constant units are learned on right keys and cannot pull the policy
  onto one fixed call (a form credit for a well-formed call with any key did: every group wrote the same key).
  Without any call credit a well-formed call is ~V^-3 at random init and no group learns from it.
Row data (the dataset's reference) is "KEY=VALUE".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rl.agent.env import Environment, ToolError, reset
from rl.agent.pieces import PieceTokenizer
from rl.data.chat_dsv4 import (ASSISTANT, CALLS_CLOSE, CALLS_START, DSML, END_THINK, EOS, RESULT_CLOSE, RESULT_OPEN,
                          THINK, USER, render_deepseek_v4, render_tools)

LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Return the value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key, e.g. 7"}},
                   "required": ["key"]}}}
CALL_HEAD = f'{CALLS_START}>\n<{DSML}invoke name="lookup">\n<{DSML}parameter name="key" string="true">'
CALL_TAIL = f"</{DSML}parameter>\n</{DSML}invoke>\n{CALLS_CLOSE}"
CALL_WEIGHT = 0.2  # the shaped reward's weight on call_progress (module docstring)


def split_data(data: str) -> tuple[str, str]:
    """"KEY=VALUE" -> (key, value). Raises ValueError naming the record for anything else."""
    key, sep, value = data.partition("=")
    if not sep or not key or not value:
        raise ValueError(f"key_lookup: row data must be 'KEY=VALUE', got {data!r}")
    return key, value


def lookup(args: dict, data: str) -> str:
    """The `lookup` tool: the row's value for its key; another key or a missing argument is a ToolError."""
    key, value = split_data(data)
    asked = args.get("key")
    if not isinstance(asked, str):
        raise ToolError("lookup needs a string argument 'key'")
    if asked.strip() != key:
        raise ToolError(f"no such key {asked.strip()!r}")
    return value


def value_reward(answer: str, data: str) -> float:
    """Partial credit for copying the value into the final answer (module docstring)."""
    _, value = split_data(data)
    got = answer.strip()
    right = sum(a == b for a, b in zip(got, value))
    return right / len(value) * (0.5 + 0.5 * (len(got) == len(value)))


def call_progress(first_turn: str, data: str) -> float:
    """The share of the right call that the first model turn (special tokens kept) writes, in order: units call
    head, the key, call tail, EOS (module docstring); the matching prefix counts, 1.0 for exactly the right call."""
    key, _ = split_data(data)
    units = [CALL_HEAD, key, CALL_TAIL, EOS]
    rest, done = first_turn, 0
    for u in units:
        if not rest.startswith(u):
            break
        rest, done = rest[len(u):], done + 1
    return done / len(units)


def key_lookup_env(thinking: bool = False) -> Environment:
    """The key-lookup Environment: one `lookup` tool, terse errors, the shaped reward of the module docstring."""
    return Environment(name="key_lookup", tools=(LOOKUP_TOOL,), handlers={"lookup": lookup},
                       reward_fn=value_reward, thinking=thinking, shaping_fn=call_progress,
                       shaping_weight=CALL_WEIGHT, terse_errors=True)


def key_lookup_tokenizer() -> PieceTokenizer:
    """The task's PieceTokenizer (26 ids): the tools section, the chat markers, the call head / tail, the result
    tags, "key " and "error" as whole pieces; the digits, "k" and "?" as characters; any other character of an
    environment's text encodes as '?' (the environment's errors are terse, so none is expected)."""
    pieces = ["\n\n" + render_tools([LOOKUP_TOOL]), USER, ASSISTANT, THINK, END_THINK, CALL_HEAD, CALL_TAIL,
              RESULT_OPEN, RESULT_CLOSE, "key ", "error", *(CALL_HEAD + d for d in "0123456789")]
    return PieceTokenizer(pieces, "0123456789?", unknown="?")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyLookupTask:
    """Prompts of the task: key "k{i}" (i < n_keys; i zero-padded to the digits of n_keys - 1) with a random
    `value_digits`-digit value per prompt.

    prompts(n, start) -> [(prompt token ids, data "KEY=VALUE")]: prompt j (global index start + j) draws its key
    and value from a generator seeded by (seed, index), so any prompt is reproducible alone.
    Raises ValueError naming the field for out-of-range knobs."""

    n_keys: int = 10
    value_digits: int = 4
    seed: int = 0
    thinking: bool = False

    def __post_init__(self):
        if not 1 <= self.n_keys <= 100:
            raise ValueError(f"KeyLookupTask.n_keys must be in 1..100, got {self.n_keys}")
        if not 1 <= self.value_digits <= 9:
            raise ValueError(f"KeyLookupTask.value_digits must be in 1..9, got {self.value_digits}")

    @property
    def tokenizer(self) -> PieceTokenizer:
        return key_lookup_tokenizer()

    def data(self, index: int) -> str:
        rng = np.random.default_rng([self.seed, index])
        key = f"{int(rng.integers(self.n_keys)):0{len(str(self.n_keys - 1))}d}"
        value = "".join(str(d) for d in rng.integers(0, 10, self.value_digits))
        return f"{key}={value}"

    def prompts(self, n: int, start: int = 0) -> list[tuple[list[int], str]]:
        tok, env = self.tokenizer, key_lookup_env(self.thinking)
        out = []
        for index in range(start, start + n):
            data = self.data(index)
            msgs = reset(env, f"key {split_data(data)[0]}", data)
            out.append((tok.encode(render_deepseek_v4(msgs, thinking=self.thinking)), data))
        return out
