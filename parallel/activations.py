"""Activation memory of one learner step per device: the planner's estimate (parallel/plan.py adds it to the actor).

Activation estimate for T = tokens per device in one micro-batch, S = sequence length, as the learner runs
(`--remat block`: only each layer's input is kept, the layer is recomputed in the backward; blocked attention,
dsv4/blocked.py; log-probs in chunks of 1024 positions), tp = tensor size, L = main layers (the learner never runs
the MTP block), R = expert-FFN rows per local token on a rank (`ep_rows_per_token`: "padded" min(f * k, E), dropless
E; "capacity" min(ep, f) * k; "ragged" ep * k dropless or f * k; f = --ep-capacity-factor, k = experts per
token):
    saved layer inputs   L * T * n_hc * D * 2                        the [n_hc, D] bf16 residual streams
    one layer's backward T * [ 4 * H * d * 4 / tp                    q, attention output and their grads (f32)
                             + 2 * H * (W + 128 + topk) * 4 / tp     blocked attention logits + probs per query
                                                                     (window + one query block + CSA top-k), f32
                             + 2 * R * (8 * D + 4 * D + 14 * I / tp) EP rows: sent / received / returned (bf16),
                                                                     y (f32), h1 / h3 (f32) and h (bf16), fwd + bwd
                             + 6 * n_hc * D * 4 ]                    mHC f32 temporaries
                         + rows * min(S, 1024) * 3 * V * 4 / tp      one log-prob chunk: logits, lse, grad (f32)
    gathered weights     2 * (largest layer's weights gathered over data x fsdp x context) + the head gathered:
                         FSDP's all-gather for the recompute and the weight grads before their reduce-scatter.
Context parallelism (`context` = C > 1 on the actor, dsv4/context.py): T stays the tokens *per device*, so a row of
S tokens covers C devices with S / C each (rows per micro-batch = T C / S; the log-prob chunk is over the S / C
local positions), weights and optimizer state are split over fsdp x context like FSDP, and one item is added:
    gathered comp. KV    rows * 2 * (max over layers of (S / m) * (d * 2 + CSA: d_I * 4) + (W - 1) * d * 2)
                         the all-gathered compressed entries (+ CSA indexer keys) of the whole sequence and the
                         sliding-window halo, value and gradient (`context_gathered`).
Tests: tests/sharding/test_plan.py.
"""

from __future__ import annotations

import math

from sharding import rules as rl

EP_BACKENDS = ("capacity", "ragged", "padded", "sized")  # parallel.expert.BACKENDS
BLOCK_Q = 128  # dsv4.attention.Attention(block_q=): queries per block of the blocked attention
LOGPROB_CHUNK = 1024  # rl.config.algo.LearnerConfig.logprob_chunk_size default


def ep_rows_per_token(cfg, sizes: dict[str, int], ep_backend: str, ep_capacity: float | None) -> float:
    """Expert-FFN rows per local token on one rank (parallel/expert.py's buffers), k = picks per token:
    padded: min(f * k, E) (dropless: E, every expert's buffer sized for all local tokens, `padded_capacity`);
    sized: padded's, its largest compiled capacity (the memory bound; a balanced call runs ~k);
    capacity: ep * C / T = min(ep, f) * k;
    ragged: its receive buffer, ep * k dropless or f * k."""
    k, ep, e = cfg.num_experts_per_tok, sizes[rl.EXPERT], cfg.n_routed_experts
    if ep_backend in ("padded", "sized"):
        return e if ep_capacity is None else min(ep_capacity * k, e)
    if ep_backend == "capacity":
        return k * (ep if ep_capacity is None else min(ep_capacity, ep))
    return k * (ep if ep_capacity is None else ep_capacity)


def actor_activations(cfg, sizes: dict[str, int], tokens: int, seq_len: int, ep_capacity: float | None,
                       ep_backend: str = "ragged") -> float:
    """Bytes per device of one layer's backward working set plus one log-prob chunk (module docstring formula:
    the per-token terms other than the saved layer inputs, and the chunk)."""
    tp, cp = sizes[rl.TENSOR], sizes.get(rl.CONTEXT, 1)
    d, n, h, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
    i_ = cfg.moe_intermediate_size / tp
    rows = ep_rows_per_token(cfg, sizes, ep_backend, ep_capacity)
    keys = cfg.sliding_window + BLOCK_Q + (cfg.index_topk if cfg.csa_compress_ratio in cfg.compress_ratios else 0)
    per_tok = (4 * h * hd * 4 / tp                       # q, attention output and their grads (f32), one layer
               + 2 * h * keys * 4 / tp                   # blocked attention: logits + probs per query (f32)
               + 2 * rows * (4 * d * 2 + d * 4 + 3 * i_ * 4 + i_ * 2)  # EP rows: sent/received/back (bf16),
                                                          # y (f32), h1/h3/h (f32, bf16), fwd + bwd
               + 6 * n * d * 4)                          # mHC f32 temporaries
    n_rows = max(1, math.ceil(tokens * cp / seq_len))  # context parallelism: a row's S tokens over cp devices
    logits = n_rows * min(seq_len // cp, LOGPROB_CHUNK) * 3 * cfg.vocab_size * 4 / tp  # one chunk: logits, lse, grad
    return tokens * per_tok + logits


def context_gathered(cfg, sizes: dict[str, int], tokens: int, seq_len: int) -> float:
    """Bytes per device that context parallelism adds (dsv4/context.py), for the largest layer: the all-gathered
    compressed entries of the whole sequence (bf16 [S/m, d]) and, CSA, the indexer's keys (f32 [S/m, d_I]), value
    and gradient (x 2), plus the sliding-window halo ((window - 1) keys/values, bf16, and its gradient), per row
    (rows = tokens * cp / S). 0 without a context axis (> 1)."""
    cp = sizes.get(rl.CONTEXT, 1)
    if cp <= 1:
        return 0.0
    n_rows = max(1, math.ceil(tokens * cp / seq_len))
    per_layer = [0.0]
    for i in range(cfg.num_hidden_layers):
        m = cfg.compress_ratios[i]
        if m:
            keys = cfg.index_head_dim * 4 if m == cfg.csa_compress_ratio else 0
            per_layer.append(seq_len // m * (cfg.head_dim * 2 + keys))
    halo = (cfg.sliding_window - 1) * cfg.head_dim * 2
    return n_rows * 2 * (max(per_layer) + halo)


def saved_layer_inputs(cfg, tokens: int, itemsize: int = 2) -> float:
    """Bytes per device of the remat'd layers' saved inputs: every main layer's [n_hc, D] streams per token in the
    compute dtype (bf16: 2). The learner never runs the MTP block (`rl.algo.logprobs.token_logprobs`)."""
    return cfg.num_hidden_layers * tokens * cfg.hc_mult * cfg.hidden_size * itemsize
