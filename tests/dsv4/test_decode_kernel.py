"""The FP8 decode attention kernel (`dsv4.decode_kernel`) against XLA's decode attention on the dequantised entries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import decode_kernel
from dsv4.attention import attend
from dsv4.decode_kernel import fp8_decode_attention
from dsv4.quant import act_quant


def _entries(rs, b, n, nb, blk, r, dtype):
    """FP8 entries as the cache stores them: (no-RoPE bytes, their per-block power-of-two scales, RoPE dims), and the
    dequantised keys [b, n, nb * blk + r] in `dtype`."""
    x = rs.randn(b, n, nb * blk).astype(np.float32) * 2.0
    kq, ks = act_quant(jnp.asarray(x), block=blk)
    kr = jnp.asarray(rs.randn(b, n, r).astype(np.float32)).astype(dtype)
    deq = (kq.astype(jnp.float32).reshape(b, n, nb, blk) * ks[..., None]).reshape(b, n, nb * blk)
    return kq, ks, kr, jnp.concatenate([deq.astype(dtype), kr], axis=-1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_decode_attention_equals_attend_on_the_dequantised_entries(dtype):
    """Rows with every entry visible, some masked (the padding past 70 entries too), and none but the sink; f32:
    summation order only; bf16: XLA's path rounds its logits and output to bf16, the kernel keeps f32."""
    rs = np.random.RandomState(0)
    b, h, nb, blk, r, n = 3, 4, 2, 16, 16, 70
    kq, ks, kr, keys = _entries(rs, b, n, nb, blk, r, dtype)
    q = jnp.asarray(rs.randn(b, h, nb * blk + r).astype(np.float32)).astype(dtype)
    mask = jnp.asarray(np.stack([np.ones(n, bool), rs.rand(n) < 0.5, np.zeros(n, bool)]))
    sink = jnp.asarray(rs.randn(h).astype(np.float32))
    scale = (nb * blk + r) ** -0.5
    got = jax.jit(lambda *a: fp8_decode_attention(*a, scale, interpret=True))(q, kq, ks, kr, mask, sink)
    ref = attend(q[:, None], keys, mask[:, None, :], sink, scale)[:, 0]
    assert got.shape == (b, h, nb * blk + r) and got.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got[2]), 0.0)  # only the sink: no entry contributes
    if dtype == jnp.float32:  # Blackwell's split (`out_tiles`): the output tiles over two calls, the same values
        pad = -n % decode_kernel.BLOCK_N
        args = [jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (kq, ks, kr)]
        bias = jnp.where(jnp.pad(mask, ((0, 0), (0, pad))), 0.0, -jnp.inf)
        split = decode_kernel._run(q, *args, bias, sink, scale=scale, interpret=True, tiles_per_call=2)
        np.testing.assert_allclose(np.asarray(split), np.asarray(got), rtol=1e-6, atol=1e-6)


def test_fp8_decode_attention_refuses_tiles_that_are_not_powers_of_two():
    rs = np.random.RandomState(1)
    kq, ks, kr, _ = _entries(rs, 1, 8, 1, 24, 16, jnp.float32)
    with pytest.raises(ValueError, match="powers of two"):
        fp8_decode_attention(jnp.zeros((1, 4, 40)), kq, ks, kr, jnp.ones((1, 8), bool), jnp.zeros(4), 1.0)


def test_fp8_index_scores_kernel_equals_the_xla_form():
    """The indexer's scores as one kernel (`fp8_index_scores`, Pallas' interpreter) against `Indexer.scores`' XLA
    form on the same FP8 queries and keys: 200 keys (a last block of 72, masked), 2 queries per row; summation order
    only."""
    from dsv4.decode_kernel import fp8_index_scores

    rs = np.random.RandomState(2)
    b, s, h, d, n = 2, 2, 16, 32, 200
    q8, sq = act_quant(jnp.asarray(rs.randn(b, s, h, d).astype(np.float32)), block=d)
    k8, ks = act_quant(jnp.asarray(rs.randn(b, n, d).astype(np.float32)), block=d)
    w = jnp.asarray(rs.randn(b, s, h).astype(np.float32)) * sq[..., 0]
    got = jax.jit(lambda *a: fp8_index_scores(*a, interpret=True))(q8, w, k8, ks[..., 0])
    dots = jnp.einsum("bshd,bwd->bshw", q8, k8, preferred_element_type=jnp.float32)
    ref = jnp.einsum("bshw,bsh->bsw", jax.nn.relu(dots), w) * ks[..., 0][:, None, :]
    assert got.shape == (b, s, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_h200_compiles_both_kernels_split_over_the_rows():
    """XLA:GPU (H200 spec, deviceless, 2 devices) compiles each kernel into the program as one Triton custom call per
    device on its own rows (custom-partitioned: no all-gather), and launch/hlo_stats.py counts the flops of XLA's
    forms; the attention kernel's products count in the compute dtype (its FP8 entries are dequantised in
    registers), the scores kernel's as FP8 GEMM operands."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dsv4.decode_kernel import fp8_index_scores
    from launch import gpu_target as gt
    from launch import hlo_stats

    mesh = jax.sharding.Mesh(np.array(gt.topology_devices(gt.TARGETS["h200"], 2)), ("x",))
    opts = gt.compile_options({"xla_gpu_disable_gpuasm_optimizations": True})

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("x", *([None] * (len(shape) - 1)))))

    b, h, n = 8, 16, 96
    attn = (arg((b, h, 192), jnp.bfloat16), arg((b, n, 128), jnp.float8_e4m3fn), arg((b, n, 2), jnp.float32),
            arg((b, n, 64), jnp.bfloat16), arg((b, n), jnp.bool_), jax.ShapeDtypeStruct((h,), jnp.float32))
    index = (arg((b, 1, h, 128), jnp.float8_e4m3fn), arg((b, 1, h), jnp.float32), arg((b, n, 128), jnp.float8_e4m3fn),
             arg((b, n), jnp.float32))
    # the attention's entries run in whole blocks of 64 (96 -> 128, the padding masked)
    for fn, args, flops, fp8 in ((lambda *a: fp8_decode_attention(*a, 0.1), attn, 2 * 2 * (b // 2) * h * 128 * 192, 0),
                                 (fp8_index_scores, index, 2 * (b // 2) * h * n * 128, 1)):
        text = jax.jit(fn).lower(*args).compile(opts).as_text()
        st = hlo_stats.count(text)
        assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 1 and "all-gather" not in text
        assert st.flops == flops and st.gemm_bytes > 0
        assert st.fp8_gemm_bytes == (st.gemm_bytes if fp8 else 0.0)
