"""rl/data/math_rewards.py: boxed answers, DAPO's "Answer:" line, AIME integers; math-verify equivalence; the worker's
time limit and no evaluation of model output; prompt-independent best scores; the --reward table.

    .venv/bin/python -m pytest -q tests/rl/test_math_rewards.py
"""

from __future__ import annotations

import pickle

import pytest

from rl.data.answers import answer_line, boxed_answer
from rl.config.run import REWARDS
from rl.data.math_rewards import aime_reward, dapo_reward, make_reward, math_reward, prompt_independent_best
from rl.data.rewards import RewardPool, compute_rewards, gsm8k_reward


def test_extraction():
    assert boxed_answer(r"so \boxed{12} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert boxed_answer(r"\boxed{$34$}") == "34" and boxed_answer("no box") is None
    assert answer_line("work\nAnswer: $34$.\n") == "34"
    assert answer_line("answer:  \\boxed{7}") == "7"
    assert answer_line("Answer: 3\nthen Answer: 5") == "5" and answer_line("nothing") is None


def test_one_answer_parser_for_every_math_reward():
    """gsm8k, math and dapo read a boxed answer and a reference through the same `rl.data.answers` cleaning. They
    disagreed on a boxed `\\text{}` answer while gsm8k had its own extraction (0 for gsm8k, 1 for math / dapo)."""
    for response, reference in ((r"\boxed{\text{18 apples}}", "18"), (r"so \boxed{$18$.}", r"\text{18}")):
        assert gsm8k_reward(response, reference) == math_reward(response, reference) == 1.0
        assert dapo_reward(response, reference) == 1.0


@pytest.mark.parametrize("fn, response, reference, want", [
    (math_reward, r"... so \boxed{34}.", "34", 1.0),
    (math_reward, r"\boxed{0.5}", r"\frac{1}{2}", 1.0),           # math-verify equivalence
    (math_reward, r"\boxed{\frac{2}{4}}", "1/2", 1.0),
    (math_reward, "Answer: 34", "34", 0.0),                       # math: boxed only
    (math_reward, r"\boxed{35}", "34", 0.0),
    (dapo_reward, "Let me think.\nAnswer: 34", "34", 1.0),
    (dapo_reward, r"Answer: $\frac{1}{2}$", "0.5", 1.0),
    (dapo_reward, r"no line but \boxed{34}", "34", 1.0),          # DAPO falls back to boxed
    (dapo_reward, "Answer: 33\n", "34", 0.0),
    (dapo_reward, "the answer is 34", "34", 0.0),                 # a bare number is not an answer
    (aime_reward, r"\boxed{034}", "34", 1.0),
    (aime_reward, "Answer: 204.", "204", 1.0),
    (aime_reward, r"\boxed{204.5}", "204", 0.0),
    (aime_reward, "204", "204", 0.0),
])
def test_rewards(fn, response, reference, want):
    assert fn(response, reference) == want


def test_reference_types_and_errors():
    with pytest.raises(TypeError):
        math_reward(r"\boxed{1}", 1)
    with pytest.raises(ValueError, match="not an integer"):
        aime_reward(r"\boxed{1}", "x^2")
    with pytest.raises(ValueError, match="--reward"):
        make_reward("nope")
    for name in REWARDS:
        if name not in ("auto", "task"):
            fn = make_reward(name)
            assert pickle.loads(pickle.dumps(fn))("x", "1") == 0.0  # picklable: it runs in the reward worker


def test_model_output_is_never_evaluated_and_time_limited(tmp_path):
    """A response that is code scores 0 without running; one that would make sympy build a huge number is cut off
    by the worker's deadline (status timeout), and the next call still works."""
    marker = tmp_path / "ran"
    code = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    with RewardPool(1) as pool:
        r, m = compute_rewards(math_reward, [rf"\boxed{{{code}}}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{4}"],
                               ["1", "2", "4"], timeout_s=3.0, pool=pool)
    assert not marker.exists()
    assert r.tolist() == [0.0, 0.0, 1.0]
    assert m["reward/timeouts"] == 1.0


def test_prompt_independent_best():
    refs = ["34", "034", "12", "7", "\\frac{1}{2}"]
    assert prompt_independent_best("aime", refs) == pytest.approx(2 / 5)  # 34 == 034
    assert prompt_independent_best("gsm8k+format", ["a #### 3", "b #### 3", "#### 4", "5"]) == \
        pytest.approx(0.1 + 0.9 * 0.5)
    with pytest.raises(ValueError):
        prompt_independent_best("auto", refs)
