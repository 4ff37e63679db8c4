"""LoRA RL on the tiny model vs full fine-tuning (issue 40): learning, the push, the learner step.

    .venv/bin/python benchmarks/lora.py                # the LoRA default run (80 steps) + the measurements
    .venv/bin/python benchmarks/lora.py --skip-run     # the in-process measurements only (~1-2 min)

1. Learning: `launch/run.py` as a real job, the default run (the tiny DeepSeek-V4 from random init, the digit-copy
   task, GRPO, 80 steps, `--mesh auto`, its lr 2e-3) with `--learner.lora.rank 16 --learner.lora.targets
   attn,shared,head` (alpha 16, `LoraConfig`'s default: scale 1; the adapters alone train, the base stays at its
   random init), no eval, no checkpoints. Why "head": a random base's frozen head and final norm bound every logit to
   about +-1.3 (dsv4/lora.py), so no adapter behind them can make the policy confident (measured: attn,shared alone,
   lr 2e-3: 0.037 -> 0.077 in 80 steps; lr 5e-3 and 2e-2 collapse, gradient norm -> 0.01). Why rank 16, scale 1
   (measured, 80 steps): rank 8 / alpha 16 plateaus (0.038 -> 0.347), rank 16 / alpha 32 too (0.041 -> 0.227), rank
   16 / alpha 16 learns (0.040 -> 0.827); our reading: the head's adapter maps the copied digits (+ <eos>) onto 16
   logits, a map of rank ~10, and scale 2 moves the adapters too fast (a higher lr is worse too: rank 8, lr 5e-3:
   0.087 over steps 43-47, the entropy falling without reward). Criterion of the default run
   (benchmarks/README.md "The default run"): mean rollout reward of the last 10% of steps >= 0.5 and >= 3x the
   first 10%'s. The full-fine-tuning figures are that section's (0.040 -> 0.927), not rerun here.
2. Push, in process (2 forced host devices: actor = device 0, rollout = device 1, as `--mesh auto`): the FP8
   rollout holds the same LoRA model; `WeightPusher` of the whole model vs `WeightPusher(only=is_adapter_key)`;
   wire bytes (exact) and the median seconds of 5 unverified pushes after a verified one.
3. Learner step, in process on the actor device: the run's learner (its recipe; routing replay off: the batch
   is synthetic) over the run's batch shape (512 rows x 16 tokens, 4 response tokens), LoRA vs full: median step
   seconds of 5 steps after the compile, the learner state's bytes (params + optimizer state) and XLA's temp bytes
   of the compiled step (`memory_analysis`).
4. Rollout: one generate call at the run's shape (512 prompts, 4 new tokens, FP8 weights), the LoRA sampler
   (adapters unmerged: base product + low-rank path) vs the same base without adapters (what a rollout that merges
   the adapters into its weights at each push runs): best of 3 after a compile call.
5. Flash arithmetic: the adapter push's wire bytes over the full push's for DeepSeek-V4-Flash (rank 8, attn,shared;
   the FP8 rollout's stored tensors from `rl.rollout.weights.EngineWeights.abstract_state`, no weights built).

Last line: `RESULT learns=0|1 first10=.. last10=.. push_wire_ratio=.. push_bytes_lora=.. push_bytes_full=..
push_s_lora=.. push_s_full=.. step_s_lora=.. step_s_full=.. state_mib_lora=.. state_mib_full=.. temp_mib_lora=..
temp_mib_full=.. generate_s_unmerged=.. generate_s_plain=.. flash_push_wire_ratio=..` (push_wire_ratio: the tiny
model's measured ratio; flash_push_wire_ratio: the arithmetic for Flash at rank 8, attn,shared).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dsv4  # noqa: E402
from dsv4.lora import LoraConfig, is_adapter_key  # noqa: E402
from dsv4.rollout_format import RolloutFormat, parse_rollout_dtype  # noqa: E402
from parallel.push.local import WeightPusher  # noqa: E402
from rl.algo.batch import TrainBatch  # noqa: E402
from rl.config.run import DEFAULT_LEARNER  # noqa: E402
from rl.algo.learner import Learner  # noqa: E402
from rl.rollout.engine import Sampler, SamplingParams  # noqa: E402
from rl.rollout.weights import EngineWeights  # noqa: E402
from sharding.mesh import build_mesh_plan  # noqa: E402

LORA = LoraConfig(rank=16, targets="attn,shared,head")  # the tiny run's (module docstring, item 1; alpha: the default)
FLASH_LORA = LoraConfig(rank=8, alpha=16.0)  # the default targets for the Flash arithmetic
ROWS, PROMPT, RESPONSE = 512, 12, 4  # the default run: 32 prompts x 16 samples, 4 new tokens
MIB = 2**20


def learning_run(steps: int, out: pathlib.Path, timeout: float) -> dict:
    """The default run with LoRA as a job; -> {first10, last10, learns, step_s}."""
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, str(REPO / "launch" / "run.py"), "--no-progress", "--eval-every", "0", "--ckpt-dir", "",
           "--tensorboard-dir", "", "--mesh", "auto", "--steps", str(steps), "--metrics-jsonl", str(metrics),
           "--learner.lora.rank", str(LORA.rank), "--learner.lora.alpha", str(LORA.alpha),
           "--learner.lora.targets", LORA.targets]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with open(out / "run.log", "wb") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        tail = (out / "run.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"the LoRA run ended with {rc}: " + " | ".join(tail))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    curve = [r["rollout/reward_mean"] for r in rows]
    n = max(1, len(curve) // 10)
    first, last = sum(curve[:n]) / n, sum(curve[-n:]) / n
    return {"first10": first, "last10": last, "learns": int(last >= 0.5 and last >= 3 * first),
            "step_s": statistics.median(r["perf/step_s"] for r in rows[1:] or rows), "curve": curve}


def _batch(rng) -> TrainBatch:
    s = PROMPT + RESPONSE
    ids = rng.integers(1, 16, (ROWS, s)).astype(np.int32)
    rm = np.zeros((ROWS, s), np.int32)
    rm[:, PROMPT:] = 1
    return TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.ones((ROWS, s), jnp.int32),
                      response_mask=jnp.asarray(rm), rollout_logprobs=jnp.zeros((ROWS, s), jnp.float32),
                      advantages=jnp.asarray(rng.normal(size=ROWS), jnp.float32))


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def learner_figures(model, cfg, plan, batch, n: int = 5) -> tuple[Learner, dict]:
    learner = Learner(model, cfg, mesh=plan.actor)
    temp = learner.lower(batch).compile().memory_analysis().temp_size_in_bytes
    learner.update(batch)  # compile
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(learner.update(batch))
        times.append(time.perf_counter() - t0)
    s = learner.state
    return learner, {"step_s": statistics.median(times), "state_mib": (_nbytes(s.params) + _nbytes(s.opt_state)) / MIB,
                     "opt_mib": _nbytes(s.opt_state) / MIB, "temp_mib": temp / MIB}


def push_figures(pusher, params_fn, sampler, n: int = 5) -> dict:
    v = sampler.weight_version + 1
    pusher.push(params_fn(), v, verify=True)
    times = []
    for i in range(n):
        times.append(pusher.push(params_fn(), v + 1 + i, verify=False).seconds)
    return {"bytes": pusher.wire_bytes, "s": statistics.median(times)}


def generate_s(sampler, n: int = 3) -> float:
    """Best-of-n seconds of one generate call at the default run's rollout shape (512 prompts of 8 tokens, 4 new),
    after a compile call."""
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(1, 16, 8))) for _ in range(ROWS)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=RESPONSE)
    sampler.generate(prompts, sp, seed=0)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        sampler.generate(prompts, sp, seed=1 + i)
        times.append(time.perf_counter() - t0)
    return min(times)


def flash_wire_ratio(lora: LoraConfig) -> tuple[float, int, int]:
    """(adapter bytes / all bytes, adapter bytes, all bytes) of the FP8 rollout's stored Flash state."""
    rf = RolloutFormat(rdt=parse_rollout_dtype("fp8"), fmt="e4m3fn", block=(128, 128), compute_dtype=jnp.bfloat16)
    state = EngineWeights(dsv4.DSV4Config.flash(), rf, lora=lora).abstract_state()
    sizes = {k: _nbytes(v) for k, v in state.items()}
    ad = sum(b for k, b in sizes.items() if is_adapter_key(k))
    full = sum(sizes.values())
    return ad / full, ad, full


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--skip-run", action="store_true", help="only the in-process measurements")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    res: dict = {"learns": "skipped"} if args.skip_run else {}
    cfg = dsv4.DSV4Config.tiny(vocab_size=16)
    plan = build_mesh_plan("actor:data=1/rollout:data=1", config=cfg)
    lcfg = dataclasses.replace(DEFAULT_LEARNER, routing_replay=False)
    batch = _batch(np.random.default_rng(0))
    lora_model = dsv4.DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), lora=LORA)
    full_model = dsv4.DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0))
    lora_learner, lo = learner_figures(lora_model, dataclasses.replace(lcfg, lora=LORA), plan, batch)
    full_learner, fu = learner_figures(full_model, lcfg, plan, batch)
    print(f"learner step (512 x 16): LoRA {lo}  full {fu}", flush=True)
    sampler = Sampler(lora_model, mesh=plan.rollout, weights="fp8", max_prompt_len=16)
    p_lora = push_figures(WeightPusher(plan, sampler, lora_learner.adapters_for_push(), only=is_adapter_key),
                          lora_learner.adapters_for_push, sampler)
    p_full = push_figures(WeightPusher(plan, sampler, lora_learner.params_for_push()), lora_learner.params_for_push,
                          sampler)
    print(f"push: LoRA {p_lora}  full {p_full}", flush=True)
    gen_lora = generate_s(sampler)  # the adapters unmerged: base product + low-rank path
    plain = Sampler(full_model, mesh=plan.rollout, weights="fp8", max_prompt_len=16)
    gen_plain = generate_s(plain)  # what a merged rollout runs (the base's products alone)
    print(f"generate (512 x 4 tokens, FP8): unmerged adapters {gen_lora:.3f} s, no adapters {gen_plain:.3f} s",
          flush=True)
    ratio, ad, full = flash_wire_ratio(FLASH_LORA)
    print(f"Flash (rank {FLASH_LORA.rank}, {FLASH_LORA.targets}): adapter push {ad / MIB:.1f} MiB of "
          f"{full / 2**30:.1f} GiB = {ratio:.5f}", flush=True)
    if not args.skip_run:
        with tempfile.TemporaryDirectory() as d:
            run = learning_run(args.steps, pathlib.Path(d), args.timeout)
        print("LoRA run reward curve: " + " ".join(f"{x:.3f}" for x in run["curve"]), flush=True)
        res.update(learns=run["learns"], first10=f"{run['first10']:.4f}", last10=f"{run['last10']:.4f}",
                   run_step_s=f"{run['step_s']:.3f}")
    res.update(push_wire_ratio=f"{p_lora['bytes'] / p_full['bytes']:.4f}", push_bytes_lora=p_lora["bytes"],
               push_bytes_full=p_full["bytes"], push_s_lora=f"{p_lora['s']:.4f}", push_s_full=f"{p_full['s']:.4f}",
               step_s_lora=f"{lo['step_s']:.3f}", step_s_full=f"{fu['step_s']:.3f}",
               state_mib_lora=f"{lo['state_mib']:.2f}", state_mib_full=f"{fu['state_mib']:.2f}",
               opt_mib_lora=f"{lo['opt_mib']:.3f}", opt_mib_full=f"{fu['opt_mib']:.2f}",
               temp_mib_lora=f"{lo['temp_mib']:.1f}", temp_mib_full=f"{fu['temp_mib']:.1f}",
               generate_s_unmerged=f"{gen_lora:.3f}", generate_s_plain=f"{gen_plain:.3f}",
               flash_push_wire_ratio=f"{ratio:.5f}")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in res.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
