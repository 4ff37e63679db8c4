"""LoRA learner (rl/algo/learner.py "LoRA"): only the adapters move and carry optimizer state, their gradient equals
the full model's gradient at the adapters, and a step resumed from `state_dict` is bitwise the same."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from dsv4.lora import LoraConfig, is_adapter_key
from rl.config.algo import LearnerConfig
from rl.algo.batch import TrainBatch
from rl.run.checkpoint import Checkpointer
from rl.algo.learner import Learner
from rl.algo.logprobs import token_logprobs

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(0, 4, 0))
LORA = LoraConfig(rank=4, alpha=8.0)
N, P, T = 8, 5, 5


@pytest.fixture(scope="module")
def model():
    m = dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32, lora=LORA)
    # non-zero B, so the adapters' A get a gradient too
    ad = nnx.state(m, nnx.LoRAParam)
    nnx.update(m, jax.tree.map(lambda x: x + 0.02 * jnp.ones_like(x), ad))
    return m


@pytest.fixture(scope="module")
def batch(model):
    rng = np.random.default_rng(0)
    am = np.ones((N, P + T), np.int32)
    rm = np.zeros((N, P + T), np.int32)
    rm[:, P:] = 1
    ids = rng.integers(1, CFG.vocab_size, (N, P + T)).astype(np.int32)
    lp = jax.jit(lambda i, m: token_logprobs(model, i, m)[0])(ids, am)
    return TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(am), response_mask=jnp.asarray(rm),
                      rollout_logprobs=lp * rm, advantages=jnp.asarray(rng.normal(size=N), jnp.float32))


def _flat(tree):
    return {"/".join(str(k) for k in p): np.array(v[...]) for p, v in nnx.to_flat_state(tree)}


def test_lora_step_moves_only_the_adapters_and_resumes_bitwise(model, batch, tmp_path):
    cfg = LearnerConfig(lr=1e-2, compute_dtype="float32", lora=LORA)  # scanned layers
    learner = Learner(model, cfg)
    before = _flat(learner.state.params)
    adapters = {k for k in before if "/lora/" in k}  # stacked paths (layers/<group>/<sub-layer>/...)
    assert adapters
    # optimizer state: Adam's two moments of the adapters, nothing for the base
    n_adapter = sum(before[k].size for k in adapters)
    n_opt = sum(x.size for x in jax.tree.leaves(learner.state.opt_state) if x.ndim > 0)
    assert n_opt == 2 * n_adapter
    d0 = learner.state_dict()
    assert set(_flat(d0["params"])) == adapters  # a LoRA checkpoint holds the adapters, not the frozen base
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2, fingerprint={"t": 1})
    ckpt.save(0, d0, {})
    ckpt.wait()
    m1 = learner.update(batch)
    assert float(m1["train/skipped_nonfinite"]) == 0 and float(m1["train/grad_norm"]) > 0
    after = _flat(learner.state.params)
    for k, v in after.items():
        if k in adapters:
            continue
        np.testing.assert_array_equal(v, before[k], err_msg=k)  # the base: bitwise unchanged
    assert all(not np.array_equal(after[k], before[k]) for k in adapters)
    learner.update(batch)
    two = jax.device_get(learner.state_dict())
    restored, _ = ckpt.restore(learner.state_dict())
    learner.load_state_dict(restored)  # resume from the step-0 checkpoint: the same two steps, bitwise
    learner.update(batch)
    learner.update(batch)
    for a, b in zip(jax.tree.leaves(jax.device_get(learner.state_dict())), jax.tree.leaves(two)):
        np.testing.assert_array_equal(a, b)
    # the push of adapters alone: per layer, official paths
    pushed = {"/".join(str(k) for k in p) for p, _ in nnx.to_flat_state(learner.adapters_for_push())}
    assert pushed and all(is_adapter_key(k) for k in pushed) and any(k.startswith("layers/1/") for k in pushed)


def test_adapter_gradient_equals_the_full_gradient_at_the_adapters(model, batch):
    lora = Learner(model, LearnerConfig(compute_dtype="float32", scan_layers=False, lora=LORA))
    full = Learner(model, LearnerConfig(compute_dtype="float32", scan_layers=False))  # everything trains
    _, g_lora, _ = lora.loss_and_grads(lora.state, batch)
    _, g_full, _ = full.loss_and_grads(full.state, batch)
    gl, gf = _flat(g_lora), _flat(g_full)
    for k in gl:
        if "/lora/" in k:
            np.testing.assert_allclose(gl[k], gf[k], rtol=1e-5, atol=1e-7, err_msg=k)
        else:
            assert not gl[k].any(), k  # no base gradient at all
    assert any(gf[k].any() for k in gf if "/lora/" not in k)


def test_lora_learner_refuses_a_model_without_adapters():
    plain = dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="--learner.lora.rank 4"):
        Learner(plain, LearnerConfig(lora=LORA))
