"""Our own safetensors reader/writer (numpy + ml_dtypes), because `safetensors.numpy` fails on F8_E8M0.

Format (https://github.com/huggingface/safetensors, README "Format"): an 8-byte little-endian unsigned
header length N, then N bytes of JSON `{name: {"dtype": str, "shape": [int], "data_offsets": [begin, end]},
"__metadata__": {str: str}}` (offsets relative to the byte after the header), then the raw little-endian
tensor bytes. Dtype strings: `DTYPES` below; F8_E4M3 is OCP e4m3fn, F8_E8M0 the MX e8m0 scale byte.

Choices:
- `SafetensorsFile.get` reads exactly one tensor (seek + readinto), never the whole file; headers are
  validated on open (dtype known, offsets inside the file and matching the shape) so a truncated
  checkpoint fails with a ValueError naming the file and the tensor before any data is read.
- Writers go to a temp file / temp dir beside the target and `os.replace` it into place, so a crash never
  leaves a half-written checkpoint under the final name. The JSON header is padded with spaces to a
  multiple of 8 bytes (as the reference writer does) so the data section is 8-byte aligned.
- Sharded checkpoints follow the Hugging Face layout: `model-0000i-of-0000N.safetensors` plus
  `model.safetensors.index.json` with `metadata.total_size` and `weight_map`; shard metadata carries
  `{"format": "pt"}`, which transformers requires.

Tests: tests/dsv4/test_safetensors_io.py (incl. interop with `safetensors.torch`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import BinaryIO

import ml_dtypes
import numpy as np

# safetensors dtype string -> numpy / ml_dtypes dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation's limit


def dtype_to_str(dtype) -> str:
    """numpy/ml_dtypes dtype -> safetensors dtype string; ValueError for dtypes the format lacks."""
    dt = np.dtype(dtype)
    for name, known in DTYPES.items():
        if dt == known or dt == known.newbyteorder(">"):
            return name
    raise ValueError(f"dtype {dt} has no safetensors encoding; supported: {sorted(DTYPES)}")


def _parse_header(path: pathlib.Path, f) -> tuple[dict[str, dict], dict[str, str], int]:
    """-> (entries {name: {dtype, shape, data_offsets}}, metadata, data_start). ValueError naming path."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, _MAX_HEADER_BYTES):
        raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes): truncated or not safetensors")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: bad safetensors JSON header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise ValueError(f"{where}: bad header entry {e!r}")
        if e["dtype"] not in DTYPES:
            raise ValueError(f"{where}: unsupported dtype {e['dtype']!r} (supported: {sorted(DTYPES)})")
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise ValueError(f"{where}: bad data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"{where}: data_offsets [{begin}, {end}] lie outside the data section "
                             f"({data_len} bytes): truncated file?")
        if end - begin != math.prod(shape) * DTYPES[e["dtype"]].itemsize:
            raise ValueError(f"{where}: {end - begin} bytes do not match {e['dtype']} {shape}")
    return header, metadata, data_start


class SafetensorsFile:
    """Lazy reader of one .safetensors file; a context manager (closes the file on exit).

    `keys()` in file (offset) order; `info(name) -> (dtype_str, shape)`; `get(name) -> np.ndarray` reads
    that one tensor into a fresh array with its numpy/ml_dtypes dtype (`DTYPES`). Errors: ValueError naming
    the file (and tensor) for a truncated file, bad header or out-of-file offsets; KeyError for an unknown name.
    """

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self._f = open(self.path, "rb")
        try:
            self._entries, self.metadata, self._data_start = _parse_header(self.path, self._f)
        except BaseException:
            self._f.close()
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def keys(self) -> list[str]:
        return sorted(self._entries, key=lambda k: self._entries[k]["data_offsets"][0])

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> dict:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        e = self._entry(name)
        return e["dtype"], tuple(e["shape"])

    def get(self, name: str) -> np.ndarray:
        """Read tensor `name` -> np.ndarray [shape] of its dtype (native byte order)."""
        return self.read_region(name)

    def _pread(self, name: str, buf: memoryview, offset: int) -> None:
        got = 0
        while got < len(buf):
            n = os.preadv(self._f.fileno(), [buf[got:]], offset + got)
            if not n:
                raise ValueError(f"{self.path}: tensor {name!r}: file ended after {got} of {len(buf)} bytes "
                                 f"(truncated or changed while reading)")
            got += n
        _STATS["bytes"] += got

    def read_region(self, name: str, index: tuple | None = None) -> np.ndarray:
        """Read only the sub-block `index` of tensor `name` -> np.ndarray of its dtype (native byte order).

        index: one `slice` (step 1 or None) per dim, as `jax.make_array_from_callback` passes it; None or
        missing trailing dims mean the whole dim. The bytes are read with one `pread` per contiguous run: the
        dims after the last partially selected dim are whole, so each run is `prod(selected sizes from that
        dim on)` elements. Only the selected bytes are read (`bytes_read()` counts them).
        ValueError naming the file and tensor for an out-of-range index or a file that ends early.
        """
        e = self._entry(name)
        dt = DTYPES[e["dtype"]]
        shape = tuple(e["shape"])
        bounds = region_bounds(index, shape, where=f"{self.path}: tensor {name!r}")
        out = np.empty(tuple(b - a for a, b in bounds), dt)
        if out.size:
            base = self._data_start + e["data_offsets"][0]
            strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
            partial = [k for k, (a, b) in enumerate(bounds) if (a, b) != (0, shape[k])]
            d = partial[-1] if partial else 0
            run = math.prod(out.shape[d:]) if shape else 1
            flat = memoryview(out.reshape(-1).view(np.uint8))
            nbytes = run * dt.itemsize
            for j, outer in enumerate(np.ndindex(*out.shape[:d])):
                elem = sum((bounds[k][0] + i) * strides[k] for k, i in enumerate(outer))
                elem += bounds[d][0] * strides[d] if shape else 0
                self._pread(name, flat[j * nbytes:(j + 1) * nbytes], base + elem * dt.itemsize)
        return out.astype(dt.newbyteorder("="), copy=False)


def region_bounds(index, shape: tuple[int, ...], *, where: str = "tensor") -> list[tuple[int, int]]:
    """`index` (slices, step 1, or None) over `shape` -> [(start, stop)] per dim; ValueError naming `where`."""
    index = tuple(index or ())
    if len(index) > len(shape):
        raise ValueError(f"{where}: index {index} has more dims than shape {list(shape)}")
    out = []
    for k, n in enumerate(shape):
        s = index[k] if k < len(index) else slice(None)
        a, b, step = s.indices(n)
        if step != 1 or b < a:
            raise ValueError(f"{where}: unsupported index {s} for dim {k} of shape {list(shape)}")
        out.append((a, b))
    return out


_STATS = {"bytes": 0}


def bytes_read() -> int:
    """Bytes this process has read from safetensors data sections so far (all `SafetensorsFile`s)."""
    return _STATS["bytes"]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write `path` atomically: a temp file in the same folder (`.<name>.*.tmp`, mode 0644: checkpoints
    are meant to be shared), fsynced and renamed over `path` when the block ends without an error, removed when it
    raises. A reader sees the old file or the whole new one. Raises OSError."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600 files
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def save_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` (name -> array, any dtype in `DTYPES`; jax arrays are converted) to `path` atomically.

    Written to a temp file in the same directory, then `os.replace`d. Returns the data-section bytes.
    ValueError for an unsupported dtype, a name starting with '__metadata__', or non-string metadata.
    """
    path = pathlib.Path(path)
    arrays = {k: np.asarray(v, order="C") for k, v in tensors.items()}
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"{path}: safetensors metadata must map str -> str, got {dict(metadata)!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, a in arrays.items():
        if name == "__metadata__":
            raise ValueError(f"{path}: '__metadata__' is reserved and cannot be a tensor name")
        header[name] = {"dtype": dtype_to_str(a.dtype), "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            if a.dtype.byteorder == ">":
                a = a.byteswap().view(a.dtype.newbyteorder("<"))
            f.write(a.reshape(-1).view(np.uint8).data)
    return offset


def _shard_files(directory: pathlib.Path) -> dict[str, list[str] | None]:
    """{shard file name: names from the index (or None without an index)}; ValueError for missing shards."""
    directory = pathlib.Path(directory)
    index = directory / INDEX_NAME
    if not index.exists():
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{directory}: no *.safetensors files and no {INDEX_NAME}")
        return {f: None for f in files}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index (JSON with a `weight_map`): {e}") from None
    shards: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        shards.setdefault(fname, []).append(name)
    missing = sorted(f for f in shards if not (directory / f).is_file())
    if missing:
        raise ValueError(f"{directory}: {INDEX_NAME} names shard file(s) that are missing: {missing}")
    return dict(sorted(shards.items()))


def iter_checkpoint_tensors(directory) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """Yield (name, loader) for every tensor of a checkpoint directory; `loader()` reads that one tensor.

    With `model.safetensors.index.json` its `weight_map` decides which tensors come from which shard
    (ValueError naming missing shard files, or a name absent from its shard); without it, every
    *.safetensors file is read (ValueError for a name present in two files). Order: shard file name,
    then offset within the file. Loaders stay valid after the iteration moves on (each opens its file).
    """
    directory = pathlib.Path(directory)
    seen: dict[str, str] = {}
    for fname, names in _shard_files(directory).items():
        path = directory / fname
        with SafetensorsFile(path) as sf:
            keys = sf.keys()
            if names is not None:
                absent = sorted(set(names) - set(keys))
                if absent:
                    raise ValueError(f"{path}: tensors listed in {INDEX_NAME} are absent from the shard: {absent[:5]}")
                wanted = set(names)
                keys = [k for k in keys if k in wanted]
        for name in keys:
            if name in seen:
                raise ValueError(f"{directory}: tensor {name!r} is in both {seen[name]} and {fname}")
            seen[name] = fname
            yield name, _loader(path, name)


def _loader(path: pathlib.Path, name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        with SafetensorsFile(path) as sf:
            return sf.get(name)

    return load


def checkpoint_keys(directory) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (shard file path, dtype string, shape) for every tensor of a checkpoint directory."""
    directory = pathlib.Path(directory)
    out: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for fname, names in _shard_files(directory).items():
        with SafetensorsFile(directory / fname) as sf:
            for name in sf.keys() if names is None else names:
                if name in out:
                    raise ValueError(f"{directory}: tensor {name!r} is in both {out[name][0]} and {fname}")
                dtype, shape = sf.info(name)
                out[name] = (str(directory / fname), dtype, shape)
    return out


def save_sharded_checkpoint(
    directory,
    tensors_iter: Iterable[tuple[str, np.ndarray]],
    *,
    max_shard_bytes: int = 5 * 2**30,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Write (name, array) pairs as HF-style shards + `model.safetensors.index.json`; returns the weight_map.

    Shards hold whole tensors, closed when the next tensor would exceed `max_shard_bytes` (a larger tensor
    gets a shard of its own); at most one shard is held in memory. Everything is written into a temp dir
    beside `directory`, which this function itself renames into place (`directory` must not exist, or be
    an empty directory: FileExistsError otherwise). Shard metadata is {"format": "pt", **metadata}.
    ValueError for a duplicate tensor name.
    """
    directory = pathlib.Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} exists and is not an empty directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    tmp.chmod(0o755)  # mkdtemp makes 0700 directories
    shard_meta = {"format": "pt", **(metadata or {})}
    try:
        shard_names: list[list[str]] = []
        pending: dict[str, np.ndarray] = {}
        pending_bytes = total = 0
        seen: set[str] = set()

        def flush() -> None:
            save_safetensors(tmp / f"shard-{len(shard_names):05d}.tmp", pending, shard_meta)
            shard_names.append(list(pending))
            pending.clear()

        for name, value in tensors_iter:
            if name in seen:
                raise ValueError(f"save_sharded_checkpoint: duplicate tensor name {name!r}")
            seen.add(name)
            a = np.asarray(value, order="C")
            if pending and pending_bytes + a.nbytes > max_shard_bytes:
                flush()
                pending_bytes = 0
            pending[name] = a
            pending_bytes += a.nbytes
            total += a.nbytes
        if pending or not shard_names:
            flush()
        n = len(shard_names)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shard_names):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / f"shard-{i:05d}.tmp", tmp / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return weight_map
