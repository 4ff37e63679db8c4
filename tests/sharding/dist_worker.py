"""Worker for tests/sharding/test_distributed.py: one of N processes that form one global CPU mesh.

Run by the test as
    python tests/sharding/dist_worker.py --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I \
        --cpu-devices-per-process 4 --out result.npy
Each process joins via `sharding.distributed`, builds the mesh plan for `MESH_SPEC` over the global devices,
runs `compute(mesh)` (jitted, inputs sharded across both processes) and process 0 saves the gathered result.
To test something else (e.g. a DeepSeek-V4 forward), replace `compute`: it gets the actor mesh and returns a
global jax.Array; the test runs the same `compute` in-process on 8 devices and compares.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from sharding import distributed, mesh as mesh_lib  # noqa: E402
from sharding.rules import DATA, FSDP, TENSOR  # noqa: E402

MESH_SPEC = "actor:data=2,fsdp=2,tensor=2"  # 8 global devices: data spans the two processes


def _host_inputs() -> tuple[np.ndarray, np.ndarray]:
    """Deterministic x [B=16, D=32] and w [D=32, F=24] (float32), identical in every process."""
    x = np.sin(np.arange(16 * 32, dtype=np.float32).reshape(16, 32) * 0.37)
    w = np.cos(np.arange(32 * 24, dtype=np.float32).reshape(32, 24) * 0.11) / 8.0
    return x, w


def compute(mesh: jax.sharding.Mesh) -> jax.Array:
    """y = tanh(x @ w) - mean_B(tanh(x @ w)) -> [B, F] on `mesh`. x is split over ('data', 'fsdp') on B,
    w over 'tensor' on F; each process builds only its own shards (make_array_from_callback), and the mean
    over B is a cross-process all-reduce."""
    x_np, w_np = _host_inputs()
    xs = NamedSharding(mesh, P((DATA, FSDP), None))
    ws = NamedSharding(mesh, P(None, TENSOR))
    x = jax.make_array_from_callback(x_np.shape, xs, lambda idx: x_np[idx])
    w = jax.make_array_from_callback(w_np.shape, ws, lambda idx: w_np[idx])

    def f(x_bd, w_df):
        y_bf = jnp.tanh(x_bd @ w_df)
        return y_bf - y_bf.mean(axis=0, keepdims=True)

    with jax.set_mesh(mesh):
        return jax.jit(f, out_shardings=NamedSharding(mesh, P((DATA, FSDP), TENSOR)))(x, w)


def main(argv: list[str] | None = None) -> int:
    parser = distributed.add_distributed_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--out", required=True, help=".npy path process 0 writes the gathered result to")
    args = parser.parse_args(argv)
    info = distributed.initialize_from_args(args)  # before any other JAX call
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    assert info.process_count == args.num_processes, info
    plan = mesh_lib.build_mesh_plan(MESH_SPEC)
    y = compute(plan.actor)
    from jax.experimental import multihost_utils

    full = np.asarray(multihost_utils.process_allgather(y, tiled=True))
    if info.process_id == 0:
        np.save(args.out, full)
    multihost_utils.sync_global_devices("dist_worker_done")
    print(f"process {info.process_id}/{info.process_count}: local devices {jax.local_device_count()}, "
          f"global {jax.device_count()}, result {full.shape}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
