"""Speculative rollouts with the MTP block: plain vs speculative decode tok/s at k = 1, 2, 3, and the acceptance
length with the random-init MTP head and after on-policy MTP training (rl/rollout/speculative.py, issue 27).

What runs (one process, CPU by default):
  1. the model: `--config` (small) from random init, made learnable first: `--sft-steps` updates of the repo's
     `Learner` (advantages 1 on fixed sequences = supervised fine-tuning of the response tokens) on a synthetic
     language: each sequence walks a fixed random permutation of `--alphabet` token ids (next = perm[current]),
     so the policy becomes near-deterministic, as a fine-tuned LM is on most of its tokens. The MTP block is not
     trained there (still random).
  2. (a) random-init MTP head: `Sampler` plain and with `speculative="mtp"`, k = 1..3, FP8 weights + FP8 KV cache
     (the run's defaults), fp32 compute on CPU, `--rows` prompts of 8 tokens of the language, `--new` tokens at
     `--temperature`; each variant compiled once (not timed), then `--rounds` timed `generate` calls interleaved;
     tok/s = emitted tokens / best wall time of a call (prefill included: it is the same on both sides).
  3. on-policy MTP training: `--mtp-steps` rounds of: rollout with the plain FP8 sampler at the temperature -> a
     Learner update with advantages 0 and `mtp_loss_weight` 1 (`train_mtp`; the policy gradient is zero and the
     trunk does not move, so the rollout policy stays the same; the MTP head learns the policy's own samples);
     then one push (`update_weights`) of the learner's weights, MTP head included, into every sampler.
  4. (b) the same timings after the training.
  5. the cost of one (k+1)-position verify (`dsv4.spec_decode.verify_forward` + `commit`) vs one decode step
     (`dsv4.cache.decode_step`) at the batch, jitted, median of repeated calls: the ratio predicts other devices.
The greedy exactness is checked on the way: at temperature 0, the rows whose plain and speculative tokens differ.

`--greedy-only` (issue 42 reproduction 10): greedy speculative vs plain greedy on the run's default rollout (FP8
weights, FP8 KV cache, fp32 compute on CPU) of the random-init tiny model, `--greedy-rows` prompts (3..13 tokens),
`--greedy-new` new tokens: the rows that differ from plain static greedy for k = 1..3, static and with 4 slots, and,
as the reference for what a batch shape alone changes, plain greedy with 4 slots. Why they can differ at all: the
verify forward quantises as the decode step does (per-token 1 x 128 activation blocks, per-vector KV-cache scales,
its own keys FP8 round-tripped; logits agree to f32 rounding, tests/rl/test_speculative.py), but a GEMM's rows
round differently with the number of rows (XLA:CPU, and GPU BLAS kernels chosen by shape): the verify multiplies
B (k + 1) rows where decoding multiplies B; an FP8 activation rounding (steps of 2^-4 relative) turns a 1-ulp
difference at a rounding boundary into a visible one, which can flip a near-tied argmax. Plain greedy with
another batch shape (slots) differs from static greedy by the same mechanism.

Run:   .venv/bin/python benchmarks/speculative.py                       (small, 32 rows, 64 tokens)
       .venv/bin/python benchmarks/speculative.py --config tiny --rows 8 --new 32 --sft-steps 40 --mtp-steps 20
Last line: RESULT plain_tok_s=.. spec_tok_s=.. speedup=.. accept_len=.. k=.. (the best k after MTP training).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from dsv4.cache import decode_step, prefill
from dsv4.spec_decode import commit, verify_forward
from rl.algo.batch import TrainBatch
from rl.config.algo import LearnerConfig
from rl.algo.learner import Learner
from rl.rollout.engine import Sampler, SamplingParams


def language(rs, alphabet: int, vocab: int):
    """A random walk table: `alphabet` distinct token ids (>= 3) and next[id] for each."""
    ids = rs.choice(np.arange(3, vocab), alphabet, replace=False)
    nxt = np.zeros(vocab, np.int64)
    nxt[ids] = ids[rs.permutation(alphabet)]
    return ids, nxt


def walk(start, nxt, n):
    out = [int(start)]
    for _ in range(n - 1):
        out.append(int(nxt[out[-1]]))
    return out


def sft_batch(rs, ids, nxt, rows, p, t):
    seqs = np.array([walk(rs.choice(ids), nxt, p + t) for _ in range(rows)], np.int32)
    am = np.ones((rows, p + t), np.int32)
    rm = np.zeros_like(am)
    rm[:, p:] = 1
    return TrainBatch(input_ids=jnp.asarray(seqs), attention_mask=jnp.asarray(am), response_mask=jnp.asarray(rm),
                      rollout_logprobs=jnp.zeros((rows, p + t), jnp.float32),
                      advantages=jnp.ones((rows,), jnp.float32))


def timed(samplers, prompts, sp, rounds):
    """{name: (best seconds, batch, stats)} with calls interleaved over rounds (the first call compiles)."""
    best, out = {}, {}
    for name, s in samplers.items():
        out[name] = (s.generate(prompts, sp, seed=0), dict(s.last_stats))  # compile
    for r in range(rounds):
        for name, s in samplers.items():
            t0 = time.perf_counter()
            b = s.generate(prompts, sp, seed=r + 1)
            dt = time.perf_counter() - t0
            if dt < best.get(name, np.inf):
                best[name] = dt
            out[name] = (b, dict(s.last_stats))
    return {n: (best[n], *out[n]) for n in samplers}


def report(tag, res):
    plain_t, plain_b, _ = res["plain"]
    rows = {}
    for name, (t, b, st) in res.items():
        tok = int(b.lengths.sum())
        rows[name] = (tok / t, st.get("rollout/spec_accept_len", 1.0), st.get("rollout/spec_accept_rate", 0.0))
        print(f"[{tag}] {name:6s} {tok / t:9.1f} tok/s  ({tok} tokens, {t:.2f} s)  accept_len "
              f"{rows[name][1]:.2f}  accept_rate {rows[name][2]:.2f}  speedup {plain_t / t * tok / plain_b.lengths.sum():.2f}",
              flush=True)
    return rows


def verify_cost(model, b, p, k_max, reps):
    """ms of one decode step and of one (k+1)-position verify + commit at batch b (jitted, median)."""
    cfg = model.config
    rs = np.random.RandomState(0)
    ids = jnp.asarray(rs.randint(3, cfg.vocab_size, (b, p)), jnp.int32)
    lens = jnp.full((b,), p, jnp.int32)
    cache_len = p + 64
    gd, st = nnx.split(model)
    caches = jax.jit(lambda st: prefill(nnx.merge(gd, st), ids, lens, cache_len)[2])(st)
    dec = jax.jit(lambda st, tok, t, c: decode_step(nnx.merge(gd, st), tok, t, c)[0])

    def ver(st, tok, t, c):
        m = nnx.merge(gd, st)
        lg, _, _, pend = verify_forward(m, tok, t, c)
        return lg, commit(c, pend, t, jnp.full((tok.shape[0],), tok.shape[1], jnp.int32))
    ver = jax.jit(ver)
    out = {}

    def median_ms(fn, *a):
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    out[0] = median_ms(dec, st, ids[:, 0], lens, caches)
    for k in range(1, k_max + 1):
        out[k] = median_ms(ver, st, ids[:, :k + 1], lens, caches)
    return out


def greedy_rows_differ(rows: int, new: int, ks) -> dict:
    """{setting: rows whose greedy tokens differ from plain static greedy} on the default FP8 rollout (tiny, random
    init, fp32 compute): settings "k=K" / "k=K slots=4" and "plain slots=4"."""
    cfg = DSV4Config.tiny()
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0))
    rs = np.random.RandomState(0)
    prompts = [list(map(int, rs.randint(3, cfg.vocab_size, rs.randint(3, 14)))) for _ in range(rows)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=new)
    mk = dict(weights="fp8", kv_cache_dtype="auto", compute_dtype=jnp.float32, max_prompt_len=16)
    ref = Sampler(model, **mk).generate(prompts, sp, seed=0)
    settings = {"plain slots=4": dict(slots=4)}
    for k in ks:
        settings[f"k={k}"] = dict(speculative="mtp", draft_tokens=k)
        settings[f"k={k} slots=4"] = dict(speculative="mtp", draft_tokens=k, slots=4)
    out = {}
    for name, kw in settings.items():
        got = Sampler(model, **mk, **kw).generate(prompts, sp, seed=0)
        out[name] = int(sum(not np.array_equal(got.tokens[i], ref.tokens[i]) for i in range(rows)))
        print(f"greedy {name}: {out[name]} of {rows} rows differ from plain static greedy", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small", choices=("tiny", "small"))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--alphabet", type=int, default=64)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--mtp-steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--weights", default="fp8")
    ap.add_argument("--verify-reps", type=int, default=5)
    ap.add_argument("--greedy-only", action="store_true", help="only the greedy rows-differ measurement")
    ap.add_argument("--greedy-rows", type=int, default=48)
    ap.add_argument("--greedy-new", type=int, default=24)
    a = ap.parse_args()
    if a.greedy_only:
        d = greedy_rows_differ(a.greedy_rows, a.greedy_new, a.ks)
        spec = [v for n, v in d.items() if n.startswith("k=")]
        print(f"RESULT greedy_rows={a.greedy_rows} spec_rows_differ_max={max(spec)} spec_rows_differ_sum={sum(spec)} "
              f"spec_settings={len(spec)} plain_slots_rows_differ={d['plain slots=4']}")
        return
    cfg = getattr(DSV4Config, a.config)()
    rs = np.random.RandomState(0)
    ids, nxt = language(rs, a.alphabet, cfg.vocab_size)
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)
    print(f"config {a.config}, devices {jax.devices()}, rows {a.rows}, new {a.new}, T {a.temperature}", flush=True)

    t0 = time.perf_counter()
    lc = dict(lr=a.lr, compute_dtype="float32", scan_layers=False, stream_optimizer=False)
    sft = Learner(model, LearnerConfig(**lc))
    for i in range(a.sft_steps):
        m = sft.update(sft_batch(rs, ids, nxt, 16, 8, 24))
        if i % 10 == 0 or i == a.sft_steps - 1:
            print(f"sft {i}: entropy {float(m['train/entropy']):.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    nnx.update(model, sft.params_for_push())
    del sft

    mk = dict(weights=a.weights, max_prompt_len=16, compute_dtype=jnp.float32, kv_cache_dtype="auto")
    samplers = {"plain": Sampler(model, **mk)}
    for k in a.ks:
        samplers[f"k={k}"] = Sampler(model, speculative="mtp", draft_tokens=k, **mk)
    prompts = [walk(rs.choice(ids), nxt, 8) for _ in range(a.rows)]
    sp = SamplingParams(temperature=a.temperature, max_new_tokens=a.new)

    g = SamplingParams(temperature=0.0, max_new_tokens=a.new)  # the timed calls' shapes: no extra compile
    ref = samplers["plain"].generate(prompts, g, seed=0)
    for name, s in samplers.items():
        got = s.generate(prompts, g, seed=0).tokens
        differ = sum(not np.array_equal(got[i], ref.tokens[i]) for i in range(len(prompts)))
        print(f"greedy {name}: {differ} of {len(prompts)} rows differ from plain greedy", flush=True)

    before = report("random MTP", timed(samplers, prompts, sp, a.rounds))

    learner = Learner(model, LearnerConfig(**lc, train_mtp=True, mtp_loss_weight=1.0))
    t0 = time.perf_counter()
    for i in range(a.mtp_steps):
        roll = samplers["plain"].generate(prompts if i == 0 else [walk(rs.choice(ids), nxt, 8) for _ in prompts],
                                          sp, seed=100 + i)
        m = learner.update(TrainBatch.from_rollout(roll, np.zeros(len(prompts), np.float32), routing=False))
        if i % 5 == 0 or i == a.mtp_steps - 1:
            nll = -float(np.sum(roll.logprobs) / roll.lengths.sum())
            print(f"mtp {i}: train/mtp_loss {float(m['train/mtp_loss']):.4f}  policy NLL/token {nll:.3f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    params = learner.params_for_push()  # the trunk did not move (advantages 0): only the MTP head changed
    for s in samplers.values():
        s.update_weights(params, version=a.mtp_steps)
    after = report("trained MTP", timed(samplers, prompts, sp, a.rounds))

    nnx.update(model, learner.params_for_push())
    cost = verify_cost(model, a.rows, 16, max(a.ks), a.verify_reps)
    for k in a.ks:
        print(f"verify of {k + 1} positions + commit: {cost[k]:.1f} ms = {cost[k] / cost[0]:.2f} x one decode step "
              f"({cost[0]:.1f} ms) at batch {a.rows}", flush=True)
    print("acceptance length before -> after MTP training: " + ", ".join(
        f"k={k} {before[f'k={k}'][1]:.2f} -> {after[f'k={k}'][1]:.2f}" for k in a.ks), flush=True)
    best = max(a.ks, key=lambda k: after[f"k={k}"][0])
    plain, spec = after["plain"][0], after[f"k={best}"][0]
    print(f"RESULT plain_tok_s={plain:.1f} spec_tok_s={spec:.1f} speedup={spec / plain:.2f} "
          f"accept_len={after[f'k={best}'][1]:.2f} k={best}")


if __name__ == "__main__":
    main()
