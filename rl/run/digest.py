"""Integrity digests of what a checkpoint holds: the learner state's arrays and the in-flight batches file.

Why our own digest and not TensorStore's `crc32c` codec: orbax 0.12.8 writes zarr3 arrays whose `crc32c` codec
covers only the shard *index* (`tensorstore_utils._build_zarr3_metadata`: `index_codecs`), not the chunk data, and
exposes no option to add it to the data codecs (only a private function to patch). Nothing checks the array bytes:
64 bytes flipped in a data file decode to other numbers without an error (issue 42). So each save records, in the
checkpoint's JSON meta, one digest per array, and a restore recomputes and compares them (rl/run/checkpoint.py).

`array_digests` (the state's arrays): computed ON DEVICE by one jitted program over the whole flat state, over the
*global* array, so the value does not depend on the sharding, the mesh or the number of processes (each process
holds only its shards; XLA reduces across them), and a checkpoint saved on one layout verifies on another. Per
array, two 32-bit lanes, each a sum mod 2^32 over the elements of a mix of (global flat index i, the element's bits
w_i as uint32 words):
    lane_a = sum_i fmix32(w_i ^ fmix32(i ^ 0x9E3779B9))      lane_b = sum_i fmix32(w_i * 0x27D4EB2F + i * 0x165667B1)
(fmix32: MurmurHash3's finaliser, a bijection of uint32). Integer sums are exact and order-free, hence
layout-independent; each term is a bijection of w_i, so ANY change of a single element changes both lanes, and a
change of several is missed with probability ~2^-64. Bits, not values: -0.0 != 0.0 and NaN payloads count. 8-byte
elements are two words (two indices); flat indices wrap at 2^32 elements (an array that large still has every
element covered; only a swap of elements 2^32 apart would go unseen). Cost: one read of the state on the device it
lives on (HBM bandwidth on a GPU), no host copy of our own. Arrays on this process's CPU devices are digested in
numpy instead, shard by shard (the same sums: XLA:CPU would first compile one program over the whole state, a
minute for the tiny learner's ~400 arrays on 2 busy cores); benchmarks/ckpt_digest.py measures that save path.

`write_npz` / `read_npz` (the in-flight batches, host numpy): blake2b-128 over every member (name, dtype, shape,
bytes, sorted by name) stored as the member `__digest__`; written to a temp file, fsynced, renamed. zipfile also
checks each member's CRC-32 on read; the digest adds the members' names and set (a member lost or renamed).
"""

from __future__ import annotations

import hashlib
import os
import zipfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv4.io.safetensors import atomic_file

ALGO = "dsv4rl-fmix32x2-sum/1"  # recorded with the digests; a restore verifies only digests of this algorithm

_GOLD = np.uint32(0x9E3779B9)


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The element bits as uint32 words: [*shape] for elements of <= 4 bytes, [*shape, 2] for 8 bytes."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    if size in (1, 2):
        try:
            return lax.bitcast_convert_type(x, jnp.uint16 if size == 2 else jnp.uint8).astype(jnp.uint32)
        except (TypeError, ValueError):  # sub-byte types (int4, float4): their values, exactly
            return x.astype(jnp.int32).astype(jnp.uint32)
    raise TypeError(f"no digest for dtype {x.dtype}")


def _lanes(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    w = _words(x)
    idx = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):  # the global row-major flat index, mod 2^32 (fused by XLA: no buffer)
        idx = idx + lax.broadcasted_iota(jnp.uint32, w.shape, d) * np.uint32(stride % (1 << 32))
        stride *= w.shape[d]
    a = _fmix32(w ^ _fmix32(idx ^ _GOLD))
    b = _fmix32(w * np.uint32(0x27D4EB2F) + idx * np.uint32(0x165667B1))
    return jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)


@jax.jit
def _all_lanes(flat: dict) -> dict:
    return {k: _lanes(v) for k, v in flat.items()}


def _scalar(x: jax.Array) -> int:
    """A replicated 0-d result as a Python int (addressable on every process that ran the program)."""
    return int(np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x)


# ------------------------------------------------------------------ the same lanes on the host, shard by shard

_CHUNK = 1 << 18  # elements per pass: the temporaries stay in cache


def _np_fmix32_(h: np.ndarray, t: np.ndarray) -> np.ndarray:
    """fmix32 in place on uint32 `h` (`t`: scratch of the same size)."""
    np.right_shift(h, 16, out=t)
    h ^= t
    h *= np.uint32(0x85EBCA6B)
    np.right_shift(h, 13, out=t)
    h ^= t
    h *= np.uint32(0xC2B2AE35)
    np.right_shift(h, 16, out=t)
    h ^= t
    return h


def _np_lanes(block: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int]:
    """The two lanes' partial sums over `block`, the part of a global array of `shape` starting at `start`."""
    size = block.dtype.itemsize
    if block.dtype == np.bool_:
        w = block.astype(np.uint32)
    elif size in (1, 2, 4, 8):
        w = (block if block.flags.c_contiguous else block.copy()).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[size])
        if size == 8:  # two words per element: [..., 2], as the device's bitcast
            w = w.reshape(*block.shape, 2)
            start, shape = (*start, 0), (*shape, 2)
    else:
        raise TypeError(f"no digest for dtype {block.dtype}")
    whole = tuple(w.shape) == tuple(shape)
    idx = None
    if not whole:  # a shard: its elements' global flat indices (mod 2^32)
        idx = np.zeros((1,) * w.ndim, np.uint32)
        stride = 1
        for d in reversed(range(w.ndim)):
            ax = (np.arange(w.shape[d], dtype=np.uint64) + start[d]) * stride % (1 << 32)
            idx = idx + ax.astype(np.uint32).reshape([-1 if i == d else 1 for i in range(w.ndim)])
            stride *= shape[d]
        idx = np.broadcast_to(idx, w.shape).ravel()
    w = w.ravel()
    a = b = 0
    for s in range(0, w.size, _CHUNK):
        n = min(_CHUNK, w.size - s)
        i = (np.arange(s, s + n, dtype=np.uint64) % (1 << 32)).astype(np.uint32) if idx is None else idx[s:s + n]
        wc, t = w[s:s + n].astype(np.uint32), np.empty(n, np.uint32)
        k = _np_fmix32_(i ^ _GOLD, t)  # lane a: fmix32(w ^ fmix32(i ^ GOLD))
        k ^= wc
        a += int(_np_fmix32_(k, t).sum(dtype=np.uint64))
        k = i * np.uint32(0x165667B1)  # lane b: fmix32(w * K1 + i * K2)
        wc *= np.uint32(0x27D4EB2F)
        k += wc
        b += int(_np_fmix32_(k, t).sum(dtype=np.uint64))
    return a % (1 << 32), b % (1 << 32)


def _host_lanes(x) -> tuple[int, int]:
    """Both lanes of a numpy array or of a fully addressable jax.Array, summed over its shards (one replica each)."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        x = np.asarray(x)
        return _np_lanes(x, (0,) * x.ndim, x.shape)
    a = b = 0
    for sh in x.addressable_shards:
        if sh.replica_id == 0:
            start = tuple(0 if s.start is None else s.start for s in sh.index)
            pa, pb = _np_lanes(np.asarray(sh.data), start, x.shape)
            a, b = (a + pa) % (1 << 32), (b + pb) % (1 << 32)
    return a, b


def _on_host(x) -> bool:
    """Digest on the host: numpy, or a fully addressable array on CPU devices (XLA:CPU would first compile one
    program over the whole state: a minute for the tiny learner's 400 arrays on 2 busy cores)."""
    return (not isinstance(x, jax.Array)) or (x.is_fully_addressable
                                                and all(d.platform == "cpu" for d in x.sharding.device_set))


def array_digests(flat: dict, where: str = "auto") -> dict[str, str]:
    """{name: 16 hex digits} of each array of `flat` ({name: jax.Array of any shape, dtype and sharding, or numpy};
    see the module docstring). Blocks until computed. Arrays on accelerators or spread over processes: one jitted
    program over all of them (compiled once per structure, shapes and shardings; every process holding shards must
    call it); numpy and arrays on this process's CPU devices: the same sums in numpy, shard by shard (equal values).
    `where`: "auto" (as said), "device" or "host" (every array there; "host": fully addressable ones only).
    Raises TypeError for an unsupported dtype."""
    dev = {k: v for k, v in flat.items() if where == "device" or (where == "auto" and not _on_host(v))}
    lanes = {k: tuple(map(_scalar, ab)) for k, ab in _all_lanes(dev).items()} if dev else {}
    lanes.update({k: _host_lanes(v) for k, v in flat.items() if k not in dev})
    return {k: f"{lanes[k][0]:08x}{lanes[k][1]:08x}" for k in flat}


# ------------------------------------------------------------------------------------------------ host files

class UnreadableFileError(ValueError):
    """A digest-checked file cannot be read or does not match its digest. `str(e)` is one line naming the file."""


_DIGEST = "__digest__"


def npz_digest(arrays: dict[str, np.ndarray]) -> str:
    """blake2b-128 (32 hex digits) over `arrays` ({name: numpy array}), sorted by name: name, dtype, shape, bytes."""
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` ({name: numpy array}, no name `__digest__`) as an uncompressed .npz with their digest, to a
    temp file in the same folder, fsynced, then renamed over `path` (`dsv4.io.safetensors.atomic_file`): a reader
    sees the old file or the whole new one. Raises OSError."""
    with atomic_file(path) as f:
        np.savez(f, **arrays, **{_DIGEST: np.array(npz_digest(arrays))})


def read_npz(path: str | os.PathLike, what: str = "file") -> dict[str, np.ndarray]:
    """Read a file of `write_npz` and verify its digest -> {name: numpy array} (without `__digest__`).

    A file written before digests were recorded (no `__digest__`) is accepted on zipfile's CRC-32 checks alone.
    Raises UnreadableFileError (one line: `what`, the path, the reason) when the file is missing, truncated,
    not a zip, fails a CRC or does not match its digest."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        reason = str(e).splitlines()[0][:160] if str(e) else ""
        raise UnreadableFileError(f"{what} {path} is unreadable ({type(e).__name__}: {reason})") from None
    saved = arrays.pop(_DIGEST, None)
    if saved is not None and str(saved) != npz_digest(arrays):
        raise UnreadableFileError(f"{what} {path} does not match its digest (the data is corrupt)")
    return arrays
