"""Helpers to build the transformers 5.23 DeepSeek-V4 reference on a tiny config with non-trivial weights."""

from __future__ import annotations

import numpy as np

from dsv4.config import DSV4Config


def hf_model(cfg: DSV4Config, seed: int = 0, dtype="float32", weight_std: float | None = 0.15):
    """A transformers `DeepseekV4ForCausalLM` for `cfg` with every parameter and buffer randomised:
    sinks, ape (position_bias), mHC base/scale, router bias and norm weights non-trivial; tid2eid a random
    distinct-expert table per token id. Matrices are N(0, weight_std^2); weight_std=None scales each by
    1/sqrt(fan_in) instead (keeps the 512-wide `small` config's activations finite; the benchmarks use it)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                 if k not in ("architectures", "model_type", "torch_dtype", "quantization_config",
                                              "expert_dtype", "compress_ratios", "use_cache")})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                        for _ in range(p.shape[0])]
                p.copy_(torch.stack(rows).to(p.dtype))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", "base", "e_score_correction_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(("fn", "hc_fn")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                std = 0.5 if p.ndim < 2 else weight_std if weight_std is not None else p.shape[-1] ** -0.5
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.to(getattr(torch, dtype))


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        kw = {}
        if attention_mask is not None:
            kw["attention_mask"] = torch.tensor(attention_mask)
        out = model(torch.tensor(ids, dtype=torch.long), use_cache=False, **kw)
    return out.logits.float().numpy()
