"""Tests for rl/data/rewards.py: GSM8K answer matching on real lines, format, combination, time limits and errors."""

import functools
import json
import operator

import numpy as np
import pytest

from rl.data.answers import extract_final_answer, reference_answer
from rl.data.prompts import gsm8k_final_answer
from rl.data.rewards import (
    RewardPool,
    RewardStats,
    combine_rewards,
    compute_rewards,
    format_reward,
    gsm8k_reward,
    safe_reward,
)

PATHOLOGICAL = "Let me compute. \\boxed{9^{9^{9^{9}}}}"  # sympy builds a number with billions of digits


@pytest.fixture(scope="module")
def pool():
    with RewardPool(1) as p:
        yield p


@pytest.fixture(scope="module")
def gsm8k_lines(shared_dir):
    with open(shared_dir / "data/gsm8k/test.jsonl") as f:
        return [json.loads(next(f)) for _ in range(3)]


def test_extract_final_answer():
    assert extract_final_answer("so 3 + 4 = 7\n#### 7") == ("7", "####")
    assert extract_final_answer("it is \\boxed{\\frac{1}{2}} or 3") == ("\\frac{1}{2}", "boxed")
    assert extract_final_answer("The answer is 1,250.") == ("1,250", "number")
    assert extract_final_answer("It costs 18, in total") == ("18", "number")
    assert extract_final_answer("no digits") is None
    # "####" and boxed answers cleaned as the math rewards clean theirs (rl.data.answers.clean_answer)
    assert extract_final_answer("#### $18$.") == ("18", "####")
    assert extract_final_answer(r"\boxed{\text{18 apples}}") == ("18 apples", "boxed")
    assert reference_answer("so 6 * 3 = 18\n#### $18$") == "18"
    assert reference_answer(r"\(\frac{1}{2}\)") == r"\frac{1}{2}"


def test_gsm8k_reward_on_real_lines(gsm8k_lines):
    first = gsm8k_lines[0]
    reference = gsm8k_final_answer(first["answer"])
    assert reference == "18"
    for right in ["#### 18", "The answer is 18", "\\boxed{18}", "She makes $18.00 a day.", first["answer"]]:
        assert gsm8k_reward(right, reference) == 1.0, right
    for wrong in ["#### 17", "The answer is 81", "\\boxed{19}", "I do not know", "", "#### 18 + 1 = 19\nso 19"]:
        assert gsm8k_reward(wrong, reference) == 0.0, wrong
    for line in gsm8k_lines:  # each solution scores 1 against its own reference, 0 against another's
        ref = gsm8k_final_answer(line["answer"])
        assert gsm8k_reward(line["answer"], ref) == 1.0
    assert gsm8k_reward(gsm8k_lines[1]["answer"], reference) == 0.0


def test_gsm8k_reward_uses_math_verify_for_expressions():
    assert gsm8k_reward("\\boxed{\\frac{36}{2}}", "18") == 1.0
    assert gsm8k_reward("\\boxed{\\frac{35}{2}}", "18") == 0.0
    assert gsm8k_reward("#### 1,000", "1000") == 1.0
    assert gsm8k_reward("#### 18", "#### 18") == 1.0  # a whole answer field as reference is read after ####


@pytest.mark.parametrize("response, reference", [
    ("#### \u22125", "-5"),            # Unicode minus sign
    ("#### - 5", "-5"),                # spaced sign
    ("#### \u2212 5", "\u22125"),       # both, on both sides
    ("#### 1e3", "1000"),              # scientific notation
    ("#### 2.5E-2", "0.025"),
    ("\\boxed{1e3}", "1000"),
    ("#### 1,234,567", "1234567"),     # thousands separators: comma, space, narrow no-break space
    ("#### 1 234 567", "1234567"),
    ("#### 1\u202f234", "1234"),
    ("#### 18 apples", "18"),          # trailing units
    ("#### $18.00 per day", "18"),
    ("#### 50%", "50"),
    ("The answer is \u22125.", "-5"),   # the last-number fallback reads the Unicode minus and exponents too
    ("So we need 1e3", "1000"),
])
def test_answer_normalisation(response, reference):
    assert gsm8k_reward(response, reference) == 1.0


@pytest.mark.parametrize("response, reference", [
    ("#### \u22125", "5"), ("#### 5", "-5"), ("#### 1e3", "100"), ("#### 1,23", "123"), ("#### 18 + 1 = 19", "18"),
    ("#### 1,000 apples and 2", "1000"),
])
def test_answer_normalisation_keeps_wrong_answers_wrong(response, reference):
    assert gsm8k_reward(response, reference) == 0.0


def test_format_reward():
    assert format_reward("3 + 4 = 7\n#### 7") == 1.0
    assert format_reward("#### -1,250.5  \n") == 1.0
    assert format_reward("The answer is 7") == 0.0
    assert format_reward("#### 7 and more text") == 0.0
    assert format_reward("#### seven") == 0.0


def test_combine_rewards():
    both = combine_rewards([gsm8k_reward, format_reward], [1.0, 0.5])
    assert both("work\n#### 18", "18") == 1.5
    assert both("The answer is 18", "18") == 1.0
    assert combine_rewards([gsm8k_reward, format_reward])("#### 17", "18") == 0.5  # default: mean
    with pytest.raises(ValueError, match="2 functions but 1 weights"):
        combine_rewards([gsm8k_reward, format_reward], [1.0])


def test_safe_reward_in_process_catches_errors():
    stats = RewardStats()
    assert safe_reward(gsm8k_reward, "#### 18", "18", timeout_s=None, stats=stats) == (1.0, "ok")
    assert safe_reward(lambda r, ref: 1 / 0, "x", "y", timeout_s=None, stats=stats) == (0.0, "error")
    assert safe_reward(lambda r, ref: float("nan"), "x", "y", timeout_s=None, stats=stats) == (0.0, "error")
    assert stats.metrics() == {"reward/errors": 2.0, "reward/timeouts": 0.0}


def test_safe_reward_in_worker_counts_errors(pool):
    stats = RewardStats()
    assert safe_reward(gsm8k_reward, "#### 18", "18", pool=pool, stats=stats) == (1.0, "ok")
    assert safe_reward(operator.truediv, 1, 0, pool=pool, stats=stats) == (0.0, "error")  # raises in the worker
    assert safe_reward(gsm8k_reward, None, "18", pool=pool, stats=stats) == (0.0, "error")  # TypeError
    assert (stats.ok, stats.errors, stats.timeouts) == (1, 2, 0)
    with pytest.raises(TypeError, match="cannot be sent"):
        safe_reward(lambda r, ref: 1.0, "x", "y", pool=pool)


def test_pathological_input_times_out_and_pool_recovers(pool):
    assert safe_reward(gsm8k_reward, "#### 18", "18", pool=pool) == (1.0, "ok")  # a started worker
    worker = pool._workers[0].proc
    value, status = safe_reward(gsm8k_reward, PATHOLOGICAL, "18", timeout_s=1.0, pool=pool)
    assert (value, status) == (0.0, "timeout")
    # the stuck worker was killed at the deadline and the restart is deferred to the next call (no timing here)
    assert not worker.is_alive() and worker.exitcode is not None and pool._workers[0] is None
    assert safe_reward(gsm8k_reward, "#### 18", "18", timeout_s=1.0, pool=pool) == (1.0, "ok")


def test_compute_rewards_batch(pool):
    responses = ["#### 18", PATHOLOGICAL, "\\boxed{\\frac{36}{2}}", "#### 17", "The answer is 3"]
    references = ["18", "18", "18", "18", "3"]
    stats = RewardStats(timeouts=1)
    rewards, metrics = compute_rewards(gsm8k_reward, responses, references, timeout_s=1.0, pool=pool, stats=stats)
    assert rewards.dtype == np.float32 and rewards.shape == (5,)
    np.testing.assert_array_equal(rewards, [1, 0, 1, 0, 1])
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 1.0}
    assert stats.timeouts == 2 and stats.ok == 4  # accumulated over calls
    raising = functools.partial(operator.truediv, 1)  # (text, ref) -> TypeError: str / str
    rewards, metrics = compute_rewards(raising, ["a", "b"], ["c", "d"], timeout_s=1.0, pool=pool)
    np.testing.assert_array_equal(rewards, [0, 0])
    assert metrics["reward/errors"] == 2.0
    rewards, _ = compute_rewards(gsm8k_reward, [], [], pool=pool)
    assert rewards.shape == (0,)
    with pytest.raises(ValueError, match="2 responses but 1 references"):
        compute_rewards(gsm8k_reward, ["a", "b"], ["c"], pool=pool)


def string_reward(response: str, reference: str):
    """A buggy reward: the score as text."""
    return "0.7"


def numpy_reward(response: str, reference: str):
    return np.float32(0.25) if response == "a" else np.bool_(True)


def test_reward_must_be_a_real_number(pool):
    """A reward function returning the string "0.7" is an error naming the reward (it was read as 0.7), in the
    worker pool and in-process; numpy numbers and bools are numbers; the pool keeps working."""
    for timeout_s in (60.0, None):  # the worker imports this module on first use: a roomy deadline
        with pytest.raises(ValueError) as e:
            compute_rewards(string_reward, ["a", "b"], ["c", "d"], timeout_s=timeout_s, pool=pool)
        msg = str(e.value)
        assert type(e.value).__name__ == "RewardTypeError" and "\n" not in msg
        assert "reward string_reward returned '0.7' (str)" in msg and "real number" in msg
        rewards, metrics = compute_rewards(numpy_reward, ["a", "b"], ["c", "d"], timeout_s=timeout_s, pool=pool)
        np.testing.assert_array_equal(rewards, [0.25, 1.0])
        assert metrics["reward/errors"] == 0.0
