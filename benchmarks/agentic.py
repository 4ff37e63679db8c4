"""Multi-turn agentic GRPO on the tiny key-lookup task (issue 39): does the tiny model learn from random init on CPU
to call `lookup` and copy the value it returns, and what do tool turns cost the rollout.

    .venv/bin/python benchmarks/agentic.py                                  # the defaults below
    .venv/bin/python benchmarks/agentic.py --steps 40 --show 16 --set learner.lr=6e-3   # a short look at a variant

One process, the job in-process (`rl.run.wiring.build` + `rl.run.loop.run`: what `launch/run.py --rollout.env
key_lookup` runs, without its CLI): the tiny DeepSeek-V4 from random init, `--mesh auto` on 2 forced host devices (actor 1,
rollout 1), `--rollout.max_turns 2`, no checkpoints, no eval; defaults (`DEFAULTS`): 150 steps of 16 prompts x 16
samples, lr 3e-3, an entropy bonus 0.05 (`learner.loss.entropy_coef`: at 0.02 the second turn collapsed onto an
empty answer before the call was learned; at lr 6e-3 the entropy reached 0 with a third of the values mapped),
8 new tokens (both turns and the tool's answer; a perfect trajectory is 2 + 2 + 2), 1-digit values. The task
(rl/agent/key_lookup.py, rl/run/env_task.py): the prompt names a key (a digit, `ENV_KEYS` = 4 keys), `lookup`
returns its value (`--task-digits` digits, random per prompt); in the task's tokenizer the whole call is one piece
per key, the key is merged with the prompt's closing markup and the value's last digit with the tool result's, so
both the call and the answer are read off the id before them; the reward is shaped: 0.2 x the share of the right
first turn (the right call, then EOS) + 0.8 x the value's part of the final answer (0.1 for an answer of the
value's length in digits, right or not, + 0.9 x the digits copied, halved without the exact length), the value's
part counted only after the right call (a guess earns nothing) and only for a final turn that answers (one that
calls a tool again has no answer): the best value-blind policy scores 0.352, so a run above 0.5 copies values.
`--show N` prints N trajectories of the trained policy (one per prompt; the environment's ids in brackets).
`--out` must not hold a metrics.jsonl (the run appends to it).

Figures (last line `RESULT learns=0|1 reward_first10=.. reward_last10=.. tool_calls_first10=.. tool_calls_last10=..
tokens_per_s_tools=.. tokens_per_s_plain=..`):
- reward_first10 / reward_last10: mean `rollout/reward_mean` over the first / last 10% of the steps (at least one
  step each); learns=1 when last >= 0.5 and >= 3x first (the default criterion, README.md);
- tool_calls_first10 / tool_calls_last10: `rollout/tool_calls_per_traj` over the same steps;
- tokens_per_s_tools / tokens_per_s_plain: after training, one training batch of prompts (prompts_per_step x
  group_size rows) through the trained rollout engine as a multi-turn request (model-written tokens per second,
  tool runs and the re-prefill of every later turn included) and as a plain single-turn request (tokens per second;
  it stops at the first EOS); each timed after a warm-up call (compiles), best of `--repeats`. Their ratio is the
  cost of the tool turns at the policy's own call rate (a policy that never calls pays only the environment's
  parse of every turn).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax starts a backend
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from rl.config import tree as config_tree  # noqa: E402
from rl.config.run import RunConfig  # noqa: E402
from rl.run.env_task import multiturn_request  # noqa: E402
from rl.run.wiring import build  # noqa: E402
from rl.run.loop import run  # noqa: E402
from rl.rollout.multiturn import generate_multiturn  # noqa: E402
from rl.run.stages import prompt_lists, sampling_params  # noqa: E402

DEFAULTS = {"rollout.env": "key_lookup", "rollout.max_turns": 2, "steps": 150, "rollout.prompts_per_step": 16,
            "rollout.group_size": 16, "rollout.max_new_tokens": 8, "data.task_digits": 1, "learner.lr": 3e-3,
            "learner.loss.entropy_coef": 0.05, "ckpt.dir": "", "log.tensorboard_dir": "", "log.progress": False,
            "eval.every": 0}


def window(rows: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and the last 10% of the steps (at least one step each)."""
    vals = [float(r.get(key, 0.0)) for r in rows]
    k = max(1, len(vals) // 10)
    return float(np.mean(vals[:k])), float(np.mean(vals[-k:]))


def throughput(wiring, repeats: int) -> tuple[float, float]:
    """(model tokens / s of the batch as a multi-turn request, tokens / s of it as a plain request): the docstring."""
    sampler, cfg = wiring.rollout.sampler, wiring.cfg
    batch = next(wiring.iterator)
    g = cfg.rollout.group_size
    rows = [p for p in prompt_lists(batch) for _ in range(g)]
    refs = [r for r in batch["reference"] for _ in range(g)]
    pi = [i for i in range(len(batch["reference"])) for _ in range(g)]
    si = [j for _ in batch["reference"] for j in range(g)]
    sp, mt = sampling_params(wiring), multiturn_request(cfg, refs)

    def tools():
        rb, _ = generate_multiturn(sampler, wiring.tokenizer, rows, sp, mt, seed=cfg.seed, step=10**6,
                                   prompt_index=pi, sample_index=si)
        last.append(rb)
        return int(rb.loss_mask.sum())

    def plain():
        return int(sampler.generate(rows, sp, seed=cfg.seed, step=10**6, prompt_index=pi,
                                    sample_index=si).lengths.sum())

    out, last = [], []
    for fn in (tools, plain):
        fn()  # compiles
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = fn()
            best = max(best, n / (time.perf_counter() - t0))
        out.append(best)
    return out[0], out[1], last[-1], refs


def show(tokenizer, rb, refs, n: int, stride: int) -> None:
    """Trajectories 0, stride, .. (n of them: one per prompt) of `rb`, one id per `|` (pieces longer than 12
    characters shortened), the environment's ids in [brackets]: what the trained policy writes."""
    for i in range(0, min(n * stride, len(refs)), stride):
        ids = rb.tokens[i, : rb.lengths[i]].tolist()
        out = []
        for t, m in zip(ids, rb.loss_mask[i, : rb.lengths[i]].tolist()):
            piece = tokenizer.table[t] if t < len(tokenizer.table) else "?"
            piece = repr(piece if len(piece) <= 12 else piece[:5] + ".." + piece[-5:])[1:-1]
            out.append(piece if m else f"[{piece}]")
        print(f"  {refs[i]}: {' | '.join(out)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="any run knob by its dotted path (rl/config/run.py), e.g. learner.lr=3e-3")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per throughput figure (best kept)")
    ap.add_argument("--show", type=int, default=4, help="trajectories of the trained policy to print (one per prompt)")
    ap.add_argument("--out", default=None, help="folder for metrics.jsonl (default: a temporary one)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    leaves = config_tree.paths(RunConfig)
    items = {**DEFAULTS, "steps": args.steps}
    for kv in args.set:
        k, sep, v = kv.partition("=")
        if not sep or k not in leaves:
            print(f"error: --set {kv!r}: expected KNOB=VALUE with a dotted knob of rl/config/run.py", file=sys.stderr)
            return 2
        items[k] = config_tree.convert(leaves[k], v, "--set")
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="agentic."))
    if (out / "metrics.jsonl").exists():  # the run appends: an old run's steps would enter the windows
        print(f"error: --out {out}: holds a metrics.jsonl already (remove it or pick another folder)", file=sys.stderr)
        return 2
    items["log.metrics_jsonl"] = str(out / "metrics.jsonl")
    cfg = RunConfig.from_overrides(list(items.items()), source="benchmarks/agentic.py")
    print(f"config: {json.dumps({k: v for k, v in items.items() if k != 'log.metrics_jsonl'})}", flush=True)
    t0 = time.perf_counter()
    wiring = build(cfg)
    run(wiring)
    train_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rows = [r for r in rows if "rollout/reward_mean" in r]
    r0, r1 = window(rows, "rollout/reward_mean")
    c0, c1 = window(rows, "rollout/tool_calls_per_traj")
    step_s = statistics.median(float(r.get("perf/step_s", 0.0)) for r in rows)
    for r in rows[:: max(1, len(rows) // 10)]:
        print(f"  step {r.get('step')}: reward {r['rollout/reward_mean']:.3f} tool calls/traj "
              f"{r.get('rollout/tool_calls_per_traj', 0):.3f} turns {r.get('rollout/turns_mean', 0):.2f} "
              f"tool errors {r.get('rollout/tool_errors', 0):.3f}", flush=True)
    tools, plain, rb, refs = throughput(wiring, args.repeats)
    show(wiring.tokenizer, rb, refs, args.show, wiring.cfg.rollout.group_size)
    learns = int(r1 >= 0.5 and r1 >= 3 * r0)
    print(f"{len(rows)} steps in {train_s:.0f} s (median step {step_s:.2f} s); reward first 10% {r0:.4f}, last 10% "
          f"{r1:.4f}; tool calls per trajectory {c0:.3f} -> {c1:.3f}; rollout {tools:.1f} model tok/s with tools vs "
          f"{plain:.1f} tok/s plain (ratio {tools / max(plain, 1e-9):.3f})")
    print(f"RESULT learns={learns} reward_first10={r0:.4f} reward_last10={r1:.4f} tool_calls_first10={c0:.3f} "
          f"tool_calls_last10={c1:.3f} tokens_per_s_tools={tools:.1f} tokens_per_s_plain={plain:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
