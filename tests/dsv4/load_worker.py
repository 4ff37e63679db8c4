"""Worker for tests/dsv4/test_load_sharded.py::test_two_processes_load_and_export: one of 2 processes x 4 CPU
devices. Loads `--ckpt` on the 8-device actor mesh (fsdp spans the processes), checks every addressable shard
against the unsharded load (numpy, this process) bitwise and every leaf's sharding against the rule table, prints
`read_frac=` (bytes this process read / checkpoint bytes), exports the sharded model to `--out` (process 0
writes) and, on process 0, loads the export back unsharded and compares it with the reference.
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
from flax import nnx  # noqa: E402

from dsv4 import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from dsv4.io.safetensors import bytes_read, checkpoint_keys, DTYPES  # noqa: E402
from sharding import distributed, mesh as mesh_lib  # noqa: E402
from sharding.rules import ACTOR_RULES, param_shardings  # noqa: E402

MESH_SPEC = "actor:fsdp=2,expert=2,tensor=2"


def _flat(m):
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(m))}


def main() -> int:
    parser = distributed.add_distributed_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    info = distributed.initialize_from_args(args)
    mesh = mesh_lib.build_mesh_plan(MESH_SPEC).actor
    total = sum(int(np.prod(s)) * DTYPES[dt].itemsize for _, dt, s in checkpoint_keys(args.ckpt).values())
    b0 = bytes_read()
    got = load_hf_checkpoint(args.ckpt, dtype=jnp.float32, mesh=mesh)
    frac = (bytes_read() - b0) / total
    with jax.default_device(jax.local_devices()[0]):
        ref = _flat(load_hf_checkpoint(args.ckpt, dtype=jnp.float32))
    sh = param_shardings(nnx.state(got), mesh, ACTOR_RULES)
    want = {"/".join(map(str, p)): v.get_value() if isinstance(v, nnx.Variable) else v
            for p, v in nnx.to_flat_state(sh)}
    for k, v in _flat(got).items():
        assert v.sharding.is_equivalent_to(want[k], v.ndim), (k, v.sharding, want[k])
        assert not v.is_fully_addressable, k  # every leaf spans both processes
        r = np.asarray(ref[k])
        for s in v.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), r[s.index], err_msg=k)
    print(f"process {info.process_id}: shards equal the unsharded load; read_frac={frac:.3f}", flush=True)
    out = save_hf_checkpoint(got, args.out)
    if info.process_id == 0:
        with jax.default_device(jax.local_devices()[0]):
            back = _flat(load_hf_checkpoint(out, dtype=jnp.float32))
        assert back.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(ref[k]), err_msg=k)
        print("export loads back identically", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
