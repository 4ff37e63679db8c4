"""Rollout sampler: logprobs, routing, stop/length handling, bucketing, FP8 vs BF16, parity with transformers."""

import sys
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from rl.algo.batch import RolloutBatch
from rl.rollout.engine import Sampler, SamplingParams

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import randomize  # noqa: E402

CFG = DSV4Config.tiny()


@pytest.fixture(scope="module")
def model():
    return randomize(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), seed=2, scale=0.1)


@pytest.fixture(scope="module")
def sampler32(model):
    return Sampler(model, weights="fp32", max_prompt_len=64)


def _prompts(rs, lens):
    return [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in lens]


@nnx.jit
def _forward(model, ids, mask):
    """(logits [B, S, V] f32, routing [B, S, L, k] int32) of the full forward of `ids` [B, S] int32 under `mask`,
    jitted (eager, op by op, a forward of the tiny model costs ~3x the CPU of its compile)."""
    out = model(ids, attention_mask=mask)
    return out.logits, out.routing


def _full_logprobs(model, batch: RolloutBatch, temperature: float):
    ids, mask, resp, rlp = batch.sequences()
    logits, routing = _forward(model, jnp.asarray(ids), jnp.asarray(mask))
    lp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
    tgt = np.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    return tgt, resp[:, 1:], rlp[:, 1:], np.asarray(routing), mask


def test_logprobs_and_routing_match_full_forward(model, sampler32):
    rs = np.random.RandomState(0)
    prompts = _prompts(rs, (5, 13, 1, 20, 9))
    batch = sampler32.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=20), seed=1)
    tgt, resp, rlp, routing, mask = _full_logprobs(model, batch, 0.7)
    err = np.abs((tgt - rlp) * resp).max()
    assert err <= 1e-5, f"sampler logprobs vs log_softmax(model(tokens)/T): {err:.2e}"
    assert resp.sum() == batch.lengths.sum() == 5 * 20
    real = mask.astype(bool)[:, :, None, None]
    assert ((batch.routing != routing) & real).sum() == 0, "routing differs from the full forward"
    assert ((batch.routing < 0) == ~real).all(), "routing must be known exactly at real tokens"
    assert batch.routing.shape == (5, batch.prompt_tokens.shape[1] + 20, CFG.num_hidden_layers,
                                   CFG.num_experts_per_tok)


def test_sample_independent_of_batch(sampler32):
    rs = np.random.RandomState(1)
    prompts = _prompts(rs, (7, 3, 11))
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    full = sampler32.generate(prompts, sp, seed=5, step=2)
    alone = sampler32.generate([prompts[2]], sp, seed=5, step=2, prompt_index=[2])
    np.testing.assert_array_equal(alone.tokens[0], full.tokens[2])
    np.testing.assert_allclose(alone.logprobs[0], full.logprobs[2], atol=1e-5)
    other = sampler32.generate(prompts, sp, seed=5, step=3)
    assert not np.array_equal(other.tokens, full.tokens), "a new step must give new samples"


def test_stop_tokens_lengths_and_finish_reasons(sampler32):
    rs = np.random.RandomState(2)
    prompts = _prompts(rs, (4, 6, 8, 10))
    free = sampler32.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16), seed=0)
    stop_tok = int(free.tokens[0, 3])  # make row 0 stop at (or before) its 4th token
    batch = sampler32.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16,
                                                       stop_token_ids=(stop_tok,)), seed=0)
    for i in range(4):
        row = free.tokens[i].tolist()
        if stop_tok in row:
            j = row.index(stop_tok)
            assert batch.lengths[i] == j + 1 and batch.finish_reasons[i] == "stop"
            assert batch.tokens[i, j] == stop_tok and (batch.tokens[i, j + 1:] == 0).all()
            assert (batch.logprobs[i, j + 1:] == 0).all()
        else:
            assert batch.lengths[i] == 16 and batch.finish_reasons[i] == "length"
        np.testing.assert_array_equal(batch.tokens[i, : batch.lengths[i]], free.tokens[i, : batch.lengths[i]])
    assert batch.lengths[0] <= 4 and batch.finish_reasons[0] == "stop"
    one = sampler32.generate(prompts, SamplingParams(max_new_tokens=1), seed=0)
    assert (one.lengths == 1).all() and one.tokens.shape == (4, 1)


def test_prompt_errors_and_single_token(sampler32):
    sp = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler32.generate([[5], []], sp, seed=0)
    with pytest.raises(ValueError, match="prompt 0 has 65 tokens"):
        sampler32.generate([[5] * 65], sp, seed=0)
    with pytest.raises(ValueError, match="outside"):
        sampler32.generate([[CFG.vocab_size]], sp, seed=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    out = sampler32.generate([[7]], sp, seed=0)
    assert out.lengths.tolist() == [4]


def test_no_recompilation_within_a_bucket(sampler32):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, max_new_tokens=12)
    rs = np.random.RandomState(3)
    sampler32.generate(_prompts(rs, (9, 12)), sp, seed=0)
    before = sampler32.compile_count()
    for i, lens in enumerate([(10,), (16, 3), (11, 12), (9, 9), (15, 1)]):
        sampler32.generate(_prompts(rs, lens), SamplingParams(temperature=0.5 + 0.1 * i, top_p=0.9, top_k=5 + i,
                                                               max_new_tokens=10 + i), seed=i)
    assert sampler32.compile_count() == before


def test_top_k_one_is_greedy(sampler32):
    rs = np.random.RandomState(4)
    prompts = _prompts(rs, (6, 9))
    greedy = sampler32.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10), seed=0)
    topk1 = sampler32.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=10), seed=9)
    np.testing.assert_array_equal(greedy.tokens, topk1.tokens)


def test_fp8_vs_bf16_weights(model):
    """FP8 rollout: (1) against BF16 weights its greedy agreement and mean |delta logprob| are reported and bounded;
    (2) its weights are exactly the block-dequantised ones: BF16 compute on them differs from it only by the
    release's FP8 activation quantisation (1x128 blocks, ue8m0 scales, before every FP8 / FP4 GEMM). Random tiny
    weights are a hard case (small logit gaps, one 128x128 block per matrix), so the bounds are loose. Measured
    (greedy, 4 prompts x 16 tokens; wo_a FP8 with its activations quantised, as since stop 52): (1) mean |dlogp|
    before the first divergence 0.134, first divergence [7, 0, 3, 4]: prompt 1's first token is a near tie of this
    near-uniform model (BF16 picks 149 at logprob -3.520, FP8 picks 62 at -3.483), so one prompt may diverge at
    once; (2) earlier 0.098, first divergence at tokens [3, 0, 8, 5] (the same near tie; [3, 8, 2, 7] with wo_a in
    FP8 on both sides). Before the release's activation quantisation (2) was bitwise equal."""
    from dsv4 import quant

    rs = np.random.RandomState(5)
    prompts = _prompts(rs, (8, 12, 5, 16))
    s16 = Sampler(model, weights="bf16", max_prompt_len=64)
    s8 = Sampler(model, weights="fp8", max_prompt_len=64, kv_cache_dtype="bf16")
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    g16, g8 = s16.generate(prompts, sp, seed=0), s8.generate(prompts, sp, seed=0)
    first_div = [int(np.argmax(a != b)) if (a != b).any() else 16 for a, b in zip(g16.tokens, g8.tokens)]
    agree = float((g16.tokens == g8.tokens).mean())
    d = np.concatenate([np.abs(g16.logprobs[i, :first_div[i]] - g8.logprobs[i, :first_div[i]]) for i in range(4)])
    print(f"FP8 vs BF16: greedy token agreement {agree:.3f}, first divergence {first_div}, "
          f"mean |delta logprob| before divergence {d.mean():.4f}")
    assert s8.fmt == "e4m3fn" and g8.weight_version == 0
    assert sorted(first_div)[1] >= 1 and d.mean() < 0.3

    ws = s8.weight_state()
    qt = {k: v for k, v in ws.items() if isinstance(v, quant.QuantizedTensor)}
    assert qt and all(v.q.dtype == jnp.float8_e4m3fn for v in qt.values())
    assert any(k.endswith("ffn/experts/w1") for k in qt) and any(k.endswith("attn/wq_a/weight") for k in qt)
    deq = {k: (qt[k].dequantize(jnp.float32) if k in qt else v) for k, v in s16.flat_params(model).items()}
    s16.update_weights(deq, version=1)
    g16q = s16.generate(prompts, sp, seed=0)
    first_q = [int(np.argmax(a != b)) if (a != b).any() else 16 for a, b in zip(g16q.tokens, g8.tokens)]
    dq = np.concatenate([np.abs(g16q.logprobs[i, :first_q[i]] - g8.logprobs[i, :first_q[i]]) for i in range(4)])
    assert sorted(first_q)[1] >= 2 and 0 < dq.mean() < 0.15, (first_q, dq.mean())
    assert g16q.weight_version == 1


def test_fnuz_engine_equals_fn_engine(model):
    """Issue 15 class 3: fp8_e4m3fnuz weights are the exact byte conversion of the e4m3fn ones (bytes
    reinterpreted, 0x80 -> 0x00, scales x 2), so an fnuz engine (MI300X/MI308X) computes bitwise what an fn
    engine (MI355X/H200) computes: same dequantised weights, tokens and logprobs."""
    from dsv4 import quant

    rs = np.random.RandomState(7)
    prompts = _prompts(rs, (6, 11, 3, 9))
    fn = Sampler(model, weights="fp8", max_prompt_len=64, compute_dtype=jnp.float32, kv_cache_dtype="bf16")
    nuz = Sampler(model, weights="fp8_e4m3fnuz", max_prompt_len=64, compute_dtype=jnp.float32,
                  kv_cache_dtype="bf16")
    assert fn.fmt == "e4m3fn" and nuz.fmt == "e4m3fnuz"
    wf, wn = fn.weight_state(), nuz.weight_state()
    n_fp8 = 0
    for k, a in wf.items():
        if isinstance(a, quant.QuantizedTensor):
            n_fp8 += 1
            q_ref, s_ref = quant.fp8_fn_to_fnuz(np.asarray(a.q), np.asarray(a.scale), name=k)
            np.testing.assert_array_equal(np.asarray(wn[k].q).view(np.uint8), q_ref.view(np.uint8), err_msg=k)
            np.testing.assert_array_equal(np.asarray(wn[k].scale), s_ref, err_msg=k)
            np.testing.assert_array_equal(np.asarray(wn[k].dequantize(jnp.float32)),
                                          np.asarray(a.dequantize(jnp.float32)), err_msg=k)
    assert n_fp8 > 10
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=8), SamplingParams(temperature=1.0, max_new_tokens=8)):
        a, b = fn.generate(prompts, sp, seed=3), nuz.generate(prompts, sp, seed=3)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
