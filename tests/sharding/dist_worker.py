"""Worker for tests/sharding/test_distributed.py: one of N processes running a sharded DeepSeek-V4 tiny forward.

Run by the test as
    python tests/sharding/dist_worker.py --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I \
        --cpu-devices-per-process 4 --out result.npy
Each process joins via `sharding.distributed`, builds the mesh plan for `MESH_SPEC` over the 8 global devices
(`fsdp` spans the two processes, so FSDP gathers and the EP dispatch's weight all-gather cross them), initialises
the model *sharded* on that mesh from the same seed (each process computes only its own shards), builds the
input ids with `jax.make_array_from_callback`, runs a jitted forward with the expert-parallel dispatch
(`parallel.expert`, capacity backend) and explicit in/out shardings, and process 0 saves the logits gathered
with `process_allgather`. The test runs the same `compute` on 8 in-process devices and compares (<= 1e-5).
Config `CFG`: tiny() with one CSA and one HCA layer and no MTP (as tests/sharding/test_sharded_model.py), to
keep two concurrent compiles short on two cores.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import dsv4  # noqa: E402
from sharding import axes as ax  # noqa: E402
from sharding import distributed, mesh as mesh_lib  # noqa: E402
from parallel.expert import make_ep_dispatch  # noqa: E402
from sharding.rules import ACTOR_RULES, activation_spec, param_shardings  # noqa: E402

MESH_SPEC = "actor:fsdp=2,expert=2,tensor=2"  # 8 global devices: fsdp spans the two processes
CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
B, S = 4, 16
# LLVM -O0 for XLA:CPU: two processes compile at once on two cores; the HLO is unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _host_ids() -> np.ndarray:
    """Deterministic input ids [B, S] int32, identical in every process."""
    return np.random.default_rng(0).integers(0, CFG.vocab_size, size=(B, S), dtype=np.int32)


def compute(mesh: jax.sharding.Mesh) -> jax.Array:
    """Logits [B, S, V] float32 of the tiny model (seed 0) on `mesh`, batch over (fsdp, expert), vocab over
    tensor. Weights are created on the devices (jit with out_shardings); ids come from a per-shard callback."""
    graphdef, abstract = nnx.split(dsv4.abstract_model(CFG))
    state_sh = param_shardings(abstract, mesh, ACTOR_RULES)
    ids_sh = NamedSharding(mesh, activation_spec(ax.ACT_BATCH, ax.ACT_SEQ, rules=ACTOR_RULES, mesh=mesh))
    out_sh = NamedSharding(mesh, activation_spec(ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB, rules=ACTOR_RULES,
                                                 mesh=mesh))
    ids_np = _host_ids()
    ids = jax.make_array_from_callback(ids_np.shape, ids_sh, lambda idx: ids_np[idx])
    ep = make_ep_dispatch(mesh, rules=ACTOR_RULES)

    def forward(state, ids_bs):
        return nnx.merge(graphdef, state)(ids_bs, dispatch_fn=ep).logits

    with jax.set_mesh(mesh):
        init = jax.jit(lambda: nnx.state(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0))), out_shardings=state_sh)
        state = init.lower().compile(compiler_options=FAST_COMPILE)()
        fwd = jax.jit(forward, in_shardings=(state_sh, ids_sh), out_shardings=out_sh)
        return fwd.lower(state, ids).compile(compiler_options=FAST_COMPILE)(state, ids)


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
