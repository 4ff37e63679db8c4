"""Compile time of forward+backward vs depth: the Python layer loop (unrolled) vs `dsv4/scan.py` (scanned).

What is measured: `jax.jit(grad).lower(...)` + `.compile()` wall time of the gradient of the mean next-token NLL
w.r.t. every `nnx.Param` of a model with `DSV4Config.small()` dims (D = 512, 16 experts, window 64, CSA m = 4,
HCA m = 16) at 4 / 12 / 24 / 43 main layers, laid out in DeepSeek-V4-Flash's schedule (3 hash layers, sliding
layers 0-1, then CSA / HCA alternating: `(0, 0) + (4, 16) * 21`, truncated). Abstract parameters
(`jax.ShapeDtypeStruct`s): nothing is allocated or run. One row of B x S = 1 x 256 tokens, fp32, the routed-expert
implementation the learner uses on this backend (`parallel.expert.default_dispatch`), XLA's default optimisation level.
unrolled = `model(ids)` (Python loop over `model.layers`); scanned = the same model through
`dsv4.scan.merge_stacked` + `layer_stack=` (one `lax.scan` per group of identical layers; Flash's schedule gives 4
traced layer bodies at any depth >= 4).

The scanned path is timed per `--remat` policy (default: none and block; `block`, the learner's default, gives
the headline ratio); the unrolled path is the model's layer loop as it is (no remat).

Run:   .venv/bin/python benchmarks/scan_compile.py            (about 5 CPU-minutes; 15-20 minutes on a loaded machine)
       .venv/bin/python benchmarks/scan_compile.py --layers 4 12 --remat block
Last line: `RESULT compile_ratio_43_4_scan=.. compile_ratio_43_4_unrolled=..` (compile time at 43 layers / at 4;
target for the scanned path <= 1.5). The ratios use the process CPU time of lower + compile (`time.process_time`,
all threads): on a shared, loaded machine wall time mostly measures the other jobs; both are printed.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv4 import DSV4Config, abstract_model  # noqa: E402
from dsv4 import scan  # noqa: E402
from parallel import expert as expert_lib  # noqa: E402
from dsv4.layers import Buffer  # noqa: E402


def config(n_layers: int) -> DSV4Config:
    """`DSV4Config.small()` dims with `n_layers` main layers in Flash's schedule (see the module docstring)."""
    ratios = ((0, 0) + (4, 16) * 21)[:n_layers]
    return DSV4Config.small(num_hidden_layers=n_layers, compress_ratios=ratios + (0,), num_hash_layers=min(3, n_layers),
                            torch_dtype="float32")


def _nll(logits, ids):
    lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1))


def compile_seconds(n_layers: int, scanned: bool, *, seq: int, remat: str | None = None) -> dict:
    """{lower, compile: wall s; cpu: process CPU s of lower + compile; bodies: traced layer bodies} of the fwd+bwd
    of `config(n_layers)` on abstract parameters."""
    cfg = config(n_layers)
    model = abstract_model(cfg)
    graphdef, params, buffers = nnx.split(model, nnx.Param, Buffer)
    dispatch = expert_lib.default_dispatch(jax.devices())
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    if scanned:
        sdef = scan.stack_def(model)
        params, buffers = scan.stack_params(params, sdef.groups), scan.stack_params(buffers, sdef.groups)
        bodies = sum(g.period for g in sdef.groups)

        def loss(p, b, ids):
            shell, stack = scan.merge_stacked(sdef, p, b, remat=remat)
            return _nll(shell(ids, dispatch_fn=dispatch, layer_stack=stack).logits, ids)
    else:
        bodies = n_layers

        def loss(p, b, ids):
            return _nll(nnx.merge(graphdef, p, b)(ids, dispatch_fn=dispatch).logits, ids)

    c0, t0 = time.process_time(), time.perf_counter()
    lowered = jax.jit(jax.grad(loss)).lower(params, buffers, ids)
    t1 = time.perf_counter()
    lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    return {"lower": t1 - t0, "compile": t2 - t1, "cpu": c2 - c0, "bodies": bodies}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24, 43])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--remat", choices=scan.REMAT_POLICIES, nargs="+", default=["none", "block"],
                    help="remat policies of the scanned path to time (the first 'block' one gives the RESULT)")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; small dims, B x S = 1 x {args.seq}, fp32, fwd+bwd")
    print("| layers | path | traced bodies | lower s | compile s | wall total s | CPU s |")
    print("|---|---|---|---|---|---|---|")
    cpu = {}
    paths = [("unrolled", None)] + [(f"scanned, remat {r}", r) for r in args.remat]
    for n in args.layers:
        for path, remat in paths:
            r = compile_seconds(n, remat is not None, seq=args.seq, remat=remat)
            cpu[(n, path)] = r["cpu"]
            print(f"| {n} | {path} | {r['bodies']} | {r['lower']:.2f} | {r['compile']:.2f} | "
                  f"{r['lower'] + r['compile']:.2f} | {r['cpu']:.2f} |", flush=True)
    lo_n, hi_n = min(args.layers), max(args.layers)
    ratio = {p: cpu[(hi_n, p)] / cpu[(lo_n, p)] for p, _ in paths}
    print(f"load average now {os.getloadavg()[0]:.1f}")
    print("compile CPU-time ratio " + ", ".join(f"{p}: {v:.2f}" for p, v in ratio.items()))
    main_path = "scanned, remat block" if "block" in args.remat else paths[1][0]
    extra = " ".join(f"compile_ratio_{hi_n}_{lo_n}_scan_{r}={ratio[f'scanned, remat {r}']:.2f}" for r in args.remat)
    print(f"RESULT compile_ratio_{hi_n}_{lo_n}_scan={ratio[main_path]:.2f} "
          f"compile_ratio_{hi_n}_{lo_n}_unrolled={ratio['unrolled']:.2f} {extra}")


if __name__ == "__main__":
    main()
