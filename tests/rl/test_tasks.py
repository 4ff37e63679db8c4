"""Tests for rl/data/tasks.py: the digit task's prompts, splits, reward by hand, and its prompt-independent best."""

import numpy as np
import pytest

from rl.data.tasks import CharTokenizer, DigitTask, TaskPrompt
from rl.data.tokenizer import TokenizerLike, check_vocab

EOS, PAD = CharTokenizer.EOS, CharTokenizer.PAD


def ids(tok, text):
    return tok.encode(text)


def test_char_tokenizer_round_trip_and_protocol():
    tok = CharTokenizer()
    assert isinstance(tok, TokenizerLike)
    assert tok.vocab_size == 16 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.decode(tok.encode("R407=")) == "R407="
    assert tok.decode([tok.bos_id, *tok.encode("12"), tok.eos_id, 200]) == "12\ufffd"  # specials dropped, unknown shown
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x")
    check_vocab(tok, 256)  # model vocab may be larger


def test_prompts_are_deterministic_and_well_formed():
    a, b = DigitTask(kind="reverse", seed=3), DigitTask(kind="reverse", seed=3)
    assert a.prompts("train", 50) == b.prompts("train", 50)
    assert a.prompts("train", 50) != DigitTask(kind="reverse", seed=4).prompts("train", 50)
    p = a.prompts("train", 1)[0]
    digits = p.text[1:4]
    assert p.text == f"R{digits}=" and p.answer == digits[::-1]
    tok = a.tokenizer
    assert p.prompt_ids == [tok.bos_id, *tok.encode(p.text)] and len(p.prompt_ids) == a.prompt_len == 6
    c = DigitTask(kind="copy").prompts("eval", 1)[0]
    assert c.text[0] == "C" and c.answer == c.text[1:4]


def test_train_and_eval_are_disjoint_and_cover_everything():
    task = DigitTask(seed=7)
    train = {p.text for p in task.prompts("train")}
    evals = {p.text for p in task.prompts("eval")}
    assert len(train) == 900 and len(evals) == 100 and not train & evals
    with pytest.raises(ValueError, match="900 train"):
        task.prompts("train", 901)
    with pytest.raises(ValueError, match="split"):
        task.prompts("test", 1)


def test_config_validation():
    with pytest.raises(ValueError, match="kind"):
        DigitTask(kind="add")
    with pytest.raises(ValueError, match="n_digits"):
        DigitTask(n_digits=7)


def test_reward_by_hand():
    task = DigitTask(kind="reverse")
    tok = task.tokenizer
    prompt = TaskPrompt(prompt_ids=[tok.bos_id, *tok.encode("R407=")], answer="704", text="R407=")
    exact = ids(tok, "704") + [EOS]
    assert task.reward(prompt, exact) == 1.0 and task.exact(prompt, exact)
    assert task.reward("704", exact + [PAD, PAD]) == 1.0  # the answer string works too; tokens after EOS ignored
    assert task.reward(prompt, ids(tok, "714") + [EOS]) == pytest.approx(2 / 3)  # one digit wrong
    assert not task.exact(prompt, ids(tok, "714") + [EOS])
    assert task.reward(prompt, ids(tok, "704")) == pytest.approx(0.5)  # missing EOS: half credit
    assert not task.exact(prompt, ids(tok, "704"))
    assert task.reward(prompt, ids(tok, "7045") + [EOS]) == pytest.approx(0.5)  # EOS one late
    assert task.reward(prompt, ids(tok, "70") + [EOS]) == pytest.approx(2 / 3 * 0.5)  # EOS one early
    assert task.reward(prompt, []) == 0.0  # empty response
    assert task.reward(prompt, [EOS]) == 0.0
    assert task.reward(prompt, [250, 251, 252, EOS]) == 0.0  # ids beyond the tokenizer: wrong, not an error
    assert task.reward(prompt, np.array(ids(tok, "7") + [EOS] + ids(tok, "04"))) == pytest.approx(1 / 3 * 0.5)


def test_batched_rewards_from_sampler_rows():
    task = DigitTask(kind="copy")
    tok = task.tokenizer
    rows = np.array([ids(tok, "123") + [EOS, PAD], ids(tok, "129") + [EOS, PAD], ids(tok, "12345")])  # -> [3, 5]
    rewards = task.rewards(["123", "123", "123"], rows)
    assert rewards.dtype == np.float32
    np.testing.assert_allclose(rewards, [1.0, 2 / 3, 0.5], rtol=1e-6)


def brute_force_best(task):
    """Every response of n digits + EOS, scored by the task's own reward against every train prompt."""
    tok = task.tokenizer
    prompts = task.prompts("train")
    answers = np.array([[int(c) for c in p.answer] for p in prompts])  # -> [P, 3]
    best, best_digits = -1.0, None
    for k in range(1000):
        cand = np.array([k // 100, k // 10 % 10, k % 10])
        mean = (answers == cand).sum(1).mean() / 3
        if mean > best:
            best, best_digits = mean, "".join(map(str, cand))
    # Check the vectorised score on the winner with the reward itself, and that dropping or moving EOS loses.
    win = tok.encode(best_digits)
    assert np.mean([task.reward(p, win + [tok.eos_id]) for p in prompts]) == pytest.approx(best)
    assert np.mean([task.reward(p, win) for p in prompts]) == pytest.approx(best / 2)
    assert np.mean([task.reward(p, win[:2] + [tok.eos_id]) for p in prompts]) < best
    return best


@pytest.mark.parametrize("kind", ["copy", "reverse"])
def test_prompt_independent_best_is_low_and_matches_brute_force(kind):
    task = DigitTask(kind=kind)
    best = task.prompt_independent_best()
    assert best <= 0.2
    assert best == pytest.approx(brute_force_best(task))
    assert best == pytest.approx(0.1044, abs=1e-4)  # the figure stated in the docstring
