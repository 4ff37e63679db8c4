"""FP8 vs unquantised rollout KV cache (`--kv-cache-dtype`, dsv4/cache.py): bytes per token and the logprob effect.

    .venv/bin/python benchmarks/kv_cache.py [--config small] [--rows 4] [--new 96]

- Bytes: Flash's per-token KV bytes of both layouts from `dsv4.cache.cache_shapes` (`parallel.model_bytes.KVCache`,
  abstract: no memory), and the benchmark model's from the live cache arrays of its Sampler (`empty_caches` at two
  cache lengths: the marginal bytes per added token).
- Logprob effect: the benchmark model (`--config`, default init, seed 0; fp32 weights and compute so only the cache
  differs) samples `--rows` responses of `--new` tokens at temperature 1 with the unquantised cache; those very
  tokens are then scored through the decode path with the FP8 cache (`dsv4.cache.teacher_forced_logprobs`:
  teacher forcing, the clean comparison; free sampling would diverge at the first different draw). Reports
  max / mean |logprob difference| over all rows x tokens.
Last line: `RESULT kv_fp8_bytes_per_token=.. kv_bf16_bytes_per_token=.. kv_ratio=.. model_fp8_bytes_per_token=..
model_bf16_bytes_per_token=.. logprob_max_abs_diff=.. logprob_mean_abs_diff=.. tokens=..`.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4 import DSV4Config, DSV4ForCausalLM  # noqa: E402
from dsv4.cache import teacher_forced_logprobs  # noqa: E402
from parallel.model_bytes import KVCache  # noqa: E402
from rl.rollout.engine import Sampler, SamplingParams  # noqa: E402


def marginal_bytes(sampler: Sampler, lo: int, hi: int) -> float:
    """Bytes per added token of the sampler's live cache arrays between cache lengths lo and hi."""
    def nb(n):
        return sum(x.nbytes for x in jax.tree.leaves(sampler.empty_caches(1, n)))
    return (nb(hi) - nb(lo)) / (hi - lo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small", choices=("tiny", "small"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=96, help="response tokens per row")
    args = ap.parse_args(argv)

    flash = DSV4Config.flash()
    fp8_flash, bf16_flash = KVCache.for_config(flash, fp8="e4m3fn"), KVCache.for_config(flash)
    print(f"Flash KV bytes per token: fp8 {fp8_flash.per_token:,.2f} B (+{fp8_flash.fixed / 2**20:.1f} MiB per "
          f"sequence), bf16 {bf16_flash.per_token:,.2f} B (+{bf16_flash.fixed / 2**20:.1f} MiB per sequence)")

    cfg = DSV4Config.preset(args.config)
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0))
    p = args.prompt_len
    dense = Sampler(model, weights="fp32", max_prompt_len=p, kv_cache_dtype="bf16")
    fp8 = Sampler(model, weights="fp32", max_prompt_len=p, kv_cache_dtype="fp8")
    step = 128  # a multiple of every compression ratio of the presets
    m_fp8, m_bf16 = marginal_bytes(fp8, step, 2 * step), marginal_bytes(dense, step, 2 * step)
    print(f"{args.config} KV bytes per token (live arrays): fp8 {m_fp8:,.2f} B, unquantised (fp32 compute) "
          f"{m_bf16:,.2f} B")

    rs = np.random.RandomState(0)
    lens = rs.randint(p // 2, p + 1, args.rows).astype(np.int32)
    prompts = [list(map(int, rs.randint(3, cfg.vocab_size, n))) for n in lens]
    out = dense.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new), seed=0)
    ids = np.zeros((args.rows, p + args.new), np.int32)
    for i, pr in enumerate(prompts):
        ids[i, :len(pr)] = pr
        ids[i, len(pr):len(pr) + args.new] = out.tokens[i]
    score = jax.jit(lambda i, n, f: teacher_forced_logprobs(model, i, n, args.new, p + args.new, kv_fp8=f),
                    static_argnums=2)
    ref = np.asarray(score(jnp.asarray(ids), jnp.asarray(lens), None))
    q = np.asarray(score(jnp.asarray(ids), jnp.asarray(lens), "e4m3fn"))
    check = np.abs(ref - out.logprobs).max()
    diff = np.abs(q - ref)
    print(f"unquantised teacher-forced vs the sampler's own logprobs: max {check:.2e} (same path)")
    print(f"fp8 vs unquantised cache, {diff.size} tokens: max |dlogprob| {diff.max():.4f}, mean {diff.mean():.5f}, "
          f"p99 {np.quantile(diff, 0.99):.4f}; mean logprob {ref.mean():.3f}")
    print(f"RESULT kv_fp8_bytes_per_token={fp8_flash.per_token:.2f} kv_bf16_bytes_per_token={bf16_flash.per_token:.2f} "
          f"kv_ratio={fp8_flash.per_token / bf16_flash.per_token:.3f} model_fp8_bytes_per_token={m_fp8:.2f} "
          f"model_bf16_bytes_per_token={m_bf16:.2f} logprob_max_abs_diff={diff.max():.4f} "
          f"logprob_mean_abs_diff={diff.mean():.5f} tokens={diff.size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
