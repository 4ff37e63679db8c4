"""Key lookup: the prompt names a key, a `lookup` tool returns its value, the reward checks the value is copied.

The smallest task where a tool is the only way to the reward: every prompt draws its own random value (seeded by
the prompt's index), so nothing in the prompt or the weights predicts it; a model must call `lookup` and then copy
the tool's answer. Transcript of a perfect trajectory, in DeepSeek-V4's chat format (rl/data/chat_dsv4.py), chat mode,
with the task's token boundaries (`|`):

    <bos> | {tools section} | <｜User｜>key  | 7<｜Assistant｜></think>                              (prompt, 4 ids)
    \n\n<｜DSML｜tool_calls>...name="key" string="true">7</｜DSML｜parameter>...</｜DSML｜tool_calls> | <eos>   (model, 2)
    <｜User｜><tool_result> | 4</tool_result><｜Assistant｜></think>                              (environment, 2)
    4 | <eos>                                                                                        (model, 2)

Sized so the tiny model learns it from random init (benchmarks/README.md, "Multi-turn agentic rollouts"):
- `key_lookup_tokenizer(n_keys)` (rl/agent/pieces.py; 41 ids for 4 keys): the markup merged into whole pieces as a
  BPE trained on these transcripts would merge it: the tools section, "<｜User｜>key ", **each key merged with the
  prompt's closer** ("7<｜Assistant｜></think>"), the tool result's opener "<｜User｜><tool_result>", **each digit
  merged with the tool result's closer** ("4</tool_result><｜Assistant｜></think>"), the closers alone, the
  thinking-mode markup, "error", and **one piece per whole call** (call head + key + call tail); the digits and "?"
  as characters (any other character of an environment's text encodes as "?"; errors are terse, so none is
  expected).
- So the two things to learn are both read off the last id the model sees: the call's piece from the key's merged
  closer, the answer's (last) digit from the value's merged closer. The value is still only in the tool's answer
  (random per prompt), and the tool turn's id is one of 10 per digit, so the answer is a copy of what the tool
  returned, never a guess from the prompt. Keys are one digit ("0".."9", up to 10 keys); the right call is 2 ids
  (the call's piece, EOS).
- Errors are terse (`Environment.terse_errors`: a wrong key is answered by the one-piece "error").
- The training run's side (not this module): 4 keys (`rl.run.env_task.ENV_KEYS`), benchmarks/agentic.py's defaults.
History (benchmarks/README.md): a 5-id call (head, "k", digit, tail, EOS), a 3-id call (head with the key, tail,
EOS), then the call as one piece with the key and the value each 2 ids back behind one-piece closers: the policy
learned the call's constant units, then the key, but not (in the steps run) the value; with the format credit (below)
and a final turn that must answer (`rl.agent.env.final_answer`) it copies values (benchmarks/agentic.py: learns).

Reward, shaped (as gsm8k+format is; `rl.agent.env.reward`): `CALL_WEIGHT x call_progress + (1 - CALL_WEIGHT) x
[call_progress == 1] x value_reward`, in [0, 1], 1 only for the right call followed by the exact value; an answer
without the right call earns nothing (it can only be a guess: without the gate a guessed value's partial credit
outweighs the call and the policy learned to stop calling). With CALL_WEIGHT 0.2 and FORMAT_CREDIT 0.1, a run above
0.5 copies values.
- `value_reward` on the final answer: FORMAT_CREDIT x [the answer is n digits] + (1 - FORMAT_CREDIT) x (right digits
  at their positions / n) x (0.5 + 0.5 x [answer has exactly n characters]) (per-position partial credit like the
  built-in digit task, rl/data/tasks.py). The format credit makes answering after the tool's result better than
  calling again (without it both earned 0 unless the digit was right, and the policy kept calling: the fourth run);
  the best value-blind policy (the right call, then any n digits) scores CALL_WEIGHT + (1 - CALL_WEIGHT) x
  (FORMAT_CREDIT + (1 - FORMAT_CREDIT) / 10) = 0.352 (`value_blind_best`), so a run above 0.5 copies values;
- `call_progress` on the first model turn: the prefix of the right turn it wrote, in units (the call with the right
  key, EOS): 0, 1/2 or 1. A credit for calling right, not for the value: the value is only in the tool's answer.
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
FORMAT_CREDIT = 0.1  # value_reward's share for an answer of the value's length in digits, right or not (docstring)
PROMPT = "key "  # the user message is PROMPT + the key
KEYS = DIGITS = "0123456789"  # the keys the task can name (KeyLookupTask.n_keys <= 10); the value's digits


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
    exact = len(got) == len(value)
    shaped = exact and all(c in DIGITS for c in got)
    return FORMAT_CREDIT * shaped + (1 - FORMAT_CREDIT) * right / len(value) * (0.5 + 0.5 * exact)


def value_blind_best() -> float:
    """The expected reward of the best policy that does not read the tool's answer: the right call, then any answer
    of the value's length in digits (each digit right with probability 1/10)."""
    return CALL_WEIGHT + (1 - CALL_WEIGHT) * (FORMAT_CREDIT + (1 - FORMAT_CREDIT) / len(DIGITS))


def call_progress(first_turn: str, data: str) -> float:
    """The share of the right first turn that the first model turn (special tokens kept) writes, in order: units
    the call with the row's key (call head + key + call tail), EOS (module docstring); 1.0 for exactly the right
    call."""
    key, _ = split_data(data)
    units = [CALL_HEAD + key + CALL_TAIL, EOS]
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


def key_lookup_tokenizer(n_keys: int = len(KEYS)) -> PieceTokenizer:
    """The task's PieceTokenizer for keys KEYS[:n_keys] (module docstring; 40 ids for 4 keys, 52 for 10): the tools
    section, "<｜User｜>key ", each key merged with the prompt's closer, the tool result's opener, each digit merged
    with the tool result's closer, the closers alone, the thinking-mode markup, "error", one piece per whole call;
    the digits and "?" as characters; any other character of an environment's text encodes as '?'."""
    keys, closer = KEYS[:n_keys], RESULT_CLOSE + ASSISTANT + END_THINK
    pieces = ["\n\n" + render_tools([LOOKUP_TOOL]), USER + PROMPT, *(k + ASSISTANT + END_THINK for k in keys),
              ASSISTANT + END_THINK, ASSISTANT + THINK, END_THINK, USER + RESULT_OPEN, *(d + closer for d in DIGITS),
              closer, RESULT_CLOSE + ASSISTANT + THINK, "error", *(CALL_HEAD + k + CALL_TAIL for k in keys)]
    return PieceTokenizer(pieces, DIGITS + "?", unknown="?")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyLookupTask:
    """Prompts of the task: key "{i}" (i < n_keys <= 10) with a random `value_digits`-digit value per prompt.

    prompts(n, start) -> [(prompt token ids, data "KEY=VALUE")]: prompt j (global index start + j) draws its key
    and value from a generator seeded by (seed, index), so any prompt is reproducible alone.
    Raises ValueError naming the field for out-of-range knobs."""

    n_keys: int = 10
    value_digits: int = 4
    seed: int = 0
    thinking: bool = False

    def __post_init__(self):
        if not 1 <= self.n_keys <= len(KEYS):
            raise ValueError(f"KeyLookupTask.n_keys must be in 1..{len(KEYS)}, got {self.n_keys}")
        if not 1 <= self.value_digits <= 9:
            raise ValueError(f"KeyLookupTask.value_digits must be in 1..9, got {self.value_digits}")

    @property
    def tokenizer(self) -> PieceTokenizer:
        return key_lookup_tokenizer(self.n_keys)

    def data(self, index: int) -> str:
        rng = np.random.default_rng([self.seed, index])
        key = KEYS[int(rng.integers(self.n_keys))]
        value = "".join(str(d) for d in rng.integers(0, 10, self.value_digits))
        return f"{key}={value}"

    def prompts(self, n: int, start: int = 0) -> list[tuple[list[int], str]]:
        tok, env = self.tokenizer, key_lookup_env(self.thinking)
        out = []
        for index in range(start, start + n):
            data = self.data(index)
            msgs = reset(env, PROMPT + split_data(data)[0], data)
            out.append((tok.encode(render_deepseek_v4(msgs, thinking=self.thinking)), data))
        return out
