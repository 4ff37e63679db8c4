"""Sharded checkpoint load at small scale: 2 processes x 4 CPU devices load an official-layout checkpoint.

The benchmark writes a ~250M-parameter DeepSeek-V4 checkpoint in the release's layout (`DSV4Config.small()` with
40 routed experts, MTP included): the released FP8 set (attention, shared experts, e/h_proj) as e4m3fn with
128x128 e8m0 scales, routed experts as FP4 e2m1 (I8 packs, 1x32 e8m0 scales), everything else bf16 (mHC, sinks,
ape and the router bias f32, `tid2eid` int64), in 256 MB safetensors shards with an index. Values are random
bytes of the right formats (no NaN codes), so writing takes seconds.

Then two worker processes (this script with `--worker`, joined through `sharding.distributed`, gloo) each with 4
CPU devices load it with `dsv4.load_hf_checkpoint(path, dtype=bfloat16, mesh=actor, rules=ACTOR_RULES)` on the
8-device actor mesh `actor:fsdp=2,expert=2,tensor=2` (fsdp spans the processes). Each worker reports:
- load_s: wall time of the call (compiles of the dequantisation jits included);
- read bytes: bytes this process read from the checkpoint's data (`dsv4.io.safetensors.bytes_read`, cross-checked
  with /proc/self/io rchar), as a fraction of the whole checkpoint;
- peak RSS growth: `ru_maxrss` after the load minus the RSS before it, over the bytes the process's devices hold
  (its bf16 shard: every addressable shard of every leaf, f32 leaves counted as they are);
- dequantisation throughput: the jitted FP4 -> bf16 dequantisation of one layer's w1 stack on process 0's 4
  devices while process 1 waits (output bytes / median of 7 runs).

    .venv/bin/python benchmarks/load.py            # ~1-2 minutes on 2 idle cores

Targets (issue 12): read_bytes_frac_per_process <= 0.6 (plus replicated tensors), peak_rss_over_bf16_shard <= 1.5,
dequantisation >= 1 GB/s of output. Last line: `RESULT load_s=.. read_bytes_frac_per_process=..
peak_rss_over_bf16_shard=.. dequant_gbps=..` (load_s and the fractions: the worse of the two processes; the
first three fields are the issue's, dequant_gbps is added).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MESH_SPEC = "actor:fsdp=2,expert=2,tensor=2"


def config():
    from dsv4 import DSV4Config
    return DSV4Config.small(n_routed_experts=40, expert_dtype="fp4",
                            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                 "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})


def write_checkpoint(path: pathlib.Path) -> tuple[int, int]:
    """Random official-layout checkpoint of `config()` -> (n params, bytes of tensor data)."""
    import ml_dtypes
    import numpy as np

    from dsv4 import abstract_model, count_params, quant
    from dsv4.io.convert import official_tensors
    from dsv4.io.safetensors import save_sharded_checkpoint
    from dsv4.names import EXPERT_KEY

    cfg = config()
    abstract = abstract_model(cfg)
    rs = np.random.default_rng(0)
    e8m0 = ml_dtypes.float8_e8m0fnu

    def fp8(shape):
        b = rs.integers(0, 256, size=shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        s = rs.integers(118, 122, size=(-(-shape[0] // 128), -(-shape[1] // 128)), dtype=np.uint8)
        return b.view(ml_dtypes.float8_e4m3fn), s.view(e8m0)

    def tensors():
        for key, leaf in official_tensors(abstract).items():
            m = EXPERT_KEY.match(key)
            if m:
                for e in range(leaf.shape[0]):
                    name = f"{m.group(1)}.{e}.{m.group(2)}.weight"
                    out, inp = leaf.shape[1:]
                    yield name, rs.integers(-128, 128, size=(out, inp // 2), dtype=np.int8)
                    yield name[: -len(".weight")] + ".scale", rs.integers(
                        120, 124, size=(out, inp // 32), dtype=np.uint8).view(e8m0)
            elif quant.FP8_WEIGHT_RE.search(key):
                q, s = fp8(leaf.shape)
                yield key, q
                yield key[: -len(".weight")] + ".scale", s
            elif key.endswith("tid2eid"):
                yield key, rs.integers(0, cfg.n_routed_experts, size=leaf.shape, dtype=np.int64)
            else:
                v = rs.standard_normal(leaf.shape, dtype=np.float32) * 0.02
                if re.search(r"norm\.weight$", key):
                    v += 1.0
                keep_f32 = re.search(r"(hc_|attn_sink|\.ape$|gate\.bias$)", key)
                yield key, v if keep_f32 else v.astype(ml_dtypes.bfloat16)

    wm = save_sharded_checkpoint(path, tensors(), max_shard_bytes=256 * 10**6)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(quantized=True) | {"expert_dtype": "fp4"}))
    total = sum((path / f).stat().st_size for f in set(wm.values()))
    return count_params(abstract, include_mtp=True), total


def _proc(file: str, field: str) -> int:
    """An integer field of /proc/self/<file> (Linux): VmRSS in kB from `status`, rchar in bytes from `io`."""
    for line in pathlib.Path(f"/proc/self/{file}").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/{file} has no {field}")


def worker(args) -> int:
    from sharding import distributed
    info = distributed.initialize_from_args(args)
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsv4 import fp4, load_hf_checkpoint
    from dsv4.io.safetensors import DTYPES, bytes_read, checkpoint_keys
    from sharding import mesh as mesh_lib
    from sharding.rules import ACTOR_RULES

    mesh = mesh_lib.build_mesh_plan(MESH_SPEC).actor
    ckpt = pathlib.Path(args.ckpt)
    total = sum(int(np.prod(s)) * DTYPES[dt].itemsize for _, dt, s in checkpoint_keys(ckpt).values())
    jnp.zeros(()).block_until_ready()
    rss0, rchar0, b0 = _proc("status", "VmRSS:") * 1024, _proc("io", "rchar:"), bytes_read()
    t0 = time.perf_counter()
    model = load_hf_checkpoint(ckpt, dtype=jnp.bfloat16, mesh=mesh, rules=ACTOR_RULES, progress=False)
    leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
    jax.block_until_ready(leaves)
    load_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    read, rchar = bytes_read() - b0, _proc("io", "rchar:") - rchar0
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    # dequantisation throughput: one layer's FP4 w1 stack [E, I, D] -> bf16 on the 4 local devices of process 0
    # (process 1 waits, so the two do not share the cores)
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("benchmark_load_loaded")
    cfg = model.config
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    local = jax.sharding.Mesh(np.array(jax.local_devices()), ("x",))
    sh = jax.sharding.NamedSharding(local, jax.sharding.PartitionSpec("x"))
    rs = np.random.default_rng(1)
    q = jax.device_put(rs.integers(-128, 128, (e, i, d // 2), dtype=np.int8), sh)
    s = jax.device_put(rs.integers(120, 124, (e, i, d // 32), dtype=np.uint8), sh)
    f = jax.jit(lambda q, s: fp4.dequantize_fp4(q, s, jnp.bfloat16), out_shardings=sh)
    dq_gbps = float("nan")
    if info.process_id == 0:
        f(q, s).block_until_ready()
        times = []
        for _ in range(7):
            t = time.perf_counter()
            f(q, s).block_until_ready()
            times.append(time.perf_counter() - t)
        dq_gbps = e * i * d * 2 / float(np.median(times)) / 1e9
    print("WORKER " + json.dumps(dict(process=info.process_id, load_s=load_s, read=read, rchar=rchar, total=total,
                                      rss0=rss0, peak=peak, held=held, dequant_gbps=dq_gbps)), flush=True)
    multihost_utils.sync_global_devices("benchmark_load_done")
    return 0


def flash_arithmetic() -> None:
    """What a Flash load reads and holds per process on the seed layout (3 processes: actor `fsdp=2,expert=8` over
    2 nodes x 8, rollout `expert=8` on the third node), from the real config and the rule tables (no devices)."""
    import types

    import numpy as np
    from flax import nnx

    from dsv4 import DSV4Config, abstract_model, quant
    from dsv4.io.convert import official_tensors
    from dsv4.names import EXPERT_KEY, official_key
    from sharding.rules import ACTOR_RULES, ROLLOUT_RULES, logical_to_spec

    cfg = DSV4Config.flash()
    abstract = abstract_model(cfg, param_dtype=np.float32)
    logical = {official_key(p): v.get_metadata().get("logical_axes")
               for p, v in nnx.to_flat_state(nnx.state(abstract))}
    actor = types.SimpleNamespace(shape={"data": 1, "fsdp": 2, "expert": 8, "tensor": 1})
    rollout = types.SimpleNamespace(shape={"data": 1, "fsdp": 1, "expert": 8, "tensor": 1})
    gib = 2**30
    total = read_actor = held_actor = held_roll = host_actor = host_roll = 0
    for key, leaf in official_tensors(abstract).items():
        n = int(np.prod(leaf.shape))
        f32 = leaf.dtype == np.float32 and re.search(r"(hc_|attn_sink|\.ape$|gate\.bias$)", key)
        if EXPERT_KEY.match(key):
            fbytes, kind = n // 2 + n // 32, "fp4"  # packed e2m1 + one e8m0 byte per 32
        elif quant.FP8_WEIGHT_RE.search(key):
            fbytes, kind = n + -(-leaf.shape[0] // 128) * -(-leaf.shape[1] // 128), "fp8"
        else:
            fbytes, kind = n * (4 if f32 or key.endswith("tid2eid") else 2), "dense"
        total += fbytes
        la = logical[key]
        sa, sr = (logical_to_spec(la, r, m) if la else () for r, m in ((ACTOR_RULES, actor), (ROLLOUT_RULES, rollout)))
        parts = lambda spec, m: int(np.prod([m.shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e)]))  # noqa: E731
        split_over_nodes = any(e and "fsdp" in ((e,) if isinstance(e, str) else e) for e in sa)
        mine = fbytes // 2 if split_over_nodes else fbytes
        read_actor += mine
        host_actor = max(host_actor, mine)
        held_actor += n * (4 if f32 else 2) / parts(sa, actor)
        host_roll = max(host_roll, fbytes)
        if kind == "dense":
            held_roll += n * (4 if f32 else 2) / parts(sr, rollout)
        else:  # FP8 q (FP4 experts converted to FP8) split like the weight, f32 scales replicated
            held_roll += n / parts(sr, rollout) + 4 * -(-n // (128 * 128))
    print(f"Flash ({cfg.num_hidden_layers} layers + MTP): checkpoint {total / 1e9:.1f} GB")
    print(f"actor process (x2): reads {read_actor / 1e9:.1f} GB = {read_actor / total:.3f} of the checkpoint; "
          f"holds {held_actor / gib:.1f} GiB bf16 params per device (x8); largest host transient "
          f"{host_actor / gib:.2f} GiB (one leaf's local part as stored)")
    print(f"rollout process: reads {total / 1e9:.1f} GB (1.000: expert=8 is inside the node); holds "
          f"{held_roll / gib:.1f} GiB per device (FP8 q + f32 scales, other tensors bf16); largest host transient "
          f"{host_roll / gib:.2f} GiB")


def main() -> int:
    from sharding import distributed
    parser = distributed.add_distributed_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help="existing checkpoint directory (default: write one in a temp dir)")
    parser.add_argument("--flash-arithmetic", action="store_true",
                        help="print what a Flash load reads and holds per process on the seed layout, then exit")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.flash_arithmetic:
        flash_arithmetic()
        return 0
    import portpicker

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="dsv4_load_bench."))
    try:
        ckpt = pathlib.Path(args.ckpt) if args.ckpt else tmp / "ckpt"
        if not args.ckpt:
            t = time.perf_counter()
            n, nbytes = write_checkpoint(ckpt)
            print(f"wrote {n / 1e6:.1f}M params, {nbytes / 1e6:.1f} MB in {time.perf_counter() - t:.1f} s: {ckpt}",
                  flush=True)
        port = portpicker.pick_unused_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(ROOT))
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--ckpt", str(ckpt), "--coordinator",
                                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                                   "--cpu-devices-per-process", "4"], env=env, cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
        outs = [p.communicate(timeout=1200)[0] for p in procs]
        if any(p.returncode for p in procs):
            print("\n----\n".join(outs), file=sys.stderr)
            return 1
        rows = [json.loads(line[len("WORKER "):]) for o in outs for line in o.splitlines() if line.startswith("WORKER ")]
        print("| process | load s | read MB | read frac | rchar MB | RSS before MB | peak RSS MB | growth / held | "
              "held MB | dequant GB/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['process']} | {r['load_s']:.1f} | {r['read'] / 1e6:.1f} | {r['read'] / r['total']:.3f} | "
                  f"{r['rchar'] / 1e6:.1f} | {r['rss0'] / 1e6:.0f} | {r['peak'] / 1e6:.0f} | "
                  f"{(r['peak'] - r['rss0']) / r['held']:.2f} | {r['held'] / 1e6:.0f} | {r['dequant_gbps']:.2f} |")
        load_s = max(r["load_s"] for r in rows)
        frac = max(r["read"] / r["total"] for r in rows)
        rss = max((r["peak"] - r["rss0"]) / r["held"] for r in rows)
        dq = rows[0]["dequant_gbps"] if rows[0]["process"] == 0 else rows[1]["dequant_gbps"]
        print(f"checkpoint {rows[0]['total'] / 1e6:.1f} MB of tensor data; read rate "
              f"{max(r['read'] for r in rows) / load_s / 1e6:.1f} MB/s per process over the whole load (page cache "
              f"warm: the benchmark wrote the files just before)")
        print(f"RESULT load_s={load_s:.2f} read_bytes_frac_per_process={frac:.3f} peak_rss_over_bf16_shard={rss:.2f} "
              f"dequant_gbps={dq:.2f}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
