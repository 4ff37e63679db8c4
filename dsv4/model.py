"""DeepSeek-V4 causal LM in Flax NNX: embed -> 4 mHC streams -> blocks -> hyper head -> norm -> head (spec §3).

Module attribute names follow the official checkpoint keys, so the NNX path `layers/3/attn/wq_a/weight` is the
official key `layers.3.attn.wq_a.weight` (only the stacked experts differ: see `dsv4/io/convert.py`).

Padding: `attention_mask` [B, S] may mark left (or right) padding. Rows that start at column 0 (the RL
layout `[prompt | response | pad]`, rl/batch.py) run as they are with `left_aligned=True`: positions 0.., no
per-row roll (the learner's path). Otherwise (outside callers with left-padded rows, e.g. the transformers parity
tests) each row is left-aligned internally (rolled so its first real token sits at position 0), run with
positions 0.., and rolled back; for rows already at column 0 both paths give the same values bitwise. Because the
model is causal and compressed entries pool only complete windows of real tokens, every real token's logits
equal those of the row run alone. (transformers 5.23 instead pools left-pad tokens into compressed entries.)

Context parallelism: under a rule table that splits `act_seq` over a mesh axis of size C (the actor's `context`),
S is padded at the end to a multiple of C x the lcm of the compression ratios (`dsv4.context.seq_multiple`) and
the outputs cut back; the attention runs split (`dsv4.context`), everything else is per token.

Routing record and replay: the output carries `routing` [B, S, L, k] int32 (expert ids of every main MoE
layer; -1 at padding). Passing it back as `routing_replay` forces the same experts (spec: issue "routing
replay"; hash layers included).

Memory options (static, set at construction; the learner passes its own): `attention_impl` ("blocked": memory
linear in S, the default; "dense": the reference, see `dsv4.attention`), its block sizes, and `remat`, the
per-layer rematerialisation policy of the full-sequence forward under differentiation (`REMAT_POLICIES`):
"none" keeps every activation for the backward; "block" keeps only each layer's input streams and recomputes
the layer in the backward (`jax.checkpoint`); "dots" also keeps the outputs of the weight matmuls (dots without
batch dimensions; `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`). All give the same values and
gradients; they trade memory for recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dsv4.attention import ATTENTION_IMPLS, Attention
from dsv4.config import DSV4Config
from dsv4.context import context_axis, seq_multiple
from dsv4.layers import Linear, RMSNorm, dot_out, param
from dsv4.lora import LoraConfig, attach
from dsv4.mhc import hc_head, hc_post, hc_pre
from dsv4.moe import MoE
from sharding import axes as ax
from sharding.rules import constrain

_STREAMS = (ax.ACT_BATCH, ax.ACT_SEQ, None, ax.ACT_EMBED)  # [B, S, n, D] residual streams
REMAT_POLICIES = ("block", "dots", "none")
# a path's attention inside `Block.step`: (attn, normalised block input [B, S, D]) -> (out [B, S, D], state)
AttendFn = Callable[[Attention, jax.Array], tuple[jax.Array, Any]]


def remat_policy(name: str):
    """`--remat` name -> (apply checkpoint?, jax.checkpoint policy). Raises ValueError naming `--remat`."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"--remat must be one of {'|'.join(REMAT_POLICIES)}, got {name!r}")
    if name == "none":
        return False, None
    return True, (None if name == "block" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


@struct.dataclass
class DSV4Output:
    """Model output.

    logits: [B, S, V] float32. routing: [B, S, L, k] int32 expert ids per main MoE layer (-1 at padding).
    mtp_logits: [B, S, V] float32 or None: MTP head logits at position t (predicting token t+2; fed the
      embedding of token t+1, the DeepSeek-V3 convention) when `return_mtp=True`.
    hidden: [B, S, D] final normalised hidden state when `return_hidden=True`, else None.
    expert_drops: [2] int32 (expert pairs dropped, pairs routed), summed over the main MoE layers (padding tokens
      included: they take buffer slots too), by a `dispatch_fn` that can drop (a capacity factor:
      `parallel.expert.make_ep_dispatch`); constant zeros otherwise.
    """

    logits: jax.Array
    routing: jax.Array
    mtp_logits: jax.Array | None = None
    hidden: jax.Array | None = None
    expert_drops: jax.Array | None = None


class Block(nnx.Module):
    """One decoder layer: mHC(attn) + attention, mHC(ffn) + MoE. Names as official `layers.i.*`."""

    def __init__(self, cfg: DSV4Config, layer_idx: int, *, rngs, param_dtype, dtype, **attn_options):
        n, dm = cfg.hc_mult, cfg.hidden_size
        mix = (2 + n) * n
        std = cfg.initializer_range
        self.cfg_hc = (n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", param(rngs, (mix, n * dm), (ax.HC, None), dtype=jnp.float32, std=std))
            setattr(self, f"hc_{site}_base", param(rngs, (mix,), (ax.HC,), dtype=jnp.float32, init="zeros"))
            setattr(self, f"hc_{site}_scale", param(rngs, (3,), (None,), dtype=jnp.float32, init="ones"))
        self.attn_norm = RMSNorm(dm, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.ffn_norm = RMSNorm(dm, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn = Attention(cfg, layer_idx, rngs=rngs, param_dtype=param_dtype, dtype=dtype, **attn_options)
        self.ffn = MoE(cfg, layer_idx, rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    def _pre(self, x: jax.Array, site: str):
        """mHC pre-mix of site "attn" | "ffn": streams x [B, S, n, D] -> (block input y [B, S, D], post, comb)
        (`dsv4.mhc.hc_pre` with this block's weights; `hc_post` takes post and comb back)."""
        n, iters, hc_eps, eps = self.cfg_hc
        return hc_pre(x, getattr(self, f"hc_{site}_fn")[...], getattr(self, f"hc_{site}_base")[...],
                      getattr(self, f"hc_{site}_scale")[...], n=n, iters=iters, hc_eps=hc_eps, norm_eps=eps)

    def step(self, x: jax.Array, token_ids: jax.Array, attend: AttendFn, forced_ids: jax.Array | None = None,
             dispatch_fn=None):
        """The one body of a decoder layer, shared by every path (full forward, `dsv4.scan`, prefill, decode,
        chunked prefill, speculative verify, MTP): mHC(attn) -> attn_norm -> attention -> mHC(ffn) -> ffn_norm
        -> MoE, each mHC post-mix adding the residual.

        x [B, S, n, D] streams; token_ids [B, S] int32 (hash routing). attend: (attn, h [B, S, D]) -> (out [B, S, D],
        state): how this path's attention reads / writes its cache (`state` is handed back untouched: the new
        cache, the prefill's aux tensors, the verify's pending state, or None). forced_ids [B, S, k] int32: routing
        replay (entries < 0 route freely; None = route freely). dispatch_fn: routed-expert implementation
        (`dsv4.moe.MoE`). Returns (x' [B, S, n, D], routing ids [B, S, k] int32, state, drops [2] int32: the
        MoE's (pairs dropped, pairs routed), zeros unless the dispatch can drop)."""
        y, post, comb = self._pre(x, "attn")
        a, state = attend(self.attn, self.attn_norm(y))
        x = hc_post(x, a, post, comb)
        y, post, comb = self._pre(x, "ffn")
        f, ids, drops = self.ffn(self.ffn_norm(y), token_ids, forced_ids, dispatch_fn)
        return hc_post(x, f, post, comb), ids, state, drops

    def __call__(self, x, positions, token_ids, forced_ids=None, dispatch_fn=None):
        """Full-sequence layer: x [B, S, n, D] streams at positions [B, S] -> (x' [B, S, n, D], (routing ids
        [B, S, k], drops [2])): `step` with the plain attention over the sequence itself."""
        x, ids, _, drops = self.step(x, token_ids, lambda attn, h: (attn(h, positions), None), forced_ids,
                                     dispatch_fn)
        return x, (ids, drops)


def block_step(layer: Block, x, positions, token_ids, forced_ids=None, dispatch_fn=None):
    """One step of the full-sequence layer loop (the Python loop and `dsv4.scan.run_layers` both run it):
    x [B, S, n, D] -> (x' [B, S, n, D] constrained to the stream layout, (routing ids [B, S, k] int32, drops [2]
    int32: `Block.step`'s))."""
    x, routes = layer(x, positions, token_ids, forced_ids, dispatch_fn)
    return constrain(x, _STREAMS), routes


class MTPBlock(Block):
    """Multi-token-prediction block `mtp.0.*` (spec §7): a sliding, learned-routing layer with its own
    `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and `hc_head_*`; shares `embed` and `head` with the model."""

    def __init__(self, cfg: DSV4Config, layer_idx: int, *, rngs, param_dtype, dtype, **attn_options):
        super().__init__(cfg, layer_idx, rngs=rngs, param_dtype=param_dtype, dtype=dtype, **attn_options)
        dm, n, std = cfg.hidden_size, cfg.hc_mult, cfg.initializer_range
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype, std=std)
        self.e_proj = Linear(dm, dm, (ax.EMBED, None), **kw)
        self.h_proj = Linear(dm, dm, (ax.EMBED, None), **kw)
        self.enorm = RMSNorm(dm, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.hnorm = RMSNorm(dm, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.norm = RMSNorm(dm, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.hc_head_fn = param(rngs, (n, n * dm), (ax.HC, None), dtype=jnp.float32, std=std)
        self.hc_head_base = param(rngs, (n,), (ax.HC,), dtype=jnp.float32, init="zeros")
        self.hc_head_scale = param(rngs, (1,), (None,), dtype=jnp.float32, init="ones")

    def inputs(self, e: jax.Array, h: jax.Array) -> jax.Array:
        """The block's input streams X~ = e_proj(enorm(e)) + h_proj(hnorm(h)) (spec §7): e [B, S, D] the embedding
        of the next token, h [B, S, n, D] the trunk's final streams -> [B, S, n, D] in h's dtype."""
        return (self.e_proj(self.enorm(e))[:, :, None, :] + self.h_proj(self.hnorm(h))).astype(h.dtype)


class DSV4ForCausalLM(nnx.Module):
    """DeepSeek-V4 causal LM.

    Args:
      config: DSV4Config. rngs: nnx.Rngs for initialisation.
      param_dtype: storage dtype of weights (float32 or bfloat16). The mHC parameters, sinks, `ape` and the
        router bias are always float32 (as in the checkpoint).
      dtype: compute dtype of matmuls (bfloat16 or float32). Norms, mHC, router, compressor pooling, softmax
        and RoPE always run in float32.
      attention_impl: "blocked" (memory-linear, default) or "dense" (reference). attn_block_q / attn_block_k:
        query block and compressed-entry block sizes of the blocked path.
      remat: "none" (default here), "block" or "dots": see the module docstring (the learner sets `--remat`).
      lora: None, or a `dsv4.lora.LoraConfig` with rank > 0: LoRA adapters on its targets (`dsv4.lora.attach`).
    Raises:
      ValueError: unknown attention_impl or remat (the message names the option).
    """

    def __init__(self, config: DSV4Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
                 attention_impl: str = "blocked", attn_block_q: int = 128, attn_block_k: int = 512,
                 remat: str = "none", lora: LoraConfig | None = None):
        cfg = config
        remat_policy(remat)
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
        self.config = cfg
        self.dtype = dtype
        self.attention_impl, self.attn_block_q, self.attn_block_k = attention_impl, attn_block_q, attn_block_k
        self.remat = remat
        opts = dict(impl=attention_impl, block_q=attn_block_q, block_k=attn_block_k)
        std = cfg.initializer_range
        dm, n = cfg.hidden_size, cfg.hc_mult
        self.embed = _Table(param(rngs, (cfg.vocab_size, dm), (ax.VOCAB, ax.EMBED), dtype=param_dtype, std=std))
        self.layers = nnx.List([Block(cfg, i, rngs=rngs, param_dtype=param_dtype, dtype=dtype, **opts)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(dm, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.head = _Table(param(rngs, (cfg.vocab_size, dm), (ax.VOCAB, ax.EMBED), dtype=param_dtype, std=std))
        self.hc_head_fn = param(rngs, (n, n * dm), (ax.HC, None), dtype=jnp.float32, std=std)
        self.hc_head_base = param(rngs, (n,), (ax.HC,), dtype=jnp.float32, init="zeros")
        self.hc_head_scale = param(rngs, (1,), (None,), dtype=jnp.float32, init="ones")
        self.mtp = nnx.List([MTPBlock(cfg, cfg.num_hidden_layers + j, rngs=rngs, param_dtype=param_dtype, dtype=dtype,
                                      **opts) for j in range(cfg.num_nextn_predict_layers)])
        self.lora = None  # the LoraConfig of the attached adapters (set by dsv4.lora.attach)
        if lora is not None and lora.enabled:
            attach(self, lora, rngs)

    def build_options(self, **overrides) -> dict:
        """The static constructor options of this model (attention_impl, block sizes, remat, lora), with overrides:
        `type(m)(m.config, rngs=..., **m.build_options(remat="block"))` rebuilds it with another remat."""
        opts = dict(attention_impl=self.attention_impl, attn_block_q=self.attn_block_q,
                    attn_block_k=self.attn_block_k, remat=self.remat, lora=self.lora)
        opts.update(overrides)
        return opts

    def set_options(self, *, attention_impl: str | None = None, attn_block_q: int | None = None,
                    attn_block_k: int | None = None, remat: str | None = None) -> "DSV4ForCausalLM":
        """Change the static options in place (e.g. on an `nnx.clone`); None keeps the current value.
        Returns self. Raises ValueError on an unknown attention_impl / remat."""
        o = self.build_options(**{k: v for k, v in dict(attention_impl=attention_impl, attn_block_q=attn_block_q,
                                                       attn_block_k=attn_block_k, remat=remat).items()
                                  if v is not None})
        remat_policy(o["remat"])
        if o["attention_impl"] not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {o['attention_impl']!r}")
        self.attention_impl, self.attn_block_q, self.attn_block_k, self.remat = (
            o["attention_impl"], o["attn_block_q"], o["attn_block_k"], o["remat"])
        for blk in [*self.layers, *self.mtp]:
            blk.attn.impl, blk.attn.block_q, blk.attn.block_k = (o["attention_impl"], int(o["attn_block_q"]),
                                                                 int(o["attn_block_k"]))
        return self

    # ------------------------------------------------------------------ pieces (reused by the sampler)
    def embed_tokens(self, ids: jax.Array, detached: bool = False) -> jax.Array:
        """ids [...] -> [..., D] in the compute dtype (no scaling); detached: no gradient to the table. The table is
        gathered over the axes that split its hidden dim (the actor's FSDP), as a layer's weights are, so that the
        looked-up rows come out sharded like `ids` (the batch) and their hidden dim whole, as the residual streams
        are: a gather from the FSDP-split table would come out hidden-split, and SPMD turns that into the streams'
        layout only by replicating the whole [B, S, D] ("Involuntary full rematerialization", once for the lookup
        and twice in its gradient)."""
        table = constrain(self.embed.weight[...], (ax.VOCAB, None))
        return (jax.lax.stop_gradient(table) if detached else table)[ids].astype(self.dtype)

    def collapse(self, x: jax.Array, owner=None) -> jax.Array:
        """Hyper head + final norm: streams [..., n, D] -> [..., D]."""
        owner = owner or self
        c = self.config
        h = hc_head(x, owner.hc_head_fn[...], owner.hc_head_base[...], owner.hc_head_scale[...], n=c.hc_mult,
                    hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps)
        return owner.norm(h)

    def lm_head(self, h: jax.Array, detached: bool = False) -> jax.Array:
        """h [..., D] -> logits [..., V] float32; detached: no gradient to the head weights."""
        w = constrain(self.head.weight[...], (ax.VOCAB, None))  # gathered over its FSDP-split D, as `embed_tokens`
        w = jax.lax.stop_gradient(w) if detached else w
        logits = jnp.einsum("...d,vd->...v", h.astype(self.dtype), w.astype(self.dtype),
                            preferred_element_type=dot_out(self.dtype)).astype(jnp.float32)
        if self.head.lora is not None:  # LoRA on the head (dsv4.lora, target "head")
            delta = self.head.lora(h.astype(self.dtype)).astype(jnp.float32)
            logits = logits + (jax.lax.stop_gradient(delta) if detached else delta)
        return logits

    # ------------------------------------------------------------------ forward
    def __call__(self, input_ids: jax.Array, *, attention_mask: jax.Array | None = None,
                 routing_replay: jax.Array | None = None, return_mtp: bool = False, return_hidden: bool = False,
                 dispatch_fn=None, layer_stack=None, left_aligned: bool = False) -> DSV4Output:
        """Full-sequence forward.

        Args:
          input_ids: [B, S] int32.
          attention_mask: [B, S] (1 = real token) with the real tokens contiguous (left or right padding);
            None = all real.
          routing_replay: [B, S, L, k] int32 expert ids to force in every main MoE layer (entries < 0 route
            normally), as returned in `.routing` by an earlier call or the sampler; None = route freely.
          return_mtp: also compute the MTP head (`mtp_logits`); "detached": the MTP head reads the trunk's streams,
            the embedding and the head weights through `stop_gradient` (its loss then trains only `mtp.*`: the
            on-policy MTP loss of speculative decoding, rl/algo/learner.py).
          dispatch_fn: routed-expert implementation (default: single-device ragged_dot; EP: parallel.expert).
          layer_stack: a `dsv4.scan.LayerStack` (stacked layer weights, run under `jax.lax.scan` per group of
            identical layers) used instead of `self.layers`; None = the Python loop over `self.layers`.
          left_aligned: the caller's promise that every row of `attention_mask` starts at column 0 (right padding
            only, the RL layout): the rows run as they are, no per-row roll (module docstring "Padding"). Not
            checked (a traced value); a left-padded row then gets wrong values.
        Returns:
          DSV4Output (see its docstring).
        Raises:
          ValueError: mis-shaped `routing_replay` or `attention_mask` (static shape check).
        """
        cfg = self.config
        b, s = input_ids.shape
        n_l, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
        n_have = len(self.layers) if layer_stack is None else layer_stack.num_layers
        if n_have != n_l:  # e.g. a dsv4.scan shell (no own layers) called without layer_stack
            raise ValueError(f"{'layer_stack' if layer_stack is not None else 'the model'} holds {n_have} layers; "
                             f"the config has {n_l}")
        if routing_replay is not None and routing_replay.shape != (b, s, n_l, k):
            raise ValueError(f"routing_replay has shape {routing_replay.shape}; expected [B, S, L, k] = "
                             f"{(b, s, n_l, k)}")
        if attention_mask is not None and attention_mask.shape != (b, s):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}; expected {(b, s)}")
        cp = context_axis() if self.attention_impl == "blocked" else None
        pad = 0 if cp is None else -s % (cp[1] * seq_multiple(cfg))
        if pad:  # context parallelism: shards of whole compression windows (dsv4/context.py); trailing padding
            # is invisible to every real token (causal), so the first S positions are the unpadded model's
            m = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
            out = self(jnp.pad(input_ids, ((0, 0), (0, pad))), attention_mask=jnp.pad(m, ((0, 0), (0, pad))),
                       routing_replay=None if routing_replay is None else jnp.pad(
                           routing_replay, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=-1),
                       return_mtp=return_mtp, return_hidden=return_hidden, dispatch_fn=dispatch_fn,
                       layer_stack=layer_stack, left_aligned=left_aligned)
            return out.replace(**{f: getattr(out, f)[:, :s] for f in ("logits", "routing", "mtp_logits", "hidden")
                                  if getattr(out, f) is not None})  # expert_drops: the padded call's
        roll = attention_mask is not None and not left_aligned
        if attention_mask is not None and left_aligned:  # rows at column 0: as they are
            ids = jnp.where(attention_mask.astype(bool), input_ids, 0)
        elif roll:
            m = attention_mask.astype(bool)
            shift = jnp.argmax(m, axis=1).astype(jnp.int32)  # leading pads per row (0 if right-padded)
            idx = (jnp.arange(s)[None, :] + shift[:, None]) % s  # right-align: new[j] = old[j + shift]
            ids = jnp.take_along_axis(input_ids, idx, axis=1)
            ids = jnp.where(jnp.take_along_axis(m, idx, axis=1), ids, 0)
            if routing_replay is not None:
                routing_replay = jnp.take_along_axis(routing_replay, idx[:, :, None, None], axis=1)
        else:
            ids = input_ids
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
        x = jnp.broadcast_to(self.embed_tokens(ids)[:, :, None, :], (b, s, cfg.hc_mult, cfg.hidden_size))
        x = constrain(x, _STREAMS)
        # ---- layer loop (begin) ----
        if layer_stack is None:
            routes, drops = [], jnp.zeros((2,), jnp.int32)
            for i, layer in enumerate(self.layers):
                forced = None if routing_replay is None else routing_replay[:, :, i]
                x, (r, d) = self._block(layer, x, positions, ids, forced, dispatch_fn)
                routes.append(r)
                drops = drops + d
            routing = jnp.stack(routes, axis=2)  # [B, S, L, k]
        else:  # stacked layers under lax.scan (dsv4/scan.py), each layer through block_step too
            x, routing, drops = layer_stack.run(x, positions, ids, routing_replay, dispatch_fn)
        # ---- layer loop (end) ----
        h = self.collapse(x)
        mtp_h = None
        if return_mtp and len(self.mtp):
            nxt = jnp.concatenate([ids[:, 1:], jnp.zeros((b, 1), ids.dtype)], axis=1)
            detached = return_mtp == "detached"
            mtp_h = self._mtp(self.mtp[0], jax.lax.stop_gradient(x) if detached else x, nxt, positions, dispatch_fn,
                              detached)
        if roll:
            inv = (jnp.arange(s)[None, :] - shift[:, None]) % s  # roll back: old[j] = new[j - shift]
            h = jnp.take_along_axis(h, inv[:, :, None], axis=1)
            routing = jnp.take_along_axis(routing, inv[:, :, None, None], axis=1)
            if mtp_h is not None:
                mtp_h = jnp.take_along_axis(mtp_h, inv[:, :, None], axis=1)
        if attention_mask is not None:
            routing = jnp.where(attention_mask.astype(bool)[:, :, None, None], routing, -1)
        logits = constrain(self.lm_head(h), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB))
        return DSV4Output(logits=logits, routing=routing,
                          mtp_logits=None if mtp_h is None else self.lm_head(mtp_h, return_mtp == "detached"),
                          hidden=h if return_hidden else None, expert_drops=drops)

    def _mtp(self, blk: MTPBlock, x, next_ids, positions, dispatch_fn, detached: bool = False):
        """MTP: X~_k = e_proj(enorm(embed(next))) + h_proj(hnorm(X_k)); block; own hyper head + norm (spec §7).
        detached: the shared embedding through `stop_gradient`."""
        xm, _ = self._block(blk, blk.inputs(self.embed_tokens(next_ids, detached), x), positions, next_ids, None,
                            dispatch_fn)
        return self.collapse(xm, owner=blk)

    def _block(self, blk: Block, x, positions, ids, forced, dispatch_fn):
        """One layer (`block_step`), under `jax.checkpoint` with the `remat` policy (a no-op without
        differentiation). The scanned path (`layer_stack`) applies its own remat around the same `block_step`."""
        on, policy = remat_policy(self.remat)
        if not on:
            return block_step(blk, x, positions, ids, forced, dispatch_fn)
        graphdef, state = nnx.split(blk)

        def run(state, x, positions, ids, forced):
            return block_step(nnx.merge(graphdef, state), x, positions, ids, forced, dispatch_fn)

        return jax.checkpoint(run, policy=policy)(state, x, positions, ids, forced)


class ShapeKeys:
    """The `rngs` of a model built only for its shapes (`abstract_model`): every draw is the same constant key.

    Why not `nnx.Rngs`: under a trace, each draw updates flax's RNG counter, whose check reads the traced value's
    `sharding`; on a tracer that raises an AttributeError whose message walks the whole jaxpr traced so far, so
    building Flash abstractly was quadratic in its layers (~25 s; ~2 s with constant keys; measured 24 layers:
    7.5 s -> 1.1 s). Only `params()` is drawn by the model and its LoRA adapters."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_model(config: DSV4Config, **options) -> DSV4ForCausalLM:
    """`nnx.eval_shape` of `DSV4ForCausalLM(config, **options)` (param_dtype, dtype, lora, remat, ...): the graph and
    every variable's shape, dtype and metadata (logical axes), no memory. The values are not the random init's."""
    return nnx.eval_shape(lambda: DSV4ForCausalLM(config, rngs=ShapeKeys(), **options))


class _Table(nnx.Module):
    """Holder so that checkpoint names read `embed.weight` / `head.weight`."""

    def __init__(self, weight):
        self.weight = weight
        self.lora = nnx.data(None)  # the head's LoRA adapter (dsv4.lora, target "head"); unused on `embed`


def count_params(model_or_state, *, active: bool = False, config: DSV4Config | None = None,
                 include_mtp: bool = False) -> int:
    """Number of logical parameters: nnx.Param leaves plus floating-point buffers (the router selection bias);
    integer tables (tid2eid) are not counted, matching the spec §10 arithmetic (284 332 240 471 for Flash).

    With `active=True`: routed experts count k/E of their size (the parameters one token touches) and the
    embedding matrix is excluded (one row is looked up), the convention of spec §10 (13.27B for Flash).
    Works on abstract models from `nnx.eval_shape` (no memory is allocated).
    """
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    total = 0
    for path, v in nnx.to_flat_state(state):
        if not jnp.issubdtype(v.get_value().dtype, jnp.floating):
            continue
        keys = [str(p) for p in path]
        if not include_mtp and keys and keys[0] == "mtp":
            continue
        size = 1
        for dim in v.get_value().shape:
            size *= dim
        if active:
            if "experts" in keys and "shared_experts" not in keys:
                size = size * config.num_experts_per_tok // config.n_routed_experts
            if keys[0] == "embed":
                size = 0
        total += size
    return total
