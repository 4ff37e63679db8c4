"""Hand-computed checks of rl/algo/metrics.py: masked means, reward/length stats, pass@k vs brute force, to_python."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.algo.metrics import masked_mean, pass_at_k, response_stats, reward_stats, to_python


def test_masked_mean():
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    mask = jnp.array([[1, 0], [1, 1]], dtype=bool)
    np.testing.assert_allclose(masked_mean(x, mask), 8 / 3, rtol=1e-6)  # (1 + 3 + 4) / 3
    np.testing.assert_allclose(masked_mean(x, mask, axis=-1), [1.0, 3.5], rtol=1e-6)  # [1/1, (3 + 4)/2]
    assert float(masked_mean(x, jnp.zeros_like(x))) == 0.0  # empty mask -> 0, not NaN
    np.testing.assert_allclose(jax.jit(masked_mean)(x, mask), 8 / 3, rtol=1e-6)


def test_reward_stats():
    # 5 ones and 3 zeros: mean 5/8 = 0.625; population var = 0.625 - 0.625^2 = 0.234375 -> std 0.4841229;
    # group 1 is all ones -> zero_std_frac 1/2.
    stats = reward_stats(jnp.array([1.0, 0, 0, 0, 1, 1, 1, 1]), 4)
    np.testing.assert_allclose(stats["rollout/reward_mean"], 0.625, rtol=1e-6)
    np.testing.assert_allclose(stats["rollout/reward_std"], math.sqrt(0.234375), rtol=1e-6)
    np.testing.assert_allclose(stats["rollout/zero_std_frac"], 0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="group_size"):
        reward_stats(jnp.ones(6), 4)


def test_response_stats():
    lengths = np.array([10, 20, 30, 40])
    # No finish reasons: truncated = length >= 40 -> 1 of 4; mean (10 + 20 + 30 + 40) / 4 = 25.
    stats = response_stats(lengths, 40)
    assert stats == {
        "rollout/response_len_mean": 25.0,
        "rollout/response_len_max": 40.0,
        "rollout/response_len_min": 10.0,
        "rollout/truncated_ratio": 0.25,
    }
    # Finish reasons win: 2 of 4 ended by "length".
    stats = response_stats(jnp.array(lengths), 40, ["length", "length", "stop", "stop"])
    assert stats["rollout/truncated_ratio"] == 0.5
    with pytest.raises(ValueError):
        response_stats(lengths, 40, ["stop"])


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3-subset holds a correct sample
    np.testing.assert_allclose(pass_at_k(5, np.array([0, 2, 5]), 2), [0.0, 0.7, 1.0])
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        pass_at_k(5, 1, 6)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_matches_enumeration(n):
    # Brute force: samples 0..c-1 are correct; pass@k = fraction of k-subsets holding at least one of them.
    for c in range(n + 1):
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # The product form never builds the binomials: 1 - C(990, 10)/C(1000, 10) against exact integers.
    expected = 1 - math.comb(990, 10) / math.comb(1000, 10)
    assert pass_at_k(1000, 10, 10) == pytest.approx(expected, rel=1e-12)
    assert 0.0 < pass_at_k(1000, 1, 500) <= 1.0


def test_to_python():
    out = to_python({"a": jnp.array(1.5), "b": np.float32(2.0), "c": 3})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0}
    assert all(type(v) is float for v in out.values())
