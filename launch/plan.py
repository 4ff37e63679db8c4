"""`python -m launch.plan`: the memory planner's command line (the planner's arithmetic is `parallel/plan.py`).

    python -m launch.plan --config flash --mesh 'actor:fsdp=2,expert=8/rollout:expert=8' --gpu mi308x --nodes 3

prints the planner's table and its `PLAN` line; with `--compile` also the real train step AOT-compiled on CPU
devices (`launch/aot.py`) and XLA's memory analysis, last line `RESULT actor_xla_gib=.. ... fits=yes|no`. Each
compile runs in a child process of its own (`launch/compile_child.py`, with the devices it needs): XLA aborting
there is one `error:` line naming the role, the target and what to try, the other role's program is still compiled
and printed, and the exit status is 1.
It lives in launch/ because `--compile` builds the learner and the sampler (rl/); the arithmetic it prints is
`parallel.plan.plan`, importable on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

import jax

import dsv4
from dsv4.cache import KV_CACHE_DTYPES
from dsv4.lora import LoraConfig
from launch import gpu_target as gt
from launch import run as run_cli
from launch.aot import reduced_depth
from launch.compile_child import CompileFailed, Job, compile_in_child
from launch.roofline import actor_summary, rollout_summary
from parallel.flops import train_flops_per_token
from parallel.model_bytes import DTYPE_BYTES
from parallel.plan import GPUS, GPUS_PER_NODE, GiB, plan
from parallel.plan import __doc__ as _PLAN_DOC
from rl import config_tree
from rl.algo_config import LearnerConfig
from rl.config import DEFAULT_LEARNER, DataConfig
from rl.rollout.config import RolloutConfig
from rl.config_tree import default
from rl.rollout.settings import EngineSettings
from sharding import mesh as mesh_lib
from sharding.rules import CONTEXT


_LEARNER = config_tree.paths(LearnerConfig)
_ROLLOUT = config_tree.paths(RolloutConfig)


def _knob_help(name: str) -> str:
    """The run's help of the learner knob `name` and its launch/run.py flag (rl/algo_config.py, one definition)."""
    return f"{_LEARNER[name].help} (launch/run.py --{name.replace('_', '-')}; default %(default)s)"


def _learner(args) -> LearnerConfig:
    """The run's learner (`rl.config.DEFAULT_LEARNER`) with this command's learner flags: what is planned and
    compiled. ValueError (the run's one-line message) for a bad value."""
    return dataclasses.replace(
        DEFAULT_LEARNER, offload_optimizer=args.offload_optimizer, train_mtp=args.train_mtp,
        freeze_router=args.freeze_router, scan_layers=args.scan_layers, stream_optimizer=args.stream_optimizer,
        ep_backend=args.ep_backend, ep_capacity_factor=args.ep_capacity_factor,
        max_tokens_per_micro_batch=args.micro_batch_tokens,
        lora=LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets))


def parser() -> argparse.ArgumentParser:
    """The planner's flags; the learner's, the rollout's and the data's take their defaults (and help) from the
    run's definitions (`rl.config.DEFAULT_LEARNER`, `rl.rollout.config.RolloutConfig`, `rl.config.DataConfig`)."""
    p = argparse.ArgumentParser(prog="python -m launch.plan", description=_PLAN_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", default=None, metavar="YAML",
                   help="plan the run of this launch/run.py config file (its model, mesh, learner and rollout "
                        "knobs; the dataset and checkpoint are not read); the flags given here override it")
    p.add_argument("--config", default="flash", help="preset name: flash | small | tiny (default flash)")
    p.add_argument("--mesh", default=None, help="mesh spec, e.g. 'actor:fsdp=2,expert=8/rollout:expert=8' "
                                                "(required without --config-file)")
    p.add_argument("--gpu", default=None, choices=sorted(GPUS),
                   help="the planner's GPU table entry (default: --target's; required with --target cpu)")
    p.add_argument("--target", default="cpu", choices=gt.TARGET_NAMES,
                   help="--compile: the compiler: cpu = XLA:CPU on host devices; a GPU = XLA:GPU on a deviceless "
                        "topology of that GPU (needs the [gpu-aot] extra; AMD GPUs through an NVIDIA spec with the "
                        "AMD memory size, labelled proxy; launch/gpu_target.py) (default %(default)s)")
    p.add_argument("--nodes", type=int, default=None, help=f"nodes of {GPUS_PER_NODE} GPUs (default: from the mesh)")
    p.add_argument("--optimizer-dtype", choices=sorted(DTYPE_BYTES), default="fp32")
    p.add_argument("--offload-optimizer", type=float, default=DEFAULT_LEARNER.offload_optimizer, metavar="FRACTION",
                   help=_knob_help("offload_optimizer"))
    p.add_argument("--tokens-per-device", type=int, default=4096, help="actor tokens per device per micro-step")
    p.add_argument("--rollout-seq-len", type=int, default=4096, help="max prompt + completion length (KV cache)")
    p.add_argument("--train-seq-len", type=int, default=None, help="actor sequence length (default: rollout's)")
    p.add_argument("--rollout-experts", choices=("fp8", "fp4"), default="fp8")
    p.add_argument("--fp8-scale-bytes", type=float, default=4.0, help="bytes per FP8 block scale (sampler: f32 = 4)")
    p.add_argument("--fp4-scale-bytes", type=float, default=1.0, help="bytes per FP4 1x32 scale (E8M0 = 1)")
    p.add_argument("--rollout-dequant", choices=("per_step", "per_call"), default="per_step",
                   help="sampler dequant mode; per_call keeps a bf16 copy of the quantised weights")
    p.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                   help="sampler compute dtype (KV entries of the unquantised cache, --kv-cache-dtype bf16)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=default(RolloutConfig, "kv_cache_dtype"),
                   help="the run's --kv-cache-dtype: fp8 | bf16 | auto (fp8 for --rollout-dtype fp8*)")
    p.add_argument("--speculative-k", type=int, choices=(0, 1, 2, 3), default=0,
                   help="plan and --compile speculative rollouts with k MTP draft tokens (--rollout.speculative mtp "
                        "--rollout.draft_tokens k: the MTP cache, k more positions, the verify program); 0 = off")
    p.add_argument("--usable-fraction", type=float, default=0.90)
    p.add_argument("--rollout-reserve", type=float, default=0.10)
    p.add_argument("--rollout-seqs-per-device", type=int, default=1, help="sequences that must fit for 'fits'")
    # the learner's scale knobs: the run's definitions (rl.config: help, choices, defaults of the run's learner)
    p.add_argument("--ep-capacity-factor", type=float, default=DEFAULT_LEARNER.ep_capacity_factor,
                   help=_knob_help("ep_capacity_factor"))
    p.add_argument("--ep-backend", choices=_LEARNER["ep_backend"].choices, default=DEFAULT_LEARNER.ep_backend,
                   help=_knob_help("ep_backend") + "; the plan without --compile counts auto as ragged (GPUs)")
    p.add_argument("--stream-optimizer", action=argparse.BooleanOptionalAction,
                   default=DEFAULT_LEARNER.stream_optimizer, help=_knob_help("stream_optimizer"))
    p.add_argument("--host-gib-per-node", type=float, default=None,
                   help="host RAM per node for the offloaded optimizer; checked only when given")
    p.add_argument("--train-mtp", action=argparse.BooleanOptionalAction, default=DEFAULT_LEARNER.train_mtp,
                   help="train the MTP module (optimizer state for it), the learner's train_mtp (default %(default)s)")
    p.add_argument("--freeze-router", action=argparse.BooleanOptionalAction, default=DEFAULT_LEARNER.freeze_router,
                   help=_knob_help("freeze_router"))
    lora_knobs = config_tree.paths(LoraConfig)
    p.add_argument("--lora-rank", type=int, default=DEFAULT_LEARNER.lora.rank,
                   help=f"{lora_knobs['rank'].help} (launch/run.py --learner.lora.rank; default %(default)s)")
    p.add_argument("--lora-alpha", type=float, default=DEFAULT_LEARNER.lora.alpha,
                   help=f"{lora_knobs['alpha'].help} (launch/run.py --learner.lora.alpha; default %(default)s)")
    p.add_argument("--lora-targets", default=DEFAULT_LEARNER.lora.targets,
                   help=f"{lora_knobs['targets'].help} (launch/run.py --learner.lora.targets; default %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="also AOT-compile the real actor train step on CPU devices and print XLA's memory analysis")
    p.add_argument("--seq-len", type=int, default=None, help="--compile: tokens per row (default --train-seq-len "
                   "or --rollout-seq-len)")
    p.add_argument("--micro-batch-tokens", type=int, default=DEFAULT_LEARNER.max_tokens_per_micro_batch,
                   help="--compile: the learner's --max-tokens-per-micro-batch (default: one row per device)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=DEFAULT_LEARNER.scan_layers,
                   help="--compile: " + _knob_help("scan_layers"))
    p.add_argument("--rollout-batch", type=int, default=1024, help="--compile: sequences of the rollout program")
    p.add_argument("--rollout-context", type=int, default=32768,
                   help="--compile: prompt + new tokens per rollout sequence")
    p.add_argument("--rollout-prompt-len", type=int, default=default(DataConfig, "max_prompt_len"),
                   help="--compile: prompt tokens per sequence (the run's --max-prompt-len; default %(default)s)")
    p.add_argument("--rollout-dtype", default=default(RolloutConfig, "dtype"),
                   help="--compile: the sampler's --rollout-dtype (default %(default)s)")
    p.add_argument("--rollout-slots", default="auto",
                   help="--compile: the rollout program's --rollout-slots: auto (default: continuous batching over as "
                        "many slots as the plan's KV budget holds, at most --rollout-batch) | N | 0 (static batching)")
    p.add_argument("--rollout-ep-backend", choices=_ROLLOUT["ep_backend"].choices,
                   default=default(RolloutConfig, "ep_backend"),
                   help="--compile: " + _ROLLOUT["ep_backend"].help + " (the run's --rollout.ep_backend; default "
                        "%(default)s)")
    p.add_argument("--rollout-ep-capacity-factor", type=float, default=default(RolloutConfig, "ep_capacity_factor"),
                   help="--compile: " + _ROLLOUT["ep_capacity_factor"].help + " (the run's "
                        "--rollout.ep_capacity_factor; default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=default(RolloutConfig, "prefill_chunk"),
                   help="--compile: the sampler's --prefill-chunk (tokens per prefill chunk; 0 = whole prompt)")
    p.add_argument("--compile-only", choices=("both", "actor", "rollout"), default="both",
                   help="--compile: which programs to compile (default both)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="plan/compile a reduced-depth copy of the config (first N main layers; labelled)")
    return p


# planner flag (dest) -> its value in the run's config (`rl.config.RunConfig`), for --config-file
_FROM_RUN = {
    "config": lambda c: c.model.config, "mesh": lambda c: c.mesh,
    **{k: (lambda c, k=k: getattr(c.learner, k)) for k in (
        "offload_optimizer", "train_mtp", "freeze_router", "scan_layers", "stream_optimizer", "ep_backend",
        "ep_capacity_factor")},
    "lora_rank": lambda c: c.learner.lora.rank, "lora_alpha": lambda c: c.learner.lora.alpha,
    "lora_targets": lambda c: c.learner.lora.targets,
    "micro_batch_tokens": lambda c: c.learner.max_tokens_per_micro_batch,
    "tokens_per_device": lambda c: c.learner.max_tokens_per_micro_batch or c.data.max_prompt_len
    + c.rollout.max_new_tokens,
    "seq_len": lambda c: c.data.max_prompt_len + c.rollout.max_new_tokens,
    "rollout_seq_len": lambda c: c.data.max_prompt_len + c.rollout.max_new_tokens,
    "rollout_batch": lambda c: c.rollout.prompts_per_step * c.rollout.group_size,
    "rollout_context": lambda c: c.data.max_prompt_len + c.rollout.max_new_tokens,
    "rollout_prompt_len": lambda c: c.data.max_prompt_len,
    "rollout_dtype": lambda c: c.rollout.dtype, "kv_cache_dtype": lambda c: c.rollout.kv_cache_dtype,
    "rollout_slots": lambda c: str(c.rollout.slots), "prefill_chunk": lambda c: c.rollout.prefill_chunk,
    "rollout_ep_backend": lambda c: c.rollout.ep_backend,
    "rollout_ep_capacity_factor": lambda c: c.rollout.ep_capacity_factor,
}


def _apply_config_file(p: argparse.ArgumentParser, args, argv: Sequence[str]) -> None:
    """--config-file: every planner knob of `_FROM_RUN` not given on the command line takes the run's value, as
    launch/run.py resolves the file (`launch.run.resolve`: defaults < algo preset < the YAML). ValueError names
    the file for a bad one."""
    run, _ = run_cli.resolve(["--config-file", args.config_file])
    given = {a.dest for a in p._actions for tok in argv for opt in a.option_strings
             if tok == opt or tok.startswith(opt + "=") or tok == opt.replace("--", "--no-", 1)}
    for dest, get in _FROM_RUN.items():
        if dest not in given:
            setattr(args, dest, get(run))


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.config_file:
        try:
            _apply_config_file(p, args, argv)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.mesh is None:
        print("error: --mesh is required (or --config-file)", file=sys.stderr)
        return 2
    if str(args.rollout_slots).lower() == "auto":
        args.rollout_slots = "auto"
    else:
        slots = int(args.rollout_slots) if str(args.rollout_slots).isdigit() else -1
        if slots < 0:
            print(f"error: --rollout-slots {args.rollout_slots}: expected auto or an int >= 0", file=sys.stderr)
            return 2
        args.rollout_slots = slots
    if args.gpu is None:
        if args.target == "cpu":
            print("error: --gpu is required (or a GPU --target)", file=sys.stderr)
            return 2
        args.gpu = args.target
    target = None if args.target == "cpu" else gt.TARGETS[args.target]
    if args.compile and target is not None and not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # deviceless topologies: the CUDA plugin skips its driver checks
    if args.compile and target is not None:
        err = gt.plugin_error()
        if err:
            print(f"error: --target {args.target}: {err}", file=sys.stderr)
            return 2
    try:
        learner = _learner(args)  # the run's checks
        config = args.config
        if args.num_layers is not None:
            config = reduced_depth(dsv4.DSV4Config.preset(args.config), args.num_layers)
        seq = args.seq_len or args.train_seq_len or args.rollout_seq_len
        tokens = args.tokens_per_device
        if args.compile:  # the plan of exactly what is compiled
            tokens = compiled_tokens_per_device(args.mesh, seq, args.micro_batch_tokens)
        name = args.config + (f" (reduced to {args.num_layers} layers)" if args.num_layers is not None else "")
        report = plan(config, args.mesh, args.gpu, learner=learner, nodes=args.nodes,
                      optimizer_dtype=args.optimizer_dtype, tokens_per_device=tokens,
                      rollout_seq_len=args.rollout_seq_len,
                      train_seq_len=seq if args.compile else args.train_seq_len,
                      rollout_experts=args.rollout_experts, fp8_scale_bytes=args.fp8_scale_bytes,
                      fp4_scale_bytes=args.fp4_scale_bytes, rollout_dequant=args.rollout_dequant,
                      kv_dtype="fp8" if _engine(args).kv_layout == "fp8" else args.kv_dtype,
                      usable_fraction=args.usable_fraction, rollout_reserve=args.rollout_reserve,
                      rollout_seqs_per_device=args.rollout_seqs_per_device, draft_tokens=args.speculative_k,
                      host_gib_per_node=args.host_gib_per_node, config_name=name,
                      xla_cpu=args.compile and target is None)
    except ValueError as e:  # MeshSpecError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    print(report.line())
    if not args.compile:
        return 0
    if target is not None:
        return _compile_gpu(config, report, args, learner, seq, target)
    a, r = report.actor, report.rollout
    a_xla = None
    failed = False
    if args.compile_only in ("both", "actor"):
        try:
            xla = _in_child("launch.aot:compile_actor", dict(config=config, mesh_spec=report.mesh_spec, seq_len=seq,
                                                               learner=learner), "actor", args, report)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except CompileFailed as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
        else:
            a_xla = xla.total
            print("\n".join(xla.lines()))
            print(f"  planner arithmetic for the same step: {a.total / GiB:.2f} GiB (XLA/plan = "
                  f"{xla.total / a.total:.2f}), of which {a.cpu_only / GiB:.2f} GiB are the items only XLA:CPU holds; "
                  "XLA:CPU upcasts bf16 dots to f32 (temporaries above a GPU's)")
            print(f"  GPU estimate: plan {a.gpu_total / GiB:.2f} GiB; XLA:CPU figure less the planned XLA:CPU-only "
                  f"items (CPU-artefact-corrected, an estimate) {(xla.total - a.cpu_only) / GiB:.2f} GiB; raw XLA:CPU "
                  f"{xla.total / GiB:.2f} GiB")
    rx = None
    if args.compile_only in ("both", "rollout"):
        try:
            rx = _compile_rollout(config, report, args)
        except CompileFailed as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    r_xla = None if rx is None else rx.total
    if args.gpu in gt.TARGETS:  # XLA:CPU's HLO with the GPU's peaks: the CPU artefacts in flops and bytes
        peaks = gt.TARGETS[args.gpu]
        _rooflines(config, report, seq, peaks, f"XLA:CPU HLO, {peaks.name} peaks",
                   xla if a_xla is not None else None, rx)
    fits = _verdict(report, args, a_xla, r_xla)
    gib = lambda b: float("nan") if b is None else b / GiB  # noqa: E731
    print(f"RESULT actor_xla_gib={gib(a_xla):.2f} actor_plan_gib={a.total / GiB:.2f} "
          f"actor_usable_gib={a.usable / GiB:.2f} rollout_xla_gib={gib(r_xla):.2f} rollout_plan_gib={r.total / GiB:.2f} "
          f"rollout_usable_gib={r.usable / GiB:.2f} fits={'yes' if fits else 'no'}")
    return 1 if failed else 0


def _rollout(args) -> RolloutConfig:
    """The rollout knobs the planner's flags name, as the run's `RolloutConfig` (the engine's settings are resolved
    from it as the run resolves them: `rl.rollout.settings.EngineSettings.for_run`)."""
    return RolloutConfig(dtype=args.rollout_dtype, kv_cache_dtype=args.kv_cache_dtype, slots=args.rollout_slots,
                         prefill_chunk=args.prefill_chunk, speculative="mtp" if args.speculative_k else "off",
                         draft_tokens=args.speculative_k or default(RolloutConfig, "draft_tokens"),
                         ep_backend=args.rollout_ep_backend, ep_capacity_factor=args.rollout_ep_capacity_factor)


def _engine(args) -> EngineSettings:
    """The engine settings of the planned rollout (its weights and KV cache layout)."""
    return EngineSettings(weights=args.rollout_dtype, kv_cache_dtype=args.kv_cache_dtype)


def _in_child(fn: str, kwargs: dict, role: str, args, report, gpu_target: gt.Target | None = None):
    """`fn(**kwargs)` ("launch.aot:compile_actor" / "launch.aot:compile_rollout") in a child process of its own
    (launch/compile_child.py): on XLA:CPU with the mesh's devices, or on abstract GPUs of `gpu_target`.
    Returns its report; raises ValueError (its own) or CompileFailed (one line naming `role`, the target and what
    to try)."""
    other = {"actor": "rollout", "rollout": "actor"}[role]
    alone = f", or --compile-only {other} to compile the {other} program alone"
    if gpu_target is None:
        target, hint = "XLA:CPU, --target cpu", f"a GPU --target (XLA:GPU, deviceless; the [gpu-aot] extra){alone}"
    else:
        target, hint = f"XLA:GPU {gpu_target.label}, --target {args.target}", f"--target cpu (XLA:CPU){alone}"
    n_dev = mesh_lib.parse_mesh_spec(report.mesh_spec).n_devices
    job = Job(fn, kwargs, gpu_target=gpu_target, n_devices=n_dev, gpus_per_node=GPUS_PER_NODE)
    return compile_in_child(job, role=role, target=target, hint=hint, n_devices=n_dev, gpu=gpu_target is not None)


def compiled_tokens_per_device(mesh: str, seq: int, micro_batch_tokens: int | None) -> int:
    """Actor tokens per device of the step `--compile` builds (`launch.aot.compile_actor`): rows per device of the
    batch axes x `seq` / C, each row split over the actor's C = context devices (dsv4/context.py); rows as the
    learner lays them out (rl/batching.py: the budget counts tokens per context shard, max(1, budget C // seq);
    1 without a budget). ValueError (MeshSpecError) for a bad `mesh`."""
    cp = mesh_lib.parse_mesh_spec(mesh).axes("actor").get(CONTEXT, 1)
    rows = 1 if micro_batch_tokens is None else max(1, micro_batch_tokens * cp // seq)
    return rows * seq // cp


def _verdict(report, args, a_xla: float | None, r_xla: float | None, say=print) -> bool:
    """Print the verdict line of the XLA figures against the plan's usable bytes; True when what was compiled
    fits (a role not compiled: the plan's verdict)."""
    a, r = report.actor, report.rollout
    r_fits = r.fits if r_xla is None else r_xla <= r.usable
    a_fits = a.fits if a_xla is None else a_xla <= a.usable
    fits = (a_fits or args.compile_only == "rollout") and (r_fits or args.compile_only == "actor")
    verdict = []
    if a_xla is not None:
        short = "" if a_fits else f", {(a_xla - a.usable) / GiB:.2f} GiB over"
        verdict.append(f"actor {'fits' if a_fits else 'does not fit'} ({a_xla / GiB:.2f} of {a.usable / GiB:.1f} "
                       f"GiB usable{short})")
    if r_xla is not None:
        short = "" if r_fits else f", {(r_xla - r.usable) / GiB:.2f} GiB over"
        verdict.append(f"rollout {'fits' if r_fits else 'does not fit'} ({r_xla / GiB:.2f} of "
                       f"{r.usable / GiB:.1f} GiB usable{short})")
    say(f"  verdict (XLA figures): {'; '.join(verdict) or 'nothing compiled'}")
    return fits


def _compile_gpu(config, report, args, learner, seq: int, target: gt.Target) -> int:
    """--compile --target GPU: both programs compiled by XLA:GPU for `target` on a deviceless topology of the
    mesh's devices (launch/gpu_target.py), XLA's memory figures against the plan's usable bytes, the roofline of
    each (launch/roofline.py), and the RESULT line of issue 24. A proxy target prefixes every line with "proxy"."""
    tag = f"proxy {target.name} | " if target.proxy else ""

    def say(text: str) -> None:
        print("\n".join(tag + ln for ln in text.splitlines()))

    if target.proxy:
        say(f"{target.device}: no ROCm runtime here, so XLA:GPU compiles for the {target.spec} NVIDIA spec with "
            f"{target.memory_bytes() / GiB:.0f} GiB of device memory (buffer assignment and partitioning are "
            f"XLA:GPU's; kernels and fusions are NVIDIA's); usable = {args.usable_fraction:.0%} of it, as planned")
    a, r = report.actor, report.rollout
    # abstract devices have no host memory: the actor compiles with its offloaded optimizer state on the device, so
    # its memory limit (the scheduler's, the rematerialisation's) is the device's plus those bytes (the plan's)
    a_target = dataclasses.replace(target, hbm_bytes=target.memory_bytes() + int(a.host)) if a.host else target
    if a.host:
        say(f"actor compile: device memory limit {a_target.memory_bytes() / GiB:.1f} GiB = "
            f"{target.memory_bytes() / GiB:.0f} GiB + the {a.host / GiB:.1f} GiB of offloaded optimizer state it "
            f"holds on the device here (abstract devices have no host memory kind)")
    backend = f"XLA:GPU {target.label}"
    a_xla = r_xla = xla = None
    failed = False
    if args.compile_only in ("both", "actor"):
        try:
            xla = _in_child("launch.aot:compile_actor", dict(config=config, mesh_spec=report.mesh_spec, seq_len=seq,
                                                               learner=learner, backend=backend,
                                                               compiler_options=gt.compile_options()),
                            "actor", args, report, gpu_target=a_target)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except CompileFailed as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    if xla is not None:
        if xla.host_from_shardings:  # the streamed update's device transient: the plan's arithmetic
            key = "optimizer update: offloaded state moved to the device (learner's step)"
            xla = dataclasses.replace(xla, transient=int(a.items.get(key, 0)))
        a_xla = xla.total
        say("\n".join(xla.lines()))
        say(f"  planner arithmetic for the same step: {a.gpu_total / GiB:.2f} GiB (XLA:GPU/plan = "
            f"{xla.total / a.gpu_total:.2f})")
    rx = None
    if args.compile_only in ("both", "rollout"):
        try:
            rx = _compile_rollout(config, report, args, gpu_target=target, backend=backend, say=say,
                                  compiler_options=gt.compile_options())
        except CompileFailed as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
        r_xla = None if rx is None else rx.total
        if rx is not None and "fnuz" in args.rollout_dtype:
            say(f"  --rollout-dtype {args.rollout_dtype}: XLA:CUDA has no e4m3fnuz GEMM, so on this NVIDIA target the "
                "FP8 projections are converted before their dots (0 FP8 dots below); on gfx942 (ROCm) they are FP8 "
                "GEMMs (dsv4/rollout_format.py `GEMM_KEYS`; --rollout-dtype fp8 shows them on an NVIDIA target). The "
                "routed experts are dequantised per layer on every backend (no grouped FP8 GEMM)")
    step_s, ratio, tok_s = _rooflines(config, report, seq, target, target.label,
                                      xla if a_xla is not None else None, rx, say=say)
    fits = _verdict(report, args, a_xla, r_xla, say=say)
    gib = lambda b: float("nan") if b is None else b / GiB  # noqa: E731
    name = target.name + ("-proxy" if target.proxy else "")
    print(f"RESULT target={name} actor_gpu_gib={gib(a_xla):.2f} actor_usable_gib={a.usable / GiB:.2f} "
          f"rollout_gpu_gib={gib(r_xla):.2f} actor_step_s_roofline={step_s:.3f} rollout_tok_s_roofline={tok_s:.0f} "
          f"remat_flops_ratio={ratio:.2f} fits={'yes' if fits else 'no'}")
    return 1 if failed else 0


def _rooflines(config, report, seq: int, target: gt.Target, label: str, xla, rx, say=print):
    """The roofline lines of the compiled actor step `xla` and rollout program `rx` (either None: not compiled)
    with `target`'s peaks (launch/roofline.py), and the machine-readable `ROOFLINE actor_step_s=..
    remat_flops_ratio=.. rollout_tok_s=..` line (benchmarks/gpu_plan.py reads it). Returns those three."""
    step_s = ratio = tok_s = float("nan")
    config = dsv4.DSV4Config.preset(config) if isinstance(config, str) else config
    if xla is not None:
        n_actor = mesh_lib.parse_mesh_spec(report.mesh_spec).size("actor")
        model = train_flops_per_token(config, seq)["total"] * xla.rows * seq / n_actor
        lines, fig = actor_summary(xla.hlo, target, model_flops=model, label=label)
        say("\n".join(lines))
        step_s, ratio = fig["step_s"], fig["remat_flops_ratio"]
    if rx is not None:
        lines, fig = rollout_summary(rx.hlo, rx.hlo.decode_step, target, seqs=rx.slots or rx.batch,
                                     weight_bytes=rx.weights, label=label)
        say("\n".join(lines))
        tok_s = fig["tok_s"]
    say(f"ROOFLINE actor_step_s={step_s:.3f} remat_flops_ratio={ratio:.2f} rollout_tok_s={tok_s:.0f}")
    return step_s, ratio, tok_s


def _compile_rollout(config, report, args, gpu_target: gt.Target | None = None, backend: str = "XLA:CPU", say=print,
                     compiler_options: dict | None = None):
    """--compile, rollout side: XLA's figures of the sampler's generate program on the rollout mesh
    (`launch.aot.compile_rollout`, `--rollout-batch` x `--rollout-context`; continuous batching over
    `--rollout-slots` slots with `--prefill-chunk` chunked per-request prefill, or static with slots 0), printed
    with the KV capacity left;
    returns the `RolloutCompileReport` (None, with the error printed, when it cannot be compiled). In a child
    process (`_in_child`; on abstract GPUs of `gpu_target` when given): CompileFailed when it aborts or fails."""
    try:
        rx = _in_child("launch.aot:compile_rollout", dict(
            config=config, mesh_spec=report.mesh_spec, batch=args.rollout_batch, context=args.rollout_context,
            prompt_len=args.rollout_prompt_len, rollout=_rollout(args), kv_budget=report.rollout.margin,
            backend=backend, compiler_options=compiler_options), "rollout", args, report, gpu_target=gpu_target)
    except ValueError as e:
        print(f"error (rollout compile): {e}", file=sys.stderr)
        return None
    r = report.rollout
    say("\n".join(rx.lines(usable=r.usable)))
    say(f"  planner arithmetic for the rollout: {r.total / GiB:.2f} GiB counted (weights + reserve) of "
        f"{r.usable / GiB:.1f} GiB usable")
    return rx


if __name__ == "__main__":
    sys.exit(main())
