"""Peer reference table: numbers taken from the peers' own published tests, which our functions must reproduce.

Each row names its source (repository, test file, test name). Only the numbers (inputs and expected outputs)
come from there; the mapping onto our API is written here. Where a peer follows a different convention than
ours (see the docstrings of rl/algo/losses.py and rl/algo/advantages.py), the row says how the number is translated.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from rl.algo.advantages import grpo_advantages, rloo_advantages
from rl.config.algo import LossConfig
from rl.algo.losses import policy_loss

# Tunix draws these rewards with jax.random.uniform(PRNGKey(0), (1, 6)) under jax_threefry_partitionable=False;
# written out here so the test does not flip a global JAX flag.
TUNIX_REWARDS = [0.57450044, 0.09968603, 0.7419659, 0.8941783, 0.59656656, 0.45325184]

ADVANTAGE_TABLE = [
    # (source, function, rewards, group_size, kwargs, expected, rtol/atol)
    ("google/tunix tests/rl/algo_core_test.py::test_grpo_compute_advantages",
     grpo_advantages, TUNIX_REWARDS, 3, {},
     [0.307498, -1.117636, 0.810138, 1.094526, -0.228671, -0.865855], 1e-3),
    ("google/tunix tests/rl/grpo/grpo_helpers_test.py::test_compute_advantages[no_std_scale] (Dr.GRPO)",
     grpo_advantages, TUNIX_REWARDS, 3, {"scale_by_std": False},
     [0.10245, -0.372365, 0.269915, 0.246179, -0.051432, -0.194747], 1e-5),
    ("google/tunix tests/rl/algo_core_test.py::test_compute_rloo_advantages",
     rloo_advantages, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3, {},
     [-1.5, 0.0, 1.5, -1.5, 0.0, 1.5], 1e-6),
    # Tunix GrpoLooAdvantagesTest.test_degenerate_groups: G = 2 leaves raw differences [1, -1]; our RLOO (no
    # std division) gives the same for a group of two.
    ("google/tunix tests/rl/algo_core_test.py::GrpoLooAdvantagesTest::test_degenerate_groups (G=2)",
     rloo_advantages, [1.0, 0.0], 2, {}, [1.0, -1.0], 1e-6),
]


@pytest.mark.parametrize("source, fn, rewards, group_size, kwargs, expected, tol", ADVANTAGE_TABLE,
                         ids=[row[0] for row in ADVANTAGE_TABLE])
def test_advantages_match_peer_values(source, fn, rewards, group_size, kwargs, expected, tol):
    adv, _ = fn(jnp.asarray(rewards, jnp.float32), group_size, **kwargs)
    np.testing.assert_allclose(adv, expected, rtol=tol, atol=tol)


def test_seq_mean_token_mean_matches_tunix():
    # google/tunix tests/rl/algo_core_test.py::test_grpo_loss_fn_packed_equals_unpacked: sequence A (advantage
    # 1.5, 3 tokens) and B (advantage 3.0, 1 token), ratio 1, "sequence-mean-token-mean" -> -2.25.
    lp = jnp.zeros((2, 3))
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    for kind in ("ppo", "gspo"):  # Tunix checks 'grpo' and 'gspo-token'
        loss, _ = policy_loss(lp, lp, jnp.array([1.5, 3.0]), mask,
                              LossConfig(policy_loss=kind, loss_agg_mode="seq-mean-token-mean"))
        np.testing.assert_allclose(loss, -2.25, rtol=1e-6)


def test_mis_matches_verl_mask_mode():
    # volcengine/verl tests/trainer/ppo/test_rollout_corr.py::test_mask_mode: old = -2 on 2 x 5 tokens; rollout
    # -1 (row 0, ratio exp(-1) = 0.368, rejected by [0.5, 2]) and -2.5 (row 1, ratio exp(0.5) = 1.649, kept with
    # weight 1.649); masked fraction 0.5. verl rejects by zeroing the response mask (`modified_response_mask`) and
    # keeps the kept token's ratio as its weight; our "mis" (IcePop) gives rejected tokens zero loss and weights
    # kept ones by their ratio: the same per-token numerators, different token-mean denominators.
    old = jnp.full((2, 5), -2.0)
    rollout = jnp.array([[-1.0] * 5, [-2.5] * 5])
    mask = jnp.ones((2, 5))
    cfg = LossConfig(correction="mis", mis_low=0.5, mis_high=2.0)
    loss, metrics = policy_loss(old, old, jnp.ones(2), mask, cfg, rollout_logprobs=rollout)
    # A = 1, ratio 1: per-token loss = -weight: row 0 -> 0, row 1 -> -1.6487 (verl's asserted kept weight 1.649).
    # Ours: token-mean over the 10 valid tokens.
    np.testing.assert_allclose(loss, -5 * math.exp(0.5) / 10, rtol=1e-6)
    # verl's loss on the same batch: agg_loss("token-mean") over its modified response mask, i.e. the 5 kept tokens:
    # -5 * 1.6487 / 5 = -1.6487 = ours x (10 valid / 5 kept).
    verl_loss = -5 * math.exp(0.5) / 5
    np.testing.assert_allclose(float(loss) * 10 / 5, verl_loss, rtol=1e-6)
    np.testing.assert_allclose(-verl_loss, 1.649, atol=0.01)  # verl's asserted kept weight
    np.testing.assert_allclose(metrics["train/tis_clipfrac"], 0.5, rtol=1e-6)  # verl: rollout_rs_masked_fraction
