"""Memory planner: per-device bytes of the actor (training) and rollout (sampling) roles for a mesh spec and GPU.

    python -m launch.plan --config flash --mesh 'actor:fsdp=2,expert=8/rollout:expert=8' --gpu mi308x --nodes 3 \
        --max-prompt-len 1024 --max-new-tokens 3072     # the run's flags (launch/run.py) + the planner's own

The numbers come from the code, not from a copy of it: per-device bytes of every model tensor under its role's
rules and the decode cache's bytes are parallel/model_bytes.py's, the learner's activations parallel/activations.py's
(each module's docstring has its formulas); this module adds them up per role and checks them against the GPU.

Units: GiB = 2^30 bytes everywhere. GPU HBM (`GPUS`): the vendors' "192 GB" / "288 GB" / "141 GB" are binary
capacities in practice (MI300X/MI308X: 8 HBM3 stacks x 24 GiB; MI355X: 8 HBM3E stacks x 36 GiB; H200: 141 GB
nominal, ~140 GiB visible, nvidia-smi 143,771 MiB), so the table holds 192 / 192 / 288 / 140 GiB (sources: AMD
Instinct MI300X / MI308X / MI355X and NVIDIA H200 product pages). `usable_fraction` (default 0.90) of it is
planned; the rest is driver/runtime context, NCCL/RCCL buffers and compiled programs. JAX preallocates only 75%
by default: launch with XLA_PYTHON_CLIENT_MEM_FRACTION >= the usable fraction.

Actor, per device, as rl/algo/learner.py holds it with `param_dtype="bfloat16"` (rl/algo/optim.py): weights as stored
(bf16; mHC / sinks / ape / router bias fp32; tid2eid int32), gradients (param dtype), fp32 master copy of the trained
bf16 params, Adam moments (2 x optimizer dtype) of the trained params (frozen ones, `train_mtp=False` /
`freeze_router`, have neither: `sharding.offload.is_trained`), activations. `offload_optimizer` F moves the whole
optimizer state (master + moments) of the params `sharding.offload.select_offloaded` picks (largest first, <= F of
the bytes) to host memory (`pinned_host`, the learner's `--offload-optimizer`; reported per node, not counted on
the GPU; with `host_gib_per_node` given, an actor needing more host RAM than that does not fit).
Activations: parallel/activations.py (T = tokens per device in one micro-batch, S = sequence length, remat block,
blocked attention, log-probs in chunks, EP rows, context parallelism's gathered compressed KV).
With `xla_cpu=True` (`--compile`) one item labelled "XLA:CPU only" is added, buffers XLA:CPU holds and a GPU does not
(found in XLA's buffer assignment of the Flash step, `--xla_dump_to`; benchmarks/README.md "Flash actor step compiled
for the seed layouts"): XLA:CPU runs its dots in f32, so it holds f32 copies of the gathered layer's weights and of
their gradients and of the head (2 * gathered layer + head, again). `RoleReport.cpu_only` is that item; the actor's
`fits` is the GPU plan's (`gpu_total`). The stacked layer weights and the saved layer inputs are *not* copied:
`dsv4.scan` reads them in place (`dsv4.block_remat.take`, uint16 saved inputs), on every backend. Before that, XLA:CPU
float-normalised the scan's bf16 `xs` into f32 copies of whole stacks (100 GiB per device for Flash on 2 x 8 devices).
Optimizer update transient: the step moves the offloaded optimizer state (fp32 masters + moments) to the device for the
update and back (`rl.algo.learner_state.opt_state_to`). Without `stream_optimizer` nothing bounds how much of it is
there at once (XLA's memory analysis of the Flash step keeps most of it live: launch/aot.py), so the plan counts all
offloaded bytes on the device. With the learner's `stream_optimizer` (`rl.algo.optim.update_streamed`) the offloaded
state of the decoder layers (stacked under `scan_layers`; a pipelined group's on each stage) is updated one layer at a
time, that of other leaves of ndim >= 3 (the MTP head's experts) one leading slice at a time, and that of 2-D leaves of
>= `ROW_STREAM_MIN` elements (the embedding, the head) in `ROW_STEPS` chunks of rows (`sharding.offload`): the plan
counts the largest such slice's state in + out, plus the offloaded state of everything else (smaller 2-D and 1-D leaves)
whole. The plan is an estimate. Against XLA (`--compile`, Flash, 8K tokens per device, padded EP, streamed update)
XLA:CPU's figure is above the plan with its XLA:CPU-only item by a constant ~29 GiB per device (the same at 8 and 43
layers: more f32 temporaries of one layer's dots than the item counts; benchmarks/README.md "Flash actor step compiled
for the seed layouts"); the per-layer slope agrees. The GPU plan leaves the item out.

Rollout: its weights (FP8 / FP4 / as stored) and the KV cache per sequence are parallel/model_bytes.py's
(`rollout_leaf_bytes`, `KVCache`). `rollout_dequant="per_call"` (the sampler's default) adds a bf16 copy of every
quantised tensor for the duration of a generate call; "per_step" keeps only the FP8 copy. Then `rollout_reserve`
(default 10% of usable) for prefill/decode activations and fragmentation; the rest is KV cache.

Nodes: `nodes` x `gpus_per_node` (8) must equal the spec's device count; devices are process-major, so the actor
takes the first nodes and the rollout the following ones (`actor nodes` is printed; a fraction = a shared node).
Output: a table, then one line `PLAN role=actor per_device_gib=... fits=yes|no margin_gib=... role=rollout ...`.
API: `plan(config, mesh_spec, gpu, learner=LearnerConfig(...), ...) -> PlanReport` (also used by
`launch/run.py --dry-run` with the run's learner).
Tests: `.venv/bin/python -m pytest -q tests/sharding/test_plan.py`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np

import dsv4
from dsv4 import scan
from dsv4.lora import is_adapter_key
from parallel import expert as expert_lib
from parallel import pipeline
from parallel.activations import EP_BACKENDS, actor_activations, context_gathered, saved_layer_inputs
from parallel.model_bytes import DTYPE_BYTES, KVCache, abstract_mesh, local_shape, model_leaves, rollout_leaf_bytes
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
_LAYER = re.compile(r"layers\.(\d+)\.")  # a decoder layer's leaf: stacked under --scan-layers, hence streamed


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
                parts.append(f"kv_dtype={self.options['kv_layout']}")  # the field's name is the line's contract
        return " ".join(parts)

    def table(self) -> str:
        o = self.options
        lines = [f"DeepSeek-V4 memory plan: config={self.config_name} ({self.n_params / 1e9:.2f} B parameters incl. "
                 f"MTP), gpu={self.gpu.name} ({self.gpu.hbm_gib:g} GiB HBM; {self.gpu.source})",
                 f"mesh {self.mesh_spec} on {self.nodes} node(s) x {GPUS_PER_NODE}; usable "
                 f"{o['usable_fraction']:.0%} = {self.actor.usable / GiB:.1f} GiB per device; units GiB (2^30 B)"]
        if "pipeline" in o:
            lines.append(o["pipeline"])
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
                        "states" if o["kv_layout"] == "fp8" else
                        f"{o['kv_layout']} entries, f32 compressor states and indexer keys")
                lines.append(f"  KV cache per sequence of {o['rollout_seq_len']} tokens: {seq_mib:.1f} MiB "
                             f"({what}; dsv4.cache layout)")
                pt = r.kv_per_token or {}
                lines.append(f"  KV cache bytes per token: {r.kv_per_seq / o['rollout_seq_len']:,.0f} B "
                             f"(at {o['rollout_seq_len']} tokens, fixed states included; per added token: "
                             f"fp8 {pt.get('fp8', 0):,.0f} B, bf16 {pt.get('bf16', 0):,.0f} B; KV layout "
                             f"{o['kv_layout']})")
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


def pipeline_line(config, stages: int, stage_axis: int, micro_batches: int | None) -> tuple[str, range] | None:
    """(the table's pipeline line, the pipelined layers) for `stages` P > 1 (`--learner.pipeline_stages`), else None:
    the group `parallel.pipeline.pipeline_plan` splits, its layers per stage and the GPipe bubble (P - 1) / (M + P
    - 1) at M micro-batches (None: 4 P). Raises ValueError (naming the flag) as the learner does."""
    if stage_axis > 1 and stages % stage_axis:
        raise ValueError(f"--learner.pipeline_stages={stages} does not spread over the mesh's {rl.STAGE}="
                         f"{stage_axis} axis: use a multiple of {stage_axis}")
    if stages <= 1:
        return None
    groups = scan.layer_groups(config)
    m = micro_batches or 4 * stages
    pp = pipeline.pipeline_plan(groups, stages, m)
    grp = groups[pp.group]
    line = (f"pipeline: {stages} stages over layers {grp.start}..{grp.stop - 1} ({grp.period * grp.repeats // stages} "
            f"per stage; the other {config.num_hidden_layers - grp.period * grp.repeats} layers, embedding and head "
            f"on every stage), GPipe bubble (P-1)/(M+P-1) = {pp.bubble:.3f} at M={m} micro-batches; the pipelined "
            f"layers' weights and optimizer state are split over {rl.STAGE}={stage_axis}; each stage keeps the "
            f"saved inputs of its layers for all M micro-batches (GPipe), other activations as without a pipeline")
    return line, range(grp.start, grp.stop)


class LearnerKnobs(Protocol):
    """The learner knobs `plan` reads: the fields of `rl.config.algo.LearnerConfig` (one layer up) of those names."""

    offload_optimizer: float
    stream_optimizer: bool
    ep_backend: str
    ep_capacity_factor: float | None
    train_mtp: bool
    freeze_router: bool
    pipeline_stages: int
    pipeline_micro_batches: int | None
    lora: Any  # dsv4.lora.LoraConfig: rank > 0 = only the adapters train (gradients and optimizer state)


def _role_nodes(devices: int) -> float:
    return devices / GPUS_PER_NODE


def plan(config, mesh_spec: str, gpu: str, *, learner: LearnerKnobs, nodes: int | None = None,
         optimizer_dtype: str = "fp32", tokens_per_device: int = 4096, rollout_seq_len: int = 4096,
         train_seq_len: int | None = None, rollout_experts: str = "fp8", fp8_scale_bytes: float = 4.0,
         fp4_scale_bytes: float = 1.0, rollout_dequant: str = "per_step", kv_layout: str = "bf16",
         usable_fraction: float = 0.90, rollout_reserve: float = 0.10, rollout_seqs_per_device: int = 1,
         host_gib_per_node: float | None = None, config_name: str | None = None,
         xla_cpu: bool = False, draft_tokens: int = 0, pipeline_micro_batches: int | None = None) -> PlanReport:
    """Plan the per-device memory of both roles. Arguments as the CLI flags (module docstring).

    Args:
      config: a `dsv4.DSV4Config` or a preset name ("flash", "small", "tiny").
      mesh_spec: `sharding.mesh` grammar; "auto" needs `nodes`.
      gpu: a key of `GPUS`.
      learner: the learner whose memory is planned (`rl.config.algo.LearnerConfig`, e.g. the run's `cfg.learner`):
        its `offload_optimizer`, `stream_optimizer`, `ep_backend` ("auto": `parallel.expert.auto_backend`:
        capacity with `xla_cpu`, as the learner on XLA:CPU; else padded with a capacity factor, ragged without),
        `ep_capacity_factor`, and the frozen set `train_mtp` /
        `freeze_router` (`sharding.offload.is_trained`: frozen params get no master or moments). The plan has no
        defaults of its own for them.
    Returns:
      PlanReport (`.table()`, `.line()`).
      draft_tokens: k >= 1 plans speculative rollouts (`KVCache.for_config`: the MTP ring and k more positions per
        sequence); 0 = off.
      pipeline_micro_batches: M, the micro-batches of one pass through the pipeline (learner.pipeline_stages P > 1),
        for the GPipe bubble (P - 1) / (M + P - 1) the table prints and the saved stage inputs of M micro-batches;
        None = the learner's `pipeline_micro_batches`, else 4 P.
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
    if optimizer_dtype not in DTYPE_BYTES:
        raise ValueError(f"optimizer dtype must be one of {list(DTYPE_BYTES)}, got {optimizer_dtype!r}")
    if rollout_experts not in ("fp8", "fp4"):
        raise ValueError(f"rollout experts must be 'fp8' or 'fp4', got {rollout_experts!r}")
    if rollout_dequant not in ("per_step", "per_call"):
        raise ValueError(f"rollout dequant must be 'per_step' or 'per_call', got {rollout_dequant!r}")
    if kv_layout not in (*DTYPE_BYTES, "fp8"):
        raise ValueError(f"kv layout must be one of {[*DTYPE_BYTES, 'fp8']}, got {kv_layout!r}")
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
    lora = learner.lora if learner.lora.enabled else None
    leaves = model_leaves(config, lora)
    usable = GPUS[gpu].hbm_gib * GiB * usable_fraction
    opts = dict(optimizer_dtype=optimizer_dtype, offload_optimizer=offload_optimizer,
                tokens_per_device=tokens_per_device, rollout_seq_len=rollout_seq_len,
                train_seq_len=train_seq_len or rollout_seq_len, rollout_experts=rollout_experts,
                fp8_scale_bytes=fp8_scale_bytes, fp4_scale_bytes=fp4_scale_bytes, rollout_dequant=rollout_dequant,
                kv_layout=kv_layout, usable_fraction=usable_fraction,
                rollout_reserve=rollout_reserve, rollout_seqs_per_device=rollout_seqs_per_device,
                ep_capacity_factor=ep_capacity_factor, ep_backend=ep_backend, stream_optimizer=stream_optimizer,
                host_gib_per_node=host_gib_per_node)

    # ---- actor
    a_sizes = spec.axes(rl.ACTOR)
    a_mesh = abstract_mesh(a_sizes)
    m_pipe = pipeline_micro_batches or learner.pipeline_micro_batches or 4 * learner.pipeline_stages
    pipe = pipeline_line(config, learner.pipeline_stages, a_sizes[rl.STAGE], m_pipe)
    if pipe is not None:
        opts["pipeline"] = pipe[0]
    split_layers, n_stage = (range(0) if pipe is None else pipe[1]), a_sizes[rl.STAGE]
    w = g = master = mom = off_master = off_mom = whole = slice_peak = 0.0
    # optimizer state as rl/algo/learner.py + rl/algo/optim.py hold it: an fp32 master for trained non-fp32 params, two
    # moments for every trained param (frozen ones: none), whole params offloaded by `select_offloaded`
    def _state(leaf, n):
        return (n * 4 if leaf.dtype != "float32" else 0), 2 * n * DTYPE_BYTES[optimizer_dtype]

    def updated(leaf) -> bool:  # a gradient and optimizer state (LoRA: the adapters alone, rl/algo/learner.py "LoRA")
        if lora is not None:
            return is_adapter_key(leaf.path.replace(".", "/"))
        return leaf.trained and offload_lib.is_trained(leaf.path, train_mtp=train_mtp, freeze_router=freeze_router)

    has_state = [leaf for leaf in leaves if updated(leaf)]
    chosen = offload_lib.select_offloaded(
        [(leaf.path, sum(_state(leaf, math.prod(leaf.shape)))) for leaf in has_state], offload_optimizer)
    has_state = {leaf.path for leaf in has_state}
    for leaf in leaves:
        n = math.prod(local_shape(leaf, rl.ACTOR_RULES, a_mesh))
        if (m := _LAYER.match(leaf.path)) and int(m.group(1)) in split_layers:  # a pipelined layer: on 1 stage of P
            n = n / n_stage
        item = np.dtype(leaf.dtype).itemsize
        w += n * item
        if leaf.trained and (lora is None or leaf.path in has_state):
            g += n * item
        if leaf.path in has_state:
            ms, mo = _state(leaf, n)
            if leaf.path in chosen:
                off_master, off_mom = off_master + ms, off_mom + mo
                if stream_optimizer and _LAYER.match(leaf.path) and len(leaf.shape) >= 2:
                    slice_peak = max(slice_peak, 2 * (ms + mo))  # one layer's state in + out
                elif stream_optimizer and len(leaf.shape) >= 3 and leaf.shape[0] > 1:  # e.g. the MTP head's experts:
                    lead = local_shape(leaf, rl.ACTOR_RULES, a_mesh)[0]  # streamed one leading slice at a time
                    slice_peak = max(slice_peak, 2 * (ms + mo) / lead)
                elif (stream_optimizer and len(leaf.shape) == 2 and math.prod(leaf.shape) >= offload_lib.ROW_STREAM_MIN
                      and local_shape(leaf, rl.ACTOR_RULES, a_mesh)[0] % offload_lib.ROW_STEPS == 0):
                    slice_peak = max(slice_peak, 2 * (ms + mo) / offload_lib.ROW_STEPS)  # the embedding, the head
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
    act = actor_activations(config, a_sizes, tokens, opts["train_seq_len"], ep_capacity_factor, ep_backend)
    saved = saved_layer_inputs(config, tokens)
    # GPipe: a stage keeps its L_p / P layers' saved inputs for every one of the M micro-batches (one counted above)
    gpipe = 0.0 if pipe is None else saved * len(split_layers) / config.num_hidden_layers * (
        m_pipe / learner.pipeline_stages - 1)
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
        **({} if pipe is None else {
            f"activations: GPipe, the pipelined layers' saved inputs of M={m_pipe} micro-batches on a stage, less "
            f"one": gpipe}),
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
    kv = KVCache.for_config(config, jnp.float32 if kv_layout == "fp32" else jnp.bfloat16,
                            "e4m3fn" if kv_layout == "fp8" else None, draft_tokens=draft_tokens)
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
