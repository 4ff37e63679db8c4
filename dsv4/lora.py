"""LoRA adapters (Hu et al., arXiv 2106.09685) on DeepSeek-V4's projections: `LoraConfig`, `Adapter`, `attach`.

Form. A target weight W [out, in] gets W' = W + (alpha / r) B A with A [r, in], B [out, r]; A starts random
(he-uniform), B at zero, so an attached model computes exactly what it did before.

Library. The adapters are Flax NNX's own `nnx.LoRA` modules (`Adapter` subclasses it: `lora_a` [in, r],
`lora_b` [r, out], both `nnx.LoRAParam`, so `nnx.LoRAParam` is the filter of what trains) attached to our layers
after construction (`attach`: a walk over the *modules* of the decoder layers, not over parameters). Not
`nnx.LoRALinear`: it subclasses `nnx.Linear` (kernel [in, out]) while our `dsv4.layers.Linear` keeps the checkpoint's
[out, in] `weight` and its product (`dsv4.layers.linear`) also takes the rollout's FP8 `QuantizedTensor` and the
FP8-aware learner's `FakeQuantWeight`; `nnx.LoRA(base_module=...)` would call the base with a promoted x and cannot
add the path inside the grouped `wo_a` product or the routed experts. Not Qwix (`qwix.LoraProvider`, not a
dependency here): it intercepts `dot_general` / `einsum` calls by module path and adds its own params; our products
go through `linear`, a grouped einsum, `ragged_dot` and custom-VJP CPU kernels, several of which it cannot see or
would rank-adapt as the wrong matrix. So the modules are the library's; only where the low-rank path joins the
base product is ours (three places below).

Targets (`LoraConfig.targets`, comma-separated groups):
  attn     the attention projections wq_a, wq_b, wkv, wo_b (unmerged: base product + scale x (x A^T) B^T, in
           `dsv4.layers.Linear`) and wo_a, whose product is grouped (`dsv4.attention.Attention.output`): its adapter
           is the LoRA of the whole [G o_lora, (H/G) d] matrix and each group g uses rows g of B (`grouped_delta`).
           The indexer's and compressor's projections are not targets (they only select / pool).
  shared   the shared expert's w1, w3, w2 (unmerged, `Linear`).
  experts  the routed experts, one adapter per expert (A [E, r, in], B [E, out, r] per w1 / w3 / w2,
           `ExpertAdapters`), applied *merged into the weights inside the forward* (W_e + scale B_e A_e for every
           expert), so every routed-expert implementation (ragged_dot, the CPU kernels, the expert-parallel
           all-to-all) runs unchanged; cost: one transient [E, I, D] per matrix and layer. Per-expert rather than
           one adapter shared by all experts: experts specialise, a shared delta would move every expert by the
           same matrix, and PEFT has a per-module layout for per-expert adapters (`dsv4.io.peft`).
  head     the output head (`lm_head`, [V, D]; unmerged in `DSV4ForCausalLM.lm_head`). Needed to fine-tune a
           *randomly initialised* base (benchmarks/lora.py): with the head and the final norm frozen at their init
           (std 0.02, weight 1) every logit stays within ~|head row| x sqrt(D) (about +-1.3 for the tiny model), so no
           adapter behind them can make the policy confident; a pretrained head has no such bound.
Default "attn,shared": the issue's default (routed experts are 98% of Flash's parameters; their adapters cost
E x the others').

Not targeted: embeddings, the head, norms, mHC, the router, the MTP module (frozen like the rest of the base).

Usage:
    model = DSV4ForCausalLM(cfg, rngs=..., lora=LoraConfig(rank=8))     # or: attach(model, LoraConfig(rank=8), rngs)
    adapters = nnx.state(model, nnx.LoRAParam)                          # what trains and what the push moves
    merged = merged_params(flat {key: array}, lora_cfg)                 # W + scale B A, adapters dropped
Tests: tests/dsv4/test_lora.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.layers import dot_out
from sharding import axes as ax

TARGET_GROUPS = ("attn", "shared", "experts", "head")
ATTN_TARGETS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
SHARED_TARGETS = ("w1", "w3", "w2")
# the key of an adapter matrix in a flat state: group 1 = the adapted Linear's module path, group 2 = a | b; or
# (routed experts) group 3 = the experts' module path, group 4 = w1 | w2 | w3, group 5 = a | b
ADAPTER_KEY = re.compile(r"^(.*)/lora/lora_(a|b)$|^(.*/ffn/experts)/lora/(w[123])_(a|b)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA of the learner (`--learner.lora.*`); rank 0 = off (full fine-tuning, the default).

    rank: r of every adapter. alpha: the scale is alpha / r (PEFT's `lora_alpha`). targets: comma-separated groups
    of `TARGET_GROUPS` (module docstring): "attn,shared" by default, "experts" adds per-expert routed adapters.
    """

    rank: int = dataclasses.field(default=0, metadata={"help": "LoRA rank r (0 = off: full fine-tuning)"})
    alpha: float = dataclasses.field(default=16.0, metadata={"help": "LoRA alpha: adapters scaled by alpha / rank"})
    targets: str = dataclasses.field(default="attn,shared", metadata={
        "help": "comma-separated LoRA targets: attn (q/kv/o projections), shared (shared expert), experts (routed, "
                "per expert)"})

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"--learner.lora.rank must be an int >= 0, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"--learner.lora.alpha must be > 0, got {self.alpha!r}")
        bad = [t for t in self.groups if t not in TARGET_GROUPS]
        if bad or not self.groups:
            raise ValueError(f"--learner.lora.targets must be a comma-separated subset of {','.join(TARGET_GROUPS)}, "
                             f"got {self.targets!r}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in str(self.targets).split(",") if t.strip())

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


class Adapter(nnx.LoRA):
    """`nnx.LoRA` with PEFT's scale: x [..., in] -> scale * (x @ lora_a @ lora_b) [..., out] in `dtype`.

    lora_a [in, r] (he-uniform), lora_b [r, out] (zeros), float32 `nnx.LoRAParam`s, replicated (`logical_axes`
    None: a few MB per layer). The weight's delta is scale * (lora_a @ lora_b).T = scale * B A in [out, in]."""

    def __init__(self, d_in: int, d_out: int, cfg: LoraConfig, *, rngs: nnx.Rngs, dtype):
        meta = {"logical_axes": (None, None)}
        super().__init__(d_in, cfg.rank, d_out, dtype=dtype, param_dtype=jnp.float32, rngs=rngs, a_metadata=meta,
                         b_metadata=meta)
        self.scale = cfg.scale

    def __call__(self, x: jax.Array) -> jax.Array:
        return (super().__call__(x) * self.scale).astype(self.dtype)

    def delta(self) -> jax.Array:
        """The weight's delta scale * B A [out, in], float32."""
        return self.scale * (self.lora_a[...].astype(jnp.float32) @ self.lora_b[...].astype(jnp.float32)).T


def grouped_delta(adapter: Adapter, og: jax.Array) -> jax.Array:
    """The low-rank path of the grouped `wo_a` product: og [B, S, G, in] -> [B, S, G, o] in the adapter's dtype,
    = per group g: scale * og_g A^T B_g^T with B_g the rows g o .. (g + 1) o of B (G o = the adapter's out)."""
    g = og.shape[-2]
    dt = adapter.dtype
    a = adapter.lora_a[...].astype(dt)
    b = adapter.lora_b[...].astype(dt)
    t = jnp.einsum("bsgi,ir->bsgr", og.astype(dt), a, preferred_element_type=dot_out(dt)).astype(dt)
    b = b.reshape(b.shape[0], g, -1)  # -> [r, G, o]
    y = jnp.einsum("bsgr,rgo->bsgo", t, b, preferred_element_type=dot_out(dt))
    return (y * adapter.scale).astype(dt)


class ExpertAdapters(nnx.Module):
    """Per-expert adapters of the routed experts (w1, w3 [E, I, D]; w2 [E, D, I]): `w{k}_a` [E, in, r] and
    `w{k}_b` [E, r, out] (`nnx.LoRAParam`, split over the expert axis like the experts), applied merged
    (`merged`)."""

    def __init__(self, n_exp: int, d: int, inter: int, cfg: LoraConfig, *, rngs: nnx.Rngs):
        self.scale = cfg.scale
        r = cfg.rank
        init_a = nnx.initializers.he_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
        for name, (d_in, d_out) in (("w1", (d, inter)), ("w3", (d, inter)), ("w2", (inter, d))):
            setattr(self, f"{name}_a", nnx.LoRAParam(init_a(rngs.params(), (n_exp, d_in, r), jnp.float32),
                                                     logical_axes=(ax.EXPERT, None, None)))
            setattr(self, f"{name}_b", nnx.LoRAParam(jnp.zeros((n_exp, r, d_out), jnp.float32),
                                                     logical_axes=(ax.EXPERT, None, None)))

    def merged(self, w1: jax.Array, w3: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Expert weights [E, out, in] -> W_e + scale B_e A_e, in each weight's dtype."""
        out = []
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            a, b = getattr(self, f"{name}_a")[...], getattr(self, f"{name}_b")[...]
            d = jnp.einsum("eir,ero->eoi", a.astype(jnp.float32), b.astype(jnp.float32))
            out.append((w.astype(jnp.float32) + self.scale * d).astype(w.dtype))
        return tuple(out)


def attach(model, cfg: LoraConfig, rngs: nnx.Rngs):
    """Attach fresh adapters (`cfg.groups`) to the main decoder layers of a `DSV4ForCausalLM` in place; returns it.

    The model must have none yet (ValueError). The MTP blocks get none (they are not trained in RL). Every adapter
    computes in its layer's compute dtype."""
    if not cfg.enabled:
        return model
    if has_adapters(model):
        raise ValueError("attach: the model already has LoRA adapters")
    groups = cfg.groups
    for blk in model.layers:
        if "attn" in groups:
            for name in ATTN_TARGETS:
                lin = getattr(blk.attn, name)
                out, d_in = lin.weight.get_value().shape
                lin.lora = Adapter(d_in, out, cfg, rngs=rngs, dtype=lin.dtype)
        ffn = blk.ffn
        if "shared" in groups and ffn.shared_experts is not None:
            for name in SHARED_TARGETS:
                lin = getattr(ffn.shared_experts, name)
                out, d_in = lin.weight.get_value().shape
                lin.lora = Adapter(d_in, out, cfg, rngs=rngs, dtype=lin.dtype)
        if "experts" in groups:
            e, i, d = ffn.experts.w1.get_value().shape
            ffn.experts.lora = ExpertAdapters(e, d, i, cfg, rngs=rngs)
    if "head" in groups:
        v, d = model.head.weight.get_value().shape
        model.head.lora = Adapter(d, v, cfg, rngs=rngs, dtype=model.dtype)
    model.lora = cfg
    return model


def has_adapters(model_or_state) -> bool:
    """Whether a model (or an nnx.State) holds any `nnx.LoRAParam`."""
    state = nnx.state(model_or_state, nnx.LoRAParam) if isinstance(model_or_state, nnx.Module) else model_or_state
    return any(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, nnx.Variable)))


def is_adapter_key(key: str) -> bool:
    """Whether a flat key ("layers/0/attn/wq_a/lora/lora_a", "layers/1/ffn/experts/lora/w1_a") is an adapter's."""
    return ADAPTER_KEY.match(key) is not None


def merged_params(flat: dict, cfg: LoraConfig) -> dict:
    """{key: array} of a model with adapters -> the same without them, each adapted weight W + scale B A (float32
    arithmetic, the weight's dtype): the merged model (export in the release's format, a rollout without adapters).
    Keys are "/"-joined paths (`dsv4.names.param_key`)."""
    out = {k: v for k, v in flat.items() if not is_adapter_key(k)}
    s = cfg.scale
    for k, v in flat.items():
        m = ADAPTER_KEY.match(k)
        if m is None or m.group(2) == "b" or m.group(5) == "b":
            continue
        if m.group(1) is not None:  # a Linear's adapter: delta [out, in] = scale (a @ b).T
            base = f"{m.group(1)}/weight"
            d = s * (v.astype(jnp.float32) @ flat[f"{m.group(1)}/lora/lora_b"].astype(jnp.float32)).T
        else:
            base = f"{m.group(3)}/{m.group(4)}"
            b = flat[f"{m.group(3)}/lora/{m.group(4)}_b"]
            d = s * jnp.einsum("eir,ero->eoi", v.astype(jnp.float32), b.astype(jnp.float32))
        w = out[base]
        out[base] = (w.astype(jnp.float32) + d).astype(w.dtype)
    return out


__all__ = ["ADAPTER_KEY", "Adapter", "ExpertAdapters", "LoraConfig", "TARGET_GROUPS", "attach", "grouped_delta",
           "has_adapters", "is_adapter_key", "merged_params"]
