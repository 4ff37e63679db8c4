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
     rl/rollout/sampling.py; temperature 0 = one-hot argmax, which makes the rule plain greedy decoding, up to the float
     rounding of the verify's wider GEMMs: dsv4/spec_decode.py "Exactness"), so every emitted token has exactly
     plain sampling's distribution.
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
Static batching (`spec_program`) and continuous batching (`spec_slots_program`, rl/rollout/slots.py's slots with one
speculative step per slot per iteration) share the step (`_Ctx.step`); a row's math reads only its own cache row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.chunked import chunk_multiple, prefill_chunked
from dsv4.spec_decode import commit, mtp_cache, mtp_forward, ring_commit, verify_forward
from rl.rollout import slots as slots_lib
from rl.rollout.sampling import filter_logits, sample_tokens

SPECULATIVE_MODES = ("off", "mtp")
_SALT = 0x5BEC  # key stream of the speculative draws (plain decoding folds in the token index only)


def check_speculative(speculative: str, draft_tokens: int, config) -> tuple[str, int]:
    """Validated (mode, k). ValueError (one line naming the flag) on a bad mode, k outside 1..3 or a model without
    an MTP block."""
    if speculative not in SPECULATIVE_MODES:
        raise ValueError(f"--rollout.speculative must be off | mtp, got {speculative!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= 3:
        raise ValueError(f"--rollout.draft_tokens must be an int in 1..3, got {draft_tokens!r}")
    if speculative == "mtp" and not config.num_nextn_predict_layers:
        raise ValueError("--rollout.speculative mtp: the model has no MTP block (num_nextn_predict_layers = 0)")
    return speculative, int(draft_tokens)


def cache_pad(config, k: int) -> int:
    """Extra cache positions a speculative rollout needs (a verify reaches k positions past the last token), rounded
    up to the compression ratios' lcm."""
    m = chunk_multiple(config)
    return -(-k // m) * m


def sampling_probs(logits: jax.Array, temperature, top_p, top_k) -> jax.Array:
    """The distribution plain sampling draws from (rl/rollout/sampling.py): logits [..., V] f32 -> probs [..., V] f32 of
    softmax(filter(logits / T)) (top-k then top-p), or one-hot at the argmax for temperature 0."""
    shape = logits.shape
    lg = logits.reshape(-1, shape[-1])
    greedy = temperature <= 0
    scaled = lg / jnp.where(greedy, 1.0, temperature)
    filtered = jax.lax.cond((top_k > 0) | (top_p < 1), filter_logits, lambda s, p, k: s, scaled, top_p, top_k)
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


class _Ctx:
    """What every step of a speculative program reads: the model (shell), layer_fn, dispatch, k, sampling params,
    stop ids."""

    def __init__(self, sampler, wstate, temperature, top_p, top_k, stop_ids):
        layerwise = sampler.dequant == "per_layer"
        self.model = sampler.layerwise.shell(wstate) if layerwise else sampler.dense_model(wstate)
        self.layer_fn = sampler.layerwise.layer_fn(wstate) if layerwise else None
        self.fn, self.k, self.sampler = sampler.dispatch_fn, sampler.draft_tokens, sampler
        self.temperature, self.top_p, self.top_k, self.stop_ids = temperature, top_p, top_k, stop_ids
        self.w_mtp = self.model.mtp[0].attn.window

    def is_stop(self, tok):
        return jnp.any(tok[..., None] == self.stop_ids, axis=-1)

    def prefill(self, ids, lens, cache_len, keys):
        """Prefill + first token (plain decoding's draw) + the MTP block over the prompt's last W positions:
        (h_t, token t + 1) for t = L - W .. L - 1, token L = the first token. Returns (tok0, lp0, prompt routing,
        caches, MTP cache, q_1 logits [R, V], streams [R, n, D])."""
        s = self.sampler
        with jax.named_scope("prefill"):
            logits, routing, caches, tail = prefill_chunked(self.model, ids, lens, cache_len, s.prefill_chunk,
                                                            dispatch_fn=self.fn, layer_fn=self.layer_fn,
                                                            kv_fp8=s.kv_fp8, tail=self.w_mtp)
        tok0, lp0 = sample_tokens(logits, jax.vmap(lambda kk: jax.random.fold_in(kk, 0))(keys), self.temperature,
                                  self.top_p, self.top_k)
        w, p = self.w_mtp, ids.shape[1]
        tpos = lens[:, None] - w + jnp.arange(w)[None]
        nxt = jnp.where(tpos + 1 < lens[:, None], jnp.take_along_axis(ids, jnp.clip(tpos + 1, 0, p - 1), 1),
                        tok0[:, None])
        mc = mtp_cache(self.model, ids.shape[0], s.compute_dtype, s.kv_fp8)
        with jax.named_scope("draft"):
            qlg, xo, kv = mtp_forward(self.model, tail, nxt, lens - w, mc, dispatch_fn=self.fn)
        ring_commit(mc, kv, tpos, tpos >= 0, w)
        return tok0, lp0, routing, caches, mc, qlg[:, -1], xo[:, -1]

    def step(self, st: dict, out: dict, orow, live, keys, lens, max_new):
        """One speculative step of every row (see the module docstring). st: per-row state {cur, len, fed, done,
        stop, caches, mc, q1, x1} [R, ...]; out: {tok, lp, rr} [N, width, ...] written at rows orow [R] (rows
        out of range and columns past the width are dropped); live [R]: rows holding a sample; keys, lens,
        max_new [R]: each row's key, prompt length and length limit. Returns (st, out, stats [3] f32 = tokens
        emitted, verify steps of active rows, accepted drafts)."""
        k, k1 = self.k, self.k + 1
        t, tp, tk = self.temperature, self.top_p, self.top_k
        model, fn = self.model, self.fn
        cur, length, fed, done, caches, mc = st["cur"], st["len"], st["fed"], st["done"], st["caches"], st["mc"]
        active = live & ~done
        pos = lens + length - 1  # position of cur
        sk = jax.vmap(lambda kk, g: jax.random.split(jax.random.fold_in(jax.random.fold_in(kk, _SALT), g), k1))(
            keys, length)  # [R, k+1]: k draft draws, then the acceptance
        drafts, qs = [], []
        ql, xh, ext = st["q1"], st["x1"], None
        with jax.named_scope("draft"):
            for j in range(k):
                qp = sampling_probs(ql, t, tp, tk)
                d = jax.vmap(_draw)(sk[:, j], qp)
                drafts.append(d)
                qs.append(qp)
                if j + 1 < k:  # chained: the block's own output streams at the next position
                    lg, xo, kv = mtp_forward(model, xh[:, None], d[:, None], pos + j, mc, extra=ext, dispatch_fn=fn)
                    kvp = (kv, (pos + j)[:, None])
                    ext = kvp if ext is None else tuple(jnp.concatenate([e, n], 1) for e, n in zip(ext, kvp))
                    ql, xh = lg[:, 0], xo[:, 0]
        drafts = jnp.stack(drafts, 1)  # [R, k]
        with jax.named_scope("verify"):
            vlg, rt, hs, pending = verify_forward(model, jnp.concatenate([cur[:, None], drafts], axis=1), pos, caches,
                                                  dispatch_fn=fn, layer_fn=self.layer_fn)
        a, y = accept_drafts(sampling_probs(vlg, t, tp, tk), jnp.stack(qs, 1), drafts, sk[:, k])
        j1 = jnp.arange(k1)[None]
        emit = jnp.where(j1 < a[:, None], jnp.concatenate([drafts, drafts[:, :1]], 1), y[:, None])  # [R, k+1]
        lp_all = jax.nn.log_softmax(vlg / jnp.where(t <= 0, 1.0, t), axis=-1)
        lp = jnp.take_along_axis(lp_all, emit[:, :, None], -1)[..., 0]
        stp = self.is_stop(emit) & (j1 <= a[:, None])
        first_stop = jnp.where(jnp.any(stp, 1), jnp.argmax(stp, 1), k1)
        n_emit = jnp.minimum(jnp.minimum(a + 1, max_new - length), first_stop + 1)
        n_emit = jnp.where(active, jnp.maximum(n_emit, 0), 0)
        wr = j1 < n_emit[:, None]
        far = jnp.iinfo(jnp.int32).max
        col = jnp.where(wr, length[:, None] + j1, far)
        out = dict(out, tok=out["tok"].at[orow[:, None], col].set(emit, mode="drop"),
                   lp=out["lp"].at[orow[:, None], col].set(lp, mode="drop"))
        # routing of the fed tokens that are response tokens: cur, then the emitted drafts
        n_rec = jnp.where(active, 1 + jnp.minimum(a, n_emit), (live & (fed < length)).astype(jnp.int32))
        rcol = jnp.where(j1 < n_rec[:, None], fed[:, None] + j1, far)
        out["rr"] = out["rr"].at[orow[:, None], rcol].set(rt, mode="drop")
        n_commit = jnp.where(active, a + 1, 0)
        caches = commit(caches, pending, pos, n_commit)
        # the MTP block over the verified positions with the main model's streams: q_1 of the next step
        with jax.named_scope("draft"):
            qlg, xo, kv = mtp_forward(model, hs, emit, pos, mc, dispatch_fn=fn)
        ring_commit(mc, kv, pos[:, None] + j1, j1 < n_commit[:, None], self.w_mtp)
        rows = jnp.arange(a.shape[0])
        stop = active & jnp.any(stp & wr, 1)
        last = jnp.take_along_axis(emit, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
        stats = jnp.stack([jnp.sum(n_emit), jnp.sum(active), jnp.sum(jnp.where(active, a, 0))]).astype(jnp.float32)
        length = length + n_emit
        st = dict(st, cur=jnp.where(n_emit > 0, last, cur), len=length, fed=fed + n_rec, caches=caches, mc=mc,
                  done=done | stop | (length >= max_new), stop=st["stop"] | stop,
                  q1=jnp.where(active[:, None], qlg[rows, a], st["q1"]),
                  x1=jnp.where(active[:, None, None], xo[rows, a], st["x1"]))
        return st, out, stats


def spec_program(sampler, shape, wstate, caches, ids, lens, key_data, temperature, top_p, top_k, max_new, stop_ids):
    """The static-batch speculative rollout (traced by the sampler's generate jit); inputs and outputs as
    `rl.rollout.static.static_program` plus stats [3] f32 = (tokens emitted, verify steps of live rows, accepted drafts)
    before the caches. shape = (B, P, T) static; the caches hold P + T + `cache_pad` positions."""
    b, p, t_cap = shape
    cfg = sampler.config
    n_l, ke = cfg.num_hidden_layers, cfg.num_experts_per_tok
    keys = jax.random.wrap_key_data(key_data)
    ctx = _Ctx(sampler, wstate, temperature, top_p, top_k, stop_ids)
    del caches  # the prefill builds them (the donated zeros only fix the signature)
    tok0, lp0, prompt_routing, caches, mc, q1, x1 = ctx.prefill(ids, lens, p + t_cap + cache_pad(cfg, ctx.k), keys)
    stop0 = ctx.is_stop(tok0)
    out = {"tok": jnp.zeros((b, t_cap), jnp.int32).at[:, 0].set(tok0),
           "lp": jnp.zeros((b, t_cap), jnp.float32).at[:, 0].set(lp0),
           "rr": jnp.full((b, t_cap, n_l, ke), -1, jnp.int32)}
    st = {"cur": tok0, "len": jnp.ones((b,), jnp.int32), "fed": jnp.zeros((b,), jnp.int32),
          "done": stop0 | (max_new <= 1), "stop": stop0, "caches": caches, "mc": mc, "q1": q1, "x1": x1}
    rows, live = jnp.arange(b), jnp.ones((b,), bool)

    def body(c):
        st, out, stats = c
        st, out, s = ctx.step(st, out, rows, live, keys, lens, max_new)
        return st, out, stats + s

    st, out, stats = jax.lax.while_loop(lambda c: jnp.any(c[0]["fed"] < c[0]["len"]), body,
                                        (st, out, jnp.zeros((3,), jnp.float32)))
    return out["tok"], out["lp"], prompt_routing, out["rr"], st["len"], st["stop"], stats, st["caches"]


def spec_slots_program(sampler, shape, wstate, caches, ids, lens, key_data, n_real, temperature, top_p, top_k,
                       max_new, stop_ids):
    """Continuous batching with speculative steps (rl/rollout/slots.py's program, traced by the sampler's slots
    jit; the same inputs and outputs, stats [6] f32 = rl/rollout/slots.py's three then `spec_program`'s three). A request is admitted
    into a free slot by its own prefill (+ the MTP block over its prompt tail); each step advances every slot by
    one speculative step; a slot whose sample has ended (its last token fed) writes its result and is freed."""
    nb, p, t_cap, s = shape
    cfg = sampler.config
    n_l, ke = cfg.num_hidden_layers, cfg.num_experts_per_tok
    cache_len = slots_lib.cache_len_for(cfg, p, t_cap + cache_pad(cfg, sampler.draft_tokens))
    keys = jax.random.wrap_key_data(key_data)
    ctx = _Ctx(sampler, wstate, temperature, top_p, top_k, stop_ids)
    def put_row(big, small, j):
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), j, 0)

    def admit(c):
        st, out, misc = c
        j = jnp.argmax(st["req"] < 0).astype(jnp.int32)
        r = misc["next"]
        row_ids = jax.lax.dynamic_slice_in_dim(ids, r, 1, 0)
        row_len = jax.lax.dynamic_slice_in_dim(lens, r, 1, 0)
        tok0, lp0, pr, c1, mc1, q1, x1 = ctx.prefill(row_ids, row_len, cache_len, keys[r][None])
        st = dict(st)
        for name, small in (("caches", c1), ("mc", mc1), ("q1", q1), ("x1", x1)):
            st[name] = jax.tree.map(lambda big, sm: put_row(big, sm, j), st[name], small)
        stop0 = ctx.is_stop(tok0)[0]
        out = dict(out, tok=out["tok"].at[r, 0].set(tok0[0]), lp=out["lp"].at[r, 0].set(lp0[0]),
                   pr=out["pr"].at[r].set(pr[0]))
        misc = dict(misc, refills=misc["refills"] + st["used"][j].astype(jnp.float32), next=r + 1)
        for name, val in (("req", r), ("fed", 0), ("len", 1), ("done", stop0 | (max_new[r] <= 1)), ("stop", stop0),
                          ("cur", tok0[0]), ("used", True)):
            st[name] = st[name].at[j].set(val)
        return st, out, misc

    def step(c):
        c = jax.lax.while_loop(lambda c: jnp.any(c[0]["req"] < 0) & (c[2]["next"] < n_real), admit, c)
        st, out, misc = c
        live = st["req"] >= 0
        req = jnp.where(live, st["req"], 0)
        st, out, sp = ctx.step(st, out, jnp.where(live, st["req"], nb), live, keys[req], lens[req], max_new[req])
        fin = live & st["done"] & (st["fed"] >= st["len"])
        fdrop = jnp.where(fin, st["req"], nb)
        out = dict(out, len=out["len"].at[fdrop].set(st["len"], mode="drop"),
                   stop=out["stop"].at[fdrop].set(st["stop"], mode="drop"))
        st = dict(st, req=jnp.where(fin, -1, st["req"]))
        misc = dict(misc, finished=misc["finished"] + jnp.sum(fin).astype(jnp.int32), spec=misc["spec"] + sp,
                    busy=misc["busy"] + jnp.sum(live).astype(jnp.float32), steps=misc["steps"] + 1.0)
        return st, out, misc

    z = lambda dt: jnp.zeros((s,), dt)  # noqa: E731
    model = ctx.model
    mc = mtp_cache(model, s, sampler.compute_dtype, sampler.kv_fp8)
    st = {"caches": caches, "mc": mc, "req": jnp.full((s,), -1, jnp.int32), "fed": z(jnp.int32),
          "len": z(jnp.int32), "done": z(bool), "stop": z(bool), "cur": z(jnp.int32), "used": z(bool),
          "q1": jnp.zeros((s, cfg.vocab_size), jnp.float32),
          "x1": jnp.zeros((s, cfg.hc_mult, cfg.hidden_size), ctx.sampler.compute_dtype)}
    out = {"tok": jnp.zeros((nb, t_cap), jnp.int32), "lp": jnp.zeros((nb, t_cap), jnp.float32),
           "pr": jnp.full((nb, p, n_l, ke), -1, jnp.int32), "rr": jnp.full((nb, t_cap, n_l, ke), -1, jnp.int32),
           "len": jnp.zeros((nb,), jnp.int32), "stop": jnp.zeros((nb,), bool)}
    misc = {"next": jnp.int32(0), "finished": jnp.int32(0), "refills": jnp.float32(0), "busy": jnp.float32(0),
            "steps": jnp.float32(0), "spec": jnp.zeros((3,), jnp.float32)}
    st, out, misc = jax.lax.while_loop(lambda c: c[2]["finished"] < n_real, step, (st, out, misc))
    stats = jnp.concatenate([jnp.stack([misc["refills"], misc["busy"], misc["steps"]]), misc["spec"]])
    return out["tok"], out["lp"], out["pr"], out["rr"], out["len"], out["stop"], stats, st["caches"]


def spec_stats(stats, k: int) -> dict:
    """Host metrics from the program's stats [tokens emitted, verify steps, accepted drafts]."""
    emitted, steps, accepted = (float(x) for x in stats)
    return {"rollout/spec_accept_len": emitted / max(steps, 1.0),
            "rollout/spec_accept_rate": accepted / max(steps * k, 1.0)}


__all__ = ["SPECULATIVE_MODES", "accept_drafts", "cache_pad", "check_speculative", "sampling_probs",
           "spec_program", "spec_slots_program", "spec_stats"]
