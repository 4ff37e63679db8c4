"""Math rewards beyond GSM8K: boxed answers, DAPO's "Answer:" line, AIME integers; the `--reward` table.

Reward functions (pure `fn(response_text, reference) -> float` in {0, 1}, module level so that they pickle into
the `rl.data.rewards.RewardPool` worker, which gives every call its time limit; model output is never evaluated as
code: plain numbers are compared as `decimal.Decimal`, anything else goes through math-verify's LaTeX/sympy
parser with its signal timeouts off, inside the worker):

    name          final answer taken from the response                         compared
    math          the last `\\boxed{...}` (none: 0)                             number / math-verify equivalence
    dapo          the last "Answer: ..." line (DAPO-Math-17K's instruction),   number / math-verify equivalence
                  else the last `\\boxed{...}`
    aime          the last `\\boxed{...}`, else the last "Answer:" line; must   integer equality (no sympy)
                  be an integer ("034", "$34$", "34." are 34)
    gsm8k         rl.data.rewards.gsm8k_reward: after "####", else boxed, else the last number
    gsm8k+format  0.9 x gsm8k + 0.1 x a final "#### <n>" line

DAPO (arXiv 2503.14476) and veRL's `math_dapo` score +1 / -1; these score 1 / 0. With GRPO's group
normalisation (mean and std) the advantages are the same for any affine map a*r + b (a > 0); with Dr.GRPO (no
std division) they are half as large as with +1 / -1.

Prompt-independent best (`prompt_independent_best`): the best expected reward of one fixed response over a
dataset. Every reward above reads one final answer, so a fixed response is right exactly on the references
equal to its answer: the best is the frequency of the most common reference (plus the format share for
gsm8k+format, which any response ending in "#### <n>" earns). References are grouped by exact number, else by
text, so for symbolic answers that math-verify would merge this is a lower bound. The run logs it once; a
reward curve must rise clearly above it before the policy is reading the prompt.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_math_rewards.py`.
"""

from __future__ import annotations

import collections
import decimal
import re
from collections.abc import Callable, Sequence

from rl.data.answers import answer_line, answers_equal, boxed_answer, plain_decimal, reference_answer
from rl.config.run import REWARDS
from rl.data.rewards import combine_rewards, format_reward, gsm8k_reward


_INT_RE = re.compile(r"[+-]?\d+")


def math_reward(response_text: str, reference: str) -> float:
    """1.0 if the last `\\boxed{}` of the response equals `reference` (number, or math-verify), else 0.0.

    No time limit here: run it through `rl.data.rewards.compute_rewards`. Raises TypeError on non-strings.
    """
    gold = reference_answer(reference)
    pred = boxed_answer(response_text)
    return float(pred is not None and bool(gold) and answers_equal(pred, gold))


def dapo_reward(response_text: str, reference: str) -> float:
    """1.0 if the response's last "Answer: ..." line (else its last `\\boxed{}`) equals `reference`, else 0.0
    (DAPO-Math-17K asks for "Answer: $Answer" on the last line). Raises TypeError on non-strings."""
    gold = reference_answer(reference)
    pred = answer_line(response_text)
    if pred is None:
        pred = boxed_answer(response_text)
    return float(pred is not None and bool(gold) and answers_equal(pred, gold))


def _as_int(text: str | None) -> int | None:
    if text is None:
        return None
    s = text.replace(",", "").strip()
    return int(s) if _INT_RE.fullmatch(s) else None


def aime_reward(response_text: str, reference: str) -> float:
    """1.0 if the response's final answer (last `\\boxed{}`, else last "Answer:" line) is the integer
    `reference` ("034" == "34"), else 0.0. No sympy. Raises TypeError on non-strings, ValueError if the
    reference is not an integer."""
    gold = _as_int(reference_answer(reference))
    if gold is None:
        raise ValueError(f"aime_reward: reference {reference!r} is not an integer")
    if not isinstance(response_text, str):
        raise TypeError(f"response must be a string, got {type(response_text).__name__}")
    pred = _as_int(boxed_answer(response_text) or answer_line(response_text))
    return float(pred is not None and pred == gold)


def make_reward(name: str) -> Callable[[str, str], float]:
    """`--reward` name -> picklable reward function. ("auto" and "task" are resolved by the caller.)

    Raises ValueError naming the flag for an unknown name.
    """
    table = {"gsm8k": gsm8k_reward, "math": math_reward, "dapo": dapo_reward, "aime": aime_reward,
             "gsm8k+format": combine_rewards([gsm8k_reward, format_reward], [0.9, 0.1])}
    if name not in table:
        raise ValueError(f"--reward must be one of {REWARDS}, got {name!r}")
    return table[name]


def _answer_class(reference: str) -> str:
    s = reference_answer(reference)
    d = plain_decimal(s)
    return str(d.normalize()) if isinstance(d, decimal.Decimal) else s


def prompt_independent_best(name: str, references: Sequence[str]) -> float:
    """Best expected reward of one fixed response over `references` (module docstring), in [0, 1].

    Raises ValueError on an empty list or an unknown reward name.
    """
    if not references:
        raise ValueError("prompt_independent_best needs at least one reference")
    if name not in REWARDS or name in ("auto", "task"):
        raise ValueError(f"prompt_independent_best: no figure for reward {name!r}")
    top = collections.Counter(_answer_class(r) for r in references).most_common(1)[0][1] / len(references)
    return 0.1 + 0.9 * top if name == "gsm8k+format" else top
