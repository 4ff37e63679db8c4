"""FP8 KV cache (`--kv-cache-dtype`, dsv4/cache.py): live cache arrays are FP8 and their bytes per token match the
layout's formula; logprobs of the same tokens vs the unquantised cache within a measured bound; continuous ==
static per request key with the FP8 cache; bad flag values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from dsv4.cache import prefill, teacher_forced_logprobs
from rl.config.run import RunConfig
from rl.rollout.engine import Sampler, SamplingParams
from rl.rollout.settings import EngineSettings

CFG = DSV4Config.tiny()  # head_dim 32 (rope 8: 24 FP8 dims, blocks of gcd(64, 24) = 8), CSA m=4 (d_I 16), HCA m=8
P = 16
SP = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=(17, 33, 90, 101))
LENS = (5, 13, 1, 16, 9)
LIMITS = [16, 3, 16, 7, 16]
# Measured on this model (default init, seed 0) and these samples: max |fp8 - unquantised| = 0.0567 nats,
# mean 0.0034 over 80 tokens (XLA:CPU, fp32 compute); the bounds leave ~2x headroom.
MAX_BOUND, MEAN_BOUND = 0.1, 0.007


@pytest.fixture(scope="module")
def model():
    return DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0))  # the default init (what a run trains from)


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in LENS]


def _row(batch, i):
    n, pl = int(batch.lengths[i]), int(batch.prompt_lengths[i])  # the joined row (rl/batch.py)
    return batch.tokens[i, :n], batch.logprobs[i, :n], batch.routing[i, :pl + n], n, batch.finish_reasons[i]


def _expected_bytes_per_token(cfg) -> float:
    """The FP8 layout's formula: per CSA entry (1/m per token) d - r FP8 dims + (d - r) / blk ue8m0 bytes + r bf16
    dims, plus an indexer key of d_I FP8 dims + 1 scale byte; per HCA entry (1/m') the same entry."""
    d, r, di = cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim
    entry = (d - r) + (d - r) // math.gcd(64, d - r) + 2 * r
    out = 0.0
    for i in range(cfg.num_hidden_layers):
        m, kind = cfg.compress_ratios[i], cfg.layer_kind(i)
        if kind == "csa":
            out += (entry + di + 1) / m
        elif kind == "hca":
            out += entry / m
    return out


def test_cache_arrays_are_fp8_and_bytes_match_the_formula(model):
    s = Sampler(model, weights="fp8", max_prompt_len=P, kv_cache_dtype="auto")  # auto + FP8 weights -> fp8
    assert s.settings.kv_layout == "fp8" and s.kv_fp8 == "e4m3fn"
    assert Sampler(model, weights="fp32", max_prompt_len=P, kv_cache_dtype="auto").kv_fp8 is None

    def nbytes(caches):
        return sum(x.nbytes for x in jax.tree.leaves(caches))

    live = s.empty_caches(2, 32)  # the arrays generate donates to its program
    ids = jnp.asarray(np.random.RandomState(1).randint(3, CFG.vocab_size, (2, P)), jnp.int32)
    filled = jax.jit(lambda i: prefill(model, i, jnp.array([5, 16], jnp.int32), 32, kv_fp8="e4m3fn")[2])(ids)
    for caches in (live, filled):
        for layer in caches:
            assert layer["kv"].dtype == jnp.float8_e4m3fn and layer["kv_scale"].dtype == jnp.uint8
            assert layer["kv_rope"].dtype == jnp.bfloat16
            if "comp" in layer:
                assert layer["comp"].dtype == jnp.float8_e4m3fn and layer["comp_scale"].dtype == jnp.uint8
            if "ik" in layer:
                assert layer["ik"].dtype == jnp.float8_e4m3fn and layer["ik_scale"].shape[-1] == 1
        assert any("ik" in layer for layer in caches) and any("comp" in layer and "ik" not in layer for layer in caches)
    assert nbytes(filled) == nbytes(live)
    per_token = (nbytes(s.empty_caches(1, 64)) - nbytes(s.empty_caches(1, 32))) / 32  # 8 | 32: whole entries
    assert per_token == _expected_bytes_per_token(CFG)
    dense = Sampler(model, weights="fp8", max_prompt_len=P, kv_cache_dtype="bf16")
    dense_per_token = (nbytes(dense.empty_caches(1, 64)) - nbytes(dense.empty_caches(1, 32))) / 32
    assert per_token < 0.5 * dense_per_token
    assert s.cache_bytes(32) == nbytes(s.empty_caches(1, 32))


def test_fp8_cache_logprobs_of_the_same_tokens_within_bound(model, prompts):
    """Sample with the unquantised cache, then score those very tokens through the decode path with both layouts
    (teacher forcing: the clean comparison; free sampling would diverge at the first different draw)."""
    s = Sampler(model, weights="fp32", max_prompt_len=P, kv_cache_dtype="bf16")
    sp = SamplingParams(temperature=1.0, max_new_tokens=16)
    out = s.generate(prompts, sp, seed=3)
    assert (out.lengths == 16).all()
    lens = np.array(LENS, np.int32)
    ids = np.zeros((len(prompts), P + 16), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
        ids[i, len(p):len(p) + 16] = out.tokens[i]
    score = jax.jit(lambda i, n: teacher_forced_logprobs(model, i, n, 16, P + 16, kv_fp8="e4m3fn"))
    q = np.asarray(score(jnp.asarray(ids), jnp.asarray(lens)))
    diff = np.abs(q - out.logprobs)  # vs the sampler's own logprobs (unquantised cache: = the full forward's)
    assert 0 < diff.max() <= MAX_BOUND and diff.mean() <= MEAN_BOUND, (diff.max(), diff.mean())
    assert np.abs(diff[:, 0]).max() <= 1e-5  # the first token comes from the prefill (unquantised keys)


def test_continuous_equals_static_per_request_with_fp8_cache(model, prompts):
    """As tests/rl/test_slots.py, with the FP8 cache: one slot vs the static path one request per call (the same
    shapes), bitwise per request key."""
    static = Sampler(model, weights="fp32", max_prompt_len=P, kv_cache_dtype="fp8")
    one = Sampler(model, weights="fp32", max_prompt_len=P, slots=1, kv_cache_dtype="fp8")
    cont = one.generate(prompts, SP, seed=1, step=3, max_new_tokens_per_row=LIMITS)
    assert "stop" in cont.finish_reasons and one.last_stats["rollout/slots_refilled"] == len(prompts) - 1
    for i, p in enumerate(prompts):
        alone = static.generate([p], SP, seed=1, step=3, prompt_index=[i], max_new_tokens_per_row=[LIMITS[i]])
        a, b = _row(alone, 0), _row(cont, i)
        assert a[3:] == b[3:]
        for x, y in zip(a[:3], b[:3]):
            np.testing.assert_array_equal(x, y)


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match=r"^rollout.kv_cache_dtype \(--rollout.kv_cache_dtype\) must be "
                                         r"fp8\|bf16\|auto"):
        RunConfig(**{"rollout.kv_cache_dtype": "int4"})
    assert RunConfig().rollout.kv_cache_dtype == "auto"
    assert RunConfig(**{"rollout.kv_cache_dtype": "bf16"}).rollout.kv_cache_dtype == "bf16"
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineSettings(weights="fp8", kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        Sampler(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), weights="fp32", kv_cache_dtype="e5m2")
    assert EngineSettings().kv_cache_dtype == RunConfig().rollout.kv_cache_dtype == "auto"  # one default
    assert EngineSettings(weights="fp8").kv_layout == "fp8" and EngineSettings(weights="bf16").kv_layout == "bf16"
    assert EngineSettings(weights="fp8", kv_cache_dtype="bf16").kv_layout == "bf16"
