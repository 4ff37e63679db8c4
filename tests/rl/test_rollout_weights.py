"""FP8-resident rollout weights: layer-wise dequantisation, FP8 GEMMs, FP4 experts, sharded caches, Sampler.lower."""

import dataclasses
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from dsv4 import DSV4Config, DSV4ForCausalLM, abstract_model, quant
from dsv4 import cache, fp8_gemm, indexer, moe
from dsv4.decode_kernel import fp8_decode_attention, fp8_index_scores
from dsv4.fp8_gemm import fp8_gemm_available, fp8_linear, quantized_linear
from dsv4.fp8_kernel import block_scaled_matmul
from dsv4.rollout_format import check_fp4_experts, parse_rollout_dtype
from launch.aot import reduced_depth
from rl.rollout.engine import Sampler, SamplingParams
from rl.rollout.layerwise import TIE_MODES, default_tie, tie_to

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import randomize  # noqa: E402

CFG = DSV4Config.tiny()
PARAMS = SamplingParams(temperature=0.7, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    return randomize(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), seed=2, scale=0.1)


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in (5, 13, 1)]


def _sampler(model, weights="fp8", dequant="per_layer", kv_cache_dtype="bf16", **kw):
    return Sampler(model, weights=weights, dequant=dequant, compute_dtype=jnp.float32, max_prompt_len=32,
                   kv_cache_dtype=kv_cache_dtype, **kw)


def _teacher_logprobs(sampler, batch, temperature):
    """log_softmax(logits / T) at each response token of `batch` under `sampler`'s (dequantised) weights."""
    ids, mask, resp, _ = batch.sequences()
    # jitted (eager, op by op, a forward costs ~3x the CPU of its compile): the weights are an argument, so the
    # dequantisation runs inside the program, as in the sampler's
    logits = jax.jit(lambda w, i, m: sampler.dense_model(w)(i, attention_mask=m).logits)(
        sampler.weight_state(), jnp.asarray(ids), jnp.asarray(mask))
    lp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
    return np.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0], resp[:, 1:].astype(bool)


def test_layerwise_dequant_equals_whole_model_dequant(model, prompts):
    """dequant="per_layer" (the default) gives today's (whole-model dequantisation) outputs."""
    ref = _sampler(model, dequant="per_call").generate(prompts, PARAMS, seed=1)
    new = _sampler(model).generate(prompts, PARAMS, seed=1)
    np.testing.assert_array_equal(new.tokens, ref.tokens)
    np.testing.assert_array_equal(new.routing, ref.routing)
    assert np.abs(new.logprobs - ref.logprobs).max() <= 1e-6


def test_fp8_linear_matches_dequantised_matmul():
    """The FP8 GEMM (activation quantised per 1x128 tile) vs x @ dequant(W)^T: bound 2^-4 sum|x||W| per output
    (e4m3 rounding of the activation, weights exact); on CPU XLA upcasts the f8 operands: same math."""
    rs = np.random.RandomState(0)
    w = jnp.asarray(rs.randn(200, 300).astype(np.float32) * 0.05)
    x = jnp.asarray(rs.randn(3, 5, 300).astype(np.float32))
    qt = quant.QuantizedTensor.from_fp8(w)
    y = jax.jit(lambda x, q: fp8_linear(x, q, jnp.float32))(x, qt)
    wd = qt.dequantize(jnp.float32)
    ref = jnp.einsum("...i,oi->...o", x, wd)
    bound = 2.0 ** -4 * jnp.einsum("...i,oi->...o", jnp.abs(x), jnp.abs(wd))
    assert y.shape == (3, 5, 200)
    assert bool(jnp.all(jnp.abs(y - ref) <= bound))
    rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert rel < 0.03, rel


@pytest.mark.parametrize("matmul", ["fp8", "interpret"])
def test_grouped_wo_a_fp8_equals_the_dequant_path(matmul):
    """wo_a on FP8 (`grouped_quantized_linear`): its groups as the experts of one FP8 expert GEMM (XLA's K-block dots,
    or the block-scaled kernel in Pallas' interpreter) equal the dequant path (the same quantised activations times
    the dequantised weight) within float rounding; the FP8-aware learner's `FakeQuantWeight` runs the dequant path's
    products bitwise."""
    rs = np.random.RandomState(3)
    g, o, k = 2, 128, 256
    qt = quant.QuantizedTensor.from_fp8(jnp.asarray(rs.randn(g * o, k).astype(np.float32) * 0.05))
    x = jnp.asarray(rs.randn(3, 1, g, k).astype(np.float32))
    ref = fp8_gemm.grouped_quantized_linear(x, dataclasses.replace(qt, matmul="dequant"), jnp.float32)
    y = fp8_gemm.grouped_quantized_linear(x, dataclasses.replace(qt, matmul=matmul), jnp.float32)
    assert y.shape == (3, 1, g, o)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    fq = fp8_gemm.FakeQuantWeight(w=qt.dequantize(jnp.float32), fmt=qt.fmt)
    np.testing.assert_array_equal(np.asarray(fp8_gemm.grouped_quantized_linear(x, fq, jnp.float32)), np.asarray(ref))
    # group g multiplies the weight's rows [g o, (g + 1) o)
    wd = qt.dequantize(jnp.float32).reshape(g, o, k)
    dense = jnp.einsum("...gi,goi->...go", quant.act_fake_quant(x), wd)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(dense), rtol=1e-6, atol=1e-6)


def test_indexer_fp8_scores_equal_the_fake_quantised_queries():
    """The FP8 rollout's indexer scores over FP8 keys (`Indexer.scores(fp8=True)`: each query head's vector as FP8
    with one power-of-two scale, an FP8 x FP8 dot) equal the f32 scores of the fake-quantised queries over the
    dequantised keys within float rounding, and stay near the unquantised queries' (e4m3 rounding, <= 2^-4)."""
    ix = next(lay.attn.indexer for lay in DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)).layers if hasattr(lay.attn, "indexer"))
    rs = np.random.RandomState(4)
    b, h, d, w = 2, ix.n_heads, ix.head_dim, 24
    q = jnp.asarray(rs.randn(b, 1, h, d).astype(np.float32))
    omega = jnp.asarray(rs.randn(b, 1, h).astype(np.float32))
    k8, ks = quant.act_quant(jnp.asarray(rs.randn(b, w, d).astype(np.float32)), block=d)  # the cache's layout
    got = ix.scores(q, omega, k8, ks[..., 0], fp8=True)
    keys = k8.astype(jnp.float32) * ks
    ref = ix.scores(quant.act_fake_quant(q, block=d), omega, keys)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    exact = ix.scores(q, omega, keys)
    assert float(jnp.max(jnp.abs(got - exact))) <= 2.0 ** -4 * float(jnp.max(jnp.abs(exact))) + 1e-6


def test_release_activation_quantisation_golden():
    """The release's rule by hand (DeepSeek-V4 inference/kernel.py act_quant, scale_fmt "ue8m0"): x = 0.1 in all 128
    columns: amax 0.1 -> 0.1 * f32(1/448) = 2.23e-4 in (2^-13, 2^-12] -> s = 2^-12; 0.1 / 2^-12 = 409.6 rounds to
    416 (e4m3 spacing 32 in [256, 512)), so x_q = 416 * 2^-12 = 0.1015625 and y = 128 * 0.1015625 * W = 13 W.
    The same through the FP8 GEMM, the dequantised path, and an FP4 weight (the release's FP8 x FP4 GEMM).
    The f32 option (s = amax * f32(1/448), q = 448): y = 12.8 up to f32 rounding (the old scheme's number)."""
    x = jnp.full((1, 128), 0.1, jnp.float32)
    q = jnp.ones((2, 128), jnp.float8_e4m3fn).at[1].set(2.0)  # W row 0 = 1, row 1 = 2 (block scale 1)
    w = quant.QuantizedTensor(q=q, scale=jnp.ones((1, 1)), kind="fp8", fmt="e4m3fn", block=(128, 128), shape=(2, 128))
    np.testing.assert_array_equal(fp8_linear(x, w, jnp.float32), [[13.0, 26.0]])
    wd = quant.QuantizedTensor(q=w.q, scale=w.scale, kind="fp8", fmt="e4m3fn", block=(128, 128), shape=(2, 128),
                               matmul="dequant")
    np.testing.assert_array_equal(quantized_linear(x, wd, jnp.float32), [[13.0, 26.0]])
    # FP4: codes 2 (= 1.0) with 1x32 scales 2^0 (e8m0 byte 127)
    w4 = quant.QuantizedTensor(q=jnp.full((2, 64), 0x22, jnp.uint8).view(jnp.int8), scale=jnp.ones((2, 4)),
                               kind="fp4", fmt="e2m1", block=(1, 32), shape=(2, 128), matmul="dequant")
    np.testing.assert_array_equal(quantized_linear(x, w4, jnp.float32), [[13.0, 13.0]])
    np.testing.assert_allclose(fp8_linear(x, w, jnp.float32, scale_fmt="f32"), [[12.8, 25.6]], rtol=1e-6)


@pytest.mark.parametrize("impl", ["ragged", "dense", "gathered", "tiled"])
def test_routed_experts_quantise_the_w2_input_golden(impl):
    """act_q quantises the w2 input as the release does (its Expert casts weights * SwiGLU to bf16 and act_quants
    it). By hand, one token, one expert, D = I = 128: x_q = 0.1015625 (see the test above), w1 = w3 = 1/128 ->
    g = u = 0.1015625; h = silu(g) * u = g^2 sigmoid(g) = 0.0054191; h * f32(1/448) = 1.21e-5 in (2^-17, 2^-16]
    -> s = 2^-16; h / s = 355.15 rounds to 352 (spacing 32) -> h_q = 352 * 2^-16; w2 = 1: y = 128 h_q = 0.6875
    (unquantised: 128 h = 0.69365)."""
    fn = {"ragged": moe.routed_experts_ragged, "dense": moe.routed_experts_dense,
          "gathered": moe.routed_experts_gathered, "tiled": moe.routed_experts_tiled}[impl]
    x = jnp.full((1, 128), 0.1015625, jnp.float32)
    ids, wts = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), jnp.float32)
    w13 = jnp.full((1, 128, 128), 1 / 128, jnp.float32)
    w2 = jnp.ones((1, 128, 128), jnp.float32)
    y = fn(x, ids, wts, w13, w13, w2, limit=10.0, dtype=jnp.float32, act_q=quant.act_fake_quant)
    np.testing.assert_allclose(np.asarray(y), 0.6875, rtol=0, atol=0)
    g = 0.1015625
    y0 = fn(x, ids, wts, w13, w13, w2, limit=10.0, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y0), 128 * g * g / (1 + np.exp(-g)), rtol=1e-5)


def test_fp8_gemm_selection_on_this_backend():
    ok, why = fp8_gemm_available()
    assert isinstance(why, str) and why
    if jax.devices()[0].platform == "cpu":
        assert not ok and "CPU" in why


def test_every_tie_returns_the_leaves_bitwise():
    """`tie_to` in each mode (cond: XLA:CPU's default; barrier: elsewhere) hands back the layer's bytes unchanged
    under jit, FP8 included."""
    x = jnp.linspace(-1.0, 1.0, 8)
    leaves = (jnp.linspace(-2.0, 2.0, 12).astype(jnp.float8_e4m3fn).reshape(3, 4), jnp.arange(3, dtype=jnp.float32))
    for tie in TIE_MODES:
        out = jax.jit(lambda x, ls, tie=tie: tie_to(x, ls, tie))(x, leaves)
        assert all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                   for a, b in zip(out, leaves)), tie
    with pytest.raises(ValueError, match="tie='x'"):
        tie_to(x, leaves, "x")
    assert default_tie() == ("cond" if jax.devices()[0].platform == "cpu" else "barrier")


# FP8 GEMM vs dequant path: both quantise the activations by the release's rule, so they multiply the same e4m3
# activations by the same weights and differ only in summation order: logprobs of the same first token within
# 1e-3 nats (measured on CPU: <= 9.5e-7 over all 36 tokens, all tokens equal; the bound leaves room for GPU f32 dots,
# which may run as TF32). Before the dequant path quantised its activations this was 0.25 (measured 0.17).
GEMM_LOGPROB_BOUND = 1e-3


def _gemm_vs_dequant(model, prompts):
    ref = _sampler(model, matmul="dequant").generate(prompts, PARAMS, seed=1)
    new = _sampler(model, matmul="fp8").generate(prompts, PARAMS, seed=1)
    assert new.tokens.shape == ref.tokens.shape
    same = new.tokens[:, 0] == ref.tokens[:, 0]
    assert same.any()
    return np.abs(new.logprobs[:, 0] - ref.logprobs[:, 0])[same]


@pytest.mark.skipif(not fp8_gemm_available()[0], reason=f"no FP8 GEMM on this backend: {fp8_gemm_available()[1]}")
def test_fp8_gemm_sampler_agrees_with_dequant_path(model, prompts):
    """Where XLA runs FP8 GEMMs (auto-selected), the sampler agrees with the dequant path within the bound."""
    assert _sampler(model).fp8_gemm
    assert _gemm_vs_dequant(model, prompts).max() <= GEMM_LOGPROB_BOUND


def test_fp8_gemm_forced_on_cpu_runs_and_is_close(model, prompts):
    """matmul="fp8" forces the FP8-GEMM formulation (on CPU XLA upcasts the f8 operands: the same math, so a
    numerics check of the program the GPU runs)."""
    assert _gemm_vs_dequant(model, prompts).max() <= GEMM_LOGPROB_BOUND


def test_fp8_expert_gemms_on_an_expert_mesh_match_the_dequant_path(prompts, monkeypatch):
    """`matmul="fp8"` on an expert mesh with the padded dispatch (`fp8_experts`): the routed experts run FP8 GEMMs
    (`parallel.padded.padded_ffn`; f8 dot_generals in the program) besides the dense projections; greedy tokens equal
    the dequant path's and every logprob is within GEMM_LOGPROB_BOUND (both quantise the activations by the
    release's rule: summation order only; measured 9.5e-7). `matmul="kernel"` (the block-scaled GEMM kernel,
    `dsv4.fp8_kernel`, in Pallas' interpreter on CPU) runs the routed experts and the projections with 128-multiple
    dims through the kernel, with the same tokens. Tiny config at 2 layers (one hash, one top-k), D = I = 128 (whole
    scale blocks), expert=2."""
    cfg = reduced_depth(DSV4Config.tiny(hidden_size=128, moe_intermediate_size=128), 2)
    m = randomize(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0)), seed=2, scale=0.1)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2, 1), ("data", "fsdp", "expert", "tensor"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    kernel_calls = []
    monkeypatch.setattr(fp8_gemm, "block_scaled_matmul",
                        lambda *a, **k: kernel_calls.append(a[2].shape) or block_scaled_matmul(*a, **k))
    out = {}
    for mm in ("dequant", "kernel", "fp8"):
        s = _sampler(m, mesh=mesh, matmul=mm, ep_backend="padded")
        assert s.dispatch_fn.fp8_experts and s.fp8_gemm == (mm != "dequant")
        out[mm] = s.generate(prompts, greedy, seed=1)
    # the kernel ran the local experts' w1, w3 ([1, 128, 128] per rank) and w2, and the dense 128 x 128 projections
    assert s.fp8_matmul == "fp8" and (1, 128, 128) in kernel_calls and len(kernel_calls) >= 3 * cfg.num_hidden_layers
    np.testing.assert_array_equal(out["kernel"].tokens, out["dequant"].tokens)
    assert np.abs(out["kernel"].logprobs - out["dequant"].logprobs).max() <= GEMM_LOGPROB_BOUND
    # the FP8 program's expert dots: w1, w3, w2 per layer and per program (prefill, decode), each on f8 operands
    text = s.lower(3, 16, 6).as_text()
    assert len(re.findall(r"stablehlo\.dot_general[^\n]*f8E4M3FN[^\n]*f8E4M3FN", text)) >= 3 * cfg.num_hidden_layers
    np.testing.assert_array_equal(out["fp8"].tokens, out["dequant"].tokens)
    assert np.abs(out["fp8"].logprobs - out["dequant"].logprobs).max() <= GEMM_LOGPROB_BOUND


def test_decode_attention_kernel_on_the_fp8_cache_matches_xla(prompts, monkeypatch):
    """FP8 KV cache, `matmul="kernel"`: each decode step's attention runs the FP8 decode kernel
    (`dsv4.decode_kernel`, Pallas' interpreter; the stored entries read once) in every layer, the indexer's scores
    their kernel (`fp8_index_scores`); greedy tokens equal
    XLA's path (`matmul="fp8"`: the entries dequantised, then `attend`) and logprobs agree to float rounding (both
    score the indexer with the same FP8 dot; measured 1.2e-6 at 4 layers). Tiny config at 2 layers (a sliding
    layer and a CSA one), D = 128."""
    cfg = reduced_depth(DSV4Config.tiny(hidden_size=128, moe_intermediate_size=128), 2)
    m = randomize(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0)), seed=2, scale=0.1)
    calls, scores = [], []
    monkeypatch.setattr(cache, "fp8_decode_attention",
                        lambda *a, **k: calls.append(a[1].shape) or fp8_decode_attention(*a, **k))
    monkeypatch.setattr(indexer, "fp8_index_scores",
                        lambda *a, **k: scores.append(a[2].shape) or fp8_index_scores(*a, **k))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    out = {mm: _sampler(m, matmul=mm, kv_cache_dtype="fp8").generate(prompts, greedy, seed=1)
           for mm in ("fp8", "kernel")}
    assert len(calls) == cfg.num_hidden_layers  # one trace of the decode step, every layer through the kernel
    assert scores  # the CSA layer's indexer scores through theirs (in the prefill's chunks and the decode step)
    np.testing.assert_array_equal(out["kernel"].tokens, out["fp8"].tokens)
    assert np.abs(out["kernel"].logprobs - out["fp8"].logprobs).max() <= 1e-5


def test_fp4_experts_logprobs_vs_fp32(model, prompts):
    """fp8+fp4experts: FP4 e2m1 experts (1x32 ue8m0 scales) + FP8 blocks, with the release's FP8 activations before
    every FP8 / FP4 GEMM. On the fp32 sampler's tokens, the teacher-forced logprobs under the FP4/FP8 weights are
    within 1.5 nats (max) / 0.45 (mean) of fp32's (measured 1.12 / 0.356; 0.66 / 0.27 with unquantised
    activations, before the release's activation quantisation). The bound is loose because these random Gaussian
    experts are not FP4-trained: e2m1 rounds them with ~12% RMS relative error (FP8: ~2.6%); the released experts
    were trained for FP4."""
    ref_s = _sampler(model, weights="fp32")
    ref = ref_s.generate(prompts, PARAMS, seed=1)
    s = _sampler(model, weights="fp8+fp4experts")
    experts = {k: v for k, v in s.weight_state().items() if quant.ROUTED_EXPERT_RE.search(k)}
    assert experts and all(v.kind == "fp4" and v.q.dtype == jnp.int8 for v in experts.values())
    lp, resp = _teacher_logprobs(s, ref, PARAMS.temperature)
    d = np.abs(lp - ref.sequences()[3][:, 1:])[resp]  # the rollout's logprobs in the joined rows
    assert d.max() <= 1.5 and d.mean() <= 0.45, (d.max(), d.mean())
    out = s.generate(prompts, PARAMS, seed=1)  # and the layer-wise FP4 program runs
    assert out.tokens.shape == ref.tokens.shape


def test_fp4_option_without_fp4_experts_is_a_clear_error(model):
    fp8_state = _sampler(model).weight_state()
    s = _sampler(model, weights="fp8+fp4experts")
    with pytest.raises(ValueError, match="no FP4 routed experts"):
        s.set_weights(fp8_state, version=1)
    with pytest.raises(ValueError, match="no FP4 routed experts"):
        check_fp4_experts({"layers/0/ffn/experts/w1": jnp.zeros((2, 2))}, source="checkpoint x")
    with pytest.raises(ValueError, match="--rollout-dtype"):
        parse_rollout_dtype("fp4")


def test_cache_sharded_over_data_and_expert(model):
    """On a data=2 x expert=4 rollout mesh each device holds 1/8 of the batch's caches (addressable shards)."""
    devs = np.array(jax.devices()[:8]).reshape(2, 1, 4, 1)
    mesh = Mesh(devs, ("data", "fsdp", "expert", "tensor"))
    s = Sampler(abstract_model(CFG), mesh=mesh, weights="fp8",
                compute_dtype=jnp.float32, max_prompt_len=32, kv_cache_dtype="bf16")
    shape = s.program_shape(3, 20, 12)
    b, p, t = shape.batch, shape.prompt, shape.new
    assert b == 8  # padded to a multiple of data x expert
    caches = s.empty_caches(b, p + t)
    total = sum(x.nbytes for x in jax.tree.leaves(caches))
    for d in mesh.devices.flat:
        per_dev = sum(sh.data.nbytes for x in jax.tree.leaves(caches) for sh in x.addressable_shards if sh.device == d)
        assert per_dev * 8 == total
    lowered = s.lower(3, 20, 12)  # the generate program takes (and donates) caches in that layout
    cache_in = lowered.compile().input_shardings[0][1]
    for sh, x in zip(jax.tree.leaves(cache_in), jax.tree.leaves(caches)):
        assert sh.shard_shape(x.shape)[0] == x.shape[0] // 8


def test_lower_and_memory_analysis(model, prompts):
    """Sampler.lower: the generate program for a batch/prompt/new-token size, with abstract inputs; the FP8
    program takes fewer argument bytes than the fp32 one. The size is the `prompts` x PARAMS generate of the tests
    above (fp8: test_layerwise_dequant_equals_whole_model_dequant, fp32: test_fp4_experts_logprobs_vs_fp32), the
    same program, so its compile loads from the suite's compile cache."""
    args, temp = {}, {}
    for w in ("fp32", "fp8"):
        lowered = _sampler(model, weights=w).lower(len(prompts), max(map(len, prompts)), PARAMS.max_new_tokens)
        assert isinstance(lowered, jax.stages.Lowered)
        ma = lowered.compile().memory_analysis()
        args[w], temp[w] = ma.argument_size_in_bytes, ma.temp_size_in_bytes
    assert args["fp8"] < 0.5 * args["fp32"]
    # layer-wise dequantisation: no converted copy of every layer's bytes held across the decode loop (issue 13's
    # target, 0.25x the unquantised weights; 0.18 measured at lower(4, 20, 12), 0.40 when XLA hoisted a u8 copy of
    # every layer's bytes)
    assert temp["fp8"] - temp["fp32"] <= 0.25 * args["fp32"], (temp, args)
    with pytest.raises(ValueError, match="max_prompt_len"):
        _sampler(model).lower(4, 64, 12)


@pytest.mark.slow
def test_planner_compiles_the_rollout_program():
    """launch.aot.compile_rollout (the planner's --compile, rollout side): XLA's figures on the rollout mesh, the
    weights and caches counted per device from their shardings (caches split over data x expert)."""
    from launch.aot import compile_rollout

    rx = compile_rollout(CFG, "actor:fsdp=4/rollout:data=2,expert=2", batch=6, context=80, prompt_len=16)
    assert (rx.batch, rx.prompt_len, rx.max_new_tokens, rx.batch_shards) == (8, 16, 64, 4)
    assert rx.temp > 0 and rx.argument > 0 and rx.total > rx.kv > 0
    s = Sampler(abstract_model(CFG), weights="fp8",
                compute_dtype=jnp.bfloat16, max_prompt_len=16, kv_cache_dtype="auto")  # compile_rollout's cache: fp8
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.cache_shapes(8, 80)))
    assert rx.kv * 4 == full
    assert any("KV capacity left" in line for line in rx.lines(usable=2**30))
