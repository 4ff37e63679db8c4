"""FP8 expert GEMMs (issue 37 item 1): `dsv4.fp8_gemm.fp8_expert_matmul` equals the dequantised reference with the
same quantised activations within float rounding; the padded / sized EP dispatch given FP8 `QuantizedTensor` experts
(`parallel.padded.padded_ffn`) runs FP8 dots and equals the dequant path (`dsv4.moe.MoE`'s: fake-quantised rows and
w2 input times dequantised experts) on a tensor-parallel rollout layout and an FSDP actor layout, and falls back to
that path where the tensor axis splits a scale block or a buffer has more than `fp8_rows_limit` rows per expert;
the block-scaled GEMM kernel (`dsv4.fp8_kernel`, Pallas' interpreter) equals the XLA form, alone and in the
dispatch; on the H200 spec (deviceless XLA:GPU, launch/gpu_target.py) every expert dot takes f8 operands, and the
kernel compiles to three Triton kernels with no copy of the expert bytes. Sampler-level parity:
tests/rl/test_rollout_weights.py.
Run: `.venv/bin/python -m pytest -q tests/parallel/test_fp8_experts.py`.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv4 import moe, quant
from dsv4.fp8_gemm import fp8_expert_matmul, quantize_rows
from dsv4.fp8_kernel import KERNEL_NAME, block_scaled_matmul
from dsv4.rollout_format import layer_value
from launch import gpu_target as gt
from launch import hlo_stats
from parallel.expert import make_ep_dispatch
from parallel.padded import padded_ffn
from sharding.mesh import build_mesh_plan
from sharding.rules import ACTOR_RULES, ROLLOUT_RULES

LIMIT = 10.0
F8_DOT = re.compile(r"stablehlo\.dot_general.*f8E4M3FN.*f8E4M3FN")


def _qt(rs, shape, scale=0.05):
    return quant.QuantizedTensor.from_fp8(jnp.asarray(rs.randn(*shape).astype(np.float32) * scale))


def test_fp8_expert_matmul_equals_dequantised_reference():
    """[E, R, K] FP8 rows x [E, O, K] FP8 blocks (K = 300: a short last block; O = 200: a short last row block)
    against the same quantised rows times the dequantised weights in f32: summation order only."""
    rs = np.random.RandomState(0)
    w = _qt(rs, (3, 200, 300))
    x = jnp.asarray(rs.randn(3, 5, 300).astype(np.float32))
    y = jax.jit(lambda x, w: fp8_expert_matmul(quantize_rows(x), w))(x, w)
    ref = jnp.einsum("eri,eoi->ero", quant.act_fake_quant(x), w.dequantize(jnp.float32))
    assert y.shape == (3, 5, 200) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    # the padded FFN's bf16 partials (a bf16 compute dtype): one bf16 rounding (2^-9 relative) per K block's sum
    yb = jax.jit(lambda x, w: fp8_expert_matmul(quantize_rows(x), w, jnp.bfloat16))(x, w)
    assert yb.dtype == jnp.float32
    bound = 2.0**-9 * np.abs(np.asarray(jnp.einsum("eri,eoi->ero", jnp.abs(quant.act_fake_quant(x)),
                                                   jnp.abs(w.dequantize(jnp.float32)))))
    assert (np.abs(np.asarray(yb) - np.asarray(ref)) <= bound + 1e-6).all()
    with pytest.raises(ValueError, match="3-d fp8"):
        fp8_expert_matmul(quantize_rows(x), quant.QuantizedTensor.from_fp8(jnp.ones((200, 300))))


def test_block_scaled_kernel_equals_the_xla_form():
    """The block-scaled GEMM kernel (`dsv4.fp8_kernel`, Pallas' interpreter) against the XLA form with f32 partials:
    5 rows (one row block of 16, masked), 130 rows (two blocks), K = 384 (3 K blocks: masked to 4); summation order
    only. A K that is not whole blocks runs the XLA form; the kernel itself refuses it."""
    rs = np.random.RandomState(2)
    w = _qt(rs, (2, 256, 384))
    wk = dataclasses.replace(w, matmul="interpret")
    for r in (5, 130):
        x = quantize_rows(jnp.asarray(rs.randn(2, r, 384).astype(np.float32)))
        ref = np.asarray(jax.jit(lambda x, w: fp8_expert_matmul(x, w))(x, w))
        y = jax.jit(lambda x, w: fp8_expert_matmul(x, w, out_dtype=jnp.bfloat16))(x, wk)
        assert y.shape == (2, r, 256) and y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2.0**-8, atol=1e-3 * np.abs(ref).max())
        y32 = jax.jit(lambda x, w: fp8_expert_matmul(x, w))(x, wk)
        np.testing.assert_allclose(np.asarray(y32), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    w3 = _qt(rs, (2, 256, 300))
    x3 = quantize_rows(jnp.asarray(rs.randn(2, 4, 300).astype(np.float32)))
    np.testing.assert_array_equal(np.asarray(fp8_expert_matmul(x3, dataclasses.replace(w3, matmul="interpret"))),
                                  np.asarray(fp8_expert_matmul(x3, w3)))
    with pytest.raises(ValueError, match="multiples of 128"):
        block_scaled_matmul(x3.q, x3.s, w3.q, w3.scale, interpret=True)


def test_block_scaled_kernel_masks_the_rows_past_the_last():
    """Pallas' Triton lowering does not bound a block to its array: at 48 rows (the sized dispatch's capacity, a row
    block of 64) the kernel masks its row loads (rows and their scales) and its store, else a GPU reads the next
    expert's rows and writes over its output (the interpreter pads, so the numerics tests cannot see it)."""
    x = jnp.zeros((2, 48, 256), jnp.float8_e4m3fn)
    w = jnp.zeros((2, 128, 256), jnp.float8_e4m3fn)
    text = str(jax.make_jaxpr(block_scaled_matmul)(x, jnp.ones((2, 48, 2)), w, jnp.ones((2, 1, 2))))
    assert re.search(r"lt \w+ 48:i32\[\]", text)  # rows past 48 are dead
    assert len(re.findall(r"<- \w+\[[^\n]*\] mask=", text)) == 2  # the rows and their scales
    assert re.search(r"\w+\[\.\.\.\] <- \w+\[\.\.\.\], \w+ mask=", text)  # the store


def test_layer_value_keeps_routed_experts_fp8_only_for_fp8_gemms():
    """`--rollout.matmul fp8`: routed experts stay FP8 for the FP8 expert GEMM (FP4 ones become exact FP8 blocks);
    the dequant path (CPU `auto`) keeps today's form."""
    rs = np.random.RandomState(1)
    w = _qt(rs, (2, 64, 256))
    key = "layers/0/ffn/experts/w1"
    assert layer_value(key, w, jnp.float32, matmul="fp8").matmul == "fp8"
    assert layer_value(key, w, jnp.float32, matmul="pallas").matmul == "pallas"
    assert layer_value(key, w, jnp.float32, matmul="dequant").matmul == "dequant"
    w4 = jax.jit(quant.QuantizedTensor.from_fp4)(jnp.asarray(rs.randn(2, 64, 256).astype(np.float32)))
    v = jax.jit(lambda w: layer_value(key, w, jnp.float32, matmul="fp8"))(w4)
    assert v.kind == "fp8" and v.matmul == "fp8" and v.q.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(*(np.asarray(jax.jit(lambda t: t.dequantize(jnp.float32))(t)) for t in (v, w4)))
    assert layer_value(key, w4, jnp.float32, matmul="dequant").kind == "fp4"


def _inputs(t, d, i, e=8, k=2, seed=0):
    rs = np.random.RandomState(seed)
    x = jnp.asarray(rs.randn(t, d).astype(np.float32))
    ids = jnp.asarray(np.argsort(rs.rand(t, e), axis=1)[:, :k].astype(np.int32))
    w = jnp.asarray(rs.uniform(0.1, 1.0, (t, k)).astype(np.float32))
    return x, ids, w, _qt(rs, (e, i, d), 0.1), _qt(rs, (e, i, d), 0.1), _qt(rs, (e, d, i), 0.1)


def _reference(x, ids, w, w1, w3, w2):
    """The dequant path of `dsv4.moe.MoE` for quantised experts, single device, f32."""
    fn = functools.partial(moe.routed_experts_ragged, limit=LIMIT, dtype=jnp.float32, act_q=quant.act_fake_quant)
    return jax.jit(lambda x, *a: fn(quant.act_fake_quant(x), *a))(x, ids, w, *(v.dequantize(jnp.float32)
                                                                               for v in (w1, w3, w2)))


ROLLOUT = "actor:fsdp=4/rollout:expert=2,tensor=2"


@pytest.mark.parametrize("spec, rules, backend, t, i, f8_dots, kernel", [
    # rollout layout, I split over tensor=2 in whole 128-blocks: 3 FP8 GEMMs of 2 K blocks (w1, w3: D = 256; w2:
    # I / tp = 128 -> 1 block); "sized" with the compaction: every capacity x every row count runs them
    (ROLLOUT, ROLLOUT_RULES, "padded", 16, 256, 5, "fp8"),
    (ROLLOUT, ROLLOUT_RULES, "sized", 16, 256, None, "fp8"),
    ("actor:fsdp=2,expert=2,tensor=2", ACTOR_RULES, "padded", 16, 256, 5, "fp8"),  # FSDP: D gathered as FP8 bytes
    (ROLLOUT, ROLLOUT_RULES, "padded", 16, 64, 0, "fp8"),  # I / tp = 32 is not a whole scale block: dequantised
    (ROLLOUT, ROLLOUT_RULES, "padded", 80, 256, 0, "fp8"),  # 2 x 40 rows per expert > FP8_ROWS_MAX (f32): dequantised
    # the block-scaled kernel (Pallas' interpreter): no row limit, so the 80 tokens' buffers run it too
    (ROLLOUT, ROLLOUT_RULES, "padded", 80, 256, None, "interpret"),
])
def test_ep_dispatch_fp8_experts_match_the_dequant_path(spec, rules, backend, t, i, f8_dots, kernel):
    plan = build_mesh_plan(spec)
    mesh = plan.rollout if rules is ROLLOUT_RULES else plan.actor
    x, ids, w, w1, w3, w2 = _inputs(t=t, d=256, i=i)
    ref = _reference(x, ids, w, w1, w3, w2)
    fn = make_ep_dispatch(mesh, backend=backend, rules=rules, compact=backend == "sized")
    w1, w3, w2 = (dataclasses.replace(v, matmul=kernel) for v in (w1, w3, w2))
    assert fn.fp8_experts
    jitted = jax.jit(lambda *a: fn(*a, limit=LIMIT, dtype=jnp.float32))
    with jax.set_mesh(mesh):
        lowered = jitted.lower(x, ids, w, w1, w3, w2)
        out = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})(x, ids, w, w1, w3, w2)
    n_f8 = len(F8_DOT.findall(lowered.as_text()))
    if kernel == "interpret":  # w1, w3, w2 through the kernel, at every compiled capacity
        with jax.set_mesh(mesh):
            jaxpr = str(jax.make_jaxpr(lambda *a: fn(*a, limit=LIMIT, dtype=jnp.float32))(x, ids, w, w1, w3, w2))
        assert jaxpr.count(f"name={KERNEL_NAME}") >= 3 and n_f8 >= 3
    elif f8_dots is None:
        assert n_f8 > 5  # one set of FP8 GEMMs per compiled (capacity, rows) branch
    else:
        assert n_f8 == f8_dots, n_f8
    # summation order only (f32 partials per 128-block, tensor-parallel partial sums vs one f32 dot), except where
    # that moves a SwiGLU output across an e4m3 rounding boundary of the w2 input: that token's row then differs by
    # one e4m3 step of one input element (<= 2^-3 of it) times w2 (here: 0 or 1 token of t)
    out, ref = np.asarray(out), np.asarray(ref)
    close = np.isclose(out, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max()).all(axis=1)
    assert (~close).sum() <= max(1, t // 40), np.nonzero(~close)
    assert np.abs(out - ref).max() <= 2.0**-4 * np.abs(ref).max()


_PLUGIN = gt.plugin_error()


@pytest.mark.skipif(_PLUGIN is not None, reason=f"no deviceless XLA:GPU compile here: {_PLUGIN}")
def test_h200_compiles_the_expert_ffn_to_fp8_gemms():
    """XLA:GPU (H200 spec, deviceless) compiles the padded expert FFN of FP8 experts (4 local experts, 32 rows, D = I
    = 256: 2 K blocks per GEMM) to 6 dots, all with f8 operands; the dequant path's dots take none. No copy of
    the expert bytes: the K-block slices fuse into the GEMMs, and w1's and w3's GEMMs stay apart (XLA's dot merger
    would concatenate their slices, i.e. copy them; `parallel.padded.padded_ffn`)."""
    devices = gt.topology_devices(gt.TARGETS["h200"], 1)
    rep = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P())
    n, r, d, i = 4, 32, 256, 256
    rs = np.random.RandomState(0)
    ws = [_qt(rs, s) for s in ((n, i, d), (n, i, d), (n, d, i))]
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    wabs = [jax.tree.map(abstract, v) for v in ws]
    xabs = jax.ShapeDtypeStruct((n, r, d), jnp.bfloat16, sharding=rep)
    gabs = jax.ShapeDtypeStruct((n, r), jnp.float32, sharding=rep)
    opts = gt.compile_options({"xla_gpu_disable_gpuasm_optimizations": True})
    fp8 = jax.jit(lambda x, g, *w: padded_ffn(quantize_rows(x), g, *w, limit=LIMIT, dtype=jnp.bfloat16))
    kern = jax.jit(lambda x, g, *w: padded_ffn(quantize_rows(x), g, *(dataclasses.replace(v, matmul="pallas")
                                                                       for v in w), limit=LIMIT, dtype=jnp.bfloat16))
    deq = jax.jit(lambda x, g, *w: padded_ffn(quant.act_fake_quant(x), g, *(v.dequantize(jnp.bfloat16) for v in w),
                                              limit=LIMIT, dtype=jnp.bfloat16, act_q=quant.act_fake_quant))
    st = {}
    for name, fn in (("fp8", fp8), ("dequant", deq), ("kernel", kern)):
        text = fn.lower(xabs, gabs, *wabs).compile(opts).as_text()
        st[name] = hlo_stats.count(text)
        if name == "kernel":  # three Triton kernels read the stored bytes, counted as FP8 GEMMs
            assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 3
        if name != "dequant":  # no kernel of the program writes expert bytes (a whole tensor or a K-block slice)
            entry = text.split("\nENTRY ")[1]
            assert not re.search(r"= f8e4m3fn\[4,256,(128|256)\]\S* (?!parameter\()", entry), "expert bytes copied"
    assert (st["fp8"].dots, st["fp8"].fp8_dots) == (6, 6)
    assert (st["kernel"].dots, st["kernel"].fp8_dots) == (3, 3) and st["kernel"].flops == st["fp8"].flops
    assert st["kernel"].bytes < st["fp8"].bytes  # no K-block partials
    assert st["dequant"].dots >= 2 and st["dequant"].fp8_dots == 0  # (XLA merges its w1 and w3 dots)
