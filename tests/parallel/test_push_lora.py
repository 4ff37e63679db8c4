"""The LoRA push (`WeightPusher(only=dsv4.lora.is_adapter_key)`): only the adapters travel, verified, and the
rollout ends up with exactly the weight state a full push of the same model gives."""

import jax
import numpy as np
from flax import nnx

import dsv4
from dsv4 import quant
from dsv4.lora import LoraConfig, is_adapter_key
from parallel.push.local import WeightPusher
from rl.rollout.engine import Sampler
from sharding.mesh import build_mesh_plan

CFG = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
LORA = LoraConfig(rank=4, alpha=8.0)


def _host(ws):
    return {k: jax.device_get((w.q, w.scale) if isinstance(w, quant.QuantizedTensor) else w) for k, w in ws.items()}


def test_adapter_push_moves_only_the_adapters_and_equals_a_full_push():
    plan = build_mesh_plan("actor:fsdp=2,expert=2/rollout:expert=2,tensor=2", config=CFG)
    actor = dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(1), lora=LORA)  # the same base as the sampler's version 0
    ad = nnx.state(actor, nnx.LoRAParam)
    leaves, tdef = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    nnx.update(actor, jax.tree.unflatten(tdef, [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]))
    state = nnx.state(actor)
    state = jax.device_put(state, plan.param_shardings("actor", state))
    sampler = Sampler(dsv4.DSV4ForCausalLM(CFG, rngs=nnx.Rngs(1), lora=LORA), mesh=plan.rollout, weights="fp8",
                      max_prompt_len=16)
    v0 = _host(sampler.weight_state())
    lora = WeightPusher(plan, sampler, state, only=is_adapter_key)
    full = WeightPusher(plan, sampler, state)
    s_lora = lora.push(state, 1, verify=True)
    got = _host(sampler.weight_state())
    assert s_lora.verified and sampler.weight_version == 1
    assert s_lora.n_tensors == sum(is_adapter_key(k) for k in got) > 0
    for k, v in got.items():  # the base stays as stored; the adapters are new
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(v0[k])))
        assert same != is_adapter_key(k), k
    s_full = full.push(state, 2, verify=True)
    ref = _host(sampler.weight_state())
    for k in ref:
        for a, b in zip(jax.tree.leaves(got[k]), jax.tree.leaves(ref[k])):
            np.testing.assert_array_equal(a, b, err_msg=k)
    n_adapter_bytes = sum(np.asarray(got[k]).nbytes for k in got if is_adapter_key(k))
    assert s_lora.bytes == n_adapter_bytes < s_full.bytes
