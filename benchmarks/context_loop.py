"""Long rows through the loop with context parallelism on the actor (issue 25 point 4), at lengths the suite cannot
afford: tests/rl/test_context_loop.py's two loop runs (`actor:expert=2,context=2/rollout:expert=2` vs
`actor:expert=2/rollout:expert=2`, tiny 2-layer model: CSA m=4, HCA m=8, window 8) with prompts of P tokens and
responses of exactly T, and its assertions (step-1 rollouts bitwise equal, rewards equal at every step, step-1 train
metrics within 1e-5).

Why a script beside the test: the suite's XLA:CPU flags (tests/conftest.py: optimisation level 0) compile faster
but run slower; a 16K-token decode under them took > 15 min per rollout on the shared 2-core box. Here the process
has the 8 host devices of the suite and XLA's default optimisation.

Run:   .venv/bin/python benchmarks/context_loop.py --prompt-len 16384 --new-tokens 16384      (rows of 32K tokens)
Last line: `RESULT cp_loop_tokens_per_row=.. cp_loop_windows=.. cp_loop_step1_max_abs_diff=..
cp_loop_last_step_max_rel_drift=.. cp_loop_s_cp1=.. cp_loop_s_cp2=..` (windows of the sliding window, 8 tokens;
seconds: each layout's loop, compiles included).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "rl"))

import jax  # noqa: E402

import test_context_loop as tcl  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=16384, help="P: prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=16384, help="T: response tokens per row (no early stop)")
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")  # as the suite (tests/conftest.py)
    p, t = args.prompt_len, args.new_tokens
    runs = {}
    for c in (1, 2):
        runs[c] = tcl.run_layout(c, prompt_len=p, new_tokens=t)
        for r in runs[c][0]:
            print(f"context={c} step {r['step']}: " + " ".join(
                f"{k}={float(v):.6g}" for k, v in r.items() if k in (
                    "rollout/reward_mean", "train/loss", "train/grad_norm", "perf/rollout_s", "perf/train_s")),
                flush=True)
        print(f"context={c}: loop {runs[c][2]:.1f} s", flush=True)
    fig = tcl.compare({**runs, "new_tokens": t})
    print(f"RESULT cp_loop_tokens_per_row={p + t} cp_loop_windows={(p + t) // 8} cp_loop_step1_max_abs_diff="
          f"{fig['step1_max_abs_diff']:.2e} cp_loop_last_step_max_rel_drift={fig['last_step_max_rel_drift']:.2e} "
          f"cp_loop_s_cp1={runs[1][2]:.1f} cp_loop_s_cp2={runs[2][2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
