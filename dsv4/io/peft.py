"""LoRA adapters in Hugging Face PEFT's layout: `adapter_model.safetensors` + `adapter_config.json`.

    save_peft_adapters(model, "out/adapter")          # the adapters of a model with dsv4/lora.py adapters
    flat, lora_cfg = load_peft_adapters("out/adapter")   # {nnx path key: np.ndarray}, LoraConfig

Names: PEFT prefixes the wrapped model's module path with `base_model.model.` and names the two factors
`lora_A.weight` [r, in] and `lora_B.weight` [out, r] (delta W = (lora_alpha / r) B A on a weight [out, in]). Module
paths are the transformers DeepSeek-V4 names (the ones `dsv4.io.convert.hf_to_official` reads): `layers.N.attn.wq_a`
-> `model.layers.N.self_attn.q_a_proj` (q_b_proj, kv_proj, o_a_proj, o_b_proj), `layers.N.ffn.shared_experts.w1|w3|w2`
-> `model.layers.N.mlp.shared_experts.gate_proj|up_proj|down_proj`, the head `head` -> `lm_head`, and per-expert
adapters of the routed experts `model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj`. Caveat on the last: that
is the per-expert-module layout (DeepSeek-V3-style checkpoints); transformers 5.23's `DeepseekV4Experts` holds fused
3-D parameters (`gate_up_proj` [E, 2I, D], `down_proj`), which PEFT adapts through `target_parameters` with another
tensor layout, not written here. The attention, shared-expert and head names are modules transformers' DeepSeek-V4
has. Ours: `lora_a` [in, r] = lora_A.weight.T, `lora_b` [r, out] = lora_B.weight.T; experts `w1_a` [E, in, r].

`adapter_config.json` holds PEFT's LoraConfig fields (peft_type LORA, r, lora_alpha, target_modules, ...) and, under
`dsv4`, our `LoraConfig.targets` and the base checkpoint it applies to (`base_model_name_or_path`, as given).
Tensors are float32. Tests: tests/dsv4/test_lora.py (written, read back equal, names readable by `hf_to_official`).
"""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from dsv4.io.safetensors import save_safetensors
from dsv4.lora import ADAPTER_KEY, LoraConfig
from dsv4.names import param_key

ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."
_ATTN = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LINEAR = re.compile(r"^layers/(\d+)/(attn/(wq_a|wq_b|wkv|wo_a|wo_b)|ffn/shared_experts/(w[123]))$")
_PEFT = re.compile(r"^base_model\.model\.(?:model\.layers\.(\d+)\.(?:self_attn\.(\w+)|mlp\.shared_experts\.(\w+)|"
                   r"mlp\.experts\.(\d+)\.(\w+))|lm_head)\.lora_(A|B)\.weight$")


def hf_module(module: str, expert: int | None = None, w: str | None = None) -> str:
    """Our module path ("layers/0/attn/wq_a", "layers/1/ffn/shared_experts/w1", or "layers/1/ffn/experts" with
    `expert` and `w`) -> the transformers module name ("model.layers.0.self_attn.q_a_proj", ...)."""
    if expert is not None:
        n = module.split("/")[1]
        return f"model.layers.{n}.mlp.experts.{expert}.{_FFN[w]}"
    if module == "head":
        return "lm_head"
    m = _LINEAR.match(module)
    if m is None:
        raise ValueError(f"no PEFT name for the adapted module {module!r}")
    if m.group(3):
        return f"model.layers.{m.group(1)}.self_attn.{_ATTN[m.group(3)]}"
    return f"model.layers.{m.group(1)}.mlp.shared_experts.{_FFN[m.group(4)]}"


def adapter_tensors(flat: dict) -> dict[str, np.ndarray]:
    """{our adapter key: array} -> {PEFT tensor name: float32 numpy array} (factors transposed to [r, in] / [out, r];
    routed-expert adapters split per expert)."""
    out = {}
    for k, v in flat.items():
        m = ADAPTER_KEY.match(k)
        if m is None:
            continue
        v = np.asarray(v, np.float32)
        if m.group(1) is not None:
            out[f"{PREFIX}{hf_module(m.group(1))}.lora_{m.group(2).upper()}.weight"] = np.ascontiguousarray(v.T)
        else:
            for e in range(v.shape[0]):
                name = f"{PREFIX}{hf_module(m.group(3), e, m.group(4))}.lora_{m.group(5).upper()}.weight"
                out[name] = np.ascontiguousarray(v[e].T)
    return out


def save_peft_adapters(model_or_flat, path, *, lora: LoraConfig | None = None,
                       base_model_name_or_path: str | None = None) -> pathlib.Path:
    """Write the adapters of `model_or_flat` (a DSV4ForCausalLM with adapters, or {key: array} with `lora`) to the
    directory `path` (created) in PEFT's layout. Raises ValueError when there are no adapters."""
    if isinstance(model_or_flat, nnx.Module):
        lora = model_or_flat.lora
        flat = {param_key(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model_or_flat, nnx.LoRAParam))}
    else:
        flat = dict(model_or_flat)
    tensors = adapter_tensors(flat)
    if not tensors or lora is None:
        raise ValueError("save_peft_adapters: the model holds no LoRA adapters")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(path / ADAPTER_FILE, tensors, metadata={"format": "pt"})
    modules = sorted({n[len(PREFIX):].rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in tensors})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
           "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
           "target_modules": modules, "base_model_name_or_path": base_model_name_or_path,
           "dsv4": {"targets": lora.targets}}
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def load_peft_adapters(path) -> tuple[dict[str, np.ndarray], LoraConfig]:
    """Read a directory written by `save_peft_adapters` -> ({our adapter key: float32 array}, LoraConfig).
    Raises ValueError naming a tensor PEFT's layout here does not cover."""
    path = pathlib.Path(path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    lora = LoraConfig(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                      targets=cfg.get("dsv4", {}).get("targets", "attn,shared"))
    attn, ffn = {v: k for k, v in _ATTN.items()}, {v: k for k, v in _FFN.items()}
    flat: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, x in load_file(str(path / ADAPTER_FILE)).items():
        m = _PEFT.match(name)
        if m is None:
            raise ValueError(f"{path / ADAPTER_FILE}: unexpected tensor {name!r}")
        n, ab = m.group(1), m.group(6).lower()
        if n is None:
            flat[f"head/lora/lora_{ab}"] = x.T
        elif m.group(2):
            flat[f"layers/{n}/attn/{attn[m.group(2)]}/lora/lora_{ab}"] = x.T
        elif m.group(3):
            flat[f"layers/{n}/ffn/shared_experts/{ffn[m.group(3)]}/lora/lora_{ab}"] = x.T
        else:
            experts.setdefault(f"layers/{n}/ffn/experts/lora/{ffn[m.group(5)]}_{ab}", {})[int(m.group(4))] = x.T
    for k, per in experts.items():
        flat[k] = np.stack([per[e] for e in range(len(per))])
    return flat, lora


__all__ = ["ADAPTER_FILE", "CONFIG_FILE", "adapter_tensors", "hf_module", "load_peft_adapters", "save_peft_adapters"]
