"""Forward and forward+backward speed: dsv4 (JAX, jit) vs transformers 5.23 eager (torch), same weights, CPU.

What is measured, per config (tiny: B=2, S=64; small: `DSV4Config.small()`, B=2, S=256), fp32 on both sides:
- fwd: logits of the full sequence (ours: jitted `model(ids, dispatch_fn=...).logits` with the routed-expert
  implementation our learner uses on this backend, `parallel.expert.default_dispatch`: on CPU `routed_experts_cpu`;
  `--ragged` also times the stock `ragged_dot`; transformers: `model(ids, use_cache=False)`
  under `torch.no_grad()`, eager attention);
- fwdbwd: the gradient of the mean next-token NLL w.r.t. every parameter (ours: jitted `jax.value_and_grad`
  over all `nnx.Param`s; transformers: `loss.backward()` with every parameter requiring grad).
Steady state: everything is warmed up (ours: compiled) first, then N rounds time the four callables in turn
(so load changes on a shared machine hit both sides alike), ours with `block_until_ready`; medians are reported.
ratio = transformers time / ours (> 1: ours faster).
Weights: a transformers model with non-trivial random weights (sinks, ape, mHC, router bias, norms), saved with
`save_pretrained` and loaded with `dsv4.load_hf_checkpoint`; the logits of both are compared before timing.
Optionally (`--bf16`) ours with bf16 params and compute is timed too (no transformers counterpart row).

Run:   .venv/bin/python benchmarks/forward.py            (about 2-4 minutes on 2 cores)
       .venv/bin/python benchmarks/forward.py --configs tiny --runs 5
The last line is `RESULT fwd_ratio_tiny=.. fwdbwd_ratio_tiny=.. fwd_ratio_small=.. fwdbwd_ratio_small=..`.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dsv4 import DSV4Config, load_hf_checkpoint  # noqa: E402
from dsv4 import moe  # noqa: E402
from parallel import expert as expert_lib  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "dsv4"))
from hf_ref import hf_model  # noqa: E402

CONFIGS = {"tiny": (DSV4Config.tiny, 2, 64), "small": (DSV4Config.small, 2, 256)}


def build_hf(cfg: DSV4Config, seed: int = 0):
    """transformers `DeepseekV4ForCausalLM` for `cfg` with every parameter/buffer randomised
    (`tests/dsv4/hf_ref.py`'s `hf_model`, matrices scaled by 1/sqrt(fan_in) so the 512-wide `small` stays finite)."""
    return hf_model(cfg, seed=seed, weight_std=None)

def paired_medians(fns: dict, runs: int, warmup: int = 1) -> dict:
    """Median wall time (s) of each blocking callable in `fns`, after `warmup` untimed rounds. The callables are
    timed in turn within each round, so a load change on a shared machine hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def ours_fns(model, ids: np.ndarray, dispatch_fn=None):
    """(forward, forward+backward) closures over jitted functions. The state is passed as flat lists of arrays
    (unflattened inside the jit), as a training loop holds it: flattening the nnx.State pytree of ~160
    Variables on every call would add ~0.4 ms of Python to each step. dispatch_fn: routed experts (None: the
    model's stock ragged_dot)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    p_leaves, p_def = jax.tree.flatten(params)
    r_leaves, r_def = jax.tree.flatten(rest)
    x = jnp.asarray(ids, jnp.int32)

    def logits(p_leaves, r_leaves, x):
        m = nnx.merge(graphdef, jax.tree.unflatten(p_def, p_leaves), jax.tree.unflatten(r_def, r_leaves))
        return m(x, dispatch_fn=dispatch_fn).logits

    def nll(p_leaves, r_leaves, x):
        logp = jax.nn.log_softmax(logits(p_leaves, r_leaves, x)[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, x[:, 1:, None], axis=-1))

    fwd = jax.jit(logits)
    grad = jax.jit(jax.value_and_grad(nll))

    def run_fwd():
        return fwd(p_leaves, r_leaves, x).block_until_ready()

    def run_fwdbwd():
        return jax.block_until_ready(grad(p_leaves, r_leaves, x))

    return run_fwd, run_fwdbwd


def hf_fns(model, ids: np.ndarray):
    import torch

    x = torch.tensor(ids, dtype=torch.long)

    def run_fwd():
        with torch.no_grad():
            return model(x, use_cache=False).logits

    def run_fwdbwd():
        model.zero_grad(set_to_none=True)
        logits = model(x, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        return loss

    return run_fwd, run_fwdbwd


def bench_config(name: str, runs: int, bf16: bool, ragged: bool = False) -> dict:
    make, b, s = CONFIGS[name]
    cfg = make(torch_dtype="float32")
    hf = build_hf(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_hf_checkpoint(d, dtype=jnp.float32)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (b, s))
    # ours = what rl.algo.learner.Learner runs on this backend: parallel.expert.default_dispatch (CPU:
    # routed_experts_cpu)
    dispatch = expert_lib.default_dispatch(jax.devices()[:1])
    of, ob = ours_fns(ours, ids, dispatch)
    hf_f, hf_b = hf_fns(hf, ids)
    ref = hf_f().float().numpy()
    got = np.asarray(of())
    delta = float(np.abs(got - ref).max())
    row = {"config": name, "B": b, "S": s, "params": sum(p.numel() for p in hf.parameters()), "delta": delta}
    t0 = time.perf_counter()
    ob()  # compile the gradient
    row["compile_s"] = time.perf_counter() - t0
    fns = {"fwd_hf": hf_f, "fwd_ours": of, "fwdbwd_hf": hf_b, "fwdbwd_ours": ob}
    if ragged and dispatch is not None:
        fns["fwd_ours_ragged"], fns["fwdbwd_ours_ragged"] = ours_fns(ours, ids, None)
        fns["fwd_ours_ragged"](), fns["fwdbwd_ours_ragged"]()  # compile
    if bf16:
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            ours16 = load_hf_checkpoint(d, dtype=jnp.bfloat16)
        fns["fwd_ours_bf16"], fns["fwdbwd_ours_bf16"] = ours_fns(ours16, ids, dispatch)
        fns["fwd_ours_bf16"](), fns["fwdbwd_ours_bf16"]()  # compile
    # the first calls above warmed ours (compiled) and transformers' forward; small also skips the warm-up round
    row.update(paired_medians(fns, runs, warmup=1 if name == "tiny" else 0))
    return row


def machine_context() -> str:
    import flax
    import torch
    import transformers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"machine: {platform.machine()} {platform.processor() or ''} | usable cores {cores} "
            f"(os.cpu_count {os.cpu_count()}) | load average {load}\n"
            f"versions: python {platform.python_version()}, jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
            f"flax {flax.__version__}, torch {torch.__version__} (threads {torch.get_num_threads()}), "
            f"transformers {transformers.__version__} | jax devices {jax.devices()}")


def warn_if_loaded() -> None:
    """On a shared machine other processes distort both sides (torch's OpenMP threads spin-wait and collapse
    under oversubscription: tiny forwards of 20 ms took 0.8-1.8 s at load 10-15 on 2 cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > cores + 0.5:
        print(f"WARNING: 1-minute load average {load:.1f} > {cores} usable cores: timings are unreliable", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"], choices=sorted(CONFIGS))
    ap.add_argument("--runs", type=int, default=None, help="timed rounds per config (default: 20 tiny, 3 small)")
    ap.add_argument("--bf16", action="store_true", help="also time ours with bf16 params + compute")
    ap.add_argument("--ragged", action="store_true",
                    help="also time ours with the model's stock ragged_dot routed experts (on CPU ours uses "
                         "dsv4.moe.routed_experts_cpu, like the learner)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(2)
    print(machine_context(), flush=True)
    warn_if_loaded()
    rows = []
    for name in args.configs:
        runs = args.runs or (20 if name == "tiny" else 3)
        rows.append(bench_config(name, runs, args.bf16, args.ragged))
        r = rows[-1]
        print(f"[{name}] params {r['params']:,}  B={r['B']} S={r['S']}  max|logits ours - transformers| "
              f"{r['delta']:.2e}  (compile of ours' gradient: {r['compile_s']:.1f} s)", flush=True)

    print()
    print(f"{'config':<7} {'B x S':<8} {'pass':<7} {'transformers ms':>16} {'ours ms':>9} {'ratio':>7}"
          + (f" {'ours bf16 ms':>13}" if args.bf16 else "") + (f" {'ours ragged ms':>15}" if args.ragged else ""))
    result = {}
    for r in rows:
        for p in ("fwd", "fwdbwd"):
            ratio = r[f"{p}_hf"] / r[f"{p}_ours"]
            result[f"{p}_ratio_{r['config']}"] = ratio
            extra = f" {1e3 * r[f'{p}_ours_bf16']:>13.2f}" if args.bf16 else ""
            if f"{p}_ours_ragged" in r:
                extra += f" {1e3 * r[f'{p}_ours_ragged']:>15.2f}"
            print(f"{r['config']:<7} {r['B']}x{r['S']:<6} {p:<7} {1e3 * r[f'{p}_hf']:>16.2f} "
                  f"{1e3 * r[f'{p}_ours']:>9.2f} {ratio:>7.2f}" + extra)
    warn_if_loaded()
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
