"""Memory planner: per-device bytes of the actor (training) and rollout (sampling) roles for a mesh spec and GPU.

    python -m launch.plan --config flash --mesh 'actor:fsdp=2,expert=8/rollout:expert=8' --gpu mi308x --nodes 3

The numbers come from the code, not from a copy of it: the parameter tree is `nnx.eval_shape` of the real
`DSV4ForCausalLM(config)` (bf16 weights, with the leaves the model keeps in fp32 / int32), each leaf is placed by
the real rule table of its role (`rules.logical_to_spec` on a `jax.sharding.AbstractMesh` of the spec's sizes, so
meshes far larger than the local machine work), and per-device bytes = the leaf's local shard (global dims divided
by the product of the mesh axes that split them). A dim that does not divide is an error, as in jit.

Units: GiB = 2^30 bytes everywhere. GPU HBM (`GPUS`): the vendors' "192 GB" / "288 GB" / "141 GB" are binary
capacities in practice (MI300X/MI308X: 8 HBM3 stacks x 24 GiB; MI355X: 8 HBM3E stacks x 36 GiB; H200: 141 GB
nominal, ~140 GiB visible, nvidia-smi 143,771 MiB), so the table holds 192 / 192 / 288 / 140 GiB (sources: AMD
Instinct MI300X / MI308X / MI355X and NVIDIA H200 product pages). `usable_fraction` (default 0.90) of it is
planned; the rest is driver/runtime context, NCCL/RCCL buffers and compiled programs. JAX preallocates only 75%
by default: launch with XLA_PYTHON_CLIENT_MEM_FRACTION >= the usable fraction.

Actor, per device, as rl/learner.py holds it with `param_dtype="bfloat16"` (rl/optim.py): weights as stored (bf16;
mHC / sinks / ape / router bias fp32; tid2eid int32), gradients (param dtype), fp32 master copy of the trained
bf16 params, Adam moments (2 x optimizer dtype) of the trained params (frozen ones, `train_mtp=False` /
`freeze_router`, have neither: `sharding.offload.is_trained`), activations. `offload_optimizer` F moves the whole
optimizer state (master + moments) of the params `sharding.offload.select_offloaded` picks (largest first, <= F of
the bytes) to host memory (`pinned_host`, the learner's `--offload-optimizer`; reported per node, not counted on
the GPU; with `host_gib_per_node` given, an actor needing more host RAM than that does not fit).
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
With `xla_cpu=True` (`--compile`) one item labelled "XLA:CPU only" is added, buffers XLA:CPU holds and a GPU does
not (found in XLA's buffer assignment of the Flash step, `--xla_dump_to`; benchmarks/README.md "Flash actor step
compiled for the seed layouts"): XLA:CPU runs its dots in f32, so it holds f32 copies of the gathered layer's
weights and of their gradients and of the head (2 * gathered layer + head, again). `RoleReport.cpu_only` is that item; the actor's `fits` is the GPU plan's
(`gpu_total`). The stacked layer weights and the saved layer inputs are *not* copied: `dsv4.scan` reads them in
place (`_take`, uint16 saved inputs), on every backend. Before that, XLA:CPU float-normalised the scan's bf16
`xs` into f32 copies of whole stacks (100 GiB per device for Flash on 2 x 8 devices).
Optimizer update transient: the step moves the offloaded optimizer state (fp32 masters + moments) to the device
for the update and back (`rl.learner_state.opt_state_to`). Without `stream_optimizer` nothing bounds how much
of it is there at once (XLA's memory analysis of the Flash step keeps most of it live: launch/aot.py), so the plan
counts all offloaded bytes on the device. With the learner's `stream_optimizer` (`rl.optim.update_streamed`) the
offloaded state of the decoder layers (stacked under `scan_layers`) is updated one layer at a time: the plan
counts one layer's largest state slice in + out, plus the offloaded state of everything else (embedding, head,
1-D leaves) whole. The plan is an estimate. Against XLA (`--compile`, Flash, 8K tokens per device, padded EP,
streamed update) XLA:CPU's figure is above the plan with its XLA:CPU-only item by a constant ~29 GiB per device
(the same at 8 and 43 layers: more f32 temporaries of one layer's dots than the item counts; benchmarks/README.md
"Flash actor step compiled for the seed layouts"); the per-layer slope agrees. The GPU plan leaves the item out.

Rollout, per device, as rl/rollout/engine.py holds it: FP8 e4m3 (1 byte per weight) for the checkpoint's FP8 set
(`dsv4.quant.FP8_WEIGHT_RE`: attention wq_a/wq_b/wkv/wo_a/wo_b, indexer wq_b, shared experts, MTP e/h_proj) and
the routed experts (`rollout_experts="fp8"`), with one f32 scale per 128x128 block replicated on every device
(`fp8_scale_bytes` = 4; E8M0 would be 1); or FP4 e2m1 experts ("fp4": 0.5 byte + one `fp4_scale_bytes` = 1 E8M0
scale per 32 inputs, split like the weight; the released layout, which the sampler cannot run yet). Everything
else as stored (bf16; fp32 mHC / sinks / ape / bias; int32 tid2eid). `rollout_dequant="per_call"` (the sampler's
default) adds a bf16 copy of every quantised tensor for the duration of a generate call; "per_step" (its
memory-saving mode, the one Flash needs) keeps only the FP8 copy (a layer's transient bf16 weights fall in the
reserve). Then `rollout_reserve` (default 10% of usable) for prefill/decode activations and fragmentation; the
rest is KV cache, whose layout comes from `dsv4.cache.cache_shapes` for every main layer (no MTP cache), evaluated
abstractly: with W = window, d = head_dim, d_I = index_head_dim, b = kv dtype bytes (bf16 = 2), per sequence of S:
    every layer:     W * d * b + W * 4                          sliding ring + int32 positions
    CSA (ratio m):   + floor(S/m) * (d * b + d_I * 4)            entries + f32 indexer keys
                     + 4 * m * 2d * 4 + 4 * m * 2d_I * 4         A, Z of the current and previous window (f32)
    HCA (ratio m'):  + floor(S/m') * d * b + 4 * m' * d * 4
so a token costs 8,224 bytes for Flash on top of 27 MiB per sequence (`kv_dtype` "bf16"). With the FP8 cache
(`kv_dtype="fp8"`, the sampler's `--kv-cache-dtype fp8`, the default for FP8 rollouts; r = RoPE dims, kept bf16):
an entry (ring slot or compressed) is e = (d - r) FP8 + (d - r) / 64 ue8m0 scale bytes + 2r = 583 B for Flash,
an indexer key d_I + 1 = 129 B, so a token costs 21 * (583 + 129) / 4 + 20 * 583 / 128 = 3,829 B, on top of
25 MiB per sequence (FP8 rings, f32 window states). DeepSeek's kernels pad an entry to 584 B (+0.2 B per token).
The sampler replicates the caches over the
rollout mesh (`Sampler.empty_caches`), so the per-device capacity is also the rollout-wide one; split over the
batch axes it would multiply by devices / tensor (one shared K=V head: no tensor split).

Nodes: `nodes` x `gpus_per_node` (8) must equal the spec's device count; devices are process-major, so the actor
takes the first nodes and the rollout the following ones (`actor nodes` is printed; a fraction = a shared node).
Output: a table, then one line `PLAN role=actor per_device_gib=... fits=yes|no margin_gib=... role=rollout ...`.
API: `plan(config, mesh_spec, gpu, learner=LearnerConfig(...), ...) -> PlanReport` (also used by
`launch/run.py --dry-run` with the run's learner).
Tests: `.venv/bin/python -m pytest -q tests/sharding/test_plan.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import dsv4
from dsv4.cache import cache_shapes
from dsv4.names import official_key
from dsv4.quant import FP8_WEIGHT_RE
from parallel import expert as expert_lib
from sharding import mesh as mesh_lib
from sharding import offload as offload_lib
from sharding import rules as rl

GiB = 2**30
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    name: str
    hbm_gib: float
    source: str


GPUS: dict[str, GpuSpec] = {
    "mi308x": GpuSpec(name="AMD Instinct MI308X", hbm_gib=192, source="AMD product page: 192 GB HBM3"),
    "mi300x": GpuSpec(name="AMD Instinct MI300X", hbm_gib=192, source="AMD product page: 192 GB HBM3"),
    "mi355x": GpuSpec(name="AMD Instinct MI355X", hbm_gib=288, source="AMD product page: 288 GB HBM3E"),
    "h200": GpuSpec(name="NVIDIA H200 SXM", hbm_gib=140, source="NVIDIA product page: 141 GB HBM3e (~140 GiB visible)"),
    "h100": GpuSpec(name="NVIDIA H100 SXM", hbm_gib=79.1,
                    source="XLA's h100_sxm spec: device_memory_size 84942979072 B"),
    "b200": GpuSpec(name="NVIDIA B200", hbm_gib=178.4, source="XLA's b200 spec: device_memory_size 191514411008 B"),
}
_BYTES = {"fp32": 4, "bf16": 2}
_LAYER = re.compile(r"layers\.(\d+)\.")  # a decoder layer's leaf: stacked under --scan-layers, hence streamed
_EXPERTS = re.compile(r"\.ffn\.experts\.w[123]$")  # the stacked routed experts (NNX paths joined with ".")


def _fp8_keys() -> re.Pattern:
    """The release's FP8 set, as defined once in `dsv4.quant`."""
    return FP8_WEIGHT_RE


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One model tensor: NNX path, global shape, dtype name, logical axes, trained (nnx.Param) or buffer."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...] | None
    trained: bool


@functools.lru_cache(maxsize=4)
def abstract_model(config):
    """`nnx.eval_shape` of `DSV4ForCausalLM(config)` with bf16 weights (no memory used). Cached per config: the
    Flash trace takes 10-35 s (flax compares each RNG draw's tracer sharding, which makes jax walk the jaxpr)."""

    return nnx.eval_shape(lambda: dsv4.DSV4ForCausalLM(config, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16,
                                                        dtype=jnp.bfloat16))


@functools.lru_cache(maxsize=4)
def model_leaves(config) -> tuple[Leaf, ...]:
    """Every tensor (nnx.Param or Buffer) of `abstract_model(config)`, in state order."""
    out = []
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(config))):
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
    if _fp8_keys().search(leaf.path):
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleReport:
    """Per-device plan of one role. `items`: name -> bytes per device (counted on the GPU); `host`: bytes per
    device kept in host memory; `usable`: planned bytes per device; `margin`: usable - counted (actor), or the
    bytes left for the KV cache after weights and reserve (rollout; `fits` = at least `rollout_seqs_per_device`
    sequences of `rollout_seq_len` fit in it)."""

    role: str
    sizes: dict[str, int]
    devices: int
    nodes: float
    items: dict[str, float]
    host: float
    usable: float
    margin: float
    fits: bool
    kv_seqs_per_device: int | None = None
    kv_tokens_per_device: int | None = None
    kv_per_seq: float | None = None
    cpu_only: float = 0.0  # bytes of the items labelled "XLA:CPU only" (in `items` with plan(xla_cpu=True))
    kv_per_token: dict[str, float] | None = None  # {"fp8": B, "bf16": B}: marginal KV bytes per token, both layouts

    @property
    def total(self) -> float:
        return sum(self.items.values())

    @property
    def gpu_total(self) -> float:
        """`total` without the XLA:CPU-only items: the plan for a GPU."""
        return self.total - self.cpu_only


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanReport:
    config_name: str
    n_params: int
    gpu: GpuSpec
    nodes: int
    mesh_spec: str
    options: dict[str, Any]
    actor: RoleReport
    rollout: RoleReport

    def line(self) -> str:
        """The machine-readable `PLAN ...` line."""
        parts = ["PLAN"]
        for r in (self.actor, self.rollout):
            parts += [f"role={r.role}", f"per_device_gib={r.gpu_total / GiB:.2f}", f"fits={'yes' if r.fits else 'no'}",
                      f"margin_gib={r.margin / GiB:.2f}"]
            if r.kv_tokens_per_device is not None:
                parts.append(f"kv_tokens_per_device={r.kv_tokens_per_device}")
                parts.append(f"kv_dtype={self.options['kv_dtype']}")
        return " ".join(parts)

    def table(self) -> str:
        o = self.options
        lines = [f"DeepSeek-V4 memory plan: config={self.config_name} ({self.n_params / 1e9:.2f} B parameters incl. "
                 f"MTP), gpu={self.gpu.name} ({self.gpu.hbm_gib:g} GiB HBM; {self.gpu.source})",
                 f"mesh {self.mesh_spec} on {self.nodes} node(s) x {GPUS_PER_NODE}; usable "
                 f"{o['usable_fraction']:.0%} = {self.actor.usable / GiB:.1f} GiB per device; units GiB (2^30 B)"]
        for r in (self.actor, self.rollout):
            axes = ",".join(f"{a}={s}" for a, s in r.sizes.items() if s > 1) or "data=1"
            title = f"{r.role} ({r.devices} devices = {r.nodes:g} node(s); {axes}; {r.role} rules)"
            lines.append(f"\n{title}\n  {'':<58}{'GiB/device':>10}")
            for name, b in r.items.items():
                lines.append(f"  {name:<58}{b / GiB:>10.2f}")
            lines.append(f"  {'total on the GPU':<58}{r.gpu_total / GiB:>10.2f}   (usable {r.usable / GiB:.1f})")
            if r.cpu_only:
                lines.append(f"  {'total with the XLA:CPU-only items (compare with XLA:CPU)':<58}"
                             f"{r.total / GiB:>10.2f}")
            if r.host:
                cap = o["host_gib_per_node"]
                lines.append(f"  {'host memory (offloaded), per device / per node':<58}{r.host / GiB:>10.2f}"
                             f"  / {r.host * GPUS_PER_NODE / GiB:.0f}" + ("" if cap is None else f" (of {cap:g})"))
            if r.kv_per_seq is not None:
                shards = r.devices // r.sizes[rl.TENSOR]  # batch shards if caches were split (one K=V head: not TP)
                seq_mib = r.kv_per_seq / 2**20
                what = ("FP8 rings, entries and indexer keys with ue8m0 scales, bf16 RoPE dims, f32 compressor "
                        "states" if o["kv_dtype"] == "fp8" else
                        f"{o['kv_dtype']} entries, f32 compressor states and indexer keys")
                lines.append(f"  KV cache per sequence of {o['rollout_seq_len']} tokens: {seq_mib:.1f} MiB "
                             f"({what}; dsv4.cache layout)")
                pt = r.kv_per_token or {}
                lines.append(f"  KV cache bytes per token: {r.kv_per_seq / o['rollout_seq_len']:,.0f} B "
                             f"(at {o['rollout_seq_len']} tokens, fixed states included; per added token: "
                             f"fp8 {pt.get('fp8', 0):,.0f} B, bf16 {pt.get('bf16', 0):,.0f} B; --kv-cache-dtype "
                             f"{o['kv_dtype']})")
                lines.append(f"  KV capacity: {r.kv_seqs_per_device:,} sequences = {r.kv_tokens_per_device:,} tokens "
                             f"per device (rl/rollout/engine.py splits the batch and its caches over data x expert: "
                             f"x{shards} rollout-wide)")
            verdict = "fits" if r.fits else "does not fit"
            what = "left for the KV cache" if r.kv_per_seq is not None else "GPU margin"
            host_note = ""
            if r.host and o["host_gib_per_node"] is not None and r.host * GPUS_PER_NODE > o["host_gib_per_node"] * GiB:
                host_note = f"; host RAM per node {r.host * GPUS_PER_NODE / GiB:.0f} > {o['host_gib_per_node']:g} GiB"
            lines.append(f"  verdict: {verdict} ({what} {r.margin / GiB:+.2f} GiB per device{host_note})")
        return "\n".join(lines)


EP_BACKENDS = ("capacity", "ragged", "padded", "sized")  # parallel.expert.BACKENDS
BLOCK_Q = 128  # dsv4.attention.Attention(block_q=): queries per block of the blocked attention
LOGPROB_CHUNK = 1024  # rl.config.LearnerConfig.logprob_chunk_size default


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


def _actor_activations(cfg, sizes: dict[str, int], tokens: int, seq_len: int, ep_capacity: float | None,
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
    compute dtype (bf16: 2). The learner never runs the MTP block (`rl.logprobs.token_logprobs`)."""
    return cfg.num_hidden_layers * tokens * cfg.hc_mult * cfg.hidden_size * itemsize


class LearnerKnobs(Protocol):
    """The learner knobs `plan` reads: the fields of `rl.config.LearnerConfig` (one layer up) of those names."""

    offload_optimizer: float
    stream_optimizer: bool
    ep_backend: str
    ep_capacity_factor: float | None
    train_mtp: bool
    freeze_router: bool


def _role_nodes(devices: int) -> float:
    return devices / GPUS_PER_NODE


def plan(config, mesh_spec: str, gpu: str, *, learner: LearnerKnobs, nodes: int | None = None,
         optimizer_dtype: str = "fp32", tokens_per_device: int = 4096, rollout_seq_len: int = 4096,
         train_seq_len: int | None = None, rollout_experts: str = "fp8", fp8_scale_bytes: float = 4.0,
         fp4_scale_bytes: float = 1.0, rollout_dequant: str = "per_step", kv_dtype: str = "bf16",
         usable_fraction: float = 0.90, rollout_reserve: float = 0.10, rollout_seqs_per_device: int = 1,
         host_gib_per_node: float | None = None, config_name: str | None = None,
         xla_cpu: bool = False, draft_tokens: int = 0) -> PlanReport:
    """Plan the per-device memory of both roles. Arguments as the CLI flags (module docstring).

    Args:
      config: a `dsv4.DSV4Config` or a preset name ("flash", "small", "tiny").
      mesh_spec: `sharding.mesh` grammar; "auto" needs `nodes`.
      gpu: a key of `GPUS`.
      learner: the learner whose memory is planned (`rl.config.LearnerConfig`, e.g. the run's `cfg.learner`):
        its `offload_optimizer`, `stream_optimizer`, `ep_backend` ("auto": `parallel.expert.auto_backend`:
        capacity with `xla_cpu`, as the learner on XLA:CPU; else padded with a capacity factor, ragged without),
        `ep_capacity_factor`, and the frozen set `train_mtp` /
        `freeze_router` (`sharding.offload.is_trained`: frozen params get no master or moments). The plan has no
        defaults of its own for them.
    Returns:
      PlanReport (`.table()`, `.line()`).
      draft_tokens: k >= 1 plans speculative rollouts (`KVCache.for_config`: the MTP ring and k more positions per
        sequence); 0 = off.
      xla_cpu: also count the buffers only XLA:CPU holds (items labelled "XLA:CPU only", `RoleReport.cpu_only`;
        module docstring), to compare with `--compile`'s XLA:CPU figures; the actor's `fits` stays the GPU's.
    Raises:
      MeshSpecError: unparsable spec, device count != nodes * 8, or a model dim the mesh does not divide.
      ValueError: unknown gpu / dtype / expert format, or an option out of range.
    """

    offload_optimizer, stream_optimizer = learner.offload_optimizer, learner.stream_optimizer
    train_mtp, freeze_router, ep_capacity_factor = learner.train_mtp, learner.freeze_router, learner.ep_capacity_factor
    ep_backend = (learner.ep_backend if learner.ep_backend != "auto"
                  else expert_lib.auto_backend(xla_cpu, ep_capacity_factor))
    if isinstance(config, str):
        config_name = config_name or config
        config = dsv4.DSV4Config.preset(config)
    config_name = config_name or "custom"
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)}")
    if optimizer_dtype not in _BYTES:
        raise ValueError(f"optimizer dtype must be one of {list(_BYTES)}, got {optimizer_dtype!r}")
    if rollout_experts not in ("fp8", "fp4"):
        raise ValueError(f"rollout experts must be 'fp8' or 'fp4', got {rollout_experts!r}")
    if rollout_dequant not in ("per_step", "per_call"):
        raise ValueError(f"rollout dequant must be 'per_step' or 'per_call', got {rollout_dequant!r}")
    if kv_dtype not in (*_BYTES, "fp8"):
        raise ValueError(f"kv dtype must be one of {[*_BYTES, 'fp8']}, got {kv_dtype!r}")
    for name, v in (("offload_optimizer", offload_optimizer), ("usable_fraction", usable_fraction),
                    ("rollout_reserve", rollout_reserve)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    if mesh_spec.strip() == "auto" and nodes is None:
        raise mesh_lib.MeshSpecError("mesh spec 'auto' needs the node count (--nodes)")
    spec = mesh_lib.parse_mesh_spec(mesh_spec, n_devices=None if nodes is None else nodes * GPUS_PER_NODE)
    n_dev = spec.n_devices
    if nodes is None:
        nodes = max(1, math.ceil(n_dev / GPUS_PER_NODE))
        if n_dev > GPUS_PER_NODE and n_dev % GPUS_PER_NODE:
            raise mesh_lib.MeshSpecError(f"mesh {spec} uses {n_dev} devices, not a whole number of "
                                         f"{GPUS_PER_NODE}-GPU nodes; pass --nodes")
    elif n_dev != nodes * GPUS_PER_NODE:
        raise mesh_lib.MeshSpecError(f"mesh {spec} uses {n_dev} devices but {nodes} node(s) x {GPUS_PER_NODE} = "
                                     f"{nodes * GPUS_PER_NODE}")
    spec.validate(n_dev, config)
    leaves = model_leaves(config)
    usable = GPUS[gpu].hbm_gib * GiB * usable_fraction
    opts = dict(optimizer_dtype=optimizer_dtype, offload_optimizer=offload_optimizer,
                tokens_per_device=tokens_per_device, rollout_seq_len=rollout_seq_len,
                train_seq_len=train_seq_len or rollout_seq_len, rollout_experts=rollout_experts,
                fp8_scale_bytes=fp8_scale_bytes, fp4_scale_bytes=fp4_scale_bytes, rollout_dequant=rollout_dequant,
                kv_dtype=kv_dtype, usable_fraction=usable_fraction,
                rollout_reserve=rollout_reserve, rollout_seqs_per_device=rollout_seqs_per_device,
                ep_capacity_factor=ep_capacity_factor, ep_backend=ep_backend, stream_optimizer=stream_optimizer,
                host_gib_per_node=host_gib_per_node)

    # ---- actor
    a_sizes = spec.axes(rl.ACTOR)
    a_mesh = abstract_mesh(a_sizes)
    w = g = master = mom = off_master = off_mom = whole = slice_peak = 0.0
    # optimizer state as rl/learner.py + rl/optim.py hold it: an fp32 master for trained non-fp32 params, two
    # moments for every trained param (frozen ones: none), whole params offloaded by `select_offloaded`
    def _state(leaf, n):
        return (n * 4 if leaf.dtype != "float32" else 0), 2 * n * _BYTES[optimizer_dtype]

    has_state = [leaf for leaf in leaves if leaf.trained
                 and offload_lib.is_trained(leaf.path, train_mtp=train_mtp, freeze_router=freeze_router)]
    chosen = offload_lib.select_offloaded(
        [(leaf.path, sum(_state(leaf, math.prod(leaf.shape)))) for leaf in has_state], offload_optimizer)
    has_state = {leaf.path for leaf in has_state}
    for leaf in leaves:
        n = math.prod(local_shape(leaf, rl.ACTOR_RULES, a_mesh))
        item = np.dtype(leaf.dtype).itemsize
        w += n * item
        if leaf.trained:
            g += n * item
        if leaf.path in has_state:
            ms, mo = _state(leaf, n)
            if leaf.path in chosen:
                off_master, off_mom = off_master + ms, off_mom + mo
                if stream_optimizer and _LAYER.match(leaf.path) and len(leaf.shape) >= 2:
                    slice_peak = max(slice_peak, 2 * (ms + mo))  # one layer's state in + out
                else:
                    whole += ms + mo
            else:
                master, mom = master + ms, mom + mo
    if ep_backend not in EP_BACKENDS:
        raise ValueError(f"--ep-backend must be one of {list(EP_BACKENDS)}, got {ep_backend!r}")
    # one layer's weights gathered over the batch-only axes (FSDP / ZeRO-3: the layer's recompute and its weight
    # grads before the reduce-scatter), the head gathered for the log-prob chunk
    g_mesh = abstract_mesh({**a_sizes, rl.DATA: 1, rl.FSDP: 1, rl.CONTEXT: 1})
    gathered: dict[int, float] = {}
    head = 0.0
    for leaf in leaves:
        item = np.dtype(leaf.dtype).itemsize
        if (m := _LAYER.match(leaf.path)) and leaf.trained:
            i = int(m.group(1))
            gathered[i] = gathered.get(i, 0.0) + math.prod(local_shape(leaf, rl.ACTOR_RULES, g_mesh)) * item
        elif leaf.path == "head.weight":
            head = math.prod(local_shape(leaf, rl.ACTOR_RULES, g_mesh)) * item
    layer_w = max(gathered.values(), default=0.0)
    tokens = tokens_per_device
    act = _actor_activations(config, a_sizes, tokens, opts["train_seq_len"], ep_capacity_factor, ep_backend)
    saved = saved_layer_inputs(config, tokens)
    cp_kv = context_gathered(config, a_sizes, tokens, opts["train_seq_len"])
    off = off_master + off_mom
    on_gpu = " (rest in host memory)" if off else ""
    a_items = {
        "weights (bf16; fp32 mHC/sinks/ape/bias; int32 tid2eid)": w,
        "gradients (param dtype)": g,
        f"fp32 master weights{on_gpu}": master,
        f"Adam moments (2 x {optimizer_dtype}){on_gpu}": mom,
        f"activations ({tokens_per_device} tokens, seq {opts['train_seq_len']}, remat block, EP {ep_backend})": act,
        f"activations: saved layer inputs ({config.num_hidden_layers} layers x bf16 [n_hc, D] per token)": saved,
        "activations: one layer's weights gathered (fsdp) + their grads; the head": 2 * layer_w + head,
        f"activations: gathered compressed KV + window halo (context={a_sizes[rl.CONTEXT]})": cp_kv,
        "optimizer update: offloaded state moved to the device (learner's step)": whole + slice_peak,
    }
    cpu_only = 0.0
    if xla_cpu:  # what XLA:CPU holds on top (module docstring): f32 copies of one layer's dot operands
        cpu = {"activations: XLA:CPU only: f32 copies of one layer's gathered weights + grads, the head":
                   2 * layer_w + head}
        a_items.update(cpu)
        cpu_only = sum(cpu.values())
    a_total = sum(a_items.values())
    a_gpu = a_total - cpu_only
    a_dev = spec.size(rl.ACTOR)
    host_ok = host_gib_per_node is None or off * GPUS_PER_NODE <= host_gib_per_node * GiB
    actor = RoleReport(role=rl.ACTOR, sizes=a_sizes, devices=a_dev, nodes=_role_nodes(a_dev), items=a_items, host=off,
                       usable=usable, margin=usable - a_gpu, fits=a_gpu <= usable and host_ok, cpu_only=cpu_only)

    # ---- rollout (on its own devices, or on the actor's when colocated: then the actor state is resident too)
    r_sizes = spec.axes(rl.ROLLOUT)
    r_mesh = abstract_mesh(r_sizes)
    r_items: dict[str, float] = {}
    dequant_copy = 0.0
    for leaf in leaves:
        cat, b, dq = rollout_leaf_bytes(leaf, local_shape(leaf, rl.ROLLOUT_RULES, r_mesh), rollout_experts,
                                        fp8_scale_bytes, fp4_scale_bytes)
        label = f"weights: {cat}" + (f" ({rollout_experts})" if cat == "routed experts" else "")
        r_items[label] = r_items.get(label, 0.0) + b
        dequant_copy += dq
    if rollout_dequant == "per_call":
        r_items["bf16 copy of the quantised weights (dequant=per_call)"] = dequant_copy
    if spec.colocated:
        r_items["actor state resident (colocated; activations excluded)"] = (
            a_gpu - off - sum(v for k, v in a_items.items() if k.startswith("activations") and "XLA:CPU" not in k))
    r_items[f"reserve for activations / fragmentation ({rollout_reserve:.0%} of usable)"] = rollout_reserve * usable
    kv = KVCache.for_config(config, jnp.float32 if kv_dtype == "fp32" else jnp.bfloat16,
                            "e4m3fn" if kv_dtype == "fp8" else None, draft_tokens=draft_tokens)
    per_token = {"fp8": KVCache.for_config(config, fp8="e4m3fn").per_token,
                 "bf16": KVCache.for_config(config).per_token}
    free = usable - sum(r_items.values())
    per_seq = kv.per_seq(rollout_seq_len)
    seqs = max(0, int(free // per_seq))
    r_dev = spec.size(rl.ROLLOUT)
    rollout = RoleReport(role=rl.ROLLOUT, sizes=r_sizes, devices=r_dev,
                         nodes=_role_nodes(r_dev if not spec.colocated else a_dev), items=r_items, host=0.0,
                         usable=usable, margin=free,
                         fits=seqs >= rollout_seqs_per_device, kv_seqs_per_device=seqs,
                         kv_tokens_per_device=seqs * rollout_seq_len, kv_per_seq=per_seq, kv_per_token=per_token)
    n_params = sum(math.prod(lf.shape) for lf in leaves if lf.dtype != "int32")
    return PlanReport(config_name=config_name, n_params=n_params, gpu=GPUS[gpu], nodes=nodes, mesh_spec=str(spec),
                      options=opts, actor=actor, rollout=rollout)
