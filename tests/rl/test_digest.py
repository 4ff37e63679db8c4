"""rl/run/digest.py: the checkpoint arrays' digest is layout-independent and sees any one changed element; the in-flight
batches file is written whole (temp + rename) and a truncated or altered one is refused in one line (issue 42).

    .venv/bin/python -m pytest -q tests/rl/test_digest.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rl.run.digest import UnreadableFileError, array_digests, npz_digest, read_npz, write_npz


def _flat():
    rng = np.random.default_rng(0)
    return {"f32": jnp.asarray(rng.standard_normal((8, 16), dtype=np.float32)),
            "bf16": jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16),
            "i8": jnp.asarray(rng.integers(-100, 100, (16,)), jnp.int8),
            "step": jnp.int32(7), "mask": jnp.asarray([True, False, True])}


def test_array_digest_is_layout_independent_and_sees_one_changed_element():
    flat = _flat()
    d = array_digests(flat)
    assert len(set(d.values())) == len(d) and all(len(v) == 16 for v in d.values())
    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[:8])  # the same values, sharded over 8 devices
    sharded = {k: jax.device_put(v, NamedSharding(mesh, P("x", "y" if k == "f32" else None))) if v.ndim == 2 else v
               for k, v in flat.items()}
    assert array_digests(sharded) == d
    assert array_digests(sharded, where="device") == d  # one jitted program (accelerators): the same sums
    assert array_digests({k: np.asarray(v) for k, v in flat.items()}) == d  # host numpy
    a = np.asarray(flat["f32"]).copy()
    a[3, 4] = np.nextafter(a[3, 4], np.float32(np.inf))  # one ulp of one element
    swapped = np.asarray(flat["f32"]).copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values in another order
    got = array_digests({**flat, "f32": jnp.asarray(a), "i8": flat["i8"].at[5].add(1),
                         "bf16": jnp.asarray(swapped[:, :4], jnp.bfloat16)})
    assert got["f32"] != d["f32"] and got["i8"] != d["i8"] and got["bf16"] != d["bf16"]
    assert got["step"] == d["step"] and got["mask"] == d["mask"]
    assert array_digests({"z": jnp.zeros(4)})["z"] != array_digests({"z": -jnp.zeros(4)})["z"]  # bits, not values


def test_npz_written_whole_and_verified(tmp_path):
    arrays = {"0/tokens": np.arange(12, dtype=np.int32).reshape(3, 4), "0/meta": np.array('{"step": 3}'),
              "0/finish_reasons": np.array(["eos", "length"]), "count": np.array(1)}
    path = tmp_path / "3.npz"
    write_npz(path, arrays)
    assert [p.name for p in tmp_path.iterdir()] == ["3.npz"]  # the temp file was renamed
    got = read_npz(path)
    assert sorted(got) == sorted(arrays) and all(np.array_equal(got[k], arrays[k]) for k in arrays)

    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut in half, as a crash or a full disk leaves it
    with pytest.raises(UnreadableFileError) as e:
        read_npz(path, "the in-flight batches file")
    assert "\n" not in str(e.value) and str(path) in str(e.value) and "BadZipFile" in str(e.value)

    # an altered member whose zip CRC still holds (rewritten by numpy, the old digest kept): the digest sees it
    forged = {**arrays, "0/tokens": arrays["0/tokens"] + 1, "__digest__": np.array(npz_digest(arrays))}
    np.savez(path, **forged)
    with pytest.raises(UnreadableFileError, match="does not match its digest"):
        read_npz(path)
    with pytest.raises(UnreadableFileError, match="FileNotFoundError"):
        read_npz(tmp_path / "missing.npz")
