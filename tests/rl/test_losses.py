"""Hand-computed checks of rl/algo/losses.py: PPO/GSPO clipping, dual clip, KL estimators, TIS/MIS corrections,
aggregation modes, and exact micro-batch accumulation with global normalisers.

Convention in these tests: old_logprobs = 0, so logprobs = log(ratio) and the ratio is exactly what is written.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.config.algo import LossConfig
from rl.algo.losses import agg_loss, kl_penalty, loss_normalizers, policy_loss

LOG = math.log


def one_token_loss(adv, ratio, cfg):
    """Loss and metrics of a single token [1, 1] with the given advantage and ratio (old = 0)."""
    lp = jnp.array([[LOG(ratio)]])
    return policy_loss(lp, jnp.zeros_like(lp), jnp.array([adv]), jnp.ones_like(lp), cfg)


# (advantage, ratio, expected per-token loss, clipped) with symmetric eps = 0.2 (clip range [0.8, 1.2]):
PPO_CASES = [
    (1.0, 1.5, -1.2, True),    # max(-1.5, -1.2) = -1.2: the clip removes the incentive to go above 1.2
    (1.0, 0.5, -0.5, False),   # max(-0.5, -0.8) = -0.5: pessimistic, the unclipped branch is kept
    (-1.0, 1.5, 1.5, False),   # max(1.5, 1.2) = 1.5
    (-1.0, 0.5, 0.8, True),    # max(0.5, 0.8) = 0.8: the clip removes the incentive to go below 0.8
    (2.0, 1.1, -2.2, False),   # inside the range: -A r = -2.2
]


@pytest.mark.parametrize("adv, ratio, expected, clipped", PPO_CASES)
def test_ppo_clip_single_token(adv, ratio, expected, clipped):
    loss, metrics = one_token_loss(adv, ratio, LossConfig())
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(metrics["train/pg_clipfrac"]) == float(clipped)


def test_ppo_batch_metrics_and_gradient():
    # The four first cases as one batch [4, 1]: token-mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.6 / 4 = 0.15;
    # clipfrac 2/4; ppo_kl = mean(old - lp) = -(2 log 1.5 + 2 log 0.5) / 4 = -log(0.75) / 2 = 0.1438410.
    adv = jnp.array([1.0, 1.0, -1.0, -1.0])
    lp = jnp.log(jnp.array([[1.5], [0.5], [1.5], [0.5]]))
    old, mask = jnp.zeros_like(lp), jnp.ones_like(lp)
    loss, metrics = policy_loss(lp, old, adv, mask, LossConfig())
    np.testing.assert_allclose(loss, 0.15, rtol=1e-6)
    np.testing.assert_allclose(metrics["train/pg_loss"], 0.15, rtol=1e-6)
    np.testing.assert_allclose(metrics["train/pg_clipfrac"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(metrics["train/ppo_kl"], -LOG(0.75) / 2, rtol=1e-6)
    assert float(metrics["train/dual_clipfrac"]) == 0.0
    # d/dlp of -A r / 4 is -A r / 4 on unclipped tokens and 0 on clipped ones:
    # [0 (clipped), -0.5/4 = -0.125, 1.5/4 = 0.375, 0 (clipped)].
    grad = jax.grad(lambda x: policy_loss(x, old, adv, mask, LossConfig())[0])(lp)
    np.testing.assert_allclose(grad[:, 0], [0.0, -0.125, 0.375, 0.0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "adv, ratio, expected, clipped",
    [
        (1.0, 1.5, -1.28, True),    # upper bound 1 + 0.28: -1.28
        (1.0, 1.25, -1.25, False),  # 1.25 < 1.28 stays unclipped (the symmetric 0.2 clip would give -1.2)
        (-1.0, 0.5, 0.8, True),     # lower bound still 1 - 0.2 = 0.8
        (-1.0, 0.75, 0.8, True),
    ],
)
def test_clip_higher_asymmetric(adv, ratio, expected, clipped):
    loss, metrics = one_token_loss(adv, ratio, LossConfig.dapo())
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(metrics["train/pg_clipfrac"]) == float(clipped)


@pytest.mark.parametrize(
    "adv, ratio, expected, dual",
    [
        (-1.0, 5.0, 3.0, True),    # max(5, 1.2) = 5 > c * |A| = 3 -> bounded at 3
        (-1.0, 2.0, 2.0, False),   # max(2, 1.2) = 2 < 3 -> unchanged
        (-2.0, 2.0, 4.0, False),   # max(4, 2.4) = 4 < 6
        (1.0, 5.0, -1.2, False),   # A > 0: dual clip does not apply, ordinary clip -1.2
    ],
)
def test_dual_clip(adv, ratio, expected, dual):
    loss, metrics = one_token_loss(adv, ratio, LossConfig(dual_clip_c=3.0))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(metrics["train/dual_clipfrac"]) == float(dual)


def test_dual_clip_gradient_is_zero_when_active():
    lp = jnp.array([[LOG(5.0)]])
    grad = jax.grad(lambda x: policy_loss(x, jnp.zeros_like(x), jnp.array([-1.0]), jnp.ones_like(x),
                                          LossConfig(dual_clip_c=3.0))[0])(lp)
    assert float(grad[0, 0]) == 0.0


# GSPO batch: row 0 has 2 tokens with lp - old = [0.2, -0.1] (+ one padding token), row 1 has 3 tokens
# with lp - old = [0.0, 0.03, -0.03]. Sequence ratios: s_0 = exp((0.2 - 0.1) / 2) = exp(0.05) = 1.0512711,
# s_1 = exp(0) = 1.
GSPO_LP = jnp.array([[0.2, -0.1, 7.0], [0.0, 0.03, -0.03]])
GSPO_MASK = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
GSPO_ADV = jnp.array([1.0, -1.0])


def test_gspo_value_and_gradient_unclipped():
    # Wide clip so nothing clips. seq-mean-token-mean: loss = 1/2 * sum_i mean_t(-A_i s_i) = (-s_0 + s_1) / 2
    # = (-1.0512711 + 1) / 2 = -0.0256355.
    # d loss / d lp_{i,t} = -A_i s_i / (2 |y_i|): row 0: -exp(0.05) / 4 = -0.2628178; row 1: +1 / 6;
    # padding token: 0.
    cfg = LossConfig(policy_loss="gspo", gspo_clip_eps_low=0.2, gspo_clip_eps_high=0.2,
                     loss_agg_mode="seq-mean-token-mean")
    old = jnp.zeros_like(GSPO_LP)

    def f(lp):
        return policy_loss(lp, old, GSPO_ADV, GSPO_MASK, cfg)[0]

    s0 = math.exp(0.05)
    np.testing.assert_allclose(f(GSPO_LP), (-s0 + 1) / 2, rtol=1e-5)
    expected = [[-s0 / 4, -s0 / 4, 0.0], [1 / 6, 1 / 6, 1 / 6]]
    np.testing.assert_allclose(jax.grad(f)(GSPO_LP), expected, rtol=1e-5, atol=1e-7)

    # Same as the gradient of the sequence-level objective -1/2 sum_i A_i exp(mean_t (lp - old)).
    def seq_objective(lp):
        s = jnp.exp((lp * GSPO_MASK).sum(-1) / GSPO_MASK.sum(-1))
        return -(GSPO_ADV * s).mean()

    np.testing.assert_allclose(jax.grad(f)(GSPO_LP), jax.grad(seq_objective)(GSPO_LP), rtol=1e-5, atol=1e-7)


def test_gspo_paper_clip():
    # Paper clip [1 - 3e-4, 1 + 4e-4]. Row 0: s_0 = 1.0512711 > 1.0004 with A = +1 -> clipped: loss per token
    # -1.0004, no gradient. Row 1: s_1 = 1, A = -1 -> 1 per token, gradient 1/6 as above.
    # loss = (-1.0004 + 1) / 2 = -0.0002; clipfrac = 2 clipped tokens / 5 tokens = 0.4.
    cfg = LossConfig.gspo()
    old = jnp.zeros_like(GSPO_LP)
    loss, metrics = policy_loss(GSPO_LP, old, GSPO_ADV, GSPO_MASK, cfg)
    np.testing.assert_allclose(loss, -0.0002, atol=1e-6)
    np.testing.assert_allclose(metrics["train/pg_clipfrac"], 0.4, rtol=1e-6)
    grad = jax.grad(lambda lp: policy_loss(lp, old, GSPO_ADV, GSPO_MASK, cfg)[0])(GSPO_LP)
    np.testing.assert_allclose(grad, [[0, 0, 0], [1 / 6, 1 / 6, 1 / 6]], rtol=1e-5, atol=1e-7)


# Per-token losses [[1, 2, 3], [4, x, x], [x, x, x]] with masks selecting 4 tokens; row 2 is empty.
AGG_LOSS = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
AGG_MASK = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, norm_length, expected",
    [
        ("token-mean", None, 2.5),                      # (1 + 2 + 3 + 4) / 4
        ("seq-mean-token-mean", None, 3.0),             # (mean(1,2,3) = 2, 4) -> (2 + 4) / 2; empty row skipped
        ("seq-mean-token-sum-norm", None, 10 / 9),      # 10 / (N = 3 * T = 3)
        ("seq-mean-token-sum-norm", 5, 10 / 15),        # 10 / (3 * 5)
    ],
)
def test_aggregation_modes(mode, norm_length, expected):
    np.testing.assert_allclose(agg_loss(AGG_LOSS, AGG_MASK, mode, norm_length=norm_length), expected, rtol=1e-6)
    # Through policy_loss: ratio 1 and per-token advantages A = -loss give per-token pg = -A * 1 = loss.
    cfg = LossConfig(loss_agg_mode=mode, norm_length=norm_length)
    zeros = jnp.zeros_like(AGG_LOSS)
    loss, _ = policy_loss(zeros, zeros, -AGG_LOSS, AGG_MASK, cfg)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_aggregation_empty_mask_is_zero():
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert float(agg_loss(AGG_LOSS, jnp.zeros_like(AGG_MASK), mode)) == 0.0


# KL: with x = lp - ref, ref = log 2 gives x = -log 2 and ref = -log 2 gives x = log 2.
def test_kl_estimators():
    lp = jnp.zeros((1, 3))
    ref = jnp.array([[LOG(2.0), -LOG(2.0), 0.0]])
    l2 = LOG(2.0)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1"), [[-l2, l2, 0.0]], rtol=1e-6)
    # k2 = x^2 / 2 = 0.480453 / 2 = 0.2402265
    np.testing.assert_allclose(kl_penalty(lp, ref, "k2"), [[l2**2 / 2, l2**2 / 2, 0.0]], rtol=1e-6)
    # k3 = exp(-x) + x - 1: x = -log2 -> 2 - log2 - 1 = 0.3068528; x = log2 -> 0.5 + log2 - 1 = 0.1931472
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3"), [[1 - l2, l2 - 0.5, 0.0]], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(lp, ref, "k4")


def test_kl_clamping():
    lp = jnp.zeros((1, 2))
    ref = jnp.array([[15.0, -15.0]])  # x = -15, +15
    # Log-ratio clamped to [-10, 10]: k1 = [-10, 10]; k2 = [50, 50];
    # k3(x = -10) = e^10 + (-10) - 1 = 22015.5 -> output clamp 10; k3(x = 10) = e^-10 + 10 - 1 = 9.0000454.
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1", 10.0), [[-10.0, 10.0]])
    np.testing.assert_allclose(kl_penalty(lp, ref, "k2", 10.0), [[50.0, 50.0]])
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3", 10.0), [[10.0, 9.0 + math.exp(-10)]], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k1", None), [[-15.0, 15.0]])


def test_k3_default_clamp_is_verl_low_var_kl():
    # verl low_var_kl: kl = clamp(ref - lp, -20, 20); k3 = exp(kl) - kl - 1, clamped to [-10, 10].
    # x = lp - ref = 10.5: k3 = exp(-10.5) + 9.5 = 9.5000275 (a clamp of 10 would stop it at 9.0000454) and its
    # gradient d/dlp = 1 - exp(-10.5) = 0.9999725 (0 under a clamp of 10). x = +-15 reaches the output clamp 10.
    lp = jnp.array([[10.5, 15.0, -15.0]])
    ref = jnp.zeros_like(lp)
    assert LossConfig().kl_clamp == 20.0
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3", LossConfig().kl_clamp),
                               [[9.5 + math.exp(-10.5), 10.0, 10.0]], rtol=1e-6)
    g = jax.grad(lambda lp: kl_penalty(lp, ref, "k3", LossConfig().kl_clamp).sum())(lp)
    np.testing.assert_allclose(g, [[1.0 - math.exp(-10.5), 0.0, 0.0]], rtol=1e-6)


def test_k3_output_clamp_is_asymmetric():
    # k3(x) = e^-x + x - 1 reaches 10 at x ~ 11.0 above zero but already at x ~ -2.611 below it (e^2.611 = 13.611):
    # x = -2.6: k3 = e^2.6 - 3.6 = 9.8637, gradient 1 - e^2.6 = -12.4637; x = -2.62: e^2.62 - 3.62 = 10.117 -> 10,
    # gradient 0.
    lp = jnp.array([[-2.6, -2.62]])
    ref = jnp.zeros_like(lp)
    np.testing.assert_allclose(kl_penalty(lp, ref, "k3"), [[math.exp(2.6) - 3.6, 10.0]], rtol=1e-5)
    g = jax.grad(lambda lp: kl_penalty(lp, ref, "k3").sum())(lp)
    np.testing.assert_allclose(g, [[1.0 - math.exp(2.6), 0.0]], rtol=1e-5)


def test_k3_gradient():
    # d/dlp [exp(ref - lp) - (ref - lp) - 1] = 1 - exp(ref - lp); at lp = log 2, ref = 0: 1 - 1/2 = 0.5.
    g = jax.grad(lambda lp: kl_penalty(lp, jnp.zeros_like(lp), "k3").sum())(jnp.array([[LOG(2.0)]]))
    np.testing.assert_allclose(g, [[0.5]], rtol=1e-6)


def test_kl_term_in_loss():
    # A = 0 -> pg = 0. k3 values [1 - log2, log2 - 0.5] sum to exactly 0.5 -> token-mean kl = 0.25;
    # loss = kl_coef * 0.25 = 0.1 * 0.25 = 0.025.
    lp = jnp.zeros((1, 2))
    ref = jnp.array([[LOG(2.0), -LOG(2.0)]])
    cfg = LossConfig(kl_coef=0.1)
    loss, metrics = policy_loss(lp, lp, jnp.zeros(1), jnp.ones_like(lp), cfg, ref_logprobs=ref)
    np.testing.assert_allclose(metrics["train/kl_loss"], 0.25, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.025, rtol=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, jnp.zeros(1), jnp.ones_like(lp), cfg)
    # kl_coef = 0: no reference needed; when one is given it is only reported.
    loss, metrics = policy_loss(lp, lp, jnp.zeros(1), jnp.ones_like(lp), LossConfig())
    assert float(loss) == 0.0 and "train/kl_loss" not in metrics
    loss, metrics = policy_loss(lp, lp, jnp.zeros(1), jnp.ones_like(lp), LossConfig(), ref_logprobs=ref)
    assert float(loss) == 0.0
    np.testing.assert_allclose(metrics["train/kl_loss"], 0.25, rtol=1e-6)


def test_entropy_bonus():
    # entropy [1, 2] -> mean 1.5; loss = 0 - 0.01 * 1.5 = -0.015.
    lp = jnp.zeros((1, 2))
    ent = jnp.array([[1.0, 2.0]])
    loss, metrics = policy_loss(lp, lp, jnp.zeros(1), jnp.ones_like(lp), LossConfig(entropy_coef=0.01), entropy=ent)
    np.testing.assert_allclose(metrics["train/entropy"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(loss, -0.015, rtol=1e-6)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, lp, jnp.zeros(1), jnp.ones_like(lp), LossConfig(entropy_coef=0.01))


def rollout_for(weights):
    """rollout logprobs such that w = exp(old - rollout) = weights, with old = 0."""
    return -jnp.log(jnp.asarray(weights, jnp.float32))


def test_tis_token():
    # w = [0.5, 1.5, 3, 4], C = 2 -> factor [0.5, 1.5, 2, 2]; 2 of 4 truncated -> tis_clipfrac 0.5.
    # ratio 1, A = 1 -> pg = -factor; token-mean = -(0.5 + 1.5 + 2 + 2) / 4 = -1.5.
    # d/dlp: -factor * r / 4 = [-0.125, -0.375, -0.5, -0.5]; no gradient into the rollout logprobs.
    w = [[0.5, 1.5, 3.0, 4.0]]
    lp = jnp.zeros((1, 4))
    rollout = rollout_for(w)
    cfg = LossConfig(correction="tis", tis_clip_high=2.0)

    def f(lp, rollout):
        return policy_loss(lp, jnp.zeros_like(lp), jnp.ones(1), jnp.ones_like(lp), cfg, rollout_logprobs=rollout)

    loss, metrics = f(lp, rollout)
    np.testing.assert_allclose(loss, -1.5, rtol=1e-6)
    np.testing.assert_allclose(metrics["train/tis_clipfrac"], 0.5, rtol=1e-6)
    g_lp, g_rollout = jax.grad(lambda a, b: f(a, b)[0], argnums=(0, 1))(lp, rollout)
    np.testing.assert_allclose(g_lp, [[-0.125, -0.375, -0.5, -0.5]], rtol=1e-6)
    assert np.all(np.asarray(g_rollout) == 0.0)
    # Mismatch metrics: mean |log w| = (log2 + log1.5 + log3 + log4) / 4 = 3.5835189 / 4 = 0.8958797;
    # k3 of KL(rollout || old) = mean(w - log w - 1)
    #   = (0.1931472 + 0.0945349 + 0.9013877 + 1.6137056) / 4 = 2.8027754 / 4 = 0.7006938.
    np.testing.assert_allclose(metrics["train/train_rollout_logprob_abs_diff"], 0.8958797, rtol=1e-5)
    np.testing.assert_allclose(metrics["train/train_rollout_kl"], 0.7006938, rtol=1e-5)


def test_mis_token():
    # IcePop: w = [0.25, 0.6, 1.5, 3] with [0.5, 2] keeps tokens 1 and 2, each weighted by its own ratio:
    # factor [0, 0.6, 1.5, 0]; ratio 1, A = 1 -> pg = -factor; the denominator is unchanged (4 tokens):
    # -(0.6 + 1.5) / 4 = -0.525; masked fraction 2/4. d/dlp = -factor / 4 = [0, -0.15, -0.375, 0].
    lp = jnp.zeros((1, 4))
    cfg = LossConfig(correction="mis", mis_low=0.5, mis_high=2.0)
    loss, metrics = policy_loss(lp, lp, jnp.ones(1), jnp.ones_like(lp), cfg,
                                rollout_logprobs=rollout_for([[0.25, 0.6, 1.5, 3.0]]))
    np.testing.assert_allclose(loss, -0.525, rtol=1e-6)
    np.testing.assert_allclose(metrics["train/tis_clipfrac"], 0.5, rtol=1e-6)
    g = jax.grad(lambda lp: policy_loss(lp, jnp.zeros_like(lp), jnp.ones(1), jnp.ones_like(lp), cfg,
                                        rollout_logprobs=rollout_for([[0.25, 0.6, 1.5, 3.0]]))[0])(lp)
    np.testing.assert_allclose(g, [[0.0, -0.15, -0.375, 0.0]], rtol=1e-6, atol=1e-8)


# Sequence-level batch: row 0 w = [1.5, 1.5]; row 1 w = [2, 0.5]; row 2 w = [1.5, pad] where the padding
# token's rollout logprob is NaN and must be ignored.
SEQ_W = [[1.5, 1.5], [2.0, 0.5], [1.5, 1.0]]
SEQ_MASK = jnp.array([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize(
    "correction, level, expected_loss, expected_frac",
    [
        # sequence weights: 1.5 * 1.5 = 2.25, 2 * 0.5 = 1, 1.5. TIS C = 2 -> factors [2, 1, 1.5]
        # -> token-mean -(2 + 2 + 1 + 1 + 1.5) / 5 = -7.5 / 5 = -1.5; row 0 truncated: 2 tokens / 5.
        ("tis", "sequence", -1.5, 0.4),
        # geometric means: 1.5, sqrt(2 * 0.5) = 1, 1.5 -> factors [1.5, 1, 1.5] -> -(3 + 2 + 1.5) / 5 = -1.3.
        ("tis", "geometric", -1.3, 0.0),
        # MIS [0.5, 2] on sequence weights [2.25, 1, 1.5]: row 0 masked, the others weighted by their ratio
        # -> -(0 + 0 + 1 + 1 + 1.5) / 5 = -0.7; 2 tokens masked.
        ("mis", "sequence", -0.7, 0.4),
        # MIS on geometric means [1.5, 1, 1.5]: all inside, weighted -> -(3 + 2 + 1.5) / 5 = -1.3.
        ("mis", "geometric", -1.3, 0.0),
    ],
)
def test_sequence_level_corrections(correction, level, expected_loss, expected_frac):
    lp = jnp.zeros((3, 2))
    cfg = LossConfig(correction=correction, correction_level=level, tis_clip_high=2.0)
    rollout = rollout_for(SEQ_W).at[2, 1].set(jnp.nan)
    loss, metrics = policy_loss(lp, lp, jnp.ones(3), SEQ_MASK, cfg, rollout_logprobs=rollout)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    np.testing.assert_allclose(metrics["train/tis_clipfrac"], expected_frac, rtol=1e-6, atol=1e-7)


def test_correction_needs_rollout_logprobs():
    lp = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(lp, lp, jnp.ones(1), jnp.ones_like(lp), LossConfig(correction="tis"))


def random_batch(n=6, t=5, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 7)
    lp = -jax.random.uniform(k[0], (n, t), minval=0.1, maxval=2.0)
    old = lp + 0.3 * jax.random.normal(k[1], (n, t))
    rollout = old + 0.2 * jax.random.normal(k[2], (n, t))
    ref = lp + 0.2 * jax.random.normal(k[3], (n, t))
    adv = jax.random.normal(k[4], (n,))
    ent = jax.random.uniform(k[5], (n, t))
    lengths = jnp.array([5, 3, 0, 1, 4, 2])[:n]  # includes an empty row
    mask = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
    return lp, old, rollout, ref, adv, ent, mask


ALL_ON = dict(kl_coef=0.05, entropy_coef=0.01, dual_clip_c=3.0, clip_eps_high=0.28)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kind, correction", [("ppo", "tis"), ("ppo", "mis"), ("gspo", "none")])
def test_global_normaliser_split_equals_full(mode, kind, correction):
    # Two micro-batches, each divided by the full batch's normalisers, sum to the full-batch loss, gradient
    # and metrics.
    lp, old, rollout, ref, adv, ent, mask = random_batch()
    cfg = LossConfig(policy_loss=kind, loss_agg_mode=mode, correction=correction, **ALL_ON)

    value_and_grad = jax.jit(jax.value_and_grad(policy_loss, has_aux=True), static_argnames="cfg")

    def loss_fn(sl, **norm):
        return value_and_grad(lp[sl], old[sl], adv[sl], mask[sl], cfg=cfg, rollout_logprobs=rollout[sl],
                              ref_logprobs=ref[sl], entropy=ent[sl], **norm)

    (full_loss, full_metrics), full_grad = loss_fn(slice(None))
    norm = loss_normalizers(mask, cfg)
    total, grads, metric_sums = 0.0, [], {}
    for sl in (slice(0, 3), slice(3, 6)):
        (part, metrics), g = loss_fn(sl, **norm)
        total += part
        grads.append(g)
        for name, value in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + value
    np.testing.assert_allclose(total, full_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jnp.concatenate(grads), full_grad, rtol=1e-5, atol=1e-7)
    assert metric_sums.keys() == full_metrics.keys()
    for name in full_metrics:
        np.testing.assert_allclose(metric_sums[name], full_metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_loss_normalizers():
    # AGG_MASK has 4 tokens, 2 non-empty rows of 3.
    norm = loss_normalizers(AGG_MASK, LossConfig(loss_agg_mode="seq-mean-token-mean"))
    assert float(norm["global_token_count"]) == 4.0 and float(norm["global_seq_count"]) == 2.0
    norm = loss_normalizers(AGG_MASK, LossConfig(loss_agg_mode="seq-mean-token-sum-norm"))
    assert float(norm["global_seq_count"]) == 3.0


def test_jit_matches_eager():
    lp, old, rollout, ref, adv, ent, mask = random_batch()
    cfg = LossConfig(correction="tis", correction_level="geometric", **ALL_ON)
    kwargs = dict(rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent)
    eager_loss, eager_metrics = policy_loss(lp, old, adv, mask, cfg, **kwargs)
    jitted = jax.jit(policy_loss, static_argnames="cfg")
    loss, metrics = jitted(lp, old, adv, mask, cfg=cfg, **kwargs, **loss_normalizers(mask, cfg))
    np.testing.assert_allclose(loss, eager_loss, rtol=1e-6)
    for name in eager_metrics:
        np.testing.assert_allclose(metrics[name], eager_metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)
    expected_keys = {
        "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/dual_clipfrac", "train/ppo_kl", "train/kl_loss",
        "train/entropy", "train/tis_clipfrac", "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl",
    }
    assert set(metrics) == expected_keys
    grad = jax.jit(jax.grad(lambda x: policy_loss(x, old, adv, mask, cfg, **kwargs)[0]))(lp)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[np.asarray(mask) == 0] == 0.0)  # padding gets no gradient


def test_advantages_per_token_shape_check():
    lp = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        policy_loss(lp, jnp.zeros((2, 4)), jnp.ones(2), jnp.ones_like(lp), LossConfig())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"policy_loss": "grpo"}, "policy_loss"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"correction": "is"}, "correction"),
        ({"correction_level": "batch"}, "correction_level"),
        ({"clip_eps_low": 1.0}, "clip_eps_low"),
        ({"clip_eps_high": -0.1}, "clip_eps_high"),
        ({"gspo_clip_eps_low": -1e-4}, "gspo_clip_eps_low"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_clamp": 0.0}, "kl_clamp"),
        ({"tis_clip_high": 0.0}, "tis_clip_high"),
        ({"mis_low": 0.0}, "mis_low"),
        ({"mis_low": 2.0, "mis_high": 1.5}, "mis_high"),
        ({"entropy_coef": float("nan")}, "entropy_coef"),
        ({"norm_length": 0}, "norm_length"),
        ({"clip_eps_high": True}, "clip_eps_high"),
    ],
)
def test_loss_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LossConfig(**kwargs)


def test_loss_config_presets_and_hashable():
    assert LossConfig.dapo().clip_eps_high == 0.28
    assert LossConfig.dr_grpo().loss_agg_mode == "seq-mean-token-sum-norm"
    assert LossConfig.gspo().policy_loss == "gspo"
    assert LossConfig.grpo().kl_coef > 0
    assert hash(LossConfig()) == hash(LossConfig())
    with pytest.raises(TypeError):
        LossConfig("ppo")  # kw-only
