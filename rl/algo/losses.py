"""Policy-gradient losses for GRPO-family training: pure, jittable functions of per-token log-probs.

What is here (sources in each docstring):
- PPO clip with asymmetric bounds (DAPO clip-higher) and optional dual clip; GSPO sequence-level ratio.
- KL penalty estimators k1/k2/k3 (`kl_penalty`).
- Train/rollout mismatch correction: TIS (truncated importance weights) and MIS/IcePop (ratio-weighted, with
  out-of-band tokens masked) at token, sequence or geometric-mean level, with mismatch metrics.
- Loss aggregation modes as verl's `agg_loss` (`agg_loss`).

Inputs (all [N, T], one row per response, T = response token axis):
    logprobs      log pi_theta(y_t)          current policy, differentiated
    old_logprobs  log pi_old(y_t)            the learner's recomputation for the behaviour policy
    rollout_logprobs  log pi_rollout(y_t)    what the sampler reported (may differ: kernels, precision, MoE routing)
    ref_logprobs  log pi_ref(y_t)            reference policy, for the KL penalty
    mask          1 on response tokens that count, 0 on prompt/padding
    advantages    [N] (broadcast over tokens) or [N, T]
Padding positions (mask == 0) of every input are zeroed before any arithmetic, so whatever a sampler leaves
there (0, -inf, NaN) reaches neither the loss, the metrics nor the gradient.

Exact gradient accumulation: a batch split into micro-batches gives exactly the full-batch loss (and
gradient) when every micro-batch passes the *full batch's* normalisers, `**loss_normalizers(full_mask, cfg)`,
to `policy_loss`; the per-micro-batch results are then summed, not averaged. With those normalisers every
returned metric is also additive across micro-batches (fractions are divided by the global token count).

`cfg` is a frozen (hashable) `LossConfig`: jit with `jax.jit(policy_loss, static_argnames="cfg")`.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_losses.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rl.config.algo import LossConfig

Metrics = dict[str, jnp.ndarray]

# exp() guard on policy log-ratios, both sides, PPO and GSPO alike; inactive for any sane policy. verl uses the same
# [-20, 20] for PPO (`compute_policy_loss_vanilla`), but for GSPO (`compute_policy_loss_gspo`) it clamps the combined
# sequence log-ratio from above only, at 10 (ratio <= e^10); the two differ only for |log s| > 10.
_LOG_RATIO_CLAMP = 20.0
# Output clamp of the k3 estimator (verl `kl_penalty(..., "low_var_kl")` clamps its result to [-10, 10]).
_K3_MAX = 10.0


def _safe_div(num: jnp.ndarray, den: jnp.ndarray | float) -> jnp.ndarray:
    """num / den, 0 where den == 0 (empty masks)."""
    den = jnp.asarray(den, jnp.float32)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def kl_penalty(
    logprobs: jnp.ndarray, ref_logprobs: jnp.ndarray, estimator: str = "k3", clamp: float | None = 20.0
) -> jnp.ndarray:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL divergence").

    With x = log pi - log pi_ref, clamped to [-clamp, clamp] when clamp is not None:
        k1 = x                       unbiased, high variance, can be negative
        k2 = x^2 / 2                 biased, low variance
        k3 = exp(-x) - (-x) - 1      unbiased, >= 0; its value is then clamped to [-10, 10]
    Convention followed: k3 with the default clamp=20 is exactly verl's `low_var_kl` (`core_algos.kl_penalty`:
    log-ratio clamped to [-20, 20], result to [-10, 10]), so k3 keeps its gradient where the output clamp is not
    reached: k3(x) = 10 at x = 11 - e^-11 ~ 11.0 for x > 0, and, because exp(-x) grows fast for x < 0, already at
    x ~ -2.611 (e^2.611 - 2.611 - 1 = 10). So the gradient survives for -2.611 < x < 11.0 and is zero outside
    (the log-ratio clamp at +-20 is never the binding one for k3). Deliberate difference: verl
    clamps only inside `low_var_kl`; here the same log-ratio clamp also applies to k1 and k2 (verl's "kl" and
    "mse" are unclamped), which only matters past |x| = clamp. A smaller clamp (e.g. 10) stops k3 at
    exp(-10) + 9 = 9.00005 with zero gradient for x >= 10.
    Args:
        logprobs, ref_logprobs: [N, T]. estimator: "k1" | "k2" | "k3". clamp: bound on |x|, None for none.
    Returns:
        [N, T] float32 (unmasked; aggregate with `agg_loss`).
    Raises:
        ValueError: unknown estimator.
    """
    x = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    if clamp is not None:
        x = jnp.clip(x, -clamp, clamp)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * jnp.square(x)
    if estimator == "k3":
        return jnp.clip(jnp.exp(-x) + x - 1.0, -_K3_MAX, _K3_MAX)
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def agg_loss(
    loss: jnp.ndarray,
    mask: jnp.ndarray,
    mode: str,
    *,
    norm_length: int | None = None,
    global_token_count: jnp.ndarray | float | None = None,
    global_seq_count: jnp.ndarray | float | None = None,
) -> jnp.ndarray:
    """Reduce a per-token loss [N, T] to a scalar (verl `agg_loss` modes).

        token-mean               sum(l m) / D_tok,               D_tok = sum(m)            (DAPO §3.3)
        seq-mean-token-mean      sum_i [sum_t l m / sum_t m] / D_seq, D_seq = #rows with >= 1 token (GRPO)
        seq-mean-token-sum-norm  sum(l m) / (D_seq * L),          D_seq = N, L = norm_length or T (Dr.GRPO)
    Conventions: token-mean and seq-mean-token-mean equal verl's modes of the same name. seq-mean-token-sum-norm
    follows TRL's `loss_type="dr_grpo"` and Tunix (divide by N * L, so the scale does not grow with the batch);
    verl's mode of the same name divides by L only (N times our value).
    `global_token_count` / `global_seq_count`, when given, replace D_tok / D_seq (see `loss_normalizers`).
    Rows without tokens contribute 0. Returns a float32 scalar.
    """
    m = jnp.asarray(mask, jnp.float32)
    lm = jnp.where(m > 0, jnp.asarray(loss, jnp.float32), 0.0) * m  # where: inf/NaN on padding cannot leak
    if mode == "token-mean":
        den = m.sum() if global_token_count is None else global_token_count
        return _safe_div(lm.sum(), den)
    if mode == "seq-mean-token-mean":
        tokens_n = m.sum(axis=-1)
        seq_mean_n = _safe_div(lm.sum(axis=-1), tokens_n)  # [N]
        den = (tokens_n > 0).sum() if global_seq_count is None else global_seq_count
        return _safe_div(seq_mean_n.sum(), den)
    if mode == "seq-mean-token-sum-norm":
        length = m.shape[-1] if norm_length is None else norm_length
        seqs = m.shape[0] if global_seq_count is None else global_seq_count
        return _safe_div(lm.sum(), jnp.asarray(seqs, jnp.float32) * length)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def loss_normalizers(mask: jnp.ndarray, cfg: LossConfig) -> dict[str, jnp.ndarray]:
    """The full batch's denominators, for exact accumulation over micro-batches split along N.

    Args:
        mask: [N, T] of the *whole* batch. cfg: its `loss_agg_mode` decides what counts as a sequence.
    Returns:
        {global_token_count: sum(mask), global_seq_count: #rows with >= 1 token (seq-mean-token-mean) or N
        (other modes)} as float32 scalars, ready for `policy_loss(..., **loss_normalizers(mask, cfg))`.
    """
    m = jnp.asarray(mask, jnp.float32)
    if cfg.loss_agg_mode == "seq-mean-token-mean":
        seqs = (m.sum(axis=-1) > 0).sum().astype(jnp.float32)
    else:
        seqs = jnp.asarray(m.shape[0], jnp.float32)
    return {"global_token_count": m.sum(), "global_seq_count": seqs}


def _policy_log_ratio(logprobs: jnp.ndarray, old_logprobs: jnp.ndarray, mask: jnp.ndarray, cfg: LossConfig):
    """Per-token log ratio [N, T] for PPO, or the GSPO token form of the sequence ratio.

    GSPO (arXiv 2507.18071 §4.2, "GSPO-token"): log s_i = mean_t (lp - old) over the sequence's tokens;
    log s_{i,t} = sg[log s_i] + lp_t - sg[lp_t], so its value is log s_i for every token and
    d s_{i,t} / d lp_t = s_i.
    """
    log_ratio = logprobs - old_logprobs
    if cfg.policy_loss == "gspo":
        seq_log_ratio = _safe_div((log_ratio * mask).sum(axis=-1, keepdims=True), mask.sum(axis=-1, keepdims=True))
        log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logprobs - jax.lax.stop_gradient(logprobs)
    return jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _clipped_pg(advantages: jnp.ndarray, ratio: jnp.ndarray, cfg: LossConfig):
    """Per-token clipped surrogate loss and its clip indicators.

    pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))            (PPO; DAPO clip-higher)
    for A < 0 with dual clip c: pg = min(pg, -A c)                    (dual-clip PPO, arXiv 1912.09729 eq. 5)
    Returns (pg [N, T], clipped [N, T] bool, dual_clipped [N, T] bool).
    """
    eps_low, eps_high = (
        (cfg.gspo_clip_eps_low, cfg.gspo_clip_eps_high) if cfg.policy_loss == "gspo"
        else (cfg.clip_eps_low, cfg.clip_eps_high)
    )
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = jnp.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual_clipped = jnp.zeros_like(clipped)
    if cfg.dual_clip_c is not None:
        pg_dual = -advantages * cfg.dual_clip_c
        negative = advantages < 0
        dual_clipped = negative & (pg > pg_dual)
        pg = jnp.where(negative, jnp.minimum(pg, pg_dual), pg)
    return pg, clipped, dual_clipped


def _correction_factor(old_logprobs: jnp.ndarray, rollout_logprobs: jnp.ndarray, mask: jnp.ndarray, cfg: LossConfig):
    """Off-policy correction factor [N, T] (no gradient) and its "clipped or masked" indicator [N, T].

    log w_t = log pi_old(y_t) - log pi_rollout(y_t); level token: log w_t; sequence: sum_t log w_t (product of
    ratios); geometric: mean_t log w_t; the sequence levels are broadcast over the row.
    TIS (Yao et al. 2025): factor = min(w, C), indicator w > C.
    MIS / IcePop (Ling team 2025, "IcePop"): factor = w * 1[mis_low <= w <= mis_high], i.e. kept tokens are
    weighted by their ratio itself and rejected ones get 0; indicator: the rejected ones. The normaliser is not
    changed: a rejected token counts in the denominator with zero loss (IcePop's objective). verl's rollout_rs
    "mask" mode with rollout_is weights keeps the same per-token numerators (ratio-weighted kept tokens, rejected
    ones 0) but rejects by zeroing the response mask (`modified_response_mask = response_mask * mask`), so its
    token-mean divides by the kept tokens only: verl's loss = ours x (valid tokens / kept tokens) for
    loss_agg_mode "token-mean" (the seq-mean modes likewise count only kept tokens per sequence).
    """
    log_w = jax.lax.stop_gradient((old_logprobs - rollout_logprobs) * mask)
    if cfg.correction_level == "sequence":
        log_w = jnp.broadcast_to(log_w.sum(axis=-1, keepdims=True), log_w.shape)
    elif cfg.correction_level == "geometric":
        seq = _safe_div(log_w.sum(axis=-1, keepdims=True), mask.sum(axis=-1, keepdims=True))
        log_w = jnp.broadcast_to(seq, log_w.shape)
    if cfg.correction == "tis":
        log_c = math.log(cfg.tis_clip_high)
        return jnp.exp(jnp.minimum(log_w, log_c)), log_w > log_c
    keep = (log_w >= math.log(cfg.mis_low)) & (log_w <= math.log(cfg.mis_high))
    # exp of the clipped log-weight: the kept band is bounded, and no inf/NaN is formed for rejected tokens.
    w_kept = jnp.exp(jnp.clip(log_w, math.log(cfg.mis_low), math.log(cfg.mis_high)))
    return jnp.where(keep, w_kept, 0.0), ~keep


def policy_loss(
    logprobs: jnp.ndarray,
    old_logprobs: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    cfg: LossConfig,
    *,
    rollout_logprobs: jnp.ndarray | None = None,
    ref_logprobs: jnp.ndarray | None = None,
    entropy: jnp.ndarray | None = None,
    global_token_count: jnp.ndarray | float | None = None,
    global_seq_count: jnp.ndarray | float | None = None,
) -> tuple[jnp.ndarray, Metrics]:
    """Clipped policy-gradient loss + optional KL penalty and entropy bonus (sources: `LossConfig` docstring).

    loss = agg(pg * c) + kl_coef * agg(kl(lp, ref)) - entropy_coef * agg(entropy)
    with pg from `_clipped_pg` on the PPO or GSPO ratio and c the TIS/MIS factor (1 when correction="none").

    Args:
        logprobs, old_logprobs, mask: [N, T]; advantages: [N] or [N, T].
        rollout_logprobs: [N, T], required when cfg.correction != "none"; when given, the mismatch metrics are
            reported either way.
        ref_logprobs: [N, T], required when cfg.kl_coef > 0 (kl_loss is reported whenever it is given).
        entropy: [N, T] per-token policy entropy, required when cfg.entropy_coef > 0.
        global_token_count, global_seq_count: the full batch's denominators (`loss_normalizers`) when this call
            sees one micro-batch; they replace the local ones in every aggregation and metric.
    Returns:
        (loss scalar, metrics): train/loss, train/pg_loss, train/pg_clipfrac, train/dual_clipfrac, train/ppo_kl,
        and when applicable train/kl_loss (unscaled), train/entropy, train/tis_clipfrac (TIS: fraction of tokens
        whose weight was truncated; MIS: fraction masked), train/train_rollout_logprob_abs_diff (masked mean
        |old - rollout|), train/train_rollout_kl (masked mean k3 estimate of KL(pi_rollout || pi_old): the samples
        come from the rollout policy, so with x = old - rollout the unbiased estimator is exp(x) - x - 1).
    """
    if logprobs.ndim != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs, old_logprobs, mask must share one [N, T] shape, got "
                         f"{logprobs.shape}, {old_logprobs.shape}, {mask.shape}")
    if cfg.correction != "none" and rollout_logprobs is None:
        raise ValueError(f"correction={cfg.correction!r} needs rollout_logprobs")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")

    m = jnp.asarray(mask, jnp.float32)
    valid = m > 0

    def clean(x):  # zero every padding position first: garbage there (inf/NaN) can reach neither loss nor grad
        return None if x is None else jnp.where(valid, jnp.asarray(x, jnp.float32), 0.0)

    lp, old, rollout, ref, entropy = (clean(x) for x in (logprobs, old_logprobs, rollout_logprobs, ref_logprobs,
                                                          entropy))
    adv = jnp.asarray(advantages, jnp.float32)
    adv = clean(adv[:, None] if adv.ndim == 1 else adv)  # [N] -> [N, 1] broadcast over tokens -> [N, T]

    def agg(x):
        return agg_loss(x, m, cfg.loss_agg_mode, norm_length=cfg.norm_length,
                        global_token_count=global_token_count, global_seq_count=global_seq_count)

    token_den = m.sum() if global_token_count is None else global_token_count

    def token_frac(x):  # masked mean over tokens, additive across micro-batches with the global count
        return _safe_div(jnp.where(valid, jnp.asarray(x, jnp.float32), 0.0).sum(), token_den)

    ratio = jnp.exp(_policy_log_ratio(lp, old, m, cfg))
    pg, clipped, dual_clipped = _clipped_pg(adv, ratio, cfg)
    metrics: Metrics = {
        "train/pg_clipfrac": token_frac(clipped),
        "train/dual_clipfrac": token_frac(dual_clipped),
        "train/ppo_kl": token_frac(old - lp),
    }
    if rollout is not None:
        metrics["train/train_rollout_logprob_abs_diff"] = token_frac(jnp.abs(old - rollout))
        metrics["train/train_rollout_kl"] = token_frac(kl_penalty(rollout, old, "k3", cfg.kl_clamp))
        if cfg.correction != "none":
            factor, corrected = _correction_factor(old, rollout, m, cfg)
            pg = pg * factor
            metrics["train/tis_clipfrac"] = token_frac(corrected)
    pg_loss = agg(pg)
    loss = pg_loss
    metrics["train/pg_loss"] = pg_loss
    if ref is not None:
        kl_loss = agg(kl_penalty(lp, ref, cfg.kl_estimator, cfg.kl_clamp))
        metrics["train/kl_loss"] = kl_loss
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
    if entropy is not None:
        entropy_mean = agg(entropy)
        metrics["train/entropy"] = entropy_mean
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy_mean
    metrics["train/loss"] = loss
    return loss, metrics


def mtp_mask(response_mask: jax.Array) -> jax.Array:
    """Response tokens the MTP loss scores: [N, S] f32, the response mask without each row's first two columns
    (the MTP block at j - 2 predicts token j)."""
    m = response_mask.astype(jnp.float32)
    return m.at[:, :2].set(0.0)
