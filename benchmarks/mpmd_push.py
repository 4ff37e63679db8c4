"""MPMD weight push between two local processes (`parallel/push/mpmd.py`) next to a plain cross-process device_put, CPU.

Two processes x 2 CPU devices (jax.distributed + gloo, socket transfers on 127.0.0.1), `--mesh
actor:expert=2/rollout:expert=2`: process 0 is the actor, process 1 the rollout. Model `DSV4Config.small()`
(~109M parameters), random init on the actor mesh; the rollout's sampler keeps FP8 weights (bf16 for the dense
tensors: embedding, head, norms; the default for an FP8 rollout, as benchmarks/weight_push.py).
- mpmd push: wall time on the rollout process of `MpmdPusher.push` (every process calls it): the actor casts each
  tensor, quantises the FP8-stored ones to FP8 blocks + f32 scales (`quant.quantize_rollout_fp8`, as the colocated
  push) and stages every wire array in the rollout's tiling, both call `jax.device_put`, the rollout waits for its
  copies, acks each chunk and swaps the arrivals in (they are the stored state: no rollout-side quantisation, no
  bf16 copy). GB/s = wire bytes / seconds (wire bytes as benchmarks/weight_push.py: fp8 q + f32 scales for FP8
  tensors, the stored dtype for the others); `wire_bytes_per_param` = wire bytes / parameters pushed.
- plain: one bf16 array of the same byte count, P("expert") on the actor mesh -> P("expert") on the rollout mesh
  (identical tiling), `jax.device_put` in both processes, timed on the receiver until its copy is ready.
Runs are interleaved (push, plain, push, ...); the median of `--runs` is reported. The machine is shared: the figures
are noisy, the ratio less so.

Run:   .venv/bin/python benchmarks/mpmd_push.py            (about 2-4 minutes on 2 shared cores)
Last line: `RESULT mpmd_push_gbps=.. plain_device_put_gbps=.. ratio=.. wire_mb=.. wire_bytes_per_param=..`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(pid: int, port: int, runs: int, config: str) -> None:
    from sharding.distributed import maybe_initialize_distributed

    maybe_initialize_distributed(f"127.0.0.1:{port}", 2, pid, cpu_devices_per_process=2, transfer_timeout_s=300)
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dsv4 import DSV4Config, abstract_model
    from dsv4.io.load import init_model
    from rl.rollout.engine import Sampler
    from sharding.mesh import build_mesh_plan
    from parallel.push.mpmd import MpmdPusher
    from sharding.mpmd import HostChannel, role_layout

    mc = DSV4Config.preset(config)
    plan = build_mesh_plan("actor:expert=2/rollout:expert=2", config=mc)
    layout = role_layout(plan)
    channel = HostChannel(layout, timeout_s=300)
    abstract = abstract_model(mc)
    state = nnx.state(abstract)
    # bf16 dense tensors, as benchmarks/weight_push.py
    sampler = Sampler(abstract, mesh=plan.rollout, weights="fp8", kv_cache_dtype="bf16")
    pusher = MpmdPusher(plan, layout, sampler, state, plan.param_shardings("actor", state), channel)
    params = nnx.state(init_model(mc, seed=0, mesh=plan.actor)) if layout.is_actor else None
    n = pusher.wire_bytes // 2
    n -= n % 2
    src_sh, dst_sh = NamedSharding(plan.actor, P("expert")), NamedSharding(plan.rollout, P("expert"))
    if layout.is_actor:
        x = jax.jit(lambda: jnp.ones((n,), jnp.bfloat16), out_shardings=src_sh)()
    else:
        x = jax.make_array_from_single_device_arrays((n,), src_sh, [], dtype=jnp.bfloat16)

    def plain(i):
        t0 = time.perf_counter()
        y = jax.device_put(x, dst_sh)
        if layout.is_rollout:
            y.block_until_ready()
            channel.ack(f"plain/{i}")
        else:
            channel.wait_acks(f"plain/{i}", "rollout", "plain device_put")
        dt = time.perf_counter() - t0
        del y
        return dt

    pusher.push(params, 0)  # warm-up: compiles the casts, the transfers, the quantisation
    plain(-1)
    push_s, plain_s = [], []
    for i in range(runs):
        t0 = time.perf_counter()
        pusher.push(params, i + 1)
        push_s.append(time.perf_counter() - t0)
        plain_s.append(plain(i))
    if layout.is_rollout:
        ok = sampler.weight_version == runs
        mb = pusher.wire_bytes / 1e6
        gp = pusher.wire_bytes / statistics.median(push_s) / 1e9
        gd = 2 * n / statistics.median(plain_s) / 1e9
        print(f"wire bytes {mb:.1f} MB in {len(pusher.chunks)} chunk(s), {len(pusher.tensors)} tensors, "
              f"{pusher.n_params / 1e6:.1f}M parameters; "
              f"push s {[round(s, 3) for s in push_s]}, plain s {[round(s, 3) for s in plain_s]}; "
              f"sampler at version {sampler.weight_version} ({'ok' if ok else 'WRONG'})", flush=True)
        print(f"RESULT mpmd_push_gbps={gp:.3f} plain_device_put_gbps={gd:.3f} ratio={gp / gd:.2f} wire_mb={mb:.1f} "
              f"wire_bytes_per_param={pusher.wire_bytes_per_param:.2f}", flush=True)
    channel.close()
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--config", default="small")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.runs, args.config)
        return 0
    import portpicker

    port = portpicker.pick_unused_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--port", str(port), "--runs",
                               str(args.runs), "--config", args.config], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        for i, o in enumerate(outs):
            print(f"--- process {i} (exit {procs[i].returncode})\n{o[-3000:]}")
        return 1
    lines = [ln for ln in outs[1].splitlines() if ln.startswith(("wire bytes", "RESULT"))]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
