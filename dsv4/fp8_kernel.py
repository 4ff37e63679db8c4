"""The block-scaled FP8 GEMM as one kernel: y[e, r, o] = sum_kb s_x[e, r, kb] S[e, o // 128, kb] (q_x q^T)[kb] with the
scales applied to each K block's partial sum inside the kernel (DeepGEMM's "promotion"), so no K-block partial leaves
it: the kernel reads the FP8 rows and weights once and writes the output, nothing else.

Why a kernel: XLA has no block-scaled GEMM, so `dsv4.fp8_gemm.fp8_expert_matmul`'s XLA form runs one GEMM per K block
and writes each block's partial sum to HBM for a fusion that scales and adds them (KB x the output: at Flash's 48
rows per local expert the partials move ~1.5x the FP8 weights' bytes, the weights 1x). Written in Pallas, lowered
by its Triton backend (`jax.experimental.pallas.triton`): XLA:GPU compiles it into the program (a
`__gpu$xla.gpu.triton` custom call; the deviceless H200 compile does, launch/gpu_target.py), and Pallas runs it
in interpret mode on CPU (the tests' numerics check against the XLA form). AMD Instinct runs Pallas' Triton backend
too (e4m3fnuz on gfx942); AITER's block-scaled FP8 GEMM is the other seam for it. Neither GPU path has been run here
(no GPU): benchmarks/gpu_check.sh is where a lent device times it.

Tiling: one program per (expert, row block of <= 128 rows, 128 outputs = one weight scale block); a loop over the
K blocks of 128 (the activations' and weights' scale block) accumulates in f32. Triton needs power-of-two blocks:
the row block is the row count rounded up to a power of two (>= 16, tl.dot's least), K and its scale blocks too.
Pallas' Triton lowering does not bound a block to its array (no implicit mask): the loop reads only the K blocks
that exist, and the rows past the last (48 rows in a block of 64, the sized dispatch's capacities) are masked on
load and store. Unmasked (until stop 52) a GPU would have read the next expert's rows and written over the first
rows of the next expert's output; Pallas' interpreter, which the tests run, pads instead, so they could not see it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import NamedSharding, PartitionSpec as P

BLOCK = 128  # K block of both scales and output block of the weight scales (the release's 128 x 128 / 1 x 128)
MAX_ROW_BLOCK = 128
KERNEL_NAME = "fp8_block_scaled_matmul"  # its name in the HLO (launch/hlo_stats.py counts its flops by it)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_block(rows: int) -> int:
    """Rows per program: `rows` rounded up to a power of two, at least 16 (tl.dot) and at most `MAX_ROW_BLOCK`."""
    return min(MAX_ROW_BLOCK, max(16, _pow2(rows)))


def _kernel(x_ref, sx_ref, w_ref, sw_ref, o_ref, *, n_kb: int, n_rows: int):
    rows, cols = o_ref.shape
    # Triton does not bound a block to its array: the rows of a block past the last (a row count that is not a
    # multiple of the row block) are masked here, on load (not read) and on store (not written)
    live = (pl.program_id(1) * rows + jnp.arange(rows))[:, None] < n_rows  # [rows, 1]

    def step(j, acc):
        # a masked row's values are undefined; its products stay in its own output row, which is not stored
        x = pl_triton.load(x_ref.at[:, pl.ds(j * BLOCK, BLOCK)], mask=jnp.broadcast_to(live, (rows, BLOCK)))
        sx = pl_triton.load(sx_ref.at[:, pl.ds(j, 1)], mask=live)
        part = jax.lax.dot_general(x, w_ref[:, pl.ds(j * BLOCK, BLOCK)], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return acc + part * (sx * sw_ref[:, pl.ds(j, 1)])

    acc = jax.lax.fori_loop(0, n_kb, step, jnp.zeros((rows, cols), jnp.float32))
    pl_triton.store(o_ref, acc.astype(o_ref.dtype), mask=jnp.broadcast_to(live, (rows, cols)))


def block_scaled_matmul(xq: jax.Array, sx: jax.Array, wq: jax.Array, sw: jax.Array, out_dtype=jnp.float32, *,
                        interpret: bool = False) -> jax.Array:
    """xq [E, R, K] fp8, sx [E, R, K / 128] f32 (the rows' 1 x 128 scales), wq [E, O, K] fp8 (the same format), sw
    [E, O / 128, K / 128] f32 (the weights' 128 x 128 scales) -> y [E, R, O] in `out_dtype`, f32 accumulation
    (module docstring). interpret: run Pallas' interpreter (CPU). Raises ValueError unless K and O are whole
    128-blocks and the shapes agree.

    Partitioned (`jax.experimental.custom_partitioning`): under GSPMD each device runs the kernel on its own rows
    (the rows' E and R shardings) and output blocks (the weight's O sharding, in whole scale blocks) with K whole,
    instead of the all-gathered operands and the whole product that XLA gives a custom call it cannot partition
    (on the 4-layer seed rollout: 2.2x the decode step's flops and the rows all-gathered). Inside a shard_map it
    is the kernel on the local blocks."""
    _check(xq, sx, wq, sw)
    return _partitioned(xq, sx, wq, sw, jnp.dtype(out_dtype), interpret)


def _check(xq, sx, wq, sw) -> None:
    e, r, k = xq.shape
    o = wq.shape[1]
    n_kb = k // BLOCK
    if (k % BLOCK or o % BLOCK or wq.shape != (e, o, k) or sx.shape != (e, r, n_kb)
            or sw.shape != (e, o // BLOCK, n_kb) or xq.dtype != wq.dtype):
        raise ValueError(f"block_scaled_matmul: rows {xq.shape} {xq.dtype}, scales {sx.shape}, weight {wq.shape} "
                         f"{wq.dtype}, scales {sw.shape}: expected K and O multiples of {BLOCK} and matching shapes")


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _shardings(arg_shapes):
    """(mesh, rows spec, weight spec, out spec) of one call: E and R as the rows are split, O as the weight is
    (whole scale blocks per device, on axes the rows do not use), K whole."""
    xs, ws = arg_shapes[0].sharding, arg_shapes[2].sharding
    mesh = xs.mesh
    spec = lambda sh: tuple(sh.spec) + (None,) * (3 - len(sh.spec))  # noqa: E731
    e, r, _ = spec(xs)
    o = spec(ws)[1] if ws.mesh.shape == mesh.shape else None
    used = set(_axes(e)) | set(_axes(r))
    n_o = math.prod(mesh.shape[a] for a in _axes(o))
    if set(_axes(o)) & used or arg_shapes[2].shape[1] % (n_o * BLOCK):
        o = None
    return mesh, P(e, r, None), P(e, o, None), P(e, r, o)


def _infer(out_dtype, interpret, mesh, arg_shapes, result_shape):
    m, _, _, out = _shardings(arg_shapes)
    return NamedSharding(m, out)


def _partition(out_dtype, interpret, mesh, arg_shapes, result_shape):
    m, rows, wts, out = _shardings(arg_shapes)
    args = tuple(NamedSharding(m, s) for s in (rows, rows, wts, wts))
    return m, functools.partial(_call, out_dtype=out_dtype, interpret=interpret), NamedSharding(m, out), args


def _call(xq, sx, wq, sw, out_dtype, interpret):
    """The pallas_call on (local) arrays."""
    e, r, k = xq.shape
    o = wq.shape[1]
    n_kb = k // BLOCK
    br, kp, kbp = row_block(r), _pow2(k), _pow2(n_kb)  # blocks past the arrays' ends are masked
    # inside a checked shard_map the output varies over the mesh axes its operands vary over
    mats = [jax.typeof(a).mat for a in (xq, sx, wq, sw)]
    varying = frozenset().union(*(m.varying for m in mats))
    mat = mats[0].update(varying=varying) if varying else None
    if mat is not None:
        xq, sx, wq, sw = (jax.lax.pcast(a, tuple(varying - m.varying), to="varying") if varying - m.varying else a
                          for a, m in zip((xq, sx, wq, sw), mats))
    return pl.pallas_call(
        functools.partial(_kernel, n_kb=n_kb, n_rows=r),
        out_shape=jax.ShapeDtypeStruct((e, r, o), out_dtype, manual_axis_type=mat),
        grid=(e, pl.cdiv(r, br), o // BLOCK),
        in_specs=[pl.BlockSpec((None, br, kp), lambda i, m, n: (i, m, 0)),
                  pl.BlockSpec((None, br, kbp), lambda i, m, n: (i, m, 0)),
                  pl.BlockSpec((None, BLOCK, kp), lambda i, m, n: (i, n, 0)),
                  pl.BlockSpec((None, 1, kbp), lambda i, m, n: (i, n, 0))],
        out_specs=pl.BlockSpec((None, br, BLOCK), lambda i, m, n: (i, m, n)),
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret, name=KERNEL_NAME)(xq, sx.astype(jnp.float32), wq, sw.astype(jnp.float32))


_partitioned = custom_partitioning(_call, static_argnums=(4, 5))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule="e r k, e r n, e o k, e p n -> e r o")
