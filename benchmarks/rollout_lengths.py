"""Continuous vs static batching of the rollout on an RL-like length spread, same weights, same workload, one run.

Workload: 256 requests (prompts of 32 random tokens; 16 prompts x 16 samples, keys per (prompt, sample) as the
loop draws them), sampled at temperature 1 with a length schedule: 90% of the requests end near 64 tokens
(uniform in [56, 72]), 10% run to 1,024 (26 requests at seeded random positions). The lengths are forced with
`Sampler.generate(max_new_tokens_per_row=...)` and no stop tokens, so both sides generate exactly the same
number of tokens for every request (checked). `--scale s` multiplies both lengths (the spread's shape stays).

- continuous: `Sampler(model, slots=S)` (rl/rollout/slots.py), one `generate` call over the 256 requests: S decode slots,
  a slot is refilled with the next request as soon as its sample ends.
- static: today's path, `Sampler(model, slots=0)` at the same slot count: the requests in order, S per
  `generate` call (each call decodes until its longest row ends, as the loop's static batch does).
Same model (tiny config by default, random weights, fp32 on CPU), same requests, same seeds. Each side is
compiled first (a warm-up call with every length 1: the same compiled program, lengths are traced values), then
timed once, whole (prefills included). tok/s = generated tokens / wall seconds.

Run:  .venv/bin/python benchmarks/rollout_lengths.py [--config tiny] [--slots 32] [--scale 1.0]
Last line: RESULT continuous_tok_s=.. static_tok_s=.. ratio=..
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dsv4 import DSV4Config  # noqa: E402
from dsv4.io.load import init_model  # noqa: E402
from rl.rollout.engine import Sampler, SamplingParams  # noqa: E402


def workload(n: int, short: int, long: int, long_frac: float, seed: int) -> np.ndarray:
    """[n] forced lengths: round(long_frac * n) requests of `long`, the rest uniform in short +- short/8."""
    rs = np.random.RandomState(seed)
    lens = rs.randint(short - short // 8, short + short // 8 + 1, n)
    lens[rs.choice(n, int(round(long_frac * n)), replace=False)] = long
    return lens.astype(np.int64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--group", type=int, default=16, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the lengths 64 and 1,024")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = DSV4Config.preset(args.config)
    short, long = max(2, round(64 * args.scale)), max(4, round(1024 * args.scale))
    lens = workload(args.requests, short, long, 0.10, args.seed)
    rs = np.random.RandomState(args.seed + 1)
    n_prompts = args.requests // args.group
    base = [list(map(int, rs.randint(3, cfg.vocab_size, args.prompt_len))) for _ in range(n_prompts)]
    prompts = [base[i // args.group] for i in range(args.requests)]
    pidx = [i // args.group for i in range(args.requests)]
    sidx = [i % args.group for i in range(args.requests)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=long)
    model = init_model(cfg, seed=0)
    kw = dict(weights="fp32", max_prompt_len=args.prompt_len)
    cont = Sampler(model, slots=args.slots, **kw)
    stat = Sampler(model, slots=0, **kw)
    del model
    s = args.slots
    print(f"config={args.config} requests={args.requests} slots={s} prompt={args.prompt_len} lengths: "
          f"{int((lens == long).sum())} x {long}, the rest in [{lens[lens != long].min()}, "
          f"{lens[lens != long].max()}]; tokens={int(lens.sum())}; devices={jax.devices()[0].platform}", flush=True)

    def run_cont(limits):
        return cont.generate(prompts, sp, seed=args.seed, step=0, prompt_index=pidx, sample_index=sidx,
                             max_new_tokens_per_row=list(limits))

    def run_static(limits):
        outs = []
        for a in range(0, args.requests, s):
            outs.append(stat.generate(prompts[a:a + s], sp, seed=args.seed, step=0, prompt_index=pidx[a:a + s],
                                      sample_index=sidx[a:a + s], max_new_tokens_per_row=list(limits[a:a + s])))
        return outs

    t0 = time.perf_counter()
    run_cont(np.ones_like(lens))
    run_static(np.ones_like(lens))
    print(f"compile + warm-up: {time.perf_counter() - t0:.1f} s", flush=True)

    t0 = time.perf_counter()
    c = run_cont(lens)
    t_cont = time.perf_counter() - t0
    stats = dict(cont.last_stats)
    t0 = time.perf_counter()
    st = run_static(lens)
    t_stat = time.perf_counter() - t0

    c_len = c.lengths
    s_len = np.concatenate([b.lengths for b in st])
    assert (c_len == lens).all() and (s_len == lens).all(), "both sides must generate the forced lengths"
    s_tok = np.concatenate([np.pad(b.tokens, ((0, 0), (0, long - b.tokens.shape[1]))) for b in st])
    same = float(np.mean([(c.tokens[i, :n] == s_tok[i, :n]).all() for i, n in enumerate(lens)]))
    n_tok = int(lens.sum())
    static_steps = sum(int(lens[a:a + s].max()) for a in range(0, args.requests, s))
    print(f"continuous: {t_cont:.2f} s, {stats['rollout/decode_steps']:.0f} decode steps, slot utilisation "
          f"{stats['rollout/slot_utilisation']:.3f}, slots refilled {stats['rollout/slots_refilled']:.0f}")
    print(f"static:     {t_stat:.2f} s, {static_steps} decode steps ({args.requests // s} calls), slot utilisation "
          f"{n_tok / (static_steps * s):.3f}")
    print(f"requests with identical tokens on both sides: {same:.3f} (sampled at T=1: the static path's logprobs "
          f"differ from the slots' in the last bits, see tests/rl/test_slots.py)")
    ct, stt = n_tok / t_cont, n_tok / t_stat
    print(f"RESULT continuous_tok_s={ct:.1f} static_tok_s={stt:.1f} ratio={ct / stt:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
