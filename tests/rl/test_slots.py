"""Continuous batching (rl/rollout/slots.py): same results per request key as the static path, slot refills counted,
slot count checked against the memory plan, prompts longer than the cache rejected."""

import pathlib
import sys

import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM, abstract_model
from rl.rollout import slots as sl
from rl.config.run import RunConfig
from rl.run.wiring import rollout_slots
from rl.rollout.engine import Sampler, SamplingParams
from sharding.mesh import parse_mesh_spec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "dsv4"))
from randomize import randomize  # noqa: E402

CFG = DSV4Config.tiny()
P = 16  # max prompt: the static path's prompt bucket for every prompt below, so its prefill width is the slots'
SP = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=(17, 33, 90, 101))  # pow2: same cache
LENS = (5, 13, 1, 16, 9)
LIMITS = [16, 3, 16, 7, 16]  # a length schedule on top of the stop tokens


@pytest.fixture(scope="module")
def model():
    return randomize(DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0)), seed=2, scale=0.1)


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in LENS]


@pytest.fixture(scope="module")
def slots3(model):
    return Sampler(model, weights="fp32", max_prompt_len=P, slots=3)


def _row(batch, i):
    """One request's result, layout-free: response tokens / logprobs / routing and the prompt's routing."""
    n = int(batch.lengths[i])
    pl = int(batch.prompt_lengths[i])  # the joined row [prompt | response | pad] (rl/batch.py)
    return (batch.tokens[i, :n], batch.logprobs[i, :n], batch.routing[i, :pl + n], n, batch.finish_reasons[i])


def _assert_same(a, b, bitwise=True):
    ta, la, ra, na, fa = a
    tb, lb, rb, nb, fb = b
    assert (na, fa) == (nb, fb)
    np.testing.assert_array_equal(ta, tb)
    np.testing.assert_array_equal(ra, rb)
    if bitwise:
        np.testing.assert_array_equal(la, lb)
    else:
        np.testing.assert_allclose(la, lb, atol=1e-5, rtol=0)


def test_continuous_equals_static_per_request(model, prompts):
    """One slot against the static path one request per call (the same shapes): bitwise; against one static
    batch of all requests: tokens, routing, lengths exact, logprobs to 1e-5 (XLA:CPU's GEMMs round a [B*P]-row
    prefill differently from a [P]-row one, so the static path itself is not bitwise batch-independent)."""
    static = Sampler(model, weights="fp32", max_prompt_len=P)
    one = Sampler(model, weights="fp32", max_prompt_len=P, slots=1)
    cont = one.generate(prompts, SP, seed=1, step=3, max_new_tokens_per_row=LIMITS)
    assert cont.lengths.tolist() != LIMITS, "the stop tokens must end some rows early"
    assert (cont.lengths <= np.array(LIMITS)).all() and "stop" in cont.finish_reasons
    for i, p in enumerate(prompts):
        alone = static.generate([p], SP, seed=1, step=3, prompt_index=[i], max_new_tokens_per_row=[LIMITS[i]])
        _assert_same(_row(alone, 0), _row(cont, i))
    batch = static.generate(prompts, SP, seed=1, step=3, max_new_tokens_per_row=LIMITS)
    for i in range(len(prompts)):
        _assert_same(_row(batch, i), _row(cont, i), bitwise=False)
    assert one.last_stats["rollout/slots_refilled"] == len(prompts) - 1


def test_result_independent_of_slot_and_batch(slots3, prompts):
    """Bitwise: the same request in another slot, order or batch (3 slots)."""
    ref = slots3.generate(prompts, SP, seed=1, step=3, max_new_tokens_per_row=LIMITS)
    perm = [3, 0, 4, 2, 1]
    shuf = slots3.generate([prompts[i] for i in perm], SP, seed=1, step=3, prompt_index=perm,
                           max_new_tokens_per_row=[LIMITS[i] for i in perm])
    for j, i in enumerate(perm):
        _assert_same(_row(shuf, j), _row(ref, i))
    rs = np.random.RandomState(7)  # another batch around requests 4 and 1 (same request bucket: no new compile)
    others = [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in (16, 2, 11)]
    sub = slots3.generate([others[0], prompts[4], others[1], prompts[1], others[2]], SP, seed=1, step=3,
                          prompt_index=[9, 4, 8, 1, 7], max_new_tokens_per_row=[16, LIMITS[4], 16, LIMITS[1], 16])
    _assert_same(_row(sub, 1), _row(ref, 4))
    _assert_same(_row(sub, 3), _row(ref, 1))
    other = slots3.generate(prompts, SP, seed=1, step=4, max_new_tokens_per_row=LIMITS)
    assert not np.array_equal(other.tokens, ref.tokens), "a new step must give new samples"


def test_slots_refilled_count(slots3, prompts):
    out = slots3.generate(prompts, SP, seed=1, step=3, max_new_tokens_per_row=LIMITS)
    st = slots3.last_stats
    assert st["rollout/slots_refilled"] == len(prompts) - 3  # 3 first admissions, then one refill per request
    # every decode step feeds each live slot one token: prompt + generated tokens' routing
    assert 0 < st["rollout/slot_utilisation"] <= 1
    busy = st["rollout/slot_utilisation"] * st["rollout/decode_steps"] * 3
    assert busy == pytest.approx(out.lengths.sum())  # each request occupies its slot for `length` decode steps
    assert st["rollout/decode_steps"] < out.lengths.sum()


def test_bad_input(model, slots3):
    per_slot = slots3.cache_bytes(sl.cache_len_for(CFG, P, 16))
    tight = Sampler(model, weights="fp32", max_prompt_len=P, slots=3, kv_budget_bytes=2.5 * per_slot)
    with pytest.raises(ValueError, match=r"--rollout-slots 3: .*room for 2 slots"):
        tight.generate([[5]], SP, seed=0)
    with pytest.raises(ValueError, match=r"prompt 0 has 17 tokens.*--max-prompt-len"):
        slots3.generate([[5] * 17], SP, seed=0)
    with pytest.raises(ValueError, match="max_new_tokens_per_row"):
        slots3.generate([[5]], SP, seed=0, max_new_tokens_per_row=[17])
    assert sl.plan_slots("auto", per_slot_bytes=100, budget_bytes=1050, seq_len=8) == 10
    assert sl.plan_slots(0, per_slot_bytes=100, budget_bytes=50, seq_len=8) == 0
    with pytest.raises(ValueError, match="--rollout-slots auto"):
        sl.plan_slots("auto", per_slot_bytes=100, budget_bytes=50, seq_len=8)
    with pytest.raises(ValueError, match="--rollout-slots"):
        RunConfig(**{"rollout.slots": "many"})
    assert RunConfig(**{"rollout.slots": "auto"}).rollout.slots == "auto"
    assert RunConfig(**{"rollout.slots": "4"}).rollout.slots == 4


def test_cache_len_rounds_to_compression_ratios():
    assert sl.cache_len_for(CFG, 64, 1024) == 1088  # tiny: ratios 4, 8 -> multiples of 8
    assert sl.cache_len_for(CFG, 13, 50) == 64
    flash = DSV4Config.preset("flash")
    assert sl.cache_len_for(flash, 1000, 3000) == 4096 and sl.cache_len_for(flash, 1000, 3100) == 4224


def test_run_config_slots_checked_against_the_plan():
    """--rollout-slots N larger than the memory plan's KV budget fails in build, before any model is made."""
    class _Plan:
        spec = parse_mesh_spec("actor:data=1")

    cfg = RunConfig(**{"rollout.slots": 10 ** 9, "rollout.max_new_tokens": 64})
    with pytest.raises(ValueError, match=r"--rollout-slots 1000000000: the memory plan leaves"):
        rollout_slots(cfg, CFG, _Plan(), 16)
    n, budget = rollout_slots(RunConfig(**{"rollout.slots": "auto", "rollout.prompts_per_step": 4,
                                            "rollout.group_size": 2}), CFG, _Plan(), 16)
    assert n == 8 and budget > 0  # auto: capped by the rows of a step
    assert rollout_slots(RunConfig(), CFG, _Plan(), 16) == (0, None)


def test_slot_caches_sharded_over_data_and_expert(model, prompts):
    """On a data=2 x expert=4 rollout mesh the slot caches are split like the static batch: each device holds 1/8
    of them (measured from the returned arrays' addressable shards); 3 slots round up to 8; results per request
    key equal the static path's on the same mesh: tokens, routing, lengths exact; logprobs to 1e-5 (measured
    <= 1e-6: on the mesh the slot program's replicated [1, P] prefill and the static path's batch-sharded one
    reach the expert-parallel MoE with different shapes, which XLA:CPU rounds differently)."""
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 4, 1), ("data", "fsdp", "expert", "tensor"))
    cont = Sampler(model, mesh=mesh, weights="fp32", max_prompt_len=P, slots=3)
    assert cont.batch_shards() == 8 and cont.slot_count() == 8
    out = cont.generate(prompts, SP, seed=1, step=3, max_new_tokens_per_row=LIMITS)
    total, per_dev = cont.last_cache_bytes
    assert total == 8 * cont.cache_bytes(sl.cache_len_for(CFG, P, SP.max_new_tokens))
    assert per_dev * 8 == total
    static = Sampler(model, mesh=mesh, weights="fp32", max_prompt_len=P)
    for i in (0, 3):  # one request per static call: a device's shapes are the slot program's ([1, P] rows)
        alone = static.generate([prompts[i]], SP, seed=1, step=3, prompt_index=[i],
                                max_new_tokens_per_row=[LIMITS[i]])
        assert static.last_cache_bytes[1] * 8 == static.last_cache_bytes[0]
        _assert_same(_row(alone, 0), _row(out, i), bitwise=False)


def test_rollout_ep_dispatch_knobs_reach_the_sampler():
    """`--rollout.ep_backend` / `--rollout.ep_capacity_factor` (RolloutConfig) pick the sampler's expert dispatch on
    an expert rollout mesh: auto = capacity on XLA:CPU (sized on GPUs, `parallel.expert.rollout_backend`), padded
    dropless or with a factor, sized. (The padded dispatch's math against the reference: tests/sharding/test_expert.py.)"""
    import jax
    from jax.sharding import Mesh

    from rl.config.rollout import RolloutConfig
    from rl.rollout.settings import EngineSettings

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 4, 1), ("data", "fsdp", "expert", "tensor"))
    abstract = abstract_model(CFG)
    for kw, name in ((dict(), "(capacity)"), (dict(ep_backend="padded"), "(padded)"),
                     (dict(ep_backend="padded", ep_capacity_factor=2.0), "(padded)"),
                     (dict(ep_backend="sized"), "(sized)")):
        s = Sampler(abstract, EngineSettings.for_run(RolloutConfig(dtype="fp32", **kw), platform="cpu",
                                                     max_prompt_len=P), mesh=mesh)
        assert name in s.dispatch_name and "expert=4" in s.dispatch_name
        assert s.settings.ep_capacity_factor == kw.get("ep_capacity_factor")
    with pytest.raises(ValueError, match=r"rollout.ep_capacity_factor \(--rollout.ep_capacity_factor\) must be > 0"):
        RolloutConfig(ep_capacity_factor=0.0)


def test_chunked_per_slot_prefill(model):
    """Prompts of up to 37 tokens (not multiples of the chunk 8, the window 8 or the ratios 4 / 8) prefilled per
    slot in chunks of 8 (`prefill_chunk=8`) against whole-prompt static prefill: tokens, routing and lengths
    exact, logprobs to 1e-5 (XLA:CPU rounds a chunk's GEMM rows differently; tests/dsv4/test_chunked.py)."""
    rs = np.random.RandomState(3)
    long = [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in (37, 5, 21, 1)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    chunked = Sampler(model, weights="fp32", max_prompt_len=40, slots=2, prefill_chunk=8)
    whole = Sampler(model, weights="fp32", max_prompt_len=40, prefill_chunk=0)
    a = chunked.generate(long, sp, seed=5)
    b = whole.generate(long, sp, seed=5)
    assert (a.prompt_tokens[:, -3:] == 0).all() and a.prompt_tokens.shape[1] == 64  # left-aligned layout
    for i in range(len(long)):
        _assert_same(_row(b, i), _row(a, i), bitwise=False)
    with pytest.raises(ValueError, match="--prefill-chunk 12"):
        Sampler(model, weights="fp32", prefill_chunk=12)
