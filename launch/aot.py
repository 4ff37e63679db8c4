"""AOT compile of the real actor train step for a mesh this machine does not have (`python -m sharding.plan ...
--compile`): XLA's own per-device memory figures next to the planner's arithmetic.

How (the idea of MaxText's `train_compile.py`: compile against a topology you do not have): the process gets as
many XLA:CPU devices as the mesh spec needs (`--xla_force_host_platform_device_count`, set by parallel/plan.py
before JAX starts), the real meshes are built on them (`sharding.mesh.build_mesh_plan`), the model is
`nnx.eval_shape`d (no weights exist), `rl.learner.Learner(..., abstract=True)` places the abstract train state with
the learner's real shardings (actor rules, bf16 params, fp32 masters + moments, host offload), and
`Learner.lower` lowers the exact `train_step` jit for an abstract `TrainBatch` of `rows` x `seq_len` tokens per
device of the batch axes (one micro-batch; `--micro-batch-tokens` sets the learner's token budget).
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
from flax import nnx

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

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp - self.host

    def lines(self) -> list[str]:
        g = lambda b: f"{b / GiB:10.2f}"  # noqa: E731
        return [f"XLA memory analysis of the actor train step (per device; {self.rows} rows x {self.seq_len} tokens "
                f"per step = {self.micro_batches} micro-batch(es); compiled in {self.compile_s:.0f} s)",
                f"  arguments (state + batch)                                {g(self.argument)}",
                f"  outputs (new state + metrics)                            {g(self.output)}",
                f"  aliased (donated state)                                  {g(-self.alias)}",
                f"  temporaries (grads, activations, XLA:CPU f32 dot copies) {g(self.temp)}",
                f"  host memory (offloaded optimizer, counted by XLA:CPU)    {g(-self.host)}",
                f"  total on the device                                      {g(self.total)}"]


def compile_actor(config, mesh_spec: str, *, seq_len: int, micro_batch_tokens: int | None = None,
                  offload_optimizer: float = 0.0, train_mtp: bool = True, freeze_router: bool = False,
                  routing_replay: bool = True, scan_layers: bool = False, ep_backend: str | None = None,
                  ep_capacity_factor: float | None = None, stream_optimizer: bool = True) -> CompileReport:
    """Lower and compile the learner's train step for `config` on the actor mesh of `mesh_spec`.

    Needs `spec.n_devices` local devices (XLA:CPU with the device-count flag). Rows per device of the batch
    axes: max(1, micro_batch_tokens // seq_len) (1 without a budget). `scan_layers`: the learner's
    `--scan-layers` (layers under lax.scan: compile time flat in depth). `ep_backend` / `ep_capacity_factor`: the
    expert-parallel dispatch (`parallel.expert.default_dispatch`, i.e. `make_ep_dispatch`; None = its
    default: "capacity", dropless, on CPU). `stream_optimizer`: the learner's streamed update of the offloaded
    stacked state (`rl.optim.update_streamed`; only with offload and scanned layers). Raises whatever the learner raises for a layout it cannot take
    (ValueError), and XLA's errors.
    """
    import dsv4
    from rl.config import LearnerConfig
    from rl.learner import Learner, TrainBatch
    from sharding.mesh import build_mesh_plan, parse_mesh_spec

    if isinstance(config, str):
        config = dsv4.DSV4Config.preset(config)
    spec = parse_mesh_spec(mesh_spec)
    devices = jax.devices()[:spec.n_devices]
    plan = build_mesh_plan(spec, devices=devices, config=config)
    model = nnx.eval_shape(lambda: dsv4.DSV4ForCausalLM(config, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16,
                                                         dtype=jnp.bfloat16))
    cfg = LearnerConfig(compute_dtype="bfloat16", param_dtype="bfloat16", offload_optimizer=offload_optimizer,
                        train_mtp=train_mtp, freeze_router=freeze_router, routing_replay=routing_replay,
                        max_tokens_per_micro_batch=micro_batch_tokens, scan_layers=scan_layers,
                        stream_optimizer=stream_optimizer)
    learner = Learner(model, cfg, mesh=plan.actor, abstract=True)
    if ep_backend is not None or ep_capacity_factor is not None:
        from parallel.expert import default_dispatch
        from rl.learner import _path

        shardings = {_path(p): sh for p, sh in jax.tree_util.tree_leaves_with_path(learner._param_shardings())}
        learner.dispatch_fn = default_dispatch(list(plan.actor.devices.flat), shardings, ep_backend=ep_backend,
                                               ep_capacity_factor=ep_capacity_factor)
    per_dev = 1 if micro_batch_tokens is None else max(1, micro_batch_tokens // seq_len)
    n = per_dev * learner._batch_devices()
    sds = jax.ShapeDtypeStruct
    routing = sds((n, seq_len, config.num_hidden_layers, config.num_experts_per_tok), jnp.int32)
    batch = TrainBatch(input_ids=sds((n, seq_len), jnp.int32), attention_mask=sds((n, seq_len), jnp.int32),
                       response_mask=sds((n, seq_len), jnp.int32), rollout_logprobs=sds((n, seq_len), jnp.float32),
                       advantages=sds((n,), jnp.float32), routing=routing if routing_replay else None)
    t0 = time.perf_counter()
    compiled = learner.lower(batch).compile()
    dt = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    host = 0
    for x in jax.tree.leaves(learner.state):
        if x.sharding.memory_kind == "pinned_host":
            host += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    lay = learner._layout(n, seq_len, seq_len)
    return CompileReport(argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
                         alias=ma.alias_size_in_bytes, temp=ma.temp_size_in_bytes, host=host, rows=n,
                         seq_len=seq_len, micro_batches=lay.micro_batches, compile_s=dt)
