"""LoRA adapters (dsv4/lora.py): attached adapters start as the identity; the unmerged forward equals the merged
weights' forward; the knobs' errors name the flag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from dsv4 import DSV4Config, DSV4ForCausalLM
from dsv4.io.convert import hf_to_official
from dsv4.io.peft import load_peft_adapters, save_peft_adapters
from dsv4.lora import LoraConfig, has_adapters, is_adapter_key, merged_params
from dsv4.names import param_key


def _flat(state):
    return {param_key(p): v.get_value() for p, v in nnx.to_flat_state(state)}


def _randomize_adapters(model, seed=1, std=0.05):
    """Non-zero B (and A) so the adapters change the output."""
    ad = nnx.state(model, nnx.LoRAParam)
    leaves, tdef = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(tdef, new))


def test_lora_identity_at_init_and_merged_equals_unmerged():
    cfg = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8, 0))  # a CSA and an HCA layer
    lcfg = LoraConfig(rank=4, alpha=8.0, targets="attn,shared,experts,head")
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    base = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0))
    adapted = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), lora=lcfg)
    assert has_adapters(adapted) and not has_adapters(base)
    keys = [k for k in _flat(nnx.state(adapted, nnx.LoRAParam))]
    assert keys and all(is_adapter_key(k) for k in keys)
    # per layer: 5 attention + 3 shared-expert adapters (a, b) + 3 expert pairs; the head's; MTP gets none
    assert len(keys) == cfg.num_hidden_layers * (2 * 8 + 6) + 2
    assert not any(k.startswith("mtp") for k in keys)
    # the base weights are the same values (the adapters are created after the base, from the same stream)
    fb, fa = _flat(nnx.state(base, nnx.Param)), _flat(nnx.state(adapted, nnx.Param))
    assert all(np.array_equal(fb[k], fa[k]) for k in fb)

    fwd = jax.jit(lambda m, x: m(x).logits)
    ref = fwd(base, ids)
    np.testing.assert_array_equal(np.asarray(fwd(adapted, ids)), np.asarray(ref))  # B = 0: exactly the base

    _randomize_adapters(adapted)
    out = fwd(adapted, ids)
    assert float(jnp.max(jnp.abs(out - ref))) > 1e-3  # the adapters act
    merged = merged_params(_flat(nnx.state(adapted)), lcfg)
    assert set(merged) == set(_flat(nnx.state(base)))
    nnx.update(base, nnx.from_flat_state({tuple(int(p) if p.isdigit() else p for p in k.split("/")): v
                                          for k, v in merged.items()}))
    np.testing.assert_allclose(np.asarray(fwd(base, ids)), np.asarray(out), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kw, flag", [(dict(rank=-1), "--learner.lora.rank"), (dict(alpha=0.0), "--learner.lora.alpha"),
                                      (dict(targets="attn,mlp"), "--learner.lora.targets")])
def test_lora_config_errors_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        LoraConfig(**kw)


def test_peft_export_reads_back_equal(tmp_path):
    cfg = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(0, 4, 0))
    lcfg = LoraConfig(rank=4, alpha=8.0, targets="attn,shared,experts,head")
    model = DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), lora=lcfg)
    _randomize_adapters(model)
    out = save_peft_adapters(model, tmp_path / "adapter", base_model_name_or_path="random:tiny")
    flat, got_cfg = load_peft_adapters(out)
    want = _flat(nnx.state(model, nnx.LoRAParam))
    assert got_cfg == lcfg and set(flat) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(flat[k], np.asarray(v), err_msg=k)
    names = load_file(str(out / "adapter_model.safetensors"))
    a = names["base_model.model.model.layers.1.self_attn.q_a_proj.lora_A.weight"]
    assert a.shape == (4, cfg.hidden_size)  # PEFT: lora_A [r, in], lora_B [out, r]
    assert names["base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_B.weight"].shape == (cfg.hidden_size, 4)
    assert names["base_model.model.lm_head.lora_B.weight"].shape == (cfg.vocab_size, 4)
    for n in names:  # the module names are the transformers names our checkpoint reader maps to ours
        module = n[len("base_model.model."):].rsplit(".lora_", 1)[0]
        off = hf_to_official(module + ".weight")
        if ".experts." not in module and module != "lm_head":
            assert f"{off[:-len('.weight')].replace('.', '/')}/lora/lora_a" in want, (n, off)
