"""`python -m launch.plan`: the memory planner's command line (the planner's arithmetic is `parallel/plan.py`).

    python -m launch.plan --config flash --mesh 'actor:fsdp=2,expert=8/rollout:expert=8' --gpu mi308x --nodes 3 \
        --max-prompt-len 1024 --max-new-tokens 3072
    python -m launch.plan --config-file launch/configs/dapo_seed_mi308x.yaml --compile --target mi308x

plans the run that launch/run.py would start with the same flags: every knob of the run (the model, the mesh, the
learner, the rollout, the data's prompt length) is read from the run's config, resolved by `launch.run.resolve` from
the same `--config-file` YAML, flat flags and dotted flags (`--learner.train_mtp`, `--rollout.speculative mtp`),
with the run's defaults. One sequence length: prompt + completion (`--max-prompt-len` + `--max-new-tokens`), the
KV cache's, the actor's rows' and the compiled rollout program's; the rollout program's batch is the step's
`--prompts-per-step` x `--group-size`; the actor's tokens per device are the learner's
(`--max-tokens-per-micro-batch`, `compiled_tokens_per_device`). The planner's own flags (`parser`) say what to
plan on (`--gpu`, `--nodes`, `--target`, the memory fractions) and what to compile (`--compile`, `--compile-only`,
`--num-layers`).

Prints the planner's table and its `PLAN` line; with `--compile` also the real train step AOT-compiled on CPU
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
import jax.numpy as jnp

import dsv4
from launch import gpu_target as gt
from launch import run as run_cli
from launch import search as search_lib
from launch.aot import reduced_depth
from launch.compile_child import CompileFailed, Job, compile_in_child
from launch.roofline import actor_summary, rollout_summary
from parallel.flops import train_flops_per_token
from parallel.model_bytes import DTYPE_BYTES
from parallel.plan import GPUS, GPUS_PER_NODE, GiB, plan
from parallel.plan import __doc__ as _PLAN_DOC
from parallel.padded import padded_capacity
from parallel.routing_load import ROUTING_LOADS, drop_line
from rl.config.run import RunConfig
from rl.rollout.settings import EngineSettings
from sharding import mesh as mesh_lib
from sharding.rules import CONTEXT


def parser() -> argparse.ArgumentParser:
    """The planner's own flags; every other flag is the run's (launch/run.py), read by `launch.run.resolve`."""
    p = argparse.ArgumentParser(prog="python -m launch.plan", description=_PLAN_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                                epilog="Every launch/run.py flag sets the planned run (python launch/run.py --help): "
                                       "--config-file, --config, --mesh, --max-prompt-len, --max-new-tokens, "
                                       "--prompts-per-step, --group-size, --rollout-dtype, --kv-cache-dtype, "
                                       "--rollout-slots, --offload-optimizer, --learner.train_mtp, ...")
    p.add_argument("--gpu", default=None, choices=sorted(GPUS),
                   help="the planner's GPU table entry (default: --target's; required with --target cpu)")
    p.add_argument("--target", default="cpu", choices=gt.TARGET_NAMES,
                   help="--compile: the compiler: cpu = XLA:CPU on host devices; a GPU = XLA:GPU on a deviceless "
                        "topology of that GPU (needs the [gpu-aot] extra; AMD GPUs through an NVIDIA spec with the "
                        "AMD memory size, labelled proxy; launch/gpu_target.py) (default %(default)s)")
    p.add_argument("--nodes", type=int, default=None, help=f"nodes of {GPUS_PER_NODE} GPUs (default: from the mesh)")
    p.add_argument("--optimizer-dtype", choices=sorted(DTYPE_BYTES), default="fp32",
                   help="what-if: bytes of the Adam moments (the learner keeps them fp32)")
    p.add_argument("--fp8-scale-bytes", type=float, default=4.0, help="bytes per FP8 block scale (sampler: f32 = 4)")
    p.add_argument("--fp4-scale-bytes", type=float, default=1.0, help="bytes per FP4 1x32 scale (E8M0 = 1)")
    p.add_argument("--rollout-dequant", choices=("per_step", "per_call"), default="per_step",
                   help="sampler dequant mode; per_call keeps a bf16 copy of the quantised weights")
    p.add_argument("--usable-fraction", type=float, default=0.90)
    p.add_argument("--rollout-reserve", type=float, default=0.10)
    p.add_argument("--rollout-seqs-per-device", type=int, default=1, help="sequences that must fit for 'fits'")
    p.add_argument("--host-gib-per-node", type=float, default=None,
                   help="host RAM per node for the offloaded optimizer; checked only when given")
    p.add_argument("--compile", action="store_true",
                   help="also AOT-compile the real actor train step and the rollout program and print XLA's memory "
                        "analysis")
    p.add_argument("--compile-only", choices=("both", "actor", "rollout"), default="both",
                   help="--compile: which programs to compile (default both)")
    p.add_argument("--routing-load", choices=ROUTING_LOADS, default="worst",
                   help="--compile: the routed experts' load the rollout's flops and bytes are counted at, for the "
                        "sized dispatch (parallel/routing_load.py): worst (the dropless top capacity, default), "
                        "uniform (random routing) or zipf (a Zipf-0.6 skew like a trained router's): the busiest cell "
                        "of simulated steps; balanced (every cell at its mean); also the routing of the learner's "
                        "drop line (the drop probability of its f_max, printed whenever its dispatch can drop)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="plan/compile a reduced-depth copy of the config (first N main layers; labelled)")
    p.add_argument("--pipeline-micro-batches", type=int, default=None,
                   help="micro-batches of one pass through the learner's pipeline (--learner.pipeline_stages), for "
                        "its bubble, its saved activations and the compiled step's batch (default: "
                        "--learner.pipeline_micro_batches, else 4 x the stages)")
    p.add_argument("--search", action="store_true",
                   help="rank every actor mesh of the run's actor devices by roofline tokens/s per GPU "
                        "(launch/search.py): the plan arithmetic's table, then the --search-compile best compiled")
    p.add_argument("--search-compile", type=int, default=2, metavar="N",
                   help="--search: compile the N best fitting layouts deviceless (needs a GPU --target; 0: none; "
                        "default %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE,
                   help="--search: GPUs per node, for which collectives cross nodes (default %(default)s)")
    return p


def resolve(argv: Sequence[str]) -> tuple[argparse.Namespace, RunConfig]:
    """argv -> (the planner's flags, the planned run's config: the rest of argv as launch/run.py resolves it).
    ValueError (one line) for a bad run flag, file or value."""
    args, rest = parser().parse_known_args(list(argv))
    cfg, _ = run_cli.resolve(rest)
    return args, cfg


def seq_len(cfg: RunConfig) -> int:
    """The planned sequence: prompt + completion (`--max-prompt-len` + `--max-new-tokens`)."""
    return cfg.data.max_prompt_len + cfg.rollout.max_new_tokens


def kv_layout(cfg: RunConfig) -> str:
    """The rollout KV cache's layout on a GPU: "fp8" (`--kv-cache-dtype` resolved for `--rollout-dtype`), else the
    entries' compute dtype ("bf16" | "fp32", `--rollout-compute-dtype`)."""
    st = EngineSettings.for_run(cfg.rollout, platform="gpu", max_prompt_len=cfg.data.max_prompt_len)
    if st.kv_layout == "fp8":
        return "fp8"
    return "fp32" if st.compute_dtype == jnp.float32 else "bf16"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, cfg = resolve(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.run = cfg
    if args.gpu is None:
        if args.target == "cpu":
            print("error: --gpu is required (or a GPU --target)", file=sys.stderr)
            return 2
        args.gpu = args.target
    target = None if args.target == "cpu" else gt.TARGETS[args.target]
    if (args.compile or args.search) and target is not None and not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # deviceless topologies: the CUDA plugin skips its driver checks
    if (args.compile or (args.search and args.search_compile > 0)) and target is not None:
        err = gt.plugin_error()
        if err:
            print(f"error: --target {args.target}: {err}", file=sys.stderr)
            return 2
    learner, seq = cfg.learner, seq_len(cfg)
    try:
        config = cfg.model.config
        if args.num_layers is not None:
            config = reduced_depth(dsv4.DSV4Config.preset(config), args.num_layers)
        name = cfg.model.config + (f" (reduced to {args.num_layers} layers)" if args.num_layers is not None else "")
        if args.search:
            return _search(config, name, args, target)
        report = _plan(config, name, args, cfg.mesh, learner, xla_cpu=args.compile and target is None)
    except ValueError as e:  # MeshSpecError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if (drop := _drop_line(config, report, args)) is not None:
        print(drop)
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
                                                               learner=learner,
                                                               micro_batches=micro_batches(args, learner)),
                            "actor", args, report)
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


def _plan(config, name: str, args, mesh: str, learner, nodes: int | None = None, xla_cpu: bool = False):
    """The planner's arithmetic (`parallel.plan.plan`) of the run `args.run` on `mesh` with `learner`; `nodes`:
    --nodes unless given. ValueError (MeshSpecError) for a layout the model or the learner cannot take."""
    cfg, r = args.run, args.run.rollout
    seq = seq_len(cfg)
    return plan(config, mesh, args.gpu, learner=learner, nodes=args.nodes if nodes is None else nodes,
                optimizer_dtype=args.optimizer_dtype,
                tokens_per_device=compiled_tokens_per_device(mesh, seq, learner.max_tokens_per_micro_batch),
                rollout_seq_len=seq, train_seq_len=seq, rollout_experts="fp4" if r.dtype == "fp8+fp4experts" else "fp8",
                fp8_scale_bytes=args.fp8_scale_bytes, fp4_scale_bytes=args.fp4_scale_bytes,
                rollout_dequant=args.rollout_dequant, kv_layout=kv_layout(cfg), usable_fraction=args.usable_fraction,
                rollout_reserve=args.rollout_reserve, rollout_seqs_per_device=args.rollout_seqs_per_device,
                draft_tokens=r.draft_tokens if r.speculative != "off" else 0, host_gib_per_node=args.host_gib_per_node,
                config_name=name, pipeline_micro_batches=args.pipeline_micro_batches, xla_cpu=xla_cpu)


def _drop_line(config, report, args) -> str | None:
    """`parallel.routing_load.drop_line` for the actor's EP dispatch when it can drop (a capacity factor on an
    expert axis > 1, the padded / sized backends: capacity per (source rank, expert)), else None."""
    o, ep = report.options, report.actor.sizes.get("expert", 1)
    if o["ep_capacity_factor"] is None or ep <= 1 or o["ep_backend"] not in ("padded", "sized"):
        return None
    config = dsv4.DSV4Config.preset(config) if isinstance(config, str) else config
    t, k, e = o["tokens_per_device"], config.num_experts_per_tok, config.n_routed_experts
    return drop_line(t, k, e, ep, padded_capacity(t, k, e, o["ep_capacity_factor"]), o["ep_capacity_factor"],
                     args.routing_load)


def micro_batches(args, learner) -> int:
    """M of the compiled actor step: with a pipeline, --pipeline-micro-batches, else the learner's
    `pipeline_micro_batches` (one pipelined pass), else 4 P; 1 without."""
    p = learner.pipeline_stages
    return 1 if p <= 1 else (args.pipeline_micro_batches or learner.pipeline_micro_batches or 4 * p)


def _compile_actor_gpu(config, report, args, learner, seq: int, target: gt.Target):
    """The actor train step compiled by XLA:GPU for `target` on a deviceless topology of `report`'s mesh, with the
    compiled batch's M micro-batches (`micro_batches`); its `CompileReport`, the offloaded state's transient the
    plan's. Abstract devices have no host memory: the step compiles with its offloaded optimizer state on the
    device, so its memory limit (the scheduler's, the rematerialisation's) is the device's plus those bytes.
    Raises ValueError (the learner's) or CompileFailed."""
    a = report.actor
    a_target = dataclasses.replace(target, hbm_bytes=target.memory_bytes() + int(a.host)) if a.host else target
    xla = _in_child("launch.aot:compile_actor", dict(config=config, mesh_spec=report.mesh_spec, seq_len=seq,
                                                       learner=learner, backend=f"XLA:GPU {target.label}",
                                                       compiler_options=gt.compile_options(),
                                                       micro_batches=micro_batches(args, learner)),
                    "actor", args, report, gpu_target=a_target)
    if xla.host_from_shardings:  # the streamed update's device transient: the plan's arithmetic
        key = "optimizer update: offloaded state moved to the device (learner's step)"
        xla = dataclasses.replace(xla, transient=int(a.items.get(key, 0)))
    return xla


def _search(config, name: str, args, target: gt.Target | None) -> int:
    """--search: `launch.search.run` on the run `args.run` with this planner's arithmetic and compile."""
    config = dsv4.DSV4Config.preset(config) if isinstance(config, str) else config
    peaks = target or gt.TARGETS.get(args.gpu)
    if peaks is None:
        raise ValueError(f"--search: no roofline peaks for --gpu {args.gpu}: give a GPU --target")
    run, gpn = args.run, args.gpus_per_node
    seq = seq_len(run)

    def plan_fn(mesh: str, learner):
        return _plan(config, name, args, mesh, learner, nodes=args.nodes if gpn == GPUS_PER_NODE else None)

    def compile_fn(report, learner):
        return _compile_actor_gpu(config, report, args, learner, seq, target)

    return search_lib.run(config, mesh=run.mesh, nodes=args.nodes, gpus_per_node=gpn, learner=run.learner, seq=seq,
                          peaks=peaks, target=target, n_compile=args.search_compile,
                          micro_batches=args.pipeline_micro_batches or run.learner.pipeline_micro_batches,
                          plan_fn=plan_fn, compile_fn=compile_fn,
                          tokens_fn=lambda m: compiled_tokens_per_device(m, seq, run.learner.max_tokens_per_micro_batch))


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
    learner lays them out (rl/algo/batching.py: the budget counts tokens per context shard, max(1, budget C // seq);
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
    a = report.actor
    if a.host:
        say(f"actor compile: device memory limit {(target.memory_bytes() + a.host) / GiB:.1f} GiB = "
            f"{target.memory_bytes() / GiB:.0f} GiB + the {a.host / GiB:.1f} GiB of offloaded optimizer state it "
            f"holds on the device here (abstract devices have no host memory kind)")
    backend = f"XLA:GPU {target.label}"
    a_xla = r_xla = xla = None
    failed = False
    if args.compile_only in ("both", "actor"):
        try:
            xla = _compile_actor_gpu(config, report, args, learner, seq, target)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except CompileFailed as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    if xla is not None:
        a_xla = xla.total
        say("\n".join(xla.lines()))
        say(f"  planner arithmetic for the same step: {a.gpu_total / GiB:.2f} GiB (XLA:GPU/plan = "
            f"{xla.total / a.gpu_total:.2f})")
    rx = None
    if args.compile_only in ("both", "rollout"):
        dtype, note = gt.rollout_fp8_stand_in(target, args.run.rollout.dtype)
        if note:
            say(f"FP8 format: {note}")
        try:
            rx = _compile_rollout(config, report, args, gpu_target=target, backend=backend, say=say,
                                  compiler_options=gt.compile_options(),
                                  rollout=dataclasses.replace(args.run.rollout, dtype=dtype))
        except CompileFailed as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
        r_xla = None if rx is None else rx.total
    step_s, ratio, rfig = _rooflines(config, report, seq, target, target.label,
                                     xla if a_xla is not None else None, rx, say=say)
    n_actor = mesh_lib.parse_mesh_spec(report.mesh_spec).size("actor")
    tok_s = float("nan") if xla is None else xla.rows * seq / n_actor / step_s
    fits = _verdict(report, args, a_xla, r_xla, say=say)
    gib = lambda b: float("nan") if b is None else b / GiB  # noqa: E731
    name = target.name + ("-proxy" if target.proxy else "")
    print(f"RESULT target={name} actor_gpu_gib={gib(a_xla):.2f} actor_usable_gib={a.usable / GiB:.2f} "
          f"rollout_gpu_gib={gib(r_xla):.2f} actor_step_s_roofline={step_s:.3f} "
          f"actor_tok_s_per_gpu_roofline={tok_s:.0f} "
          f"rollout_tok_s_roofline={rfig.get('tok_s', float('nan')):.0f} remat_flops_ratio={ratio:.2f} "
          + "".join(f"{k}={rfig.get(k, float('nan')):.{d}f} " for k, d in ROLLOUT_FIELDS) + f"fits={'yes' if fits else 'no'}")
    return 1 if failed else 0


# issue 37's decode-step figures in the RESULT line (name, decimals): launch.roofline.rollout_summary's
ROLLOUT_FIELDS = (("decode_step_ms_roofline", 3), ("decode_step_ms_limit", 3), ("decode_bytes_x_weights", 2),
                  ("fp8_gemm_byte_share", 3), ("expert_flops_x_routed", 2))


def _rooflines(config, report, seq: int, target: gt.Target, label: str, xla, rx, say=print):
    """The roofline lines of the compiled actor step `xla` and rollout program `rx` (either None: not compiled)
    with `target`'s peaks (launch/roofline.py), and the machine-readable `ROOFLINE actor_step_s=..
    remat_flops_ratio=.. rollout_tok_s=..` line (benchmarks/gpu_plan.py reads it). Returns (actor step s, remat
    ratio, the rollout's figures: `launch.roofline.rollout_summary`'s, {} when not compiled)."""
    step_s = ratio = tok_s = float("nan")
    config = dsv4.DSV4Config.preset(config) if isinstance(config, str) else config
    if xla is not None:
        n_actor = mesh_lib.parse_mesh_spec(report.mesh_spec).size("actor")
        model = train_flops_per_token(config, seq)["total"] * xla.rows * seq / n_actor
        lines, fig = actor_summary(xla.hlo, target, model_flops=model, label=label,
                                   axes=mesh_lib.parse_mesh_spec(report.mesh_spec).axes("actor"))
        say("\n".join(lines))
        step_s, ratio = fig["step_s"], fig["remat_flops_ratio"]
    rfig = {}
    if rx is not None:
        spec, seqs = mesh_lib.parse_mesh_spec(report.mesh_spec), rx.slots or rx.batch
        per_device = seqs / spec.size("rollout")  # decode tokens per device of one step
        routed = (6.0 * config.hidden_size * config.moe_intermediate_size * config.num_experts_per_tok
                  * config.num_hidden_layers)  # per token: w1, w3, w2 of k experts, every layer
        lines, rfig = rollout_summary(rx.hlo, rx.hlo.decode_step, target, seqs=seqs, weight_bytes=rx.weights,
                                      label=label, axes=spec.axes("rollout"), kv_bytes=rx.kv,
                                      token_flops=per_device * train_flops_per_token(config, rx.cache_len)["total"] / 3,
                                      routed_flops=per_device * routed)
        say("\n".join(lines))
        tok_s = rfig["tok_s"]
    say(f"ROOFLINE actor_step_s={step_s:.3f} remat_flops_ratio={ratio:.2f} rollout_tok_s={tok_s:.0f}")
    return step_s, ratio, rfig


def _compile_rollout(config, report, args, gpu_target: gt.Target | None = None, backend: str = "XLA:CPU", say=print,
                     compiler_options: dict | None = None, rollout=None):
    """--compile, rollout side: XLA's figures of the sampler's generate program on the rollout mesh
    (`launch.aot.compile_rollout`: the step's `--prompts-per-step` x `--group-size` sequences of `--max-prompt-len`
    + `--max-new-tokens`; continuous batching over `--rollout-slots` slots with `--prefill-chunk` chunked
    per-request prefill, or static with slots 0), printed with the KV capacity left;
    returns the `RolloutCompileReport` (None, with the error printed, when it cannot be compiled). In a child
    process (`_in_child`; on abstract GPUs of `gpu_target` when given): CompileFailed when it aborts or fails.
    `rollout`: the rollout knobs to compile (default the run's; a proxy's FP8 stand-in, `gt.rollout_fp8_stand_in`)."""
    run = args.run
    rollout = run.rollout if rollout is None else rollout
    try:
        rx = _in_child("launch.aot:compile_rollout", dict(
            config=config, mesh_spec=report.mesh_spec, batch=run.rollout.prompts_per_step * run.rollout.group_size,
            context=seq_len(run), prompt_len=run.data.max_prompt_len, rollout=rollout,
            kv_budget=report.rollout.margin, backend=backend, compiler_options=compiler_options,
            routing_load=args.routing_load, lora=run.learner.lora), "rollout", args,
            report, gpu_target=gpu_target)
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
