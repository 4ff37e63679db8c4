"""Train/rollout logprob mismatch split by source, and what the FP8-aware learner (`--learner.fp8_forward`) removes.

    .venv/bin/python benchmarks/mismatch.py [--config small] [--rows 8] [--prompt-len 32] [--new 32] [--slots 4]

One model (`--config`, default init, seed 0), fp32 compute everywhere (CPU), `--rows` prompts of random tokens,
`--new` response tokens each at temperature 1 (no stop tokens, so every row has exactly `--new`). The FP8 rollout
(`--rollout-dtype fp8`, the run's default, with its FP8 KV cache) samples the tokens once; every row below scores
those very tokens (teacher forcing), so rows differ only in the numerics:

- reference: the fp32 learner's full forward (`rl.algo.learner.Learner.compute_logprobs`, blocked attention, free
  routing);
- one source at a time, each against the reference (or, for the cache, against the same path without it):
  `fp8 weights` (the rollout's FP8 / dequantised weights, unquantised activations, full forward), `fp8
  activations` (fp32 weights, the rollout's activation quantisation at the same linears, full forward), `fp8 kv
  cache` (decode path with vs without the FP8 cache, fp32 weights: `dsv4.cache.teacher_forced_logprobs`), `decode vs
  full forward` (the decode path over caches, incremental attention, vs the learner's blocked attention, fp32
  weights), `continuous batching` (the fp32 sampler with `--slots` slots vs static batching, its own logprobs of its
  own samples, compared on the tokens where both sampled the same; a row's slot and neighbours differ);
- `fp8 weights+activations` (the rollout's layers, full forward): the two FP8 sources together;
- `fp8 rollout vs fp32 learner` (`fp8`): what a run logs as `train/train_rollout_logprob_abs_diff` (the FP8
  rollout's own logprobs vs the fp32 learner, with routing replay, the run's default; and without);
- `fp8 rollout vs FP8-aware learner` (`fp8_aware`): the same with `LearnerConfig.fp8_forward`;
- `fp8 rollout minus its FP8 kv cache vs FP8-aware`: the rollout's FP8 layers through the decode path with the
  unquantised cache (teacher forced) vs the FP8-aware learner: what is left once the cache is taken out.
Per row: mean and max |dlogp| over all response tokens and the mismatch KL (k3 estimate of KL(rollout || learner),
`rl.algo.losses.kl_penalty`, what the learner logs as `train/train_rollout_kl`).

Cost of `fp8_forward` (`--cost`, on by default): the learner's train step on the same batch, fp8_forward off vs on:
compiled temp bytes (`Learner.lower(batch).compile().memory_analysis()`; XLA:CPU figures) and step time (median of
3 calls of that compiled step).

Exact mode (`--exact-rollout`, rl/rollout/exact.py): the learner built with `exact_layout` draws a batch from the same
prompts with its own forward (`rl.rollout.exact.generate`) and the train step's own metric
`train/train_rollout_logprob_abs_diff` is read on it (`Learner.loss_and_grads`): `exact` (FP8-aware learner, the FP8
rollout's weights and activations), `exact fp32` (fp32 learner), and `exact, 2 micro-batches` (the FP8-aware case
with `micro_batch_size` = rows / 2: the step's scanned micro-batch loop, the one part left inexact). Cost: rollout
tok/s of the FP8 sampler's `generate` (static batch, FP8 KV cache) vs `rl.rollout.exact.generate` (each the median of 3 warm
calls), `exact_cost_frac` = exact s / generate s - 1 (the rollout time exact mode adds, as a fraction).

Last line: `RESULT fp8_mean_abs_dlogp=.. fp8_aware_mean_abs_dlogp=.. exact_mean_abs_dlogp=.. exact_cost_frac=..
fp8_max_abs_dlogp=.. fp8_aware_max_abs_dlogp=.. fp8_kl=.. fp8_aware_kl=.. exact_fp32_mean_abs_dlogp=..
exact_microbatched_mean_abs_dlogp=.. rollout_tok_s=.. exact_rollout_tok_s=.. fp8_forward_temp_ratio=..
fp8_forward_step_ratio=..`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4 import DSV4Config, DSV4ForCausalLM, quant  # noqa: E402
from dsv4.cache import teacher_forced_logprobs  # noqa: E402
from dsv4.fp8_gemm import FakeQuantWeight  # noqa: E402
from dsv4.names import param_key  # noqa: E402
from dsv4.quant import QuantizedTensor  # noqa: E402
from rl.algo.batch import RolloutBatch, TrainBatch  # noqa: E402
from rl.config.algo import LearnerConfig, LossConfig  # noqa: E402
from rl.rollout.exact import exact_layout  # noqa: E402
from rl.rollout.exact import generate as exact_generate  # noqa: E402
from rl.algo.learner import Learner  # noqa: E402
from rl.algo.logprobs import token_logprobs  # noqa: E402
from rl.algo.losses import kl_penalty  # noqa: E402
from dsv4.rollout_format import GEMM_KEYS, layer_value  # noqa: E402
from rl.rollout.engine import Sampler, SamplingParams  # noqa: E402


def stats(lp: np.ndarray, ref: np.ndarray, mask: np.ndarray | None = None) -> tuple[float, float, float, int]:
    """(mean |lp - ref|, max |lp - ref|, mean k3 KL(lp's policy || ref's), tokens) over `mask` (default all)."""
    mask = np.ones(lp.shape, bool) if mask is None else mask.astype(bool)
    d = np.abs(lp - ref)[mask]
    kl = np.asarray(kl_penalty(jnp.asarray(lp), jnp.asarray(ref), "k3", LearnerConfig().loss.kl_clamp))[mask]
    return float(d.mean()), float(d.max()), float(kl.mean()), int(mask.sum())


def variant_models(sampler: Sampler, model: DSV4ForCausalLM):
    """(fp8 weights only, fp8 activations only) models: the rollout's FP8 weights dequantised into plain arrays
    (so no layer quantises its input), and the fp32 weights wrapped as `FakeQuantWeight`s where the rollout's
    layers quantise their inputs (`GEMM_KEYS`, routed experts)."""
    ws = sampler.weight_state()
    cd = sampler.compute_dtype
    dense = {k: (v.dequantize(cd) if isinstance(v, QuantizedTensor) else v) for k, v in ws.items()}
    acts = {}
    fp32 = sampler.flat_params(model)
    for k, v in ws.items():
        if isinstance(v, QuantizedTensor) and isinstance(layer_value(k, v, cd, matmul="dequant"), QuantizedTensor):
            routed = quant.ROUTED_EXPERT_RE.search(k) is not None
            acts[k] = FakeQuantWeight(w=fp32[k].astype(cd), fmt="e4m3fn" if routed else v.fmt)
        elif isinstance(v, QuantizedTensor):
            acts[k] = fp32[k].astype(cd)
        else:
            acts[k] = v
    assert any(GEMM_KEYS.search(k) for k in acts)

    def build(vals):
        flat = [(p, var.replace(vals[param_key(p)])) for p, var in sampler.weights.abstract_params]
        return nnx.merge(sampler.weights.graphdef, nnx.from_flat_state(flat))

    return build(dense), build(acts)


def full_forward(model, ids, mask, dispatch_fn) -> np.ndarray:
    """Token logprobs [N, S] of a full forward (the learner's path: blocked attention, chunked head)."""
    chunk = LearnerConfig().logprob_chunk_size
    fn = jax.jit(lambda i, m: token_logprobs(model, i, m, chunk_size=chunk, dispatch_fn=dispatch_fn)[0])
    return np.asarray(fn(jnp.asarray(ids), jnp.asarray(mask)))


def cost(model, batch: TrainBatch, fp8: bool) -> tuple[int, float]:
    """(compiled temp bytes, median step seconds) of the learner's train step with fp8_forward = fp8."""
    learner = Learner(model, LearnerConfig(lr=1e-6, compute_dtype="float32", routing_replay=True, fp8_forward=fp8),
                      rollout_dtype="fp8")
    compiled = learner.lower(batch).compile()  # the train step's own jit, lowered for this batch
    temp = compiled.memory_analysis().temp_size_in_bytes
    fitted = learner.fit_batch(batch, True)[0]  # the batch as train_step hands it to that jit
    state, times = learner.state, []
    for _ in range(3):
        t0 = time.perf_counter()
        state, _ = compiled(state, fitted)  # donates the old state
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return int(temp), float(np.median(times))


def median_s(fn, calls: int = 3) -> float:
    """Median wall seconds of `calls` calls of fn(), after one warm-up call (compiles)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def exact_row(model, prompts, sp: SamplingParams, adv: np.ndarray, *, fp8: bool, max_prompt_len: int,
              micro_batches: int = 1):
    """(stats of the train step's own metric on an exact-mode batch, learner, the batch): exact mode's learner
    (FP8-aware when `fp8`, fp32 compute, routing replay, TIS) draws the batch from `prompts`
    (`rl.rollout.exact.generate`); the step (`loss_and_grads`) then reads it."""
    n = len(prompts)
    cfg = LearnerConfig(lr=1e-6, compute_dtype="float32", routing_replay=True, fp8_forward=fp8,
                        loss=LossConfig(correction="tis"), micro_batch_size=n // micro_batches)
    lay = exact_layout(cfg, rows_per_step=n, max_prompt_len=max_prompt_len, max_new_tokens=sp.max_new_tokens)
    learner = Learner(model, cfg, rollout_dtype="fp8", exact_layout=lay)
    ex, _ = exact_generate(learner, prompts, sp, seed=0, routing_replay=True)
    _, _, m = learner.loss_and_grads(learner.state, TrainBatch.from_rollout(ex, adv))
    resp = np.arange(ex.tokens.shape[1])[None] < ex.lengths[:, None]
    # the step's own metric (its max is not reported by the step: 0 when the mean is, else not known here)
    mean = float(m["train/train_rollout_logprob_abs_diff"])  # a mean of |.|: 0 only if every token is 0
    return (mean, 0.0 if mean == 0 else float("nan"), float(m["train/train_rollout_kl"]), int(resp.sum())), learner, ex


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small", choices=("tiny", "small"))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=32, help="response tokens per row (a power of two)")
    ap.add_argument("--slots", type=int, default=4, help="decode slots of the continuous-batching row")
    ap.add_argument("--no-cost", dest="cost", action="store_false", help="skip the fp8_forward cost section")
    args = ap.parse_args(argv)
    cfg = DSV4Config.preset(args.config)
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0))
    p, new, f32 = args.prompt_len, args.new, jnp.float32
    rs = np.random.RandomState(0)
    lens = rs.randint(p // 2, p + 1, args.rows).astype(np.int32)
    prompts = [list(map(int, rs.randint(3, cfg.vocab_size, n))) for n in lens]
    sp = SamplingParams(temperature=1.0, max_new_tokens=new)
    t0 = time.perf_counter()

    fp8 = Sampler(model, weights="fp8", compute_dtype=f32, max_prompt_len=p, kv_cache_dtype="auto")
    rb = fp8.generate(prompts, sp, seed=0)
    assert (rb.lengths == new).all() and rb.tokens.shape[1] == new
    ids, mask, resp, rlp = rb.sequences()
    batch = TrainBatch(input_ids=ids, attention_mask=mask, response_mask=resp, rollout_logprobs=rlp,
                       advantages=np.where(np.arange(args.rows) % 2, 1.0, -1.0).astype(np.float32), routing=rb.routing)
    r = resp > 0

    def at_resp(x):  # [N, S] -> [N, new], the response tokens in order
        return np.asarray(x)[r].reshape(args.rows, new)

    rows = {}
    learners = {}
    for name, aware in (("fp32", False), ("fp8_aware", True)):
        learners[name] = Learner(model, LearnerConfig(lr=1e-6, compute_dtype="float32", fp8_forward=aware),
                                 rollout_dtype="fp8")
    ref = at_resp(learners["fp32"].compute_logprobs(learners["fp32"].state, batch, routing_replay=False)[0].logprobs)

    w_only, a_only = variant_models(fp8, model)
    rows["fp8 weights"] = stats(at_resp(full_forward(w_only, ids, mask, fp8.dispatch_fn)), ref)
    rows["fp8 activations"] = stats(at_resp(full_forward(a_only, ids, mask, fp8.dispatch_fn)), ref)
    both = fp8.dense_model(fp8.weight_state())
    rows["fp8 weights+activations"] = stats(at_resp(full_forward(both, ids, mask, fp8.dispatch_fn)), ref)

    tf_ids = np.zeros((args.rows, p + new), np.int32)  # right-padded prompt, then the response
    for i, pr in enumerate(prompts):
        tf_ids[i, :len(pr)] = pr
        tf_ids[i, len(pr):len(pr) + new] = rb.tokens[i]
    score = jax.jit(lambda i, n, f: teacher_forced_logprobs(model, i, n, new, p + new, kv_fp8=f), static_argnums=2)
    dec = np.asarray(score(jnp.asarray(tf_ids), jnp.asarray(lens), None))
    dec8 = np.asarray(score(jnp.asarray(tf_ids), jnp.asarray(lens), "e4m3fn"))
    rows["fp8 kv cache"] = stats(dec8, dec)
    rows["decode vs full forward"] = stats(dec, ref)
    score8 = jax.jit(lambda i, n: teacher_forced_logprobs(both, i, n, new, p + new))  # FP8 layers, unquantised cache
    dec_fp8w = np.asarray(score8(jnp.asarray(tf_ids), jnp.asarray(lens)))

    static = Sampler(model, weights="fp32", max_prompt_len=p, kv_cache_dtype="bf16").generate(prompts, sp, seed=1)
    slotted = Sampler(model, weights="fp32", max_prompt_len=p, kv_cache_dtype="bf16",
                      slots=args.slots).generate(prompts, sp, seed=1)
    same = np.cumprod(static.tokens == slotted.tokens, axis=1).astype(bool)  # up to the first different draw
    rows["continuous batching"] = stats(slotted.logprobs, static.logprobs, same)

    rl = at_resp(rlp)
    for name, replay in (("fp32", True), ("fp32", False), ("fp8_aware", True), ("fp8_aware", False)):
        lrn = learners[name]
        res, m = lrn.compute_logprobs(lrn.state, batch, routing_replay=replay)
        label = ("fp8 rollout vs fp32 learner" if name == "fp32" else "fp8 rollout vs FP8-aware learner") + \
            (" (replay)" if replay else " (free routing)")
        rows[label] = stats(rl, at_resp(res.logprobs))
        if replay:  # the learner's own metric is the same number
            assert abs(float(m["train/train_rollout_logprob_abs_diff"]) - rows[label][0]) < 1e-6
    aware_free = at_resp(learners["fp8_aware"].compute_logprobs(learners["fp8_aware"].state, batch,
                                                                  routing_replay=False)[0].logprobs)
    rows["fp8 rollout minus its FP8 kv cache vs FP8-aware"] = stats(dec_fp8w, aware_free)
    del learners, w_only, a_only, both, score, score8  # memory: the exact rows build learners of their own
    gc.collect()
    jax.clear_caches()
    rows["exact fp32: fp32 learner (step metric)"], _, _ = exact_row(
        model, prompts, sp, batch.advantages, fp8=False, max_prompt_len=p)
    rows["exact, 2 micro-batches (scanned step loop)"], _, _ = exact_row(
        model, prompts, sp, batch.advantages, fp8=True, max_prompt_len=p, micro_batches=2)
    gc.collect()
    jax.clear_caches()
    rows["exact: FP8-aware learner (step metric)"], ex_learner, ex = exact_row(
        model, prompts, sp, batch.advantages, fp8=True, max_prompt_len=p)
    # cost of exact mode: its draws vs the FP8 rollout's generate (both compiled, medians of 3 calls)
    gen_s = median_s(lambda: fp8.generate(prompts, sp, seed=0))
    exact_s = median_s(lambda: exact_generate(ex_learner, prompts, sp, seed=0, routing_replay=True))
    n_tok, n_ex = int(rb.lengths.sum()), int(ex.lengths.sum())
    del ex_learner
    gc.collect()
    jax.clear_caches()
    secs = time.perf_counter() - t0

    print(f"config {args.config}: {args.rows} rows x {new} response tokens (prompts {lens.min()}-{lens.max()}), "
          f"fp32 compute, FP8 rollout with FP8 KV cache ({secs:.0f} s)")
    print(f"| {'source (one at a time)':<52} | mean abs dlogp | max abs dlogp | mismatch KL (k3) | tokens |")
    print(f"|{'-' * 54}|---------------:|--------------:|-----------------:|-------:|")
    for name, (mean, mx, kl, n) in rows.items():
        print(f"| {name:<52} | {mean:14.2e} | {mx:13.2e} | {kl:16.2e} | {n:6d} |")
    fp8_row, aware_row = rows["fp8 rollout vs fp32 learner (replay)"], rows["fp8 rollout vs FP8-aware learner (replay)"]
    exact = rows["exact: FP8-aware learner (step metric)"]
    print(f"exact mode cost ({args.rows} rows x {new} tokens): FP8 rollout generate (static batching, FP8 KV cache) "
          f"{gen_s:.3f} s ({n_tok / gen_s:.1f} tok/s); exact draws from the FP8-aware learner's forward "
          f"{exact_s:.3f} s ({n_ex / exact_s:.1f} tok/s)")
    result = (f"fp8_mean_abs_dlogp={fp8_row[0]:.3e} fp8_aware_mean_abs_dlogp={aware_row[0]:.3e} "
              f"exact_mean_abs_dlogp={exact[0]:g} exact_cost_frac={exact_s / gen_s - 1:.3f} "
              f"fp8_max_abs_dlogp={fp8_row[1]:.3e} fp8_aware_max_abs_dlogp={aware_row[1]:.3e} "
              f"fp8_kl={fp8_row[2]:.3e} fp8_aware_kl={aware_row[2]:.3e} "
              f"exact_fp32_mean_abs_dlogp={rows['exact fp32: fp32 learner (step metric)'][0]:g} "
              f"exact_microbatched_mean_abs_dlogp={rows['exact, 2 micro-batches (scanned step loop)'][0]:.3e} "
              f"rollout_tok_s={n_tok / gen_s:.1f} exact_rollout_tok_s={n_ex / exact_s:.1f}")
    if args.cost:
        off, on = cost(model, batch, False), cost(model, batch, True)
        print(f"learner train step ({args.rows} x {ids.shape[1]} tokens, fp32 compute, scanned layers, remat block; "
              f"XLA:CPU temp): fp8_forward off {off[0] / 2**20:.1f} MiB temp, {off[1]:.2f} s/step; "
              f"on {on[0] / 2**20:.1f} MiB temp, {on[1]:.2f} s/step")
        result += f" fp8_forward_temp_ratio={on[0] / off[0]:.3f} fp8_forward_step_ratio={on[1] / off[1]:.3f}"
    print("RESULT " + result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
