"""Speculative decoding in the rollout with DeepSeek-V4's own MTP block as the draft (`--rollout.speculative mtp`,
`--rollout.draft_tokens k`, k = 1..3; `Sampler(speculative="mtp", draft_tokens=k)`).

Each decode step of a row (cur = its last emitted token, not yet fed, at position P):
  1. draft: the MTP block's logits at P - 1 (from the previous step) give q_1; d_1 ~ filter(q_1). Chained, the
     block is fed its own output streams and d_j at P + j - 2 for q_{j+1} (as DeepSeek-V3/V4 serving does).
  2. verify: one main-model forward of [cur, d_1 .. d_k] at P .. P + k against the caches (`dsv4.spec_decode`:
     the caches are only read) -> p_0 .. p_k.
  3. accept (`accept_drafts`, the standard rule of Leviathan et al. / Chen et al. 2023): d_j is kept with
     probability min(1, p_{j-1}(d_j) / q_j(d_j)) while all before it were; at the first rejection the token is
     drawn from norm(max(0, p_{j-1} - q_j)), and after k acceptances a bonus token from p_k. p and q are the
     distributions plain sampling draws from (`sampling_probs`: temperature, then top-k and top-p, the filters of
     rl/sampling.py; temperature 0 = one-hot argmax, which makes the rule plain greedy decoding), so every emitted
     token has exactly plain sampling's distribution.
  4. emit the a accepted drafts and the drawn token, cut at a stop token or `max_new_tokens`; commit the caches
     for the a + 1 fed positions only (rejected positions never touch the caches: `dsv4.spec_decode`), run the
     MTP block over the verified positions with the main model's streams (commit its ring likewise) -> next q_1.
What the learner sees is plain decoding's: logprobs log_softmax(p_logits / T) at each emitted token from the
verify forward (the main model; never the draft), and the main model's routing of every fed token (the last
emitted token is fed once more as plain decoding does, so its routing is recorded too).
Randomness: per row, from its key folded with a salt and the row's emitted-token count at the step (draws,
acceptance uniforms, residual draw), so a row's result does not depend on its neighbours or the batch size.
After the prompt's prefill (first token drawn exactly as plain decoding draws it), the MTP block runs over the
prompt's last W positions (W = its window) to fill its ring and give the first q_1.
Metrics (`Sampler.last_stats`): rollout/spec_accept_len (mean tokens emitted per verify step of a live row) and
rollout/spec_accept_rate (accepted drafts / proposed drafts).
Static batching only (`slots=0`); continuous batching with speculation is not implemented (ValueError).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.chunked import chunk_multiple, prefill_chunked
from dsv4.spec_decode import commit, mtp_cache, mtp_forward, ring_commit, verify_forward
from rl.sampling import _filter_logits, sample_tokens

SPECULATIVE_MODES = ("off", "mtp")
_SALT = 0x5BEC  # key stream of the speculative draws (plain decoding folds in the token index only)


def check_speculative(speculative: str, draft_tokens: int, config, slots: int) -> tuple[str, int]:
    """Validated (mode, k). ValueError (one line naming the flag) on a bad mode, k outside 1..3, a model without an
    MTP block, or continuous batching."""
    if speculative not in SPECULATIVE_MODES:
        raise ValueError(f"--rollout.speculative must be off | mtp, got {speculative!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= 3:
        raise ValueError(f"--rollout.draft_tokens must be an int in 1..3, got {draft_tokens!r}")
    if speculative == "mtp" and not config.num_nextn_predict_layers:
        raise ValueError("--rollout.speculative mtp: the model has no MTP block (num_nextn_predict_layers = 0)")
    if speculative == "mtp" and slots:
        raise ValueError("--rollout.speculative mtp: continuous batching (--rollout-slots) is not supported yet; "
                         "use --rollout-slots 0")
    return speculative, int(draft_tokens)


def cache_pad(config, k: int) -> int:
    """Extra cache positions a speculative rollout needs (a verify reaches k positions past the last token), rounded
    up to the compression ratios' lcm."""
    m = chunk_multiple(config)
    return -(-k // m) * m


def sampling_probs(logits: jax.Array, temperature, top_p, top_k) -> jax.Array:
    """The distribution plain sampling draws from (rl/sampling.py): logits [..., V] f32 -> probs [..., V] f32 of
    softmax(filter(logits / T)) (top-k then top-p), or one-hot at the argmax for temperature 0."""
    shape = logits.shape
    lg = logits.reshape(-1, shape[-1])
    greedy = temperature <= 0
    scaled = lg / jnp.where(greedy, 1.0, temperature)
    filtered = jax.lax.cond((top_k > 0) | (top_p < 1), _filter_logits, lambda s, p, k: s, scaled, top_p, top_k)
    probs = jnp.where(greedy, jax.nn.one_hot(jnp.argmax(lg, -1), shape[-1], dtype=jnp.float32),
                      jax.nn.softmax(filtered, axis=-1))
    return probs.reshape(shape)


def _draw(key, probs):
    """One token ~ probs [V] (zero entries never drawn)."""
    return jax.random.categorical(key, jnp.log(probs)).astype(jnp.int32)


def accept_drafts(p: jax.Array, q: jax.Array, drafts: jax.Array, keys: jax.Array):
    """The speculative-sampling rule, per row.

    p [B, k+1, V] target probabilities at the k+1 verified positions, q [B, k, V] the draft probabilities the
    drafts [B, k] were drawn from, keys [B] PRNG keys. Returns (a [B] int32 accepted drafts in 0..k, y [B] int32
    the token drawn after them: from norm(max(0, p_a - q_{a+1})) when a < k, else from p_k).
    """
    b, k1, v = p.shape
    k = k1 - 1
    rows = jnp.arange(b)
    ks = jax.vmap(lambda kk: jax.random.split(kk, 2))(keys)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(ks[:, 0])  # [B, k] in [0, 1)
    pd = jnp.take_along_axis(p[:, :k], drafts[:, :, None], -1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[:, :, None], -1)[..., 0]
    ok = u * qd < pd  # accept with probability min(1, pd / qd) (qd > 0: d was drawn from q)
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)  # no draft after the bonus position
    resid = jnp.maximum(p[rows, a] - q_pad[rows, a], 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p[rows, a])  # p == q: a rejection has prob. 0
    y = jax.vmap(_draw)(ks[:, 1], resid / jnp.sum(resid, -1, keepdims=True))
    return a, y


def spec_program(sampler, shape, wstate, caches, ids, lens, key_data, temperature, top_p, top_k, max_new, stop_ids):
    """The static-batch speculative rollout (traced by `Sampler._spec_jit`); inputs and outputs as
    `Sampler._generate_fn` plus stats [2] f32 = (tokens emitted, verify steps of live rows, accepted drafts)
    before the caches. shape = (B, P, T) static; the caches hold P + T + `cache_pad` positions."""
    b, p, t_cap = shape
    k = sampler.draft_tokens
    k1 = k + 1
    cfg = sampler.config
    n_l, ke = cfg.num_hidden_layers, cfg.num_experts_per_tok
    cache_len = p + t_cap + cache_pad(cfg, k)
    keys = jax.random.wrap_key_data(key_data)
    rows = jnp.arange(b)
    layerwise = sampler.dequant == "per_layer"
    model = sampler._layerwise.shell(wstate) if layerwise else sampler._model(wstate)
    layer_fn = sampler._layerwise.layer_fn(wstate) if layerwise else None
    fn = sampler.dispatch_fn
    w_mtp = model.mtp[0].attn.window
    with jax.named_scope("prefill"):
        logits, prompt_routing, caches, tail = prefill_chunked(model, ids, lens, cache_len, sampler.prefill_chunk,
                                                               dispatch_fn=fn, layer_fn=layer_fn,
                                                               kv_fp8=sampler.kv_fp8, tail=w_mtp)
    tok0, lp0 = sample_tokens(logits, jax.vmap(lambda kk: jax.random.fold_in(kk, 0))(keys), temperature, top_p,
                              top_k)

    def is_stop(tok):
        return jnp.any(tok[..., None] == stop_ids, axis=-1)

    # the MTP block over the prompt's last W positions: (h_t, token t + 1) for t = L - W .. L - 1 (token L = tok0)
    tpos = lens[:, None] - w_mtp + jnp.arange(w_mtp)[None]
    nxt = jnp.where(tpos + 1 < lens[:, None], jnp.take_along_axis(ids, jnp.clip(tpos + 1, 0, p - 1), 1), tok0[:, None])
    mc = mtp_cache(model, b, sampler.compute_dtype, sampler.kv_fp8)
    with jax.named_scope("draft"):
        qlg, xo, kv = mtp_forward(model, tail, nxt, lens - w_mtp, mc, dispatch_fn=fn)
    ring_commit(mc, kv, tpos, tpos >= 0, w_mtp)
    q1, x1 = qlg[:, -1], xo[:, -1]

    stop0 = is_stop(tok0)
    pad = t_cap + k1 + 1
    out_tok = jnp.zeros((b, pad), jnp.int32).at[:, 0].set(tok0)
    out_lp = jnp.zeros((b, pad), jnp.float32).at[:, 0].set(lp0)
    out_rr = jnp.full((b, pad, n_l, ke), -1, jnp.int32)
    done = stop0 | (max_new <= 1)
    length, fed = jnp.ones((b,), jnp.int32), jnp.zeros((b,), jnp.int32)
    stats = jnp.zeros((3,), jnp.float32)
    carry = (tok0, length, fed, done, stop0, out_tok, out_lp, out_rr, caches, mc, q1, x1, stats)
    j1 = jnp.arange(k1)[None]

    def cond(c):
        return jnp.any(c[2] < c[1])

    def body(c):
        cur, length, fed, done, stopped, out_tok, out_lp, out_rr, caches, mc, q1, x1, stats = c
        active = ~done
        pos = lens + length - 1  # position of cur
        sk = jax.vmap(lambda kk, g: jax.random.split(jax.random.fold_in(jax.random.fold_in(kk, _SALT), g), k1))(
            keys, length)  # [B, k+1]: k draft draws, then the acceptance
        drafts, qs = [], []
        ql, xh, ext = q1, x1, None
        with jax.named_scope("draft"):
            for j in range(k):
                qp = sampling_probs(ql, temperature, top_p, top_k)
                d = jax.vmap(_draw)(sk[:, j], qp)
                drafts.append(d)
                qs.append(qp)
                if j + 1 < k:  # chained: the block's own output streams at the next position
                    lg, xo, kv = mtp_forward(model, xh[:, None], d[:, None], pos + j, mc, extra=ext, dispatch_fn=fn)
                    kvp = (kv, (pos + j)[:, None])
                    ext = kvp if ext is None else tuple(jnp.concatenate([e, n], 1) for e, n in zip(ext, kvp))
                    ql, xh = lg[:, 0], xo[:, 0]
        drafts = jnp.stack(drafts, 1)  # [B, k]
        fed_tok = jnp.concatenate([cur[:, None], drafts], axis=1)
        with jax.named_scope("verify"):
            vlg, rt, hs, pending = verify_forward(model, fed_tok, pos, caches, dispatch_fn=fn, layer_fn=layer_fn)
        pv = sampling_probs(vlg, temperature, top_p, top_k)
        a, y = accept_drafts(pv, jnp.stack(qs, 1), drafts, sk[:, k])
        emit = jnp.where(j1 < a[:, None], jnp.concatenate([drafts, drafts[:, :1]], 1), y[:, None])  # [B, k+1]
        greedy = temperature <= 0
        lp_all = jax.nn.log_softmax(vlg / jnp.where(greedy, 1.0, temperature), axis=-1)
        lp = jnp.take_along_axis(lp_all, emit[:, :, None], -1)[..., 0]
        st = is_stop(emit) & (j1 <= a[:, None])
        first_stop = jnp.where(jnp.any(st, 1), jnp.argmax(st, 1), k1)
        n_emit = jnp.minimum(jnp.minimum(a + 1, max_new - length), first_stop + 1)
        n_emit = jnp.where(active, jnp.maximum(n_emit, 0), 0)
        wr = j1 < n_emit[:, None]
        col = jnp.where(wr, length[:, None] + j1, pad - 1)
        out_tok = out_tok.at[rows[:, None], col].set(jnp.where(wr, emit, out_tok[rows[:, None], col]))
        out_lp = out_lp.at[rows[:, None], col].set(jnp.where(wr, lp, out_lp[rows[:, None], col]))
        # routing of the fed tokens that are response tokens: cur, then the emitted drafts
        n_rec = jnp.where(active, 1 + jnp.minimum(a, n_emit), (fed < length).astype(jnp.int32))
        rec = j1 < n_rec[:, None]
        rcol = jnp.where(rec, fed[:, None] + j1, pad - 1)
        out_rr = out_rr.at[rows[:, None], rcol].set(jnp.where(rec[..., None, None], rt, out_rr[rows[:, None], rcol]))
        n_commit = jnp.where(active, a + 1, 0)
        caches = commit(caches, pending, pos, n_commit)
        # the MTP block over the verified positions with the main model's streams; q_1 of the next step
        with jax.named_scope("draft"):
            qlg, xo, kv = mtp_forward(model, hs, emit, pos, mc, dispatch_fn=fn)
        ring_commit(mc, kv, pos[:, None] + j1, j1 < n_commit[:, None], w_mtp)
        q1 = jnp.where(active[:, None], qlg[rows, a], q1)
        x1 = jnp.where(active[:, None, None], xo[rows, a], x1)
        stop = active & jnp.any(st & wr, 1)
        last = jnp.take_along_axis(emit, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
        cur = jnp.where(n_emit > 0, last, cur)
        stats = stats + jnp.stack([jnp.sum(n_emit), jnp.sum(active), jnp.sum(jnp.where(active, a, 0))]).astype(
            jnp.float32)
        length = length + n_emit
        fed = fed + n_rec
        done = done | stop | (length >= max_new)
        return (cur, length, fed, done, stopped | stop, out_tok, out_lp, out_rr, caches, mc, q1, x1, stats)

    out = jax.lax.while_loop(cond, body, carry)
    _, length, _, _, stopped, out_tok, out_lp, out_rr, caches, _, _, _, stats = out
    return (out_tok[:, :t_cap], out_lp[:, :t_cap], prompt_routing, out_rr[:, :t_cap], length, stopped, stats,
            caches)


def spec_stats(stats, k: int) -> dict:
    """Host metrics from the program's stats [tokens emitted, verify steps, accepted drafts]."""
    emitted, steps, accepted = (float(x) for x in stats)
    return {"rollout/spec_accept_len": emitted / max(steps, 1.0),
            "rollout/spec_accept_rate": accepted / max(steps * k, 1.0)}


__all__ = ["SPECULATIVE_MODES", "accept_drafts", "cache_pad", "check_speculative", "sampling_probs",
           "spec_program", "spec_stats"]
