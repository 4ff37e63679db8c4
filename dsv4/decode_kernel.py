"""Decode attention over the FP8 cache's entries as one kernel: each row's query heads against its window and
compressed entries, read once as stored (FP8 no-RoPE dims with their per-64 power-of-two scales, bf16 RoPE dims),
dequantised in registers, with the sink logit and an online softmax (spec §5.3; DeepSeek's FlashMLA FP8 decode:
FP8 KV bytes, bf16 products).

Why a kernel: XLA's decode attention (`dsv4.attention.attend` on `dsv4.cache.read_entries`) writes the dequantised
keys (window + the indexer's top-k entries, bf16 [B, 640, 512] per CSA layer of the seed rollout) to HBM and reads them
twice more (the logits' dot and the values' dot): ~0.38 GiB per CSA layer of the seed's decode step (H200 spec),
where the stored entries are 0.045. This kernel reads the stored entries once and writes only the output.

Numerics: the values are the keys (one shared KV head); both products multiply the dequantised entries in the compute
dtype with f32 accumulation (as XLA's path does; its logits and outputs round to the compute dtype, here they stay f32
until the output), the softmax runs in f32 over the entries and the sink. Only the summation order differs from
`attend` (tests: tests/dsv4/test_decode_kernel.py, Pallas' interpreter).

The indexer's scores over the FP8 key cache (`fp8_index_scores`, DeepGEMM's `fp8_mqa_logits`): the FP8 x FP8 dot
of each query's heads with a block of keys, the ReLU, the heads' weights and their sum in one kernel, which writes the
[B, S, W] scores only; XLA writes the per-head dots ([B, 64, 2,304] f32 per CSA layer of the seed's decode step) and
reads them back to weight and sum them.

Tiling (attention): one program per row; a loop over blocks of `BLOCK_N` entries (the row's entries padded to whole
blocks, masked) loads each 64-dim scale block of the no-RoPE dims and the RoPE dims as separate tiles (448 is not a
power of two; Triton's tiles are), so every tile has power-of-two sides; accumulators per tile. The scores: one
program per (row, query, block of `BLOCK_W` keys), the keys past the last masked. Both, like `dsv4.fp8_kernel`:
compiled into the program by XLA:GPU (a `__gpu$xla.gpu.triton` custom call), Pallas' interpreter on CPU,
custom-partitioned over the rows under GSPMD. Not run on a GPU here (no GPU lent): `benchmarks/gpu_check.sh` is where
a lent device would time it; AITER's / FlashMLA's FP8 decode kernels are the ROCm / CUDA seams.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import NamedSharding, PartitionSpec as P

BLOCK_N = 64  # entries per loop step
# Output tiles per kernel call on Blackwell (of the 7 no-RoPE tiles of 64 and the RoPE tile): all 8 accumulators of 64
# f32 columns in one program ask its tensor memory for 544 of its 512 columns (the B200 proxy's compile fails); two
# calls of 4 fit, each reading the entries (0.045 GiB more per CSA layer of the seed's decode step). Elsewhere one
# call (`out_tiles`); how many a Hopper or an Instinct runs best is for a lent device to time.
BLACKWELL_OUT_TILES = 4


def out_tiles(devices) -> int | None:
    """Output tiles per call on `devices` (their compute capability, abstract devices included): None = all."""
    try:
        major = int(str(getattr(devices[0], "compute_capability", "0")).split(".")[0])
    except ValueError:
        major = 0
    return BLACKWELL_OUT_TILES if major >= 10 else None
KERNEL_NAME = "fp8_kv_decode_attention"  # its name in the HLO (launch/hlo_stats.py counts its flops by it)
BLOCK_W = 128  # keys per program of the indexer's scores
INDEX_KERNEL_NAME = "fp8_index_scores"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _kernel(q_ref, kq_ref, ks_ref, kr_ref, bias_ref, sink_ref, o_ref, *, n: int, nb: int, blk: int, r: int,
            scale: float, dtype, outs: tuple[int, ...]):
    """One row's attention; this program writes the output tiles `outs` (of the nb no-RoPE tiles, then the RoPE
    tile nb) into o_ref [H, their widths], and computes the logits from every tile."""
    h = o_ref.shape[0]
    qs = [q_ref[:, pl.ds(j * blk, blk)] for j in range(nb)] + [q_ref[:, pl.ds(nb * blk, r)]]

    def step(i, carry):
        m, ll, accs = carry
        n0 = i * BLOCK_N
        tiles = [(kq_ref[pl.ds(n0, BLOCK_N), pl.ds(j * blk, blk)].astype(jnp.float32)
                  * ks_ref[pl.ds(n0, BLOCK_N), pl.ds(j, 1)]).astype(dtype) for j in range(nb)]
        tiles.append(kr_ref[pl.ds(n0, BLOCK_N), :].astype(dtype))
        logits = sum(jax.lax.dot_general(qj, kj, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                     for qj, kj in zip(qs, tiles))  # [H, BLOCK_N]
        logits = logits * scale + bias_ref[pl.ds(n0, BLOCK_N)][None, :]
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        pd = p.astype(dtype)
        accs = tuple(a * alpha[:, None] + jax.lax.dot_general(pd, tiles[j], (((1,), (0,)), ((), ())),
                                                              preferred_element_type=jnp.float32)
                     for a, j in zip(accs, outs))
        return m_new, ll * alpha + jnp.sum(p, axis=1), accs

    sink = sink_ref[...].astype(jnp.float32)  # the sink logit starts the running max: never -inf
    init = (sink, jnp.ones((h,), jnp.float32), tuple(jnp.zeros((h, blk if j < nb else r), jnp.float32) for j in outs))
    _, ll, accs = jax.lax.fori_loop(0, n // BLOCK_N, step, init)
    for k, a in enumerate(accs):
        o_ref[:, pl.ds(k * blk, a.shape[1])] = a / ll[:, None]


def kernel_fits(heads: int, block: int, rope: int) -> bool:
    """Whether `fp8_decode_attention` takes these tiles: heads, scale block and RoPE dims powers of two."""
    return all(v == _pow2(v) for v in (heads, block, rope))


def fp8_decode_attention(q: jax.Array, kq: jax.Array, ks: jax.Array, kr: jax.Array, mask: jax.Array, sink: jax.Array,
                         scale: float, *, interpret: bool = False) -> jax.Array:
    """One query per row against its FP8 entries: q [B, H, D] (compute dtype; D = nb * blk + r), kq [B, N, nb * blk]
    FP8 (the no-RoPE dims), ks [B, N, nb] float32 (their per-block scales, powers of two), kr [B, N, r] (the RoPE
    dims), mask [B, N] bool, sink [H] -> o [B, H, D] float32: softmax over the visible entries and the sink of
    q . k * scale, times the entries (keys = values). The same value as `dsv4.attention.attend` on the dequantised
    entries, up to summation order. interpret: Pallas' interpreter (CPU). Raises ValueError unless the heads, the
    scale blocks and the RoPE dims are powers of two and the shapes agree."""
    b, h, d = q.shape
    n, nq = kq.shape[1:]
    nb = ks.shape[-1]
    blk, r = nq // nb, kr.shape[-1]
    if (kq.shape[0] != b or ks.shape[:2] != (b, n) or kr.shape[:2] != (b, n) or mask.shape != (b, n)
            or nq + r != d or nb * blk != nq or sink.shape != (h,) or not kernel_fits(h, blk, r)):
        raise ValueError(f"fp8_decode_attention: q {q.shape}, entries {kq.shape} / scales {ks.shape} / rope "
                         f"{kr.shape}, mask {mask.shape}, sink {sink.shape}: expected matching shapes and powers of "
                         f"two for the heads, the scale block and the RoPE dims")
    pad = -n % BLOCK_N  # whole blocks of entries; the padding is masked
    if pad:
        kq, ks, kr = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (kq, ks, kr))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))
    bias = jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)
    return _partitioned(q, kq, ks.astype(jnp.float32), kr, bias, sink.astype(jnp.float32), float(scale), interpret)


def _call(q, kq, ks, kr, bias, sink, scale, interpret):
    """The kernel unpartitioned: one call."""
    return _run(q, kq, ks, kr, bias, sink, scale=scale, interpret=interpret, tiles_per_call=None)


def _run(q, kq, ks, kr, bias, sink, *, scale, interpret, tiles_per_call):
    """The pallas_call(s) on (local) arrays: one, or one per `tiles_per_call` output tiles (`out_tiles`)."""
    b, h, d = q.shape
    n, nq = kq.shape[1:]
    nb = ks.shape[-1]
    blk, r = nq // nb, kr.shape[-1]
    tiles, per = list(range(nb + 1)), tiles_per_call or nb + 1
    parts = []
    for g in range(0, nb + 1, per):  # one call per group of output tiles: each reads every entry
        outs = tuple(tiles[g:g + per])
        width = sum(blk if j < nb else r for j in outs)
        parts.append(pl.pallas_call(
            functools.partial(_kernel, n=n, nb=nb, blk=blk, r=r, scale=scale, dtype=q.dtype, outs=outs),
            out_shape=jax.ShapeDtypeStruct((b, h, width), jnp.float32),
            grid=(b,),
            in_specs=[pl.BlockSpec((None, h, _pow2(d)), lambda i: (i, 0, 0)),
                      pl.BlockSpec((None, _pow2(n), _pow2(nq)), lambda i: (i, 0, 0)),
                      pl.BlockSpec((None, _pow2(n), _pow2(nb)), lambda i: (i, 0, 0)),
                      pl.BlockSpec((None, _pow2(n), r), lambda i: (i, 0, 0)),
                      pl.BlockSpec((None, _pow2(n)), lambda i: (i, 0)),
                      pl.BlockSpec((h,), lambda i: (0,))],
            out_specs=pl.BlockSpec((None, h, _pow2(width)), lambda i: (i, 0, 0)),
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret, name=KERNEL_NAME)(q, kq, ks, kr, bias, sink))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _row_spec(arg_shapes):
    """(mesh, the rows' mesh axes): the rows split as q's are, everything else whole."""
    sh = arg_shapes[0].sharding
    return sh.mesh, (tuple(sh.spec) + (None,))[0]


def _infer(scale, interpret, mesh, arg_shapes, result_shape):
    m, rows = _row_spec(arg_shapes)
    return NamedSharding(m, P(rows, None, None))


def _partition(scale, interpret, mesh, arg_shapes, result_shape):
    m, rows = _row_spec(arg_shapes)
    three, two = NamedSharding(m, P(rows, None, None)), NamedSharding(m, P(rows, None))
    args = (three, three, three, three, two, NamedSharding(m, P(None)))
    call = functools.partial(_run, scale=scale, interpret=interpret, tiles_per_call=out_tiles(m.devices.flat))
    return m, call, three, args


_partitioned = custom_partitioning(_call, static_argnums=(6, 7))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule="b h d, b n q, b n s, b n r, b n, h -> b h d")


def _index_kernel(q_ref, w_ref, k_ref, ks_ref, o_ref, *, n_keys: int):
    bw = o_ref.shape[0]
    live = pl.program_id(2) * bw + jnp.arange(bw) < n_keys  # keys past the last: not read, not written
    k = pl_triton.load(k_ref, mask=jnp.broadcast_to(live[:, None], k_ref.shape))
    dots = jax.lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    sc = jnp.sum(jnp.maximum(dots, 0.0) * w_ref[...][:, None], axis=0)  # [BW]: a masked key's column stays apart
    pl_triton.store(o_ref, sc * pl_triton.load(ks_ref, mask=live), mask=live)


def index_kernel_fits(heads: int, dim: int) -> bool:
    """Whether `fp8_index_scores` takes these tiles: heads and the key dim powers of two."""
    return heads == _pow2(heads) and dim == _pow2(dim)


def fp8_index_scores(q: jax.Array, w: jax.Array, keys: jax.Array, ks: jax.Array, *, interpret: bool = False
                     ) -> jax.Array:
    """The indexer's scores over FP8 keys in one kernel: q [B, S, H, d] FP8 (the queries), w [B, S, H] float32 (the
    heads' weights with the queries' scales and 1 / sqrt(d) folded in), keys [B, W, d] FP8 (the same format), ks
    [B, W] float32 (their scales, positive) -> [B, S, W] float32 = ks * sum_h w ReLU(q . k), the dot on FP8 operands
    with f32 accumulation. interpret: Pallas' interpreter (CPU). Raises ValueError unless the shapes agree and the
    heads and d are powers of two."""
    b, s, h, d = q.shape
    n = keys.shape[1]
    if (w.shape != (b, s, h) or keys.shape != (b, n, d) or ks.shape != (b, n) or keys.dtype != q.dtype
            or not index_kernel_fits(h, d)):
        raise ValueError(f"fp8_index_scores: q {q.shape} {q.dtype}, weights {w.shape}, keys {keys.shape} "
                         f"{keys.dtype}, scales {ks.shape}: expected matching shapes and formats, heads and dims "
                         f"powers of two")
    return _index_partitioned(q, w.astype(jnp.float32), keys, ks.astype(jnp.float32), interpret)


def _index_call(q, w, keys, ks, interpret):
    b, s, h, d = q.shape
    n = keys.shape[1]
    bw = min(BLOCK_W, _pow2(n))
    return pl.pallas_call(
        functools.partial(_index_kernel, n_keys=n),
        out_shape=jax.ShapeDtypeStruct((b, s, n), jnp.float32),
        grid=(b, s, pl.cdiv(n, bw)),
        in_specs=[pl.BlockSpec((None, None, h, d), lambda i, t, j: (i, t, 0, 0)),
                  pl.BlockSpec((None, None, h), lambda i, t, j: (i, t, 0)),
                  pl.BlockSpec((None, bw, d), lambda i, t, j: (i, j, 0)),
                  pl.BlockSpec((None, bw), lambda i, t, j: (i, j))],
        out_specs=pl.BlockSpec((None, None, bw), lambda i, t, j: (i, t, j)),
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name=INDEX_KERNEL_NAME)(q, w, keys, ks)


def _index_infer(interpret, mesh, arg_shapes, result_shape):
    m, rows = _row_spec(arg_shapes)
    return NamedSharding(m, P(rows, None, None))


def _index_partition(interpret, mesh, arg_shapes, result_shape):
    m, rows = _row_spec(arg_shapes)
    args = tuple(NamedSharding(m, P(rows, *([None] * (len(a.shape) - 1)))) for a in arg_shapes)
    return m, functools.partial(_index_call, interpret=interpret), NamedSharding(m, P(rows, None, None)), args


_index_partitioned = custom_partitioning(_index_call, static_argnums=(4,))
_index_partitioned.def_partition(partition=_index_partition, infer_sharding_from_operands=_index_infer,
                                 sharding_rule="b s h d, b s h, b n d, b n -> b s n")
