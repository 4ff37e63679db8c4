"""Model FLOPs of the DeepSeek-V4 architecture per token, the yardstick that hardware FLOPs (XLA's, with the
remat policy's recompute) are measured against (benchmarks/learner_scale.py's MFU, launch/plan.py's roofline).

Per trained token (forward + backward = 3 x forward; rematerialised recompute NOT counted, as MFU is defined):
  matmul: 6 x (parameters of every float matrix a token goes through: attention and compressor / indexer
    projections, mHC, shared experts, router, lm head; routed experts x k / E; the embedding is a gather and the
    MTP block does not run in the RL step, so neither counts),
  attention: 6 x per layer 2 x heads x head_dim x ctx (QK^T and PV, one kv head), ctx = the entries a token
    attends: window + (CSA: index_topk; HCA: seq / (2 m), the mean over positions), plus CSA's indexer scoring
    6 x index_heads x index_head_dim x seq / (2 m).
Units: flops (multiply-adds count 2).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from dsv4 import DSV4Config, abstract_model
from dsv4.names import param_key


def train_flops_per_token(cfg: DSV4Config, seq: int) -> dict:
    """Model FLOPs of one trained token (forward + backward, no recompute) at sequence length `seq`: {"matmul",
    "attention", "total"} (the module docstring's formulas). A forward-only token (sampling) is a third of it."""
    abstract = abstract_model(cfg)
    k_frac = cfg.num_experts_per_tok / cfg.n_routed_experts
    params = 0.0
    for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        key = param_key(path)
        x = v.get_value()
        if len(x.shape) < 2 or not jnp.issubdtype(x.dtype, jnp.floating) or key.startswith(("mtp/", "embed/")):
            continue
        n = float(math.prod(x.shape))
        params += n * k_frac if "/ffn/experts/" in key else n
    attn = 0.0
    for m in cfg.compress_ratios[:cfg.num_hidden_layers]:
        ctx = min(cfg.sliding_window, seq)
        if m == cfg.csa_compress_ratio:
            ctx += min(cfg.index_topk, seq // m)
            attn += 2.0 * cfg.index_n_heads * cfg.index_head_dim * seq / (2 * m)
        elif m:
            ctx += seq / (2 * m)
        attn += 2.0 * 2 * cfg.num_attention_heads * cfg.head_dim * ctx
    out = {"matmul": 6.0 * params, "attention": 3.0 * attn}
    out["total"] = out["matmul"] + out["attention"]
    return out
