"""The save-path cost of the checkpoint digests (issue 42): `Checkpointer.save` with vs without `digest`.

    .venv/bin/python benchmarks/ckpt_digest.py                         # tiny and small (~1 GiB of state)
    .venv/bin/python benchmarks/ckpt_digest.py --configs tiny --repeats 5

The state is shaped as the learner's (rl/algo/learner.py::state_dict): every parameter of the model preset in fp32 (the
masters), AdamW's two moments of the same shapes and a step counter, filled with random numbers (they do not
compress, as trained weights do not). On the default devices (the host's CPU here), asynchronous saves as a run does
them; the two settings alternate, each save into its own directory, the first save of each setting (the digest's
compile) not counted. Figures per config, medians over `--repeats`:
- save_s / save_digest_s: `save` returns (the part the training loop waits for: orbax's device-to-host copy, and
  with digest the digests, computed on the arrays' devices before that copy);
- total_s / total_digest_s: `save` + `wait` (the write to disk finished);
- digest_s: `rl.run.digest.array_digests` alone (also the verification's extra cost on restore), compile_s its
  first call;
- overhead: save_digest_s / save_s - 1 (the loop's extra wait per checkpoint, relative).
Last line: `RESULT <config>_save_s=.. <config>_save_digest_s=.. <config>_overhead=.. <config>_digest_s=.. ...`.
Wall clock on whatever else the machine runs: note the load next to the figures.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4 import DSV4Config, abstract_model
from rl.run.checkpoint import Checkpointer
from rl.run.digest import array_digests


def learner_like_state(preset: str, seed: int = 0) -> dict:
    """{"step": int32, "params": {path: f32}, "opt_state": {"mu": ..., "nu": ...}} of the preset's parameter shapes."""
    abstract = nnx.state(abstract_model(DSV4Config.preset(preset)))
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    rng = np.random.default_rng(seed)

    def fill():
        return {jax.tree_util.keystr(p): jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32))
                for p, x in leaves}

    return {"step": jnp.int32(1), "params": fill(), "opt_state": {"mu": fill(), "nu": fill()}}


def measure(preset: str, repeats: int, root) -> dict:
    state = learner_like_state(preset)
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
    mib = sum(x.size * x.dtype.itemsize for x in flat.values()) / 2**20
    t0 = time.perf_counter()
    array_digests(flat)
    compile_s = time.perf_counter() - t0
    digest_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        array_digests(flat)
        digest_s.append(time.perf_counter() - t0)
    times = {True: ([], []), False: ([], [])}
    cks = {d: Checkpointer(f"{root}/{preset}-{d}", keep=1, fingerprint={"bench": preset}, digest=d)
           for d in (False, True)}
    for step in range(repeats + 1):
        for d, ck in cks.items():
            t0 = time.perf_counter()
            ck.save(step + 1, state, {"x": step})
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            if step:  # the first save of each setting: compiles, directory set-up
                times[d][0].append(t1 - t0)
                times[d][1].append(t2 - t0)
    for ck in cks.values():
        ck.close()
    med = statistics.median
    out = {"state_mib": round(mib, 1), "save_s": med(times[False][0]), "save_digest_s": med(times[True][0]),
           "total_s": med(times[False][1]), "total_digest_s": med(times[True][1]), "digest_s": med(digest_s),
           "compile_s": compile_s}
    out["overhead"] = out["save_digest_s"] / out["save_s"] - 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,small", help="comma-separated model presets")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt_digest_")
    fields = []
    try:
        for preset in args.configs.split(","):
            r = measure(preset, args.repeats, root)
            print(f"{preset}: state {r['state_mib']} MiB  save {r['save_s']:.3f} s -> {r['save_digest_s']:.3f} s "
                  f"with digest ({r['overhead']:+.1%}); save+write {r['total_s']:.3f} -> {r['total_digest_s']:.3f} s; "
                  f"digest alone {r['digest_s']:.3f} s (first call, compile: {r['compile_s']:.2f} s)", flush=True)
            fields += [f"{preset}_{k}={v:.4g}" for k, v in r.items()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
