"""Bytes of the model's tensors per device and of one sequence's decode cache, from the code, not from a copy of it.

The parameter tree is `nnx.eval_shape` of the real `DSV4ForCausalLM(config)` (bf16 weights, with the leaves the
model keeps in fp32 / int32), each leaf is placed by the real rule table of its role (`rules.logical_to_spec` on a
`jax.sharding.AbstractMesh` of the spec's sizes, so meshes far larger than the local machine work), and per-device
bytes = the leaf's local shard (global dims divided by the product of the mesh axes that split them). A dim that does
not divide is an error, as in jit. The planner (parallel/plan.py) adds these up per role.

Rollout weights, per device, as rl/rollout/engine.py holds them (`rollout_leaf_bytes`): FP8 e4m3 (1 byte per
weight) for the checkpoint's FP8 set (`dsv4.quant.FP8_WEIGHT_RE`: attention wq_a/wq_b/wkv/wo_a/wo_b, indexer
wq_b, shared experts, MTP e/h_proj) and the routed experts (`rollout_experts="fp8"`), with one f32 scale per 128x128 block replicated on every device (`fp8_scale_bytes` = 4;
E8M0 would be 1); or FP4 e2m1 experts ("fp4": 0.5 byte + one `fp4_scale_bytes` = 1 E8M0 scale per 32 inputs, split
like the weight; the released layout, which the sampler cannot run yet). Everything else as stored (bf16; fp32 mHC
/ sinks / ape / bias; int32 tid2eid); a quantised tensor's bf16 dequantised copy is reported beside it (the
planner counts it for `rollout_dequant="per_call"`).

The KV cache (`kv_cache_bytes`, `KVCache`): its layout comes from `dsv4.cache.cache_shapes` for every main layer
(no MTP cache), evaluated abstractly: with W = window, d = head_dim, d_I = index_head_dim, b = kv dtype bytes (bf16 = 2), per sequence of S:
    every layer:     W * d * b + W * 4                          sliding ring + int32 positions
    CSA (ratio m):   + floor(S/m) * (d * b + d_I * 4)            entries + f32 indexer keys
                     + 4 * m * 2d * 4 + 4 * m * 2d_I * 4         A, Z of the current and previous window (f32)
    HCA (ratio m'):  + floor(S/m') * d * b + 4 * m' * d * 4
so a token costs 8,224 bytes for Flash on top of 27 MiB per sequence (bf16 entries). With the FP8 cache
(`fp8="e4m3fn"`, the engine's FP8 KV layout, the default for FP8 rollouts; r = RoPE dims, kept bf16):
an entry (ring slot or compressed) is e = (d - r) FP8 + (d - r) / 64 ue8m0 scale bytes + 2r = 583 B for Flash,
an indexer key d_I + 1 = 129 B, so a token costs 21 * (583 + 129) / 4 + 20 * 583 / 128 = 3,829 B, on top of
25 MiB per sequence (FP8 rings, f32 window states). DeepSeek's kernels pad an entry to 584 B (+0.2 B per token).
The sampler replicates the caches over the rollout mesh (`Sampler.empty_caches`), so the per-device capacity is also
the rollout-wide one; split over the batch axes it would multiply by devices / tensor (one shared K=V head: no tensor
split).
Tests: tests/sharding/test_plan.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import dsv4
from dsv4.cache import cache_shapes
from dsv4.names import official_key
from dsv4.quant import FP8_WEIGHT_RE
from sharding import mesh as mesh_lib
from sharding import rules as rl

DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # the optimizer / KV dtypes the planner takes, by name
_EXPERTS = re.compile(r"\.ffn\.experts\.w[123]$")  # the stacked routed experts (NNX paths joined with ".")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One model tensor: NNX path, global shape, dtype name, logical axes, trained (nnx.Param) or buffer."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...] | None
    trained: bool


@functools.lru_cache(maxsize=4)
def abstract_model(config, lora=None):
    """`dsv4.abstract_model(config, lora=lora)` with bf16 weights (no memory used; `lora`: a `dsv4.lora.LoraConfig`
    or None), cached per config (the planner asks for the same model per role and per layout; Flash takes ~2 s)."""

    return dsv4.abstract_model(config, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, lora=lora)


@functools.lru_cache(maxsize=4)
def model_leaves(config, lora=None) -> tuple[Leaf, ...]:
    """Every tensor (nnx.Param or Buffer) of `abstract_model(config, lora)`, in state order."""
    out = []
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(config, lora))):
        value = var.get_value()
        logical = getattr(var, "logical_axes", None) or var.get_metadata().get("logical_axes")
        out.append(Leaf(official_key(path), tuple(value.shape), str(value.dtype),
                        None if logical is None else tuple(logical), isinstance(var, nnx.Param)))
    return tuple(out)


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """An AbstractMesh with the mesh axes of `sizes` (absent ones: 1; no devices needed)."""
    return AbstractMesh(tuple(sizes.get(a, 1) for a in rl.MESH_AXES), rl.MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(rl.MESH_AXES))


def local_shape(leaf: Leaf, rules: rl.Rules, mesh: AbstractMesh) -> tuple[int, ...]:
    """Per-device shard shape of `leaf` under `rules` on `mesh`. Raises MeshSpecError for a dim that does not
    divide (the message names the leaf, as `rules.param_shardings` would)."""
    if leaf.logical_axes is None:
        return leaf.shape
    spec = rl.logical_to_spec(leaf.logical_axes, rules, mesh)
    out = []
    for dim, (size, entry) in enumerate(zip(leaf.shape, spec)):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts = math.prod(mesh.shape[a] for a in axes)
        if size % parts:
            raise mesh_lib.MeshSpecError(f"{leaf.path}: dim {dim} ({leaf.logical_axes[dim]!r}) of size {size} is not "
                                         f"divisible by {'*'.join(axes)} = {parts}")
        out.append(size // parts)
    return tuple(out)


def _blocks(shape: tuple[int, ...], block: int = 128) -> int:
    """Number of block x block scale tiles of a [..., out, in] weight."""
    lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return lead * math.ceil(shape[-2] / block) * math.ceil(shape[-1] / block)


def rollout_leaf_bytes(leaf: Leaf, shape: tuple[int, ...], experts: str, fp8_scale_bytes: float,
                       fp4_scale_bytes: float) -> tuple[str, float, float]:
    """(category, bytes, bytes of a bf16 dequantised copy or 0) of one rollout tensor whose local shard is `shape`.

    FP8 scales are replicated on the rollout mesh (as rl/rollout/engine.py places them), so they count with the global
    shape; FP4 scales (no sampler path yet; the released layout) are assumed split like their weight.
    """
    n = math.prod(shape)
    if _EXPERTS.search(leaf.path):
        if experts == "fp4":
            return "routed experts", n * 0.5 + n / 32 * fp4_scale_bytes, 2 * n
        return "routed experts", n + _blocks(leaf.shape) * fp8_scale_bytes, 2 * n
    if FP8_WEIGHT_RE.search(leaf.path):
        return "fp8 set", n + _blocks(leaf.shape) * fp8_scale_bytes, 2 * n
    return "bf16/fp32/int32 rest", n * np.dtype(leaf.dtype).itemsize, 0.0


@functools.lru_cache(maxsize=64)
def kv_cache_bytes(config, cache_len: int, dtype=jnp.bfloat16, fp8: str | None = None) -> int:
    """Bytes of one sequence's decode cache of model `config` at `cache_len` positions: `dsv4.cache.cache_shapes` of
    every main layer (the rollout engine's layout: one cache per `model.layers` entry; the MTP block has none),
    evaluated abstractly. dtype: kv / entries when unquantised; fp8: None or the FP8 layout's format ("e4m3fn" /
    "e4m3fnuz": the same bytes). The one KV-bytes function: the planner (`KVCache`), the slot plan
    (`rl.rollout.slots.plan_slots`) and the engine ask it."""
    model = abstract_model(config)
    dtype = jnp.dtype(dtype)
    tree = jax.eval_shape(lambda: [cache_shapes(layer.attn, 1, int(cache_len), dtype, fp8) for layer in model.layers])
    return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCache:
    """Decode-cache bytes of one sequence: `per_seq(S)` = fixed + per_token * S (exact when the compress ratios
    divide S; `dsv4.cache` allocates floor(S / m) entries)."""

    fixed: float  # independent of S: sliding rings, positions, compressor window states
    per_token: float  # compressed entries and indexer keys, per token of max length

    @classmethod
    def for_config(cls, config, dtype=jnp.bfloat16, fp8: str | None = None, draft_tokens: int = 0) -> "KVCache":
        """From `dsv4.cache.cache_shapes` of every main layer (the sampler's layout: rl/rollout/engine.py builds one cache
        per `model.layers` entry; the MTP block has none), evaluated abstractly at two cache lengths. fp8: None
        (entries in `dtype`) or the FP8 layout ("e4m3fn" / "e4m3fnuz": the same bytes). draft_tokens: k >= 1 =
        speculative rollouts (`--rollout.speculative mtp`, rl/rollout/speculative.py): the MTP block's ring cache and the
        k verify positions past the last token (rounded to the compression ratios' lcm) are added to `fixed`."""

        model = abstract_model(config)
        step = math.lcm(*(r for r in config.compress_ratios if r) or (1,))
        fixed = kv_cache_bytes(config, 0, dtype, fp8)
        per_token = (kv_cache_bytes(config, step, dtype, fp8) - fixed) / step
        if draft_tokens and len(model.mtp):
            attn = model.mtp[0].attn
            ring = jax.eval_shape(lambda: cache_shapes(attn, 1, attn.window, dtype, fp8))
            fixed += sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(ring))
            fixed += per_token * (-(-draft_tokens // step) * step)
        return cls(fixed=fixed, per_token=per_token)

    def per_seq(self, seq_len: int) -> float:
        return self.fixed + self.per_token * seq_len
