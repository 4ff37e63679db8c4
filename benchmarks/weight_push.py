"""Weight push speed (`parallel/push/local.py`): actor fp32 -> FP8 rollout weights, against memcpy, CPU.

What is measured, per layout and per quantisation site, for `DSV4Config.small()` (109M parameters pushed) on 8 forced
host devices:
- push: wall time of `WeightPusher.push(..., verify=False)` after the `WeightPusher` warm-up. Two sites
  (`--quantize-on`): `actor` (the default of `WeightPusher`: FP8 blocks quantised on the actor mesh, fp8 q + f32
  scales on the wire) and `rollout` (bf16 on the wire, quantised chunk by chunk on arrival). GB/s = wire bytes /
  seconds; wire bytes per parameter = wire bytes / parameters (fp8 + scales for the FP8 tensors quantised on the
  actor, bf16 for those quantised on arrival and for bf16-stored tensors, f32 for the few the sampler keeps in
  f32, int32 tables). The stage split (cast = actor jits incl. actor-side quantisation, transfer, quantise =
  rollout jits) comes from `PushStats`; a verified push is timed too. rollout_peak_mib: `WeightPusher.memory()`
  (per rollout device, 2 quantised states + the largest chunk extra, from the compiled programs).
- memcpy, in the same run and interleaved with the pushes (so load changes on a shared machine hit both alike):
  (a) `jax.device_put` of one bf16 buffer of the same byte count from device 0 to device 7 (device to device);
  (b) a jitted copy (`x + 0` cannot be elided; `x * 1` either) of that buffer on device 0. memcpy = the faster.
  ratio = push GB/s / memcpy GB/s; target >= 0.5. transfer_gbps = wire bytes / the device_put stage alone.
Layouts (every mesh axis must divide the small config's power-of-two dims, so a 6-device actor uses a size-3
`data` axis, which the actor rules never map onto a weight: 3 data-parallel replicas of an fsdp=2 layout):
  6/2  actor:data=3,fsdp=2/rollout:expert=2              (the RESULT line)
  4/4  actor:fsdp=2,expert=2/rollout:expert=2,tensor=2   (the `auto` spec for 8 devices)
  1    actor:data=1                                      (one device, colocated: benchmarks/gpu_check.sh on one GPU)
Best and median of `--runs` pushes are printed; RESULT uses the median. `compiles`: XLA compilations during the
timed pushes and probes (0 expected: everything compiles in the warm-up or before).

Run:   .venv/bin/python benchmarks/weight_push.py            (about 3-6 minutes on 2 shared cores)
       .venv/bin/python benchmarks/weight_push.py --layouts 6/2 --runs 3
The last line is `RESULT push_gbps=.. memcpy_gbps=.. ratio=.. wire_bytes_per_param=.. push_s=..
arrival_push_s=.. arrival_wire_bytes_per_param=.. rollout_peak_mib=.. arrival_rollout_peak_mib=..
rollout_peak_verified_mib=..` (6/2 layout, medians; the unprefixed fields are the default `actor` site, `arrival_`
the `rollout` site; rollout_peak_verified_mib: `PushMemory.peak_verified` of the actor site, <= 2 states + one
chunk).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax import monitoring  # noqa: E402

from dsv4 import DSV4Config, DSV4ForCausalLM  # noqa: E402
from rl.rollout.engine import Sampler  # noqa: E402
from sharding.mesh import build_mesh_plan  # noqa: E402
from parallel.push.local import WeightPusher  # noqa: E402

_COMPILES = [0]


def _count_compiles(event: str, secs: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1

LAYOUTS = {"6/2": "actor:data=3,fsdp=2/rollout:expert=2", "4/4": "actor:fsdp=2,expert=2/rollout:expert=2,tensor=2",
           "1": "actor:data=1"}  # "1": one device, colocated (a single GPU: cast + quantise, nothing crosses)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def memcpy_probes(nbytes: int):
    """(device_put d2d seconds, jitted copy seconds) callables for `nbytes` of bf16 on device 0 (-> device 7)."""
    devs = jax.devices()
    x = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), devs[0])
    copy = jax.jit(lambda a: a + jnp.bfloat16(0))
    jax.block_until_ready((copy(x), jax.device_put(x, devs[-1])))  # compile / first touch

    def d2d():
        return _timed(lambda: jax.device_put(x, devs[-1]))

    def jcopy():
        return _timed(lambda: copy(x))

    return d2d, jcopy


def bench_layout(name: str, spec: str, cfg: DSV4Config, runs: int, chunk_mib: int, quantize_on: str) -> dict:
    plan = build_mesh_plan(spec, config=cfg)
    make = lambda: DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32)  # noqa: E731
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    with jax.set_mesh(plan.actor):
        state = jax.jit(lambda: nnx.state(make()), out_shardings=plan.param_shardings("actor", abstract))()
    sampler = Sampler(nnx.merge(graphdef, state), mesh=plan.rollout, weights="fp8", max_prompt_len=16,
                      kv_cache_dtype="bf16")
    t0 = time.perf_counter()
    pusher = WeightPusher(plan, sampler, abstract, chunk_bytes=chunk_mib * 2**20, verify_every=0,
                          quantize_on=quantize_on)
    warmup_s = time.perf_counter() - t0
    d2d, jcopy = memcpy_probes(pusher.wire_bytes)
    version = sampler.weight_version
    pushes, d2d_s, copy_s = [], [], []
    compiles0 = _COMPILES[0]
    for _ in range(runs):  # interleaved: push, then the two memcpy probes
        version += 1
        pushes.append(pusher.push(state, version, verify=False))
        d2d_s.append(d2d())
        copy_s.append(jcopy())
    version += 1
    verified = pusher.push(state, version, verify=True)
    compiles = _COMPILES[0] - compiles0
    med = lambda xs: statistics.median(xs)  # noqa: E731
    gb = pusher.wire_bytes / 1e9
    push_s = [p.seconds for p in pushes]
    mem = pusher.memory()  # after the compile count: it compiles for memory_analysis()
    row = dict(layout=name, site=quantize_on, spec=spec, wire_mb=pusher.wire_bytes / 1e6,
               wire_bytes_per_param=pusher.wire_bytes / pusher.n_params, rollout_peak_mib=mem.peak / 2**20,
               rollout_peak_verified_mib=mem.peak_verified / 2**20, rollout_chunk_wire_mib=mem.chunk_wire / 2**20,
               rollout_state_mib=mem.state / 2**20, rollout_chunk_mib=mem.chunk / 2**20,
               rollout_check_mib=mem.check / 2**20, actor_chunk_mib=mem.actor_chunk / 2**20,
               tensors=len(pusher.tensors), chunks=len(pusher.chunks), warmup_s=warmup_s, push_best_s=min(push_s), push_med_s=med(push_s),
               push_gbps=gb / med(push_s), push_best_gbps=gb / min(push_s),
               cast_s=med([p.cast_s for p in pushes]), transfer_s=med([p.transfer_s for p in pushes]),
               quantize_s=med([p.quantize_s for p in pushes]), verified_s=verified.seconds,
               verify_s=verified.verify_s, compiles=compiles, d2d_gbps=gb / med(d2d_s), copy_gbps=gb / med(copy_s))
    row["transfer_gbps"] = gb / row["transfer_s"]
    row["memcpy_gbps"] = max(row["d2d_gbps"], row["copy_gbps"])
    row["ratio"] = row["push_gbps"] / row["memcpy_gbps"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="6/2,4/4", help="comma list of " + ", ".join(LAYOUTS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--quantize-on", default="actor,rollout", help="comma list of actor, rollout (where the FP8 "
                    "blocks are quantised; RESULT: actor unprefixed, rollout as arrival_*)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    cfg = DSV4Config.small()
    monitoring.register_event_duration_secs_listener(_count_compiles)
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}, config small, "
          f"runs {args.runs}, chunk {args.chunk_mib} MiB", flush=True)
    sites = [q.strip() for q in args.quantize_on.split(",") if q.strip()]
    if not sites or any(q not in ("actor", "rollout") for q in sites):
        ap.error(f"--quantize-on {args.quantize_on!r}: expected a comma list of actor, rollout")
    rows = []
    for name in names:
        for site in sites:
            rows.append(bench_layout(name, LAYOUTS[name], cfg, args.runs, args.chunk_mib, site))
            print(f"  done {name} {site}", flush=True)
    cols = [("layout", "{:>6}"), ("site", "{:>7}"), ("wire_mb", "{:>8.1f}"), ("wire_bytes_per_param", "{:>20.3f}"),
            ("tensors", "{:>7d}"), ("chunks", "{:>6d}"),
            ("warmup_s", "{:>8.1f}"), ("push_med_s", "{:>10.3f}"), ("push_best_s", "{:>11.3f}"),
            ("cast_s", "{:>6.3f}"), ("transfer_s", "{:>10.3f}"), ("quantize_s", "{:>10.3f}"),
            ("verified_s", "{:>10.3f}"), ("push_gbps", "{:>9.3f}"), ("transfer_gbps", "{:>13.3f}"),
            ("d2d_gbps", "{:>8.3f}"), ("compiles", "{:>8d}"),
            ("copy_gbps", "{:>9.3f}"), ("ratio", "{:>5.2f}"), ("rollout_peak_mib", "{:>16.1f}"),
            ("rollout_peak_verified_mib", "{:>25.1f}"), ("rollout_chunk_wire_mib", "{:>22.2f}"),
            ("rollout_state_mib", "{:>17.1f}"), ("rollout_chunk_mib", "{:>17.2f}"), ("rollout_check_mib", "{:>17.2f}"),
            ("actor_chunk_mib", "{:>15.2f}")]
    print(" ".join(f"{c:>{len(f.format(rows[0][c]))}}" for c, f in cols))
    for r in rows:
        print(" ".join(f.format(r[c]) for c, f in cols))
    for r in rows:
        print(f"{r['layout']}: {r['spec']}")
    layout = "6/2" if any(r["layout"] == "6/2" for r in rows) else rows[0]["layout"]
    fields_mem = [f"rollout_peak_verified_mib={r['rollout_peak_verified_mib']:.1f}" for r in rows
                  if r["layout"] == layout and r["site"] == "actor"]
    by_site = {r["site"]: r for r in rows if r["layout"] == layout}
    head = by_site.get("actor", rows[0])
    fields = [f"push_gbps={head['push_gbps']:.3f}", f"memcpy_gbps={head['memcpy_gbps']:.3f}",
              f"ratio={head['ratio']:.2f}"]
    for prefix, site in (("", "actor"), ("arrival_", "rollout")):
        r = by_site.get(site)
        if r is not None:
            fields += [f"{prefix}wire_bytes_per_param={r['wire_bytes_per_param']:.3f}",
                       f"{prefix}push_s={r['push_med_s']:.3f}", f"{prefix}rollout_peak_mib={r['rollout_peak_mib']:.1f}"]
    print("RESULT " + " ".join(fields + fields_mem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
