"""AOT compile of the real actor train step for a mesh this machine does not have (`python -m launch.plan ...
--compile`): XLA's own per-device memory figures next to the planner's arithmetic.

How (the idea of MaxText's `train_compile.py`: compile against a topology you do not have): the process gets as
many XLA:CPU devices as the mesh spec needs (`--xla_force_host_platform_device_count`, set by launch/plan.py
before JAX starts), the real meshes are built on them (`sharding.mesh.build_mesh_plan`), the model is
`nnx.eval_shape`d (no weights exist), `rl.algo.learner.Learner(..., abstract=True)` places the abstract train state with
the learner's real shardings (actor rules, bf16 params, fp32 masters + moments, host offload), and
`Learner.lower` lowers the exact `train_step` jit for an abstract `TrainBatch` of `rows` x `seq_len` tokens per
device of the batch axes (one micro-batch; `--max-tokens-per-micro-batch` sets the learner's token budget).
`compiled.memory_analysis()` then gives, per device: arguments (state + batch), outputs (new state + metrics),
aliases (the donated state) and temporaries.

Per-device total = arguments + outputs - aliases + temporaries - host bytes. Where XLA:CPU differs from a GPU:
- bf16 dots: XLA:CPU upcasts bf16 matmuls to f32 (its temporaries hold f32 copies of bf16 operands), so temp
  memory is an over-estimate of a GPU's;
- host memory kinds: XLA:CPU reports `pinned_host` arguments inside `argument_size` (its host_* fields are 0), so
  the offloaded optimizer bytes (summed from the state's shardings) are subtracted once (they are donated:
  aliased input and output);
- fusion and scheduling differ (GPU fusions keep fewer temporaries live; the CPU scheduler is not memory-aware
  in the same way), and no collective buffers (NCCL/RCCL) are counted.
Tests: tests/sharding/test_plan_compile.py.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

import dsv4
from dsv4.lora import LoraConfig
from parallel.model_bytes import kv_cache_bytes
from parallel.padded import capacity_buckets
from parallel.routing_load import bucket_index, peak_cell_load, peak_expert_load
from rl.rollout import slots as sl
from rl.config.algo import LearnerConfig
from rl.config.run import DEFAULT_LEARNER, DataConfig
from rl.config.rollout import RolloutConfig
from rl.config.tree import default
from launch.hlo_stats import HloStats, count
from rl.algo.batch import TrainBatch
from rl.algo.learner import Learner
from rl.algo.learner_step import TRAIN
from rl.rollout.engine import Sampler
from rl.rollout.settings import EngineSettings
from sharding.mesh import build_mesh_plan, parse_mesh_spec
from sharding import offload as so
from sharding.rules import ROLLOUT_RULES, batch_shards

GiB = 2**30


def reduced_depth(config, num_layers: int):
    """`config` with its first `num_layers` main layers (hash layers capped), MTP entries kept."""
    n_mtp = config.num_nextn_predict_layers
    ratios = tuple(config.compress_ratios[:num_layers]) + tuple(config.compress_ratios[-n_mtp:] if n_mtp else ())
    return dataclasses.replace(config, num_hidden_layers=num_layers, compress_ratios=ratios,
                               num_hash_layers=min(config.num_hash_layers, num_layers))


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Per-device bytes from XLA (`memory_analysis`) of the actor train step, and how it was built."""

    argument: int
    output: int
    alias: int
    temp: int
    host: int
    rows: int
    seq_len: int
    micro_batches: int
    compile_s: float
    backend: str = "XLA:CPU"  # or "XLA:GPU <target label>"
    hlo: HloStats | None = None  # flops / bytes / collectives counted from the optimized HLO (launch/hlo_stats.py)
    host_from_shardings: bool = False  # deviceless: offload compiled device-only, host bytes from the shardings
    transient: int = 0  # deviceless offload: the streamed update's device transient (plan arithmetic), added

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp - self.host + self.transient

    def lines(self) -> list[str]:
        g = lambda b: f"{b / GiB:10.2f}"  # noqa: E731
        cpu = self.backend == "XLA:CPU"
        host = ("host memory (offloaded optimizer, counted by XLA:CPU)   " if cpu else
                "host memory (offloaded optimizer, from the shardings)   " if self.host_from_shardings else
                "host memory (offloaded optimizer)                       ")
        on = "" if cpu else f" on {self.backend}"
        out = [f"XLA memory analysis of the actor train step{on} (per device; {self.rows} rows x "
               f"{self.seq_len} tokens per step = {self.micro_batches} micro-batch(es); compiled in "
               f"{self.compile_s:.0f} s)",
               f"  arguments (state + batch)                                {g(self.argument)}",
               f"  outputs (new state + metrics)                            {g(self.output)}",
               f"  aliased (donated state)                                  {g(-self.alias)}",
               f"  temporaries (grads, activations{', XLA:CPU f32 dot copies' if cpu else ''})"
               f"{' ' * (17 if cpu else 41)}{g(self.temp)}",
               f"  {host} {g(-self.host)}"]
        if self.host_from_shardings:
            out.append(f"  optimizer update transient (plan arithmetic, streamed)   {g(self.transient)}")
        out.append(f"  total on the device                                      {g(self.total)}")
        if self.host_from_shardings:
            out.append("  (abstract GPU devices have no host memory kind: the step was compiled with the optimizer "
                       "state on the device; the offloaded bytes are those of the learner's state shardings)")
        return out


def compile_actor(config, mesh_spec: str, *, seq_len: int, learner: LearnerConfig = DEFAULT_LEARNER,
                  devices=None, backend: str = "XLA:CPU", compiler_options: dict | None = None,
                  micro_batches: int = 1) -> CompileReport:
    """Lower and compile the learner's train step for `config` on the actor mesh of `mesh_spec`.

    `learner`: the learner compiled (default: the run's, `rl.config.run.DEFAULT_LEARNER`), in the accelerator layout
    (bf16 compute and params, fp32 masters + moments); its knobs decide the rest: `max_tokens_per_micro_batch`
    (rows per device of the batch axes: max(1, budget x context // seq_len), 1 without a budget), `scan_layers`,
    `offload_optimizer` / `stream_optimizer`, the EP dispatch (`ep_backend` "auto" = capacity on XLA:CPU,
    `ep_capacity_factor`), the frozen set (`train_mtp`, `freeze_router`; `lora`: the model carries the adapters,
    which alone train, over the frozen bf16 base), and `routing_replay` (the batch then carries routing). A `context`
    axis splits each row over its devices (dsv4/context.py; the budget then counts tokens per context shard, as the
    learner's). Needs `spec.n_devices` local devices (XLA:CPU with the
    device-count flag), or `devices`: abstract GPU devices (launch/gpu_target.py; `backend` labels the report).
    Abstract devices have no host memory kind: with `offload_optimizer` > 0 the step is compiled with the
    optimizer state on the device and the offloaded bytes (`sharding.offload.select_offloaded` of the trained
    params, their per-device masters + moments from the state's shardings) are reported as `host`,
    `host_from_shardings=True`. `compiler_options`: XLA options of this compile (`Lowered.compile`; e.g. the GPU
    test's cheaper ptxas). `micro_batches` M: the step's batch holds M micro-batches of those rows (what a pipelined
    learner, `pipeline_stages` > 1, runs through its GPipe schedule in one step: its bubble and its M micro-batches'
    saved stage inputs are in the compiled program). Raises whatever the learner raises for a layout it cannot take (ValueError), and XLA's
    errors.
    """
    if isinstance(config, str):
        config = dsv4.DSV4Config.preset(config)
    spec = parse_mesh_spec(mesh_spec)
    devices = list(jax.devices() if devices is None else devices)[:spec.n_devices]
    plan = build_mesh_plan(spec, devices=devices, config=config)
    lora = learner.lora if learner.lora.enabled else None  # LoRA: the adapters train, the base is frozen
    model = dsv4.abstract_model(config, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, lora=lora)
    cfg = dataclasses.replace(learner, compute_dtype="bfloat16", param_dtype="bfloat16")
    deviceless = not devices[0].addressable_memories()
    offload = cfg.offload_optimizer
    if deviceless:
        cfg = dataclasses.replace(cfg, offload_optimizer=0.0, stream_optimizer=False)
    micro_batch_tokens, routing_replay = cfg.max_tokens_per_micro_batch, cfg.routing_replay
    learner = Learner(model, cfg, mesh=plan.actor, abstract=True)
    # rows per device of the batch axes, as the learner lays them out: the budget counts tokens per context shard
    per_dev = 1 if micro_batch_tokens is None else max(1, micro_batch_tokens * learner.context_devices() // seq_len)
    n = micro_batches * per_dev * learner.batch_devices()
    sds = jax.ShapeDtypeStruct
    routing = sds((n, seq_len, config.num_hidden_layers, config.num_experts_per_tok), jnp.int32)
    batch = TrainBatch(input_ids=sds((n, seq_len), jnp.int32), attention_mask=sds((n, seq_len), jnp.int32),
                       response_mask=sds((n, seq_len), jnp.int32), rollout_logprobs=sds((n, seq_len), jnp.float32),
                       advantages=sds((n,), jnp.float32), routing=routing if routing_replay else None)
    t0 = time.perf_counter()
    compiled = learner.lower(batch).compile(compiler_options)
    dt = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    host = 0
    if deviceless and offload:
        host = _offloaded_bytes(learner, offload)
    for x in jax.tree.leaves(learner.state):
        if x.sharding.memory_kind == "pinned_host":
            host += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    lay = learner.layout(n, seq_len, seq_len)
    return CompileReport(argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
                         alias=ma.alias_size_in_bytes, temp=ma.temp_size_in_bytes, host=host, rows=n,
                         seq_len=seq_len, micro_batches=lay.micro_batches, compile_s=dt, backend=backend,
                         hlo=count(compiled.as_text()), host_from_shardings=deviceless and offload > 0)


def _offloaded_bytes(learner: Learner, fraction: float) -> int:
    """Per-device bytes of the optimizer state (fp32 master + 2 fp32 moments, `so.state_bytes`) that
    `--offload-optimizer fraction` puts in host memory: the trained params `so.select_offloaded` picks (by their
    global state bytes, as `rl.algo.learner_state.offload_shardings`), each counted with its per-device shard (masters
    and moments are placed like their params)."""
    params = jax.tree_util.tree_leaves_with_path(learner.state.params)
    labels = [lab for _, lab in jax.tree_util.tree_leaves_with_path(learner.labels)]
    trained = [(p, x) for (p, x), lab in zip(params, labels) if lab == TRAIN]
    keys = [jax.tree_util.keystr(p) for p, _ in trained]
    chosen = so.select_offloaded([(k, so.state_bytes(math.prod(x.shape), str(x.dtype)))
                                  for k, (_, x) in zip(keys, trained)], fraction)
    return sum(so.state_bytes(math.prod(x.sharding.shard_shape(x.shape)), str(x.dtype))
               for k, (_, x) in zip(keys, trained) if k in chosen)


# ------------------------------------------------------------------------------------------------ rollout side
@dataclasses.dataclass(frozen=True)
class RolloutCompileReport:
    """Per-device bytes from XLA (`memory_analysis`) of the rollout's generate program (`Sampler.lower`), the
    per-device bytes of its weight state and KV caches (from their shardings), and how it was built."""

    argument: int
    output: int
    alias: int
    temp: int
    weights: int
    kv: int
    batch: int
    prompt_len: int
    max_new_tokens: int
    cache_len: int
    rollout_dtype: str
    compile_s: float
    batch_shards: int = 1  # the batch (and its caches) split over data x expert: sequences per device = batch / this
    slots: int = 0  # continuous batching over this many slot caches (0 = the static program: one cache per sequence)
    prefill_chunk: int = 0
    backend: str = "XLA:CPU"  # or "XLA:GPU <target label>"
    hlo: HloStats | None = None  # flops / bytes / collectives of the whole generate program (launch/hlo_stats.py)
    ep_dispatch: str = ""  # the sampler's routed-expert dispatch (`Sampler.dispatch_name`)
    routing: str = ""  # the routing load the counts assume, and the sized dispatch's capacity it picks

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    def lines(self, usable: float | None = None) -> list[str]:
        g = lambda b: f"{b / GiB:10.2f}"  # noqa: E731
        how = (f"continuous batching over {self.slots} slots ({self.slots // self.batch_shards} per device), "
               f"per-request prefill in chunks of {self.prefill_chunk or 'the whole prompt'}"
               if self.slots else "static batching")
        on = "" if self.backend == "XLA:CPU" else f" on {self.backend}"
        out = [f"XLA memory analysis of the rollout generate program{on} (per device; {self.batch} sequences x "
               f"{self.prompt_len} prompt + {self.max_new_tokens} new tokens, cache {self.cache_len} tokens; {how}; "
               f"--rollout-dtype {self.rollout_dtype}; compiled in {self.compile_s:.0f} s)",
               f"  routed experts: {self.ep_dispatch or 'no EP dispatch'}"
               + (f"; flops and bytes counted at {self.routing}" if "sized" in self.ep_dispatch else ""),
               f"  arguments (weights + KV caches + inputs)                 {g(self.argument)}",
               f"    of which weights (resident, quantised)                 {g(self.weights)}",
               f"    of which KV caches (batch split over data x expert)    {g(self.kv)}",
               f"  outputs (tokens, logprobs, routing, caches)              {g(self.output)}",
               f"  aliased (donated caches)                                 {g(-self.alias)}",
               f"  temporaries (activations, per-layer dequantised weights) {g(self.temp)}",
               f"  total on the device                                      {g(self.total)}"]
        if usable is not None:
            left = usable - self.total
            per_seq = self.kv * self.batch_shards / max(1, self.slots or self.batch)  # one sequence's cache
            extra = max(0, int(left // per_seq)) if per_seq > 0 else 0
            out.append(f"  KV capacity left: {left / GiB:.2f} GiB of {usable / GiB:.1f} GiB usable = {extra:,} more "
                       f"sequences of {self.cache_len} tokens per device")
        return out


def compile_rollout(config, mesh_spec: str, *, batch: int = 1024, context: int = 32768,
                    prompt_len: int = default(DataConfig, "max_prompt_len"), rollout: RolloutConfig = RolloutConfig(),
                    kv_budget: float | None = None, devices=None, backend: str = "XLA:CPU",
                    compiler_options: dict | None = None, routing_load: str = "worst",
                    lora: LoraConfig | None = None) -> RolloutCompileReport:
    """Lower and compile the sampler's generate program for `config` on the rollout mesh of `mesh_spec` with an
    abstract model (no weights): `batch` sequences of `prompt_len` prompt tokens and `context - prompt_len` new
    tokens (bucketed as `Sampler.generate` buckets them), bf16 compute, FP8-resident weights dequantised layer by
    layer. `rollout`: the run's rollout knobs (`RolloutConfig`: --rollout-dtype, --kv-cache-dtype, --rollout-slots,
    --prefill-chunk, speculative decoding, the EP dispatch), resolved into the engine's settings as the run resolves
    them (`rl.rollout.settings.EngineSettings.for_run`). `rollout.slots`: 0 = the static program; N or "auto" =
    continuous batching (rl/rollout/slots.py) over N slots (auto: as many as `kv_budget` bytes per device hold, at
    most `batch`; `batch` without a budget), each refill prefilling its own request in chunks of the prefill chunk.
    `rollout.speculative` "mtp" compiles the speculative program instead (rl/rollout/speculative.py). Needs
    `spec.n_devices` local devices. Raises ValueError for sizes the sampler rejects (and --rollout-slots beyond the
    budget), and XLA's errors. `devices`: abstract GPU devices instead (launch/gpu_target.py; the rollout mesh takes
    the ones after the actor's, as on the real machines); `compiler_options` as `compile_actor`'s. `routing_load`
    (--routing-load): the routed experts' load the flops and bytes are counted at, for the sized dispatch (which
    capacity its switch runs in a decode step, parallel/routing_load.py; "worst": the dropless top). `lora`: the
    learner's `LoraConfig` (`--learner.lora.*`; None or rank 0: none): the rollout's model carries the same adapters
    and applies them unmerged (base product + low-rank path, dsv4/lora.py), as the run's sampler.
    """
    if isinstance(config, str):
        config = dsv4.DSV4Config.preset(config)
    if not 1 <= prompt_len < context:
        raise ValueError(f"the rollout context {context} must exceed the prompt length {prompt_len}")
    spec = parse_mesh_spec(mesh_spec)
    devices = list(jax.devices() if devices is None else devices)[:spec.n_devices]
    plan = build_mesh_plan(spec, devices=devices, config=config)
    lora = lora if lora is not None and lora.enabled else None
    model = dsv4.abstract_model(config, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, lora=lora)
    new = context - prompt_len
    # the run's engine settings, in bf16 as on the GPU the plan is for
    settings = EngineSettings.for_run(rollout, platform=devices[0].platform, max_prompt_len=prompt_len,
                                      compute_dtype=jnp.bfloat16)
    slots = rollout.slots
    if slots:
        seq = sl.cache_len_for(config, prompt_len, new)
        slots = sl.plan_slots(slots, per_slot_bytes=kv_cache_bytes(config, seq, jnp.bfloat16, settings.kv_bytes_format),
                              budget_bytes=kv_budget, seq_len=seq, shards=batch_shards(ROLLOUT_RULES, plan.rollout))
        slots = min(slots or batch, batch)
    sampler = Sampler(model, dataclasses.replace(settings, slots=slots), mesh=plan.rollout)
    t0 = time.perf_counter()
    lowered = sampler.lower(batch, prompt_len, new)
    compiled = lowered.compile(compiler_options)
    dt = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    shape = sampler.program_shape(batch, prompt_len, new)
    caches = sampler.cache_shapes(shape.cache_rows, shape.cache_len, placed=True)

    def dev_bytes(x):
        shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
        return math.prod(shape) * jnp.dtype(x.dtype).itemsize

    kv = sum(dev_bytes(x) for x in jax.tree.leaves(caches))
    # the sized dispatch's decode-step capacities (as `parallel.expert.make_ep_dispatch` builds them) and the one
    # the routing load picks
    t_local = max(1, (shape.slots or shape.batch) // sampler.batch_shards())
    ep = dict(zip(plan.rollout.axis_names, plan.rollout.devices.shape)).get("expert", 1)
    buckets = capacity_buckets(t_local, config.num_experts_per_tok, config.n_routed_experts,
                               settings.ep_capacity_factor)
    peak = peak_cell_load(t_local, config.num_experts_per_tok, config.n_routed_experts, ep, routing_load)
    branch = bucket_index(buckets, peak)
    picks = [(branch, len(buckets))]
    routing = f"{routing_load} routing: capacity {buckets[branch]} of {buckets}"
    if settings.ep_compact and "(sized)" in sampler.dispatch_name:  # the second switch (parallel/padded.py `_buffers_ffn`): rows per local expert
        top = ep * buckets[branch]
        inner = tuple(c for c in capacity_buckets(ep * t_local, config.num_experts_per_tok, config.n_routed_experts,
                                                  None) if c < top) + (top,)
        rows = bucket_index(inner, peak_expert_load(t_local, config.num_experts_per_tok, config.n_routed_experts, ep,
                                                    buckets[branch], routing_load))
        picks.append((rows, len(inner)))
        routing += f", compacted to {inner[rows]} rows per local expert of {inner}"
    weights = sum(dev_bytes(x) for x in jax.tree.leaves(sampler.abstract_weights()))
    return RolloutCompileReport(argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
                                alias=ma.alias_size_in_bytes, temp=ma.temp_size_in_bytes, weights=weights, kv=kv,
                                batch=shape.batch, prompt_len=shape.prompt, max_new_tokens=shape.new,
                                cache_len=shape.cache_len, rollout_dtype=rollout.dtype, compile_s=dt,
                                batch_shards=sampler.batch_shards(), slots=shape.slots,
                                prefill_chunk=sampler.prefill_chunk, backend=backend,
                                hlo=count(compiled.as_text(), expert_branch=picks),
                                ep_dispatch=sampler.dispatch_name,
                                routing=routing)
