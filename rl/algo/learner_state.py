"""The learner's state and where it lives: `TrainState`, `LogprobResult`, the param dtype policy, the state's
shardings, and the optimizer state's placement (host offload and its slice-by-slice streaming), for rl/algo/learner.py.

    shardings = state_shardings(abstract_state, mesh, rules)        # sharding.rules over a TrainState
    shardings = master_like_params(shardings)                        # fp32 masters placed like their params
    chosen, shardings = offload_shardings(cfg, state.params, shardings, trained, device)   # --offload-optimizer
    streamed = streamable(state.params, chosen)                      # --learner.stream_optimizer
    opt_state = opt_state_to(opt_state, "device", chosen, streamed, state.params, shardings.opt_state)  # in-step

Offload: `sharding.offload.select_offloaded` picks the trained params whose optimizer state moves to host memory
(`pinned_host`), a fraction `LearnerConfig.offload_optimizer` of the state's bytes; inside the step the state is
moved to the device and back (`opt_state_to`), except the streamed params', which `rl.algo.optim.update_streamed` moves
one layer slice at a time. Tests: tests/rl/test_learner_scale.py, tests/rl/test_learner_scan.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx, struct
from jax.sharding import Mesh

from dsv4.names import tree_key
from dsv4.quant import select_fp8_format
from dsv4.rollout_format import RolloutFormat, parse_rollout_dtype
from rl.algo import optim
from rl.config.algo import LearnerConfig
from sharding import offload as so
from sharding import rules as sr


@struct.dataclass
class TrainState:
    """step: int32 scalar (applied updates); params: nnx.State of float32 Params; opt_state: optax state;
    buffers: nnx.State of Buffers; ref_params: nnx.State of the reference Params (kl_coef > 0) or None."""

    step: jax.Array
    params: Any
    opt_state: Any
    buffers: Any
    ref_params: Any = None


@struct.dataclass
class LogprobResult:
    """`Learner.compute_logprobs` output: logprobs, entropy [N, S] float32, routing [N, S, L, k] int32."""

    logprobs: jax.Array
    entropy: jax.Array
    routing: jax.Array


def resolve_param_dtype(cfg: LearnerConfig, devices) -> LearnerConfig:
    """`cfg` with `param_dtype="auto"` decided for `devices` (`jax.Device`s; only `.platform` is read): float32 on
    CPU (bf16 matmuls are emulated there), bfloat16 (+ fp32 masters) on accelerators; other values unchanged."""
    if cfg.param_dtype != "auto":
        return cfg
    cpu = all(d.platform == "cpu" for d in devices)
    return dataclasses.replace(cfg, param_dtype="float32" if cpu else "bfloat16")


def state_shardings(abstract_state: Any, mesh: Mesh, rules: sr.Rules) -> Any:
    """`sharding.rules.param_shardings` of a TrainState. Variables that hold no array (optax's `MaskedNode` in
    the Adam state of frozen params) are kept as they are: they have no leaves, so they need no sharding."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=is_var)[0]
    named = {jax.tree_util.keystr(p, simple=True, separator="."): leaf for p, leaf in flat if jax.tree.leaves(leaf)}
    shardings = sr.param_shardings(named, mesh, rules)
    return jax.tree_util.tree_map_with_path(
        lambda p, leaf: shardings.get(jax.tree_util.keystr(p, simple=True, separator="."), leaf),
        abstract_state, is_leaf=is_var)


def place(state: Any, shardings: Any, abstract: bool) -> Any:
    """`state` at `shardings`: an abstract state (leaves `jax.ShapeDtypeStruct`) gets them as its leaves'
    shardings, a concrete one is moved there (`jax.device_put`)."""
    if abstract:
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state, shardings)
    return jax.device_put(state, shardings)


def master_like_params(shardings: TrainState) -> TrainState:
    """fp32 masters (bare arrays in `optim.MasterState.master`) are placed like their params."""
    if not isinstance(shardings.opt_state, optim.MasterState):
        return shardings
    by_path = {tree_key(p): sh for p, sh in jax.tree_util.tree_leaves_with_path(shardings.params)}
    master = {k: by_path[k] for k in shardings.opt_state.master}
    return shardings.replace(opt_state=shardings.opt_state.replace(master=master))


def offload_shardings(cfg: LearnerConfig, params: Any, shardings: TrainState, trained: dict[str, bool],
                      device) -> tuple[frozenset[str], TrainState]:
    """The params whose optimizer state `sharding.offload.select_offloaded` moves to host memory (pinned_host)
    -> (their paths, `shardings` with their state there). `device`: one device of the learner's mesh.
    Raises ValueError when `cfg.offload_optimizer` > 0 and the backend has no host memory."""
    frac = cfg.offload_optimizer
    if frac == 0:
        return frozenset(), shardings
    kinds = {m.kind for m in device.addressable_memories()}
    if so.HOST_MEMORY_KIND not in kinds:
        raise ValueError(f"--offload-optimizer {frac}: the {device.platform} backend has no "
                         f"'{so.HOST_MEMORY_KIND}' memory (memory kinds: {sorted(kinds)})")
    leaves = jax.tree_util.tree_leaves_with_path(params)
    sizes = [(k, so.state_bytes(math.prod(x.shape), str(x.dtype))) for p, x in leaves if trained[(k := tree_key(p))]]
    chosen = so.select_offloaded(sizes, frac)
    names = {tree_key(p) for p, _ in leaves}
    opt_sh = optim.offload_shardings(shardings.opt_state, names, chosen, so.HOST_MEMORY_KIND)
    return chosen, shardings.replace(opt_state=opt_sh)


def streamable(params: Any, offloaded: frozenset[str]) -> dict[str, int]:
    """Offloaded params whose state the step streams slice by slice (`rl.algo.optim.update_streamed`), each with the
    number of blocks its leading dim is split into over the mesh: ndim >= 3 (a slice keeps ndim >= 2: the
    weight-decay mask is unchanged) and a leading dim > 1 (with `scan_layers`: the stacked layer dim), unsplit (1) or
    split in blocks (a pipelined group's layers over `stage`: every stage streams its own layers; before, such a
    leaf's whole state went to the device for the update); and 2-D leaves of >= `ROW_STREAM_MIN` elements whose rows
    split into `ROW_STEPS` chunks (`sharding.offload`) per block (the embedding and the head: Flash's 2 x 5.9 GiB of
    fp32 state went to the device whole). (Streaming a group of one layer too was measured worse: +11 GiB in
    XLA:CPU's figure of the 4-layer Flash step, so it is moved whole.)"""
    out = {}
    for p, x in jax.tree_util.tree_leaves_with_path(params):
        name = tree_key(p)
        rows = x.ndim == 2 and math.prod(x.shape) >= so.ROW_STREAM_MIN
        if name not in offloaded or not (rows or (x.ndim >= 3 and x.shape[0] > 1)):
            continue
        sh = getattr(x, "sharding", None)
        spec = getattr(sh, "spec", None)
        lead = spec[0] if spec is not None and len(spec) else None
        blocks = 1 if lead is None else math.prod(sh.mesh.shape[a] for a in (lead if isinstance(lead, tuple)
                                                                              else (lead,)))
        if x.shape[0] % (blocks * (so.ROW_STEPS if rows else 1)) == 0:
            out[name] = blocks
    return out


def opt_state_to(opt_state: Any, kind: str, offloaded: frozenset[str], streamed: Mapping[str, int], params: Any,
                 opt_shardings: Any) -> Any:
    """Inside the step: offloaded optimizer state to device memory (kind "device") or back (kind "host"); the
    state of the `streamed` params stays where it is (the streamed update moves it slice by slice). `params`: the
    state's params (their paths name the state's owners); `opt_shardings`: the optimizer state's shardings."""
    if not offloaded:
        return opt_state
    owner = optim.param_owner({tree_key(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)})

    def move(path, x, sh):
        if sh.memory_kind != so.HOST_MEMORY_KIND or owner(path) in streamed:
            return x
        return jax.device_put(x, sh if kind == "host" else sh.with_memory_kind("device"))

    return jax.tree_util.tree_map_with_path(move, opt_state, opt_shardings)


def fp8_forward_format(cfg: LearnerConfig, rollout_dtype: str, devices, block, compute_dtype) -> RolloutFormat | None:
    """--learner.fp8_forward: how the rollout stores each weight (`dsv4.rollout_format.RolloutFormat`, its FP8
    format chosen for the rollout's `devices`, scale `block` (b0, b1), dequantised to `compute_dtype`); None without
    it. Raises ValueError naming the flag when --rollout-dtype is not an FP8 one."""
    if not cfg.fp8_forward:
        return None
    rdt = parse_rollout_dtype(rollout_dtype)
    if not rdt.fp8:
        raise ValueError(f"LearnerConfig.fp8_forward (--learner.fp8_forward) reproduces an FP8 rollout, but "
                         f"--rollout-dtype is {rollout_dtype}: use an fp8 --rollout-dtype")
    return RolloutFormat(rdt=rdt, fmt=select_fp8_format(rdt.fp8_name, devices), block=tuple(block),
                         compute_dtype=compute_dtype)


def check_lora(module, cfg: LearnerConfig) -> None:
    """Raises ValueError naming --learner.lora.rank when LoRA is on and `module` does not hold adapters of exactly
    `cfg.lora` (build it with `DSV4ForCausalLM(..., lora=...)` or `dsv4.lora.attach`)."""
    if cfg.lora.enabled and getattr(module, "lora", None) != cfg.lora:
        raise ValueError(f"--learner.lora.rank {cfg.lora.rank}: the model holds no adapters of this LoraConfig "
                         f"(it has {getattr(module, 'lora', None)}): build it with DSV4ForCausalLM(..., lora=...) "
                         f"or dsv4.lora.attach")
