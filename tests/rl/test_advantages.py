"""Hand-computed checks of rl/algo/advantages.py: GRPO, Dr.GRPO, RLOO, batch normalisation, DAPO dynamic sampling."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.algo.advantages import (
    DynamicSampler,
    compute_advantages,
    dynamic_sampling_filter,
    grpo_advantages,
    rloo_advantages,
)
from rl.config.algo import AdvantageConfig

# Two prompts, G = 4: prompt 0 has one correct answer, prompt 1 is all correct (no signal).
REWARDS = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])


def test_grpo_hand_computed():
    # Group 0: mean = 1/4 = 0.25; deviations [0.75, -0.25, -0.25, -0.25];
    # unbiased var = (0.75^2 + 3 * 0.25^2) / (4 - 1) = 0.75 / 3 = 0.25 -> std 0.5;
    # adv = [0.75, -0.25, -0.25, -0.25] / 0.5 = [1.5, -0.5, -0.5, -0.5]. Group 1 is constant -> 0.
    adv, metrics = grpo_advantages(REWARDS, 4, eps=0.0)
    np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], rtol=1e-6)
    assert float(metrics["rollout/zero_std_frac"]) == 0.5  # 1 of 2 groups
    assert float(metrics["rollout/zero_std_groups"]) == 1.0
    # With the default eps the denominator is 0.5 + 1e-6: 0.75 / 0.500001 = 1.499997.
    adv_eps, _ = grpo_advantages(REWARDS, 4)
    np.testing.assert_allclose(adv_eps[0], 0.75 / 0.500001, rtol=1e-6)


def test_dr_grpo_no_std_division():
    # Dr.GRPO: adv = r - mean = [0.75, -0.25, -0.25, -0.25 | 0, 0, 0, 0].
    adv, _ = grpo_advantages(REWARDS, 4, scale_by_std=False)
    np.testing.assert_allclose(adv, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_constant_groups_are_exactly_zero(scale_by_std):
    # 0.1 is not representable: mean(0.1, 0.1, 0.1) - 0.1 can be a rounding residue, and with std = 0 the
    # division by eps would blow that residue up to ~1e-2. The implementation must return exact zeros.
    rewards = jnp.array([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    adv, metrics = grpo_advantages(rewards, 3, scale_by_std=scale_by_std)
    assert np.all(np.asarray(adv) == 0.0)
    assert float(metrics["rollout/zero_std_frac"]) == 1.0


def test_batch_norm_dr_grpo():
    # Dr.GRPO adv [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]: batch mean 0, sum of squares 0.75,
    # unbiased batch var 0.75 / 7 = 3/28, std = sqrt(3/28) = 0.3273268;
    # adv / std: 0.75 * sqrt(28/3) = 2.2912878, -0.25 * sqrt(28/3) = -0.7637626; the constant group stays 0.
    adv, _ = grpo_advantages(REWARDS, 4, scale_by_std=False, batch_norm=True, eps=0.0)
    s = math.sqrt(28 / 3)
    np.testing.assert_allclose(adv, [0.75 * s, -0.25 * s, -0.25 * s, -0.25 * s, 0, 0, 0, 0], rtol=1e-6)


def test_batch_norm_grpo():
    # G = 2, rewards [1, 0 | 3, 1]. Group 0: mean 0.5, unbiased std sqrt(0.5/1) = 1/sqrt2 -> [1/sqrt2, -1/sqrt2].
    # Group 1: mean 2, unbiased std sqrt(2/1) = sqrt2 -> [1/sqrt2, -1/sqrt2].
    # Batch [a, -a, a, -a], a = 1/sqrt2: mean 0, unbiased var 4 * 0.5 / 3 = 2/3 -> a / sqrt(2/3) = sqrt3 / 2.
    adv, _ = grpo_advantages(jnp.array([1.0, 0.0, 3.0, 1.0]), 2, batch_norm=True, eps=0.0)
    h = math.sqrt(3) / 2
    np.testing.assert_allclose(adv, [h, -h, h, -h], rtol=1e-6)


def test_rloo():
    # Group 0: r_i - mean of the other three: 1 - 0 = 1; 0 - 1/3 = -1/3 (= 4/3 * Dr.GRPO's [0.75, -0.25]).
    adv, metrics = rloo_advantages(REWARDS, 4)
    np.testing.assert_allclose(adv, [1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0], rtol=1e-6)
    assert float(metrics["rollout/zero_std_frac"]) == 0.5


def test_compute_advantages_dispatch():
    adv, _ = compute_advantages(REWARDS, 4, AdvantageConfig.dr_grpo())
    np.testing.assert_allclose(adv[:4], [0.75, -0.25, -0.25, -0.25], rtol=1e-6)
    adv, _ = compute_advantages(REWARDS, 4, AdvantageConfig(estimator="rloo"))
    np.testing.assert_allclose(adv[1], -1 / 3, rtol=1e-6)
    adv, _ = compute_advantages(REWARDS, 4, AdvantageConfig.grpo())
    np.testing.assert_allclose(adv[0], 0.75 / 0.500001, rtol=1e-6)


def test_jittable():
    fn = jax.jit(grpo_advantages, static_argnames=("group_size", "scale_by_std", "batch_norm", "eps"))
    adv, metrics = fn(REWARDS, group_size=4, eps=0.0)
    np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], rtol=1e-6)
    assert float(metrics["rollout/zero_std_frac"]) == 0.5
    keep = jax.jit(dynamic_sampling_filter, static_argnames="group_size")(REWARDS, group_size=4)
    np.testing.assert_array_equal(keep, [True, False])


def test_bad_shapes():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(jnp.ones(4), 1)
    with pytest.raises(ValueError, match="multiple"):
        grpo_advantages(jnp.ones(6), 4)
    with pytest.raises(ValueError, match=r"\[N\]"):
        grpo_advantages(jnp.ones((2, 4)), 4)


def test_dynamic_sampling_filter():
    # Groups: [1,0,0,0] mixed -> keep; [1,1,1,1] all correct -> drop; [0,0,0,0] all wrong -> drop.
    rewards = jnp.array([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(dynamic_sampling_filter(rewards, 4), [True, False, False])


def test_dynamic_sampler_reaches_target():
    sampler = DynamicSampler(target_groups=3, group_size=2, max_rounds=3)
    # Round 1: only "a" has differing rewards.
    assert not sampler.add_round(np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), ["a", "b", "c"])
    # Round 2: "d", "e", "f" all mixed; only 2 more are needed, so "f" is discarded.
    assert sampler.add_round(np.array([[0.0, 1.0], [1.0, 0.0], [0.5, 0.2]]), ["d", "e", "f"])
    kept, metrics = sampler.result()
    assert kept == ["a", "d", "e"]
    assert metrics == {
        "rollout/dynamic_sampling/rounds": 2.0,
        "rollout/dynamic_sampling/budget_hit": 0.0,
        "rollout/dynamic_sampling/kept_groups": 3.0,
        "rollout/dynamic_sampling/sampled_groups": 6.0,
    }
    np.testing.assert_array_equal(sampler.kept_rewards_array(), [1, 0, 0, 1, 1, 0])
    with pytest.raises(RuntimeError):
        sampler.add_round(np.array([1.0, 0.0]))


def test_dynamic_sampler_budget_hit():
    sampler = DynamicSampler(target_groups=2, group_size=2, max_rounds=2)
    assert not sampler.add_round(np.array([1.0, 1.0, 0.0, 1.0]))  # keeps group 1 of round 0
    assert sampler.add_round(np.array([0.0, 0.0]))  # nothing kept, budget spent
    kept, metrics = sampler.result()
    assert kept == [(0, 1)]  # default payload: (round, index in round)
    assert metrics["rollout/dynamic_sampling/budget_hit"] == 1.0
    assert metrics["rollout/dynamic_sampling/rounds"] == 2.0
    assert metrics["rollout/dynamic_sampling/kept_groups"] == 1.0


def test_dynamic_sampler_validation():
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSampler(target_groups=0, group_size=2, max_rounds=1)
    with pytest.raises(ValueError, match="group_size"):
        DynamicSampler(target_groups=1, group_size=1, max_rounds=1)
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSampler(target_groups=1, group_size=2, max_rounds=0)
    sampler = DynamicSampler(target_groups=1, group_size=2, max_rounds=1)
    with pytest.raises(ValueError, match="payloads"):
        sampler.add_round(np.array([1.0, 0.0]), ["a", "b"])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"estimator": "ppo"}, "estimator"),
        ({"eps": -1.0}, "eps"),
        ({"scale_by_std": 1}, "scale_by_std"),
        ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds"),
    ],
)
def test_advantage_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdvantageConfig(**kwargs)


def test_advantage_config_presets():
    assert AdvantageConfig.grpo().scale_by_std
    assert not AdvantageConfig.dr_grpo().scale_by_std
    assert AdvantageConfig.dapo().dynamic_sampling
    with pytest.raises(TypeError):
        AdvantageConfig(True)  # kw-only
