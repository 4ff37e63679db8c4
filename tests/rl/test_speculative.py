"""Speculative decoding with the MTP block (rl/rollout/speculative.py, dsv4/spec_decode.py): the acceptance rule's output
distribution, the verify + commit caches against one-token decoding, greedy rollouts equal to plain ones (tokens,
logprobs, routing; independent of the batch around a row), sampled rollouts' logprobs and routing against the full
forward, and the decoupled on-policy MTP loss with the push carrying its weights.

Model: the tiny config (window 8, CSA m=4, HCA m=8, hash layer, MTP block) in float32; few compiles.
"""

import sys
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from dsv4.cache import decode_step, prefill
from dsv4.chunked import prefill_chunked
from dsv4.model import Block
from dsv4.quant import dequantize_fp8_blockwise
from dsv4.spec_decode import commit, verify_forward
from rl.config.algo import SPECULATIVE_MTP_LOSS_WEIGHT, LearnerConfig
from rl.config.run import RunConfig
from rl.algo.batch import TrainBatch
from rl.algo.learner import Learner
from rl.algo.optim import clip_by_global_norm_apart
from rl.algo.logprobs import token_logprobs
from rl.rollout.engine import Sampler, SamplingParams
from rl.rollout.speculative import accept_drafts, check_speculative, sampling_probs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import randomize  # noqa: E402

CFG = DSV4Config.tiny()


@pytest.fixture(scope="module")
def model():
    return randomize(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), seed=2, scale=0.1)


def _chi2(counts, probs):
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the filtered support was emitted"
    e = n * probs[keep]
    return float((((counts[keep] - e) ** 2) / e).sum()), int(keep.sum()) - 1


def test_acceptance_rule_emits_the_target_distribution():
    """k = 2 drafts over a 6-token vocabulary, p and q after temperature 0.8, top-k 5 and top-p 0.95: the first
    emitted token ~ p_0 and, where d_1 was accepted, the second ~ p_1 (a context-free target: p_j does not
    depend on the prefix). Pearson chi-square with a fixed seed over 200k rows; the bound is the 1e-6 upper
    quantile of chi2 with df <= 5 (~ 35.9): a correct rule fails for one seed in a million, while emitting q
    instead of p gives a statistic in the thousands (checked below)."""
    v, n, k = 6, 200_000, 2
    rs = np.random.RandomState(0)
    temp, top_p, top_k = jnp.float32(0.8), jnp.float32(0.95), jnp.int32(5)
    p = sampling_probs(jnp.asarray(rs.normal(size=(k + 1, v)) * 1.5, jnp.float32), temp, top_p, top_k)
    q = sampling_probs(jnp.asarray(rs.normal(size=(k, v)) * 1.5, jnp.float32), temp, top_p, top_k)
    keys = jax.random.split(jax.random.key(0), 2 * n + 1)
    drafts = jnp.stack([jax.vmap(lambda kk, j=j: jax.random.categorical(kk, jnp.log(q[j])))(keys[j * n:(j + 1) * n])
                        for j in range(k)], 1).astype(jnp.int32)
    a, y = jax.jit(accept_drafts)(jnp.broadcast_to(p, (n, k + 1, v)), jnp.broadcast_to(q, (n, k, v)), drafts,
                                  jax.random.split(keys[-1], n))
    a, y, d = np.asarray(a), np.asarray(y), np.asarray(drafts)
    first = np.where(a >= 1, d[:, 0], y)
    pn, qn = np.asarray(p, np.float64), np.asarray(q, np.float64)
    stat, df = _chi2(np.bincount(first, minlength=v), pn[0])
    assert stat < 35.9, f"first token: chi2 {stat:.1f} (df {df})"
    sel = a >= 1
    second = np.where(a[sel] >= 2, d[sel, 1], y[sel])
    stat2, df2 = _chi2(np.bincount(second, minlength=v), pn[1])
    assert stat2 < 35.9, f"second token: chi2 {stat2:.1f} (df {df2})"
    assert 0.2 < sel.mean() < 0.95  # both branches exercised
    wrong = np.bincount(d[:, 0], minlength=v)  # the drafts themselves: q, not p
    assert ((wrong - n * pn[0]) ** 2 / np.maximum(n * pn[0], 1)).sum() > 1000
    # greedy (temperature 0): one-hot p and q -> accept while the draft is the argmax, then the argmax
    lg = jnp.asarray(rs.normal(size=(3, k + 1, v)), jnp.float32)
    best = np.argmax(np.asarray(lg), -1)  # [3, k+1]
    dg = np.array([[best[0, 0], best[0, 1]], [best[1, 0], (best[1, 1] + 1) % v], [(best[2, 0] + 1) % v, best[2, 1]]])
    ag, yg = accept_drafts(sampling_probs(lg, jnp.float32(0), top_p, top_k), jax.nn.one_hot(dg, v),
                           jnp.asarray(dg, jnp.int32), jax.random.split(jax.random.key(1), 3))
    assert list(np.asarray(ag)) == [2, 1, 0]
    assert list(np.asarray(yg)) == [best[0, 2], best[1, 1], best[2, 0]]


def test_verify_and_commit_leave_the_caches_of_one_token_decoding(monkeypatch):
    """Verify k + 1 = 4 positions, commit a random 1..4 of them (the rest garbage tokens): the logits and routing
    of every committed position equal one-token decoding's, across ring wrap-around and CSA / HCA window
    boundaries (window 8, ratios 4 and 8)."""
    steps, real = [], Block.step  # every path runs its layers through the one Block.step (counted at trace time)
    monkeypatch.setattr(Block, "step", lambda self, *a, **kw: steps.append(type(self).__name__) or real(self, *a, **kw))
    cfg = DSV4Config.tiny(num_hidden_layers=3, compress_ratios=(0, 4, 8, 0))  # sliding (hash), CSA, HCA
    model = randomize(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0)), seed=1, scale=0.1)
    b, s, p_bucket, cache_len, k = 3, 30, 16, 48, 3
    rs = np.random.RandomState(0)
    ids = jnp.asarray(rs.randint(0, cfg.vocab_size, (b, s + 2 * k + 2)), jnp.int32)
    lens = np.array([5, 13, 1], np.int32)
    prompt = jnp.where(jnp.arange(p_bucket)[None] < lens[:, None], ids[:, :p_bucket], 0)
    _, _, caches = nnx.jit(lambda m, i, n: prefill(m, i, n, cache_len))(model, prompt, jnp.asarray(lens))

    @nnx.jit
    def plain_all(m, c):
        def body(c, i):
            t = jnp.asarray(lens) + i
            lg, r, c = decode_step(m, ids[jnp.arange(b), t], t, c)
            return c, (lg, r)
        return jax.lax.scan(body, c, jnp.arange(s - int(lens.max())))[1]

    @nnx.jit
    def ver_commit(m, tok, p0, c, n):
        lg, r, _, pend = verify_forward(m, tok, p0, c)
        return lg, r, commit(c, pend, p0, n)

    plain_lg, plain_r = (np.asarray(x) for x in plain_all(model, caches))
    pos, errs, n_cmp = lens.copy(), [], 0
    rows = np.arange(b)
    while True:
        n = rs.randint(1, k + 2, size=b)
        tok = np.asarray(ids)[rows[:, None], np.minimum(pos[:, None] + np.arange(k + 1)[None], ids.shape[1] - 1)]
        tok = np.where(np.arange(k + 1)[None] < n[:, None], tok, rs.randint(0, cfg.vocab_size, tok.shape))
        lg, r, caches = ver_commit(model, jnp.asarray(tok, jnp.int32), jnp.asarray(pos), caches,
                                   jnp.asarray(n, jnp.int32))
        lg, r = np.asarray(lg), np.asarray(r)
        for i in range(b):
            for j in range(n[i]):
                st = pos[i] + j - lens[i]
                if st < plain_lg.shape[0]:
                    errs.append(np.abs(lg[i, j] - plain_lg[st, i]).max())
                    np.testing.assert_array_equal(r[i, j], plain_r[st, i])
                    n_cmp += 1
        pos = pos + n
        if (pos - lens).min() >= plain_lg.shape[0]:
            break
    assert n_cmp >= 40 and max(errs) <= 1e-5, f"{n_cmp} positions, max |delta logits| {max(errs):.2e}"
    assert steps == ["Block"] * (3 * cfg.num_hidden_layers)  # prefill, decode, verify


def test_verify_on_the_fp8_rollout_quantises_as_decoding():
    """The run's default rollout (FP8 weights dequantised per layer with 1 x 128 ue8m0 activation quantisation, FP8
    KV cache, fp32 compute): a verify of 4 positions gives one-token decoding's logits to f32 rounding (a different
    quantisation group, scale or cache value would move them by ~1e-2) and its routing exactly. Bitwise equality is
    not asserted: a GEMM's rows round differently with its row count (B (k+1) vs B), and FP8 activation rounding
    can amplify that (benchmarks/speculative.py --greedy-only measures the greedy rows that differ)."""
    cfg = DSV4Config.tiny(num_hidden_layers=1, compress_ratios=(4, 0))  # CSA with its indexer (+ the MTP block, unused)
    model = randomize(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0)), seed=1, scale=0.1)
    s = Sampler(model, weights="fp8", kv_cache_dtype="auto", max_prompt_len=16, compute_dtype=jnp.float32)
    assert s.kv_fp8 and s.dequant == "per_layer"
    ws, b, n = s.weight_state(), 3, 4
    rs = np.random.RandomState(1)
    lens = jnp.asarray([5, 13, 1], jnp.int32)
    ids = jnp.asarray(rs.randint(3, CFG.vocab_size, (b, 16)), jnp.int32)
    toks = jnp.asarray(rs.randint(3, CFG.vocab_size, (b, n)), jnp.int32)

    @jax.jit
    def both(ws):
        m, lf = s.layerwise.shell(ws), s.layerwise.layer_fn(ws)
        caches = prefill_chunked(m, ids, lens, 32, s.prefill_chunk, layer_fn=lf, kv_fp8=s.kv_fp8)[2]
        lg, r, _, _ = verify_forward(m, toks, lens, caches, layer_fn=lf)

        def body(c, i):
            lg1, r1, c = decode_step(m, toks[:, i], lens + i, c, layer_fn=lf)
            return c, (lg1, r1)
        plg, pr = jax.lax.scan(body, caches, jnp.arange(n))[1]
        return lg, r, plg.swapaxes(0, 1), pr.swapaxes(0, 1)

    lg, r, plg, pr = (np.asarray(x) for x in both(ws))
    assert np.abs(lg - plg).max() <= 1e-5 * max(1.0, np.abs(plg).max())
    np.testing.assert_array_equal(r, pr)


def test_speculative_run_trains_its_mtp_head_by_default():
    """`--rollout.speculative mtp` turns on-policy MTP training on (train_mtp, mtp_loss_weight) unless given."""
    on = RunConfig(**{"rollout.speculative": "mtp"}).learner
    assert on.train_mtp and on.mtp_loss_weight == SPECULATIVE_MTP_LOSS_WEIGHT > 0
    off = RunConfig(**{"rollout.speculative": "mtp", "learner.train_mtp": False}).learner
    assert not off.train_mtp and off.mtp_loss_weight == 0.0
    assert RunConfig(**{"rollout.speculative": "mtp", "learner.mtp_loss_weight": 0.5}).learner.mtp_loss_weight == 0.5
    assert not RunConfig().learner.train_mtp


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--rollout.draft_tokens"):
        check_speculative("mtp", 4, CFG)
    with pytest.raises(ValueError, match="--rollout.speculative"):
        check_speculative("eagle", 2, CFG)
    with pytest.raises(ValueError, match="MTP block"):
        check_speculative("mtp", 2, DSV4Config.tiny(num_nextn_predict_layers=0, compress_ratios=(0, 4, 8, 4)))


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in (5, 13, 1, 20)]


@pytest.fixture(scope="module")
def spec(model):
    """One speculative sampler (k = 3) for the rollout tests: temperature and the rest are traced, one compile."""
    return Sampler(model, weights="fp32", max_prompt_len=32, speculative="mtp", draft_tokens=3)


@nnx.jit
def _forward(model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out.logits, out.routing


def _reference(model, batch, temperature):
    """The full forward over [prompt | response]: (argmax token at each response position, log_softmax(logits / T)
    at the emitted tokens, routing) in the layout of `batch.sequences()`."""
    ids, mask, resp, _ = batch.sequences()
    logits, routing = _forward(model, jnp.asarray(ids), jnp.asarray(mask))
    logits = np.asarray(logits)
    lp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
    tgt = np.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    return np.argmax(logits[:, :-1], -1), tgt, np.asarray(routing), ids, mask, resp


def test_greedy_speculative_equals_plain_decoding(model, spec, prompts):
    """Greedy, k = 3, a stop token and per-row length limits. Plain decoding equals the full forward over its own
    tokens (tests/rl/test_sampler.py), so the speculative rollout is checked against it: every token the argmax of
    the full forward's logits before it, logprobs log_softmax(logits) at it (1e-5) and routing identical (prompt
    and response, the last token's too); the first stop token ends a row, the per-row limit another. A row's result
    does not depend on the rows around it (a reordered sub-batch gives the same tokens and routing)."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(7,))  # one shape bucket for the module
    mx = [16, 11, 16, 6]
    out = spec.generate(prompts, sp, seed=1, max_new_tokens_per_row=mx)
    best, tgt, routing, ids, mask, resp = _reference(model, out, 1.0)
    r = resp[:, 1:] > 0
    np.testing.assert_array_equal(np.where(r, ids[:, 1:], -1), np.where(r, best, -1))
    np.testing.assert_allclose(np.where(r, out.sequences()[3][:, 1:], 0), np.where(r, tgt, 0), atol=1e-5)
    real = mask.astype(bool)[:, :, None, None]
    np.testing.assert_array_equal(np.where(real, out.routing, -1), np.where(real, routing, -1))
    for i, row in enumerate(out.response_lists()):
        assert 7 not in row[:-1] and len(row) <= mx[i]
        assert out.finish_reasons[i] == ("stop" if row[-1] == 7 else "length")
        assert row[-1] == 7 or len(row) == mx[i]
    assert spec.last_stats["rollout/spec_accept_len"] >= 1.0
    assert 0.0 <= spec.last_stats["rollout/spec_accept_rate"] <= 1.0
    order = [3, 1, 0]
    sub = spec.generate([prompts[i] for i in order], sp, seed=1, prompt_index=order,
                        max_new_tokens_per_row=[mx[i] for i in order])
    np.testing.assert_array_equal(sub.tokens, out.tokens[order])
    np.testing.assert_array_equal(sub.response_half(sub.routing), out.response_half(out.routing)[order])


def test_sampled_speculative_records_the_main_models_logprobs_and_routing(model, spec, prompts):
    """Sampling at temperature 3 (flat p and q: most drafts accepted, so multi-token commits are exercised): the
    logprobs recorded are the main model's log_softmax(logits / T) at every emitted token and the routing is the
    main model's, both equal to the full forward over the emitted sequence (which also checks the caches after
    accepted runs); the acceptance metrics report them."""
    out = spec.generate(prompts, SamplingParams(temperature=3.0, max_new_tokens=16), seed=3)
    _, tgt, routing, _, mask, resp = _reference(model, out, 3.0)
    r = resp[:, 1:] > 0
    np.testing.assert_allclose(np.where(r, out.sequences()[3][:, 1:], 0), np.where(r, tgt, 0), atol=1e-5)
    real = mask.astype(bool)[:, :, None, None]
    np.testing.assert_array_equal(np.where(real, out.routing, -1), np.where(real, routing, -1))
    assert (out.lengths == 16).all()
    assert spec.last_stats["rollout/spec_accept_len"] > 1.5, spec.last_stats


def test_continuous_batching_gives_the_static_results(model, spec, prompts):
    """Speculative continuous batching (2 slots refilled over 4 requests) against the static speculative rollout,
    greedy and sampled (the same per-sample keys): the same tokens, lengths, routing and logprobs, so a row's
    acceptance and draws do not depend on the slot, its neighbours or the admission order."""
    slots = Sampler(model, weights="fp32", max_prompt_len=32, speculative="mtp", draft_tokens=3, slots=2)
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(7,)),
               SamplingParams(temperature=3.0, max_new_tokens=16)):
        ref = spec.generate(prompts, sp, seed=5)
        out = slots.generate(prompts, sp, seed=5)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.lengths, ref.lengths)
        np.testing.assert_array_equal(out.routing, ref.routing)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    assert slots.last_stats["rollout/slots_refilled"] == 2 and slots.last_stats["rollout/spec_accept_len"] > 1.5


def test_mtp_loss_leaves_the_policy_gradient_and_update_and_the_push_carries_the_mtp_weights():
    """`--learner.mtp_loss_weight 1` next to 0 (both train_mtp): the gradient of every trunk parameter is bitwise
    the same (the MTP head reads the trunk, embedding and head through stop_gradient), the MTP block's is non-zero
    only with the loss; the clip treats the MTP gradient apart (the trunk's clipped update is optax's on the trunk
    alone, bitwise); the push into an FP8 sampler carries the trained MTP weights."""
    cfg = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(0, 4, 0))
    m = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    n, p, t = 4, 4, 6
    am = np.ones((n, p + t), np.int32)
    am[1, :2] = 0
    am[2, -2:] = 0
    rm = am.copy()
    rm[:, :p] = 0
    ids = np.where(am > 0, rng.integers(1, cfg.vocab_size, (n, p + t)), 0).astype(np.int32)
    lp, _, _ = jax.jit(lambda i, mm: token_logprobs(m, i, mm))(ids, am)
    batch = TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(am), response_mask=jnp.asarray(rm),
                       rollout_logprobs=lp * rm, advantages=jnp.asarray(rng.normal(size=n), jnp.float32))
    kw = dict(scan_layers=False, stream_optimizer=False, train_mtp=True, compute_dtype="float32", lr=1e-2,
              max_grad_norm=1e-3)  # a clip that binds, so a shared clip would couple the two
    base, with_mtp = Learner(m, LearnerConfig(**kw)), Learner(m, LearnerConfig(**kw, mtp_loss_weight=1.0))
    _, g0, _ = base.loss_and_grads(base.state, batch)
    _, g1, met = with_mtp.loss_and_grads(with_mtp.state, batch)
    f0, f1 = ({"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(g)} for g in (g0, g1))
    trunk = [k for k in f0 if not k.startswith("mtp")]
    assert trunk and all(np.array_equal(f0[k], f1[k]) for k in trunk)
    assert all(not f0[k].any() for k in f0 if k.startswith("mtp"))
    assert any(f1[k].any() for k in f1 if k.startswith("mtp"))
    assert float(met["train/mtp_loss"]) > 0
    tree = {"layers": {"w": jnp.asarray(f0["layers/1/attn/wq_a/weight"])}, "mtp": {"w": jnp.asarray(f1[
        "mtp/0/e_proj/weight"]) * 1e3}}
    clipped, _ = clip_by_global_norm_apart(1e-3, lambda path: str(path[0].key) == "mtp").update(tree, optax.EmptyState())
    alone, _ = optax.clip_by_global_norm(1e-3).update({"w": tree["layers"]["w"]}, optax.EmptyState())
    np.testing.assert_array_equal(np.asarray(clipped["layers"]["w"]), np.asarray(alone["w"]))
    assert abs(float(optax.tree.norm(clipped["mtp"])) - 1e-3) < 1e-8
    old_mtp = np.asarray(with_mtp.params_for_push()["mtp"][0]["e_proj"]["weight"][...]).copy()
    metrics = with_mtp.update(batch)
    assert float(metrics["train/mtp_loss"]) > 0
    new_mtp = np.asarray(with_mtp.params_for_push()["mtp"][0]["e_proj"]["weight"][...])
    assert not np.array_equal(new_mtp, old_mtp)
    sampler = Sampler(m, weights="fp8", max_prompt_len=16, kv_cache_dtype="bf16")
    sampler.update_weights(with_mtp.params_for_push(), version=1)
    pushed = sampler.weight_state()["mtp/0/e_proj/weight"]
    assert pushed.kind == "fp8"
    deq = np.asarray(dequantize_fp8_blockwise(pushed.q, pushed.scale, block=pushed.block), np.float32)
    assert np.abs(deq - new_mtp).max() < np.abs(deq - old_mtp).max()
    assert np.abs(deq - new_mtp).max() <= 0.07 * np.abs(new_mtp).max()  # FP8 e4m3 blocks
