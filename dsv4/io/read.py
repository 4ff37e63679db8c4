"""The reads of a checkpoint load: one model leaf from its file tensors into a (sharded) jax.Array.

`load_leaf` places a planned `Leaf` (`dsv4.io.plan`) in its sharding without it ever being whole on a host: the
array is created with `jax.make_array_from_callback` in a row-split sharding over the *same* mesh axes
(`row_sharding`), whose callback reads only each addressable shard's rows (`SafetensorsFile.read_region`, one
`pread` per contiguous run; a shard replicated over local devices is read once), then a jitted identity reshards it
on the devices. Quantised leaves are placed as stored (q and the scale blocks covering it) and dequantised by a
jitted function whose out_shardings is the leaf's (`dsv4.quant`). NaN / inf checks run on each shard's raw bytes
as it is read, on the host. Errors are `CheckpointError`s naming file and tensor.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dsv4 import fp4, quant, scales
from dsv4.io.convert import CheckpointError
from dsv4.io.plan import FP8_DTYPES, Leaf, Src, packed_shape, short_error
from dsv4.io.safetensors import SafetensorsFile, region_bounds


class Files:
    """Open SafetensorsFile handles of one load (closed by `close`); errors name file and tensor."""

    def __init__(self):
        self._open: dict[str, SafetensorsFile] = {}

    def read(self, src: Src, bounds: list[tuple[int, int]]) -> np.ndarray:
        if src.offset is not None:
            bounds = [(a + o, b + o) for (a, b), o in zip(bounds, src.offset)]
        try:
            f = self._open.get(src.file)
            if f is None:
                f = self._open[src.file] = SafetensorsFile(src.file)
            a = f.read_region(src.name, tuple(slice(a, b) for a, b in bounds))
            return a.view(np.uint8) if src.dtype == "F8_E8M0" else a  # e8m0 bytes travel as uint8
        except (OSError, ValueError) as e:
            msg = short_error(e)
            raise CheckpointError(msg if msg.startswith(src.file) else f"{src.file}: tensor {src.name!r}: {msg}") from None

    def close(self):
        for f in self._open.values():
            f.close()
        self._open.clear()


def _read_stacked(files: Files, srcs: list[Src], stacked: bool, bounds, dtype=None, check_for=None) -> np.ndarray:
    """The region `bounds` of a leaf (stacked: dim 0 picks the per-expert files) as one numpy array; each
    file region is checked by `check_for(src)` (a callable or None) before the cast to `dtype`."""
    def read(src, bnds):
        a = files.read(src, bnds)
        check = check_for(src) if check_for is not None else None
        if check is not None:
            check(a)
        return a

    if not stacked:
        a = read(srcs[0], bounds)
        return a if dtype is None else a.astype(dtype, copy=False)
    (e0, e1), rest = bounds[0], bounds[1:]
    out = None
    for j, e in enumerate(range(e0, e1)):
        a = read(srcs[e], rest)
        if out is None:
            out = np.empty((e1 - e0, *a.shape), dtype or a.dtype)
        out[j] = a
    if out is None:
        out = np.empty((0, *[b - a for a, b in rest]), dtype or np.float32)
    return out


def _aligned_spec(spec: PartitionSpec, shape, grid_block, mesh) -> PartitionSpec:
    """Keep a dim's mesh axes on the scale only where every q shard covers whole scale blocks."""
    out = []
    for d, (n, blk) in enumerate(zip(shape, grid_block)):
        entry = spec[d] if d < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts = math.prod(mesh.shape[a] for a in axes)
        ok = parts == 1 or (n % parts == 0 and (n // parts) % blk == 0)
        out.append(entry if ok else None)
    return PartitionSpec(*out)


def _fit_spec(spec: PartitionSpec, shape, mesh) -> PartitionSpec:
    """Drop mesh axes from dims they do not divide (the stored packed layout may be narrower)."""
    out = []
    for d, n in enumerate(shape):
        entry = spec[d] if d < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(entry if n % math.prod(mesh.shape[a] for a in axes) == 0 else None)
    return PartitionSpec(*out)


def row_sharding(sharding: NamedSharding, shape) -> NamedSharding:
    """The sharding to *read* a leaf in: the mesh axes of `sharding` moved onto dim 0 (same axes, so every process
    still needs the same bytes), so each device's region is a run of whole rows: one `pread` per file tensor
    instead of one per row (and whole pages from disk). `sharding` itself when dim 0 does not divide."""
    axes = [a for e in sharding.spec if e for a in ((e,) if isinstance(e, str) else e)]
    parts = math.prod(sharding.mesh.shape[a] for a in axes)
    if not axes or not shape or shape[0] % parts:
        return sharding
    lead = axes[0] if len(axes) == 1 else tuple(axes)
    return NamedSharding(sharding.mesh, PartitionSpec(lead, *([None] * (len(shape) - 1))))


def _identity(x):
    return x


def _place(files: Files, srcs, stacked, shape, sharding, dtype=None, check_for=None):
    """A jax.Array of `shape` in `sharding` (None: default device) whose shards are read by region: read in
    `row_sharding` (contiguous runs), then resharded on the devices by a jitted identity if that differs."""
    if sharding is None:
        return jnp.asarray(_read_stacked(files, srcs, stacked, [(0, n) for n in shape], dtype, check_for))
    read_sh = row_sharding(sharding, shape)
    x = _read_placed(files, srcs, stacked, shape, read_sh, dtype, check_for)
    if read_sh.is_equivalent_to(sharding, len(shape)):
        return x
    with jax.set_mesh(sharding.mesh):
        return _jit(("reshard",), _identity, sharding)(x)


def _read_placed(files: Files, srcs, stacked, shape, sharding, dtype, check_for):
    where = f"{srcs[0].file}: tensor {srcs[0].name!r}"
    memo: dict = {}

    def cb(index):
        bounds = tuple(region_bounds(index, shape, where=where))
        if bounds not in memo:  # a shard replicated over local devices is read once
            memo[bounds] = _read_stacked(files, srcs, stacked, list(bounds), dtype, check_for)
        return memo[bounds]

    return jax.make_array_from_callback(shape, sharding, cb)


def _dequant_fn(kind, block, dtype):
    def f(q, s):
        if kind == "fp8":
            return quant.dequantize_fp8_blockwise(q, s, block=block, dtype=dtype)
        return fp4.dequantize_fp4(q, s, dtype)
    return f


_JITS: dict = {}


def _jit(key, fn, out_shardings):
    """`jax.jit(fn, out_shardings=...)`, cached per (key, sharding), whose call waits for its result: the loader
    runs one program at a time. Its reshards and dequantisations move shards between devices (all-to-all); left
    in flight, many of them at once deadlocked XLA:CPU's in-process collectives (a rendezvous short of
    participants, aborted after 40 s: tests/dsv4/test_load_sharded.py under a loaded machine, 2026-12-03..05) and
    hung gloo's across processes. Loading is bound by reading the files, so the wait costs nothing measurable."""
    k = (key, out_shardings)
    if k not in _JITS:
        f = jax.jit(fn, out_shardings=out_shardings)
        _JITS[k] = lambda *args: jax.block_until_ready(f(*args))
    return _JITS[k]


def _finite_check(src: Src):
    """Host check of the raw bytes just read (no device pass, no compile): NaN/inf floats, NaN fp8 bytes,
    the e8m0 NaN byte 255. CheckpointError naming file and tensor."""
    dt = src.dtype
    if dt in ("F32", "F16", "BF16", "F64"):
        bad = lambda a: not np.isfinite(a).all()  # noqa: E731
    elif dt in FP8_DTYPES:
        nan = (0x80,) if dt == "F8_E4M3FNUZ" else (0x7F, 0xFF)
        bad = lambda a: bool(np.isin(a.view(np.uint8), nan).any())  # noqa: E731
    elif dt == "F8_E8M0":
        bad = lambda a: bool((a.view(np.uint8) == 255).any())  # noqa: E731
    else:
        return None

    def check(a):
        if a.size and bad(a):
            raise CheckpointError(f"{src.file}: tensor {src.name!r} contains NaN or inf")
    return check


def load_leaf(fh, leaf: Leaf, sharding, mesh, block, cfg, keep_quantized, dense=True):
    """-> (dense jax.Array, or None when only the stored blocks are wanted; QuantizedTensor or None)."""
    if leaf.kind == "plain":
        check_for = _finite_check
        if leaf.key.endswith("tid2eid"):
            n = cfg.n_routed_experts

            def check_for(src):
                def check(a):
                    if a.size and (a.min() < 0 or a.max() >= n):
                        raise CheckpointError(f"{src.file}: tensor {src.name!r}: expert ids outside [0, {n})")
                return check
        return _place(fh, leaf.srcs, leaf.stacked, leaf.shape, sharding, leaf.dtype, check_for), None
    # quantised: the stored q and its scales, then (unless only those are wanted) dequantised on the devices
    qshape = ((leaf.shape[0],) if leaf.stacked else ()) + packed_shape(leaf)
    sc0 = leaf.scales[0]
    sshape = ((leaf.shape[0],) if leaf.stacked else ()) + sc0.shape
    lead = (1,) if leaf.stacked else ()
    q_sh = s_sh = None
    if sharding is not None:
        q_sh = NamedSharding(mesh, _fit_spec(sharding.spec, qshape, mesh))
        grid_block = lead + (block if leaf.kind == "fp8" else (1, fp4.FP4_BLOCK // 2))
        s_sh = NamedSharding(mesh, _aligned_spec(q_sh.spec, qshape, grid_block, mesh))
    q = _place(fh, leaf.srcs, leaf.stacked, qshape, q_sh, None, _finite_check)
    s = _place(fh, leaf.scales, leaf.stacked, sshape, s_sh, None, _finite_check)
    qt = None
    if keep_quantized:
        with _mesh_ctx(mesh):
            s32 = _jit(("scale",), scales.scale_to_f32, s_sh)(s)
        if leaf.kind == "fp8":
            fmt = "e4m3fnuz" if leaf.srcs[0].dtype == "F8_E4M3FNUZ" else "e4m3fn"
            qt = quant.QuantizedTensor(q=q, scale=s32, kind="fp8", fmt=fmt, block=block, shape=leaf.shape)
        else:
            qt = quant.QuantizedTensor(q=q, scale=s32, kind="fp4", fmt="e2m1", block=(1, fp4.FP4_BLOCK),
                                       shape=leaf.shape)
    if not dense:
        return None, qt
    fn = _dequant_fn(leaf.kind, block, leaf.dtype)
    with _mesh_ctx(mesh):
        return _jit(("dq", leaf.kind, block, str(leaf.dtype)), fn, sharding)(q, s), qt


def _mesh_ctx(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
