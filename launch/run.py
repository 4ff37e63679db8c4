"""GRPO post-training of DeepSeek-V4 in JAX: the entry point of a run (or of the two-job layout's rollout job).

    python launch/run.py --mesh auto                      # embedded default: tiny model, built-in task, CPU
    python launch/run.py --config-file launch/configs/gsm8k_tiny.yaml --steps 3 --tokenizer PATH/tokenizer.json
    python launch/run.py --config flash --init /ckpt/DeepSeek-V4-Flash --dataset gsm8k/train.jsonl \
        --tokenizer /ckpt/DeepSeek-V4-Flash/tokenizer.json --mesh actor:fsdp=2,expert=8/rollout:expert=8 \
        --coordinator host0:1234 --num-processes 3 --process-id $RANK
    python launch/run.py --launcher ray --ray-address auto --mesh actor:fsdp=2,expert=8/rollout:expert=8 ...
        # the two-job layout as Ray actors in placement groups (launch/ray_run.py; the [ray] extra)

Every flag is a knob of the nested `rl.config.run.RunConfig` (`--group-size` <-> `rollout.group_size`); any knob
also takes a dotted flag (`--learner.lr 1e-6`); the flat spellings (`FLAT`) exist only here. `--config-file
FILE.yaml` sets knobs from a YAML mapping (nested sections or dotted keys); precedence: defaults < `--algo` preset < YAML < flat flags < dotted flags. `--dry-run` prints the
resolved config, the meshes and the memory plan, then exits. Bad input (files, fields, flags) ends with a
one-line error naming what is wrong and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import pathlib
import sys
import threading
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # runnable as a script from a fresh clone

import jax  # noqa: E402  (importing jax starts no backend: XLA_FLAGS set below in __main__ still apply)

from launch.ray_run import LaunchError, add_launcher_args, launch  # noqa: E402
from parallel.push.mpmd import MpmdPushVerificationError  # noqa: E402
from parallel.plan import GPUS, plan  # noqa: E402
from rl.config import tree as config_tree  # noqa: E402
from rl.config.run import RunConfig  # noqa: E402
from rl.config.file import load_config_file  # noqa: E402
from rl.config.notes import overridden_settings  # noqa: E402
from rl.run.loop import run, run_eval  # noqa: E402
from rl.rollout.two_job import RolloutJobError  # noqa: E402
from rl.rollout.settings import EngineSettings  # noqa: E402
from rl.run.wiring import build, load_data, resolve_model_config  # noqa: E402
from sharding.distributed import add_distributed_args, initialize_from_args  # noqa: E402
from sharding.job_link import LinkLost  # noqa: E402
from sharding.mesh import DeviceCountError, build_mesh_plan, parse_mesh_spec  # noqa: E402
from sharding.mpmd import PeerTimeoutError, exit_on_failure, lost_peer  # noqa: E402

log = logging.getLogger("dsv4rl")

# The historic flat flags, this argparse's only: flag --a-b (dest a_b) -> the one dotted path it spells (a contract:
# these spellings keep working; everywhere else, RunConfig and the YAML file included, a knob is its dotted path)
FLAT = {
    "mesh": "mesh", "config": "model.config", "init": "model.init",
    **{k: "data." + k for k in ("task", "task_digits", "dataset", "tokenizer", "data_format", "prompt_field",
                                 "answer_field", "chat_template", "eval_dataset", "reward", "max_prompt_len",
                                 "on_bad_record", "on_overlong_prompt", "apply_chat_template", "system_prompt",
                                 "thinking")},
    "steps": "steps",
    **{k: "rollout." + k for k in ("prompts_per_step", "group_size", "max_new_tokens", "temperature", "top_p",
                                    "top_k")},
    "rollout_dtype": "rollout.dtype", "rollout_compute_dtype": "rollout.compute_dtype",
    "kv_cache_dtype": "rollout.kv_cache_dtype",
    "algo": "algo", "dapo_max_resample_batches": "dapo.max_resample_batches",
    "dapo_on_budget_exhausted": "dapo.on_budget_exhausted",
    "lr": "learner.lr", "warmup_steps": "learner.warmup_steps",
    **{k: "learner.loss." + k for k in ("kl_coef", "kl_estimator", "correction", "correction_level", "mis_low",
                                         "mis_high")},
    "tis_clip": "learner.loss.tis_clip_high",
    **{k: "learner." + k for k in ("routing_replay", "freeze_router", "micro_batch_size", "max_tokens_per_micro_batch",
                                    "logprob_chunk_size", "compute_dtype", "param_dtype", "offload_optimizer")},
    **{"eval_" + k: "eval." + k for k in ("every", "prompts", "samples", "only", "before_train")},
    "ckpt_dir": "ckpt.dir", "ckpt_every": "ckpt.every", "resume": "ckpt.resume",
    "allow_dataset_change": "ckpt.allow_dataset_change", "keep_checkpoints": "ckpt.keep",
    **{k: "log." + k for k in ("metrics_jsonl", "tensorboard_dir", "wandb_project")},
    "seed": "seed", "progress": "log.progress", "remat": "learner.remat", "scan_layers": "learner.scan_layers",
    "stream_optimizer": "learner.stream_optimizer", "ep_backend": "learner.ep_backend",
    "ep_capacity_factor": "learner.ep_capacity_factor",
    "rollout_slots": "rollout.slots", "max_staleness": "rollout.max_staleness",
    "prefill_chunk": "rollout.prefill_chunk",
    "async_rollout": "rollout.async_rollout", "partial_rollout": "rollout.partial_rollout",
    "push_timeout": "rollout.push_timeout",
    "rollout_address": "rollout.address", "rollout_job": "rollout.job", "actor_address": "rollout.actor_address",
    "rollout_restart_timeout": "rollout.restart_timeout",
    "exact_rollout": "rollout.exact",
}


def _leaf(path: str):
    return config_tree.paths(RunConfig)[path]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None: a knob's flag defaults to None (unset, so the YAML file can set it) and
    its help already says the knob's own default."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    """The flat flags (`FLAT`: `--group-size` <-> `rollout.group_size`), help and type from the
    knob's field. Dotted flags (`--learner.lr 1e-6`, any path of the config tree) are read by `resolve`."""
    p = argparse.ArgumentParser(prog="launch/run.py", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter,
                                epilog="Any knob of the nested config also takes a dotted flag, e.g. --learner.lr "
                                       "1e-6, --learner.loss.clip_eps_high 0.28, --rollout.push_verify_every 0 "
                                       "(it wins over the flat flag and the YAML file).")
    p.add_argument("--config-file", help="YAML file of the config: nested sections (learner: {lr: ...}) and/or "
                                         "dotted keys (learner.lr: ...) (flags override it)")
    p.add_argument("--dry-run", action="store_true", help="print config, meshes and memory plan, then exit")
    p.add_argument("--log-level", default="INFO", help="Python logging level: DEBUG, INFO, WARNING, ERROR")
    flat = flat_values(RunConfig())
    for name, path in FLAT.items():
        leaf = _leaf(path)
        flag = "--" + name.replace("_", "-")
        text = leaf.help if "(default" in leaf.help else f"{leaf.help} (default: {flat[name]})"
        if leaf.base is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, type=str, default=None, metavar=leaf.base.__name__.upper(), help=text)
    add_distributed_args(p)
    add_launcher_args(p)
    return p


def flat_values(cfg: RunConfig) -> dict:
    """{flat flag name: value} of `cfg` (`--dry-run`'s first table, the names of the flags)."""
    return {name: config_tree.get(cfg, path) for name, path in FLAT.items()}


def _dotted(extra: list[str]) -> list[tuple[str, str]]:
    """`--a.b VALUE` / `--a.b=VALUE` (a bool knob alone: true) -> [(path, raw)]. ValueError names a bad one."""
    leaves, out, i = config_tree.paths(RunConfig), [], 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or "." not in tok.split("=", 1)[0]:
            raise ValueError(f"unrecognized argument {tok!r} (see --help)")
        key, eq, raw = tok[2:].partition("=")
        path = key.replace("-", "_")
        if path not in leaves:
            near = difflib.get_close_matches(path, list(leaves), n=3)
            raise ValueError(f"--{key}: unknown config key {path!r}" + (f" (did you mean {' or '.join(near)}?)"
                                                                         if near else ""))
        if not eq:
            if i + 1 < len(extra) and not (extra[i + 1].startswith("--") and leaves[path].base is bool):
                raw, i = extra[i + 1], i + 1
            elif leaves[path].base is bool:
                raw = "true"
            else:
                raise ValueError(f"--{key}: expected a value")
        out.append((path, raw))
        i += 1
    return out


def resolve(argv=None) -> tuple[RunConfig, argparse.Namespace]:
    """argv -> RunConfig: defaults < `algo` preset < YAML file < flat flags < dotted flags. ValueError names the
    bad key, flag or file (one line)."""
    args, extra = parser().parse_known_args(argv)
    dotted = _dotted(extra)
    items: list[tuple[str, object]] = []
    if args.config_file:
        data = load_config_file(args.config_file)  # one line naming FILE:LINE:COLUMN when bad (repeated keys too)
        for path, (key, v) in config_tree.flatten(data, RunConfig, f"--config-file {args.config_file}").items():
            items.append((path, config_tree.convert(_leaf(path), v, args.config_file, key)))
    for name, path in FLAT.items():
        raw = getattr(args, name)
        if raw is not None:
            items.append((path, config_tree.convert(_leaf(path), raw, "--" + name.replace("_", "-"), name)))
    for path, raw in dotted:
        items.append((path, config_tree.convert(_leaf(path), raw, "--" + path)))
    items = [(p, None if p in _EMPTY_IS_NONE and v == "" else v) for p, v in items]
    args.given = {p for p, _ in items}  # the knobs the user set (rl/config/notes.py)
    try:
        return RunConfig.from_overrides(items, source="launch/run.py"), args
    except ValueError as e:
        raise ValueError(_flat_spelling(str(e))) from None


def _flat_spelling(msg: str) -> str:
    """The config's messages name a knob's dotted flag, `(--rollout.group_size)`; on this command line they name its
    flat spelling when it has one, `(--group-size)` (both flags work)."""
    for name, path in FLAT.items():
        msg = msg.replace(f"(--{path})", f"(--{name.replace('_', '-')})")
    return msg


_EMPTY_IS_NONE = ("ckpt.dir", "log.metrics_jsonl", "log.tensorboard_dir")


def dry_run(cfg: RunConfig) -> None:
    """Print the resolved config, the meshes and the memory plan. Loads the data (bad input fails here too) but
    builds no model; a mesh larger than this machine is still planned."""
    print("config:", json.dumps(flat_values(cfg), indent=1, default=str))  # the flat flags' names
    print("config tree:", json.dumps(cfg.to_tree(), indent=1, default=str))  # every knob, nested
    tok, *_ = load_data(cfg)
    mc = resolve_model_config(cfg, tok.vocab_size)
    spec = parse_mesh_spec(cfg.mesh)  # a malformed spec is an error (exit 2), not a planning note
    try:
        print("meshes:", build_mesh_plan(spec, config=mc).describe())
    except ValueError as e:  # a flash mesh larger than this machine is still plannable
        print(f"meshes: {spec} is not buildable on this machine's {_n_devices()} devices ({e}); planning only")
    print(_memory_plan(cfg, mc, str(spec)))


def _memory_plan(cfg: RunConfig, model_cfg, spec: str) -> str:
    """parallel/plan.py's table for this mesh, on the detected GPU (else MI308X for fp8_e4m3fnuz, else H200)."""
    kind = jax.devices()[0].device_kind.lower().replace(" ", "")
    gpu = next((g for g in GPUS if g in kind), None)
    note = "detected" if gpu else "assumed: no known GPU here"
    gpu = gpu or ("mi308x" if cfg.rollout.dtype == "fp8_e4m3fnuz" else "h200")
    seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    try:
        kv = EngineSettings.for_run(cfg.rollout, platform=jax.devices()[0].platform,
                                    max_prompt_len=cfg.data.max_prompt_len).kv_layout
        report = plan(model_cfg, spec, gpu, learner=cfg.learner, rollout_seq_len=seq, config_name=cfg.model.config,
                      kv_layout=kv)
    except Exception as e:  # noqa: BLE001 - the plan is advice; the run itself checks the mesh
        return f"memory plan: unavailable for mesh {spec} on {gpu} ({type(e).__name__}: {e})"
    return f"memory plan (gpu {gpu}, {note}; sequences of {seq} tokens):\n{report.table()}\n{report.line()}"


def _n_devices() -> int:
    return jax.device_count()


def _device_hint(e: Exception) -> str:
    """For a mesh larger than this CPU host's devices: how to set the count."""
    if not isinstance(e, DeviceCountError) or _platform() != "cpu":
        return ""
    return (f"; this process has {e.present} CPU devices: --cpu-devices-per-process {e.needed} (or XLA_FLAGS="
            f"--xla_force_host_platform_device_count={e.needed}) sets the count")


def _platform() -> str:
    return jax.devices()[0].platform


def cpu_device_count(argv: list[str]) -> int | None:
    """The CPU devices `python launch/run.py argv` splits this host into when neither XLA_FLAGS nor
    --cpu-devices-per-process sets the count: as many as the --mesh spec needs over this run's processes
    (--num-processes), and 2 for `--mesh auto` (actor 1 + rollout 1: two real, disjoint meshes with a real
    cross-mesh push). None: the user's settings decide (or the arguments are bad: `main` reports them)."""
    if ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
            or any(a.startswith("--cpu-devices-per-process") for a in argv) or {"-h", "--help"} & set(argv)):
        return None
    try:
        cfg, args = resolve(argv)
        if args.launcher == "ray":  # a launcher: this process starts no backend (each job splits its own host)
            return None
        if cfg.mesh.strip() == "auto":
            return 2
        spec = parse_mesh_spec(cfg.mesh)
        needed = spec.n_devices
        if cfg.rollout.job or cfg.rollout.address:  # the two-job layout: each job holds its own role's devices
            needed = spec.size("rollout") if cfg.rollout.job else max(spec.size("actor"), spec.size("rollout"))
    except (ValueError, SystemExit):
        return None
    processes = max(1, args.num_processes or 1)
    return max(1, -(-needed // processes))


def _peer_failure(e: PeerTimeoutError) -> None:
    """An MPMD process of the other side (or of this one) died or went silent: one line, the others told, exit 1
    (`sharding.mpmd.exit_on_failure`; when the heartbeat thread's watch is already reporting, wait for its exit)."""
    exit_on_failure(e)
    threading.Event().wait()


def main(argv=None) -> int:
    """Entry point (importable). Returns the exit status."""
    try:
        cfg, args = resolve(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # orbax and grain, imported above, log through the root logger at import, which gives it logging's default
    # handler (BASIC_FORMAT, level WARNING): replace that one (other handlers, e.g. pytest's, stay)
    root = logging.getLogger()
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler and getattr(h.formatter, "_fmt", None) == logging.BASIC_FORMAT:
            root.removeHandler(h)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "orbax", "jax._src", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for line in overridden_settings(cfg, args.given):  # each overridden or ignored setting said once
        log.warning(line)
    if args.launcher == "ray":  # the jobs run as Ray actors (launch/ray_run.py); this process starts no backend
        try:
            return launch(list(sys.argv[1:] if argv is None else argv), cfg.mesh, args.ray_address,
                          connect_timeout=args.ray_connect_timeout)
        except (LaunchError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    info = wiring = None
    try:
        separate = "rollout:" in cfg.mesh or cfg.mesh.strip() == "auto"  # a rollout mesh of its own may span processes
        info = initialize_from_args(args, transfer_timeout_s=cfg.rollout.push_timeout, transfers=separate)
        if info.process_count > 1:
            log.info("process %d of %d (%s)", info.process_id, info.process_count, info.source)
        if args.dry_run:
            dry_run(cfg)
            return 0
        wiring = build(cfg)
        if cfg.eval.only:
            run_eval(wiring)
            return 0
        summary = run(wiring)
    except PeerTimeoutError as e:  # MPMD: the other role's processes stopped answering (sharding/mpmd.py)
        _peer_failure(e)
    except (RolloutJobError, LinkLost) as e:  # the two-job layout: the rollout did not come back / the actor is gone
        print(f"error: {e}", file=sys.stderr)  # (a rollout job the actor refused: RolloutMismatchError, status 2)
        sys.stderr.flush()
        os._exit(getattr(e, "status", 1))  # not sys.exit: the channel's threads and transfer server may hold it
    except MpmdPushVerificationError as e:  # MPMD: both roles stop on a push that failed verification, one line
        print(f"error: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: jax's shutdown barrier would wait for the other processes
    except (ValueError, OSError) as e:  # user errors (bad input, files, permissions): one line, no traceback
        lost = lost_peer(wiring.layout, e) if wiring is not None and info.process_count > 1 else None
        if lost is not None:  # a dead peer's collective, surfaced as one of these (an actor job of several processes)
            _peer_failure(lost)
        print(f"error: {e}{_device_hint(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        if info is None or info.process_count == 1:
            raise
        if wiring is not None and isinstance(e, jax.errors.JaxRuntimeError):  # MPMD: a collective's peer died?
            lost = lost_peer(wiring.layout, e)
            if lost is not None:
                _peer_failure(lost)
        traceback.print_exc()  # multi-process: exit now, or jax's shutdown barrier waits minutes for the others
        sys.stderr.flush()
        os._exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler is installed (startup, compiles)
        print("interrupted (Ctrl-C) before the first step: nothing to save", file=sys.stderr)
        return 130
    if summary.get("signal") == "SIGINT":
        saved = "; checkpoint saved: rerun the same command to resume" if cfg.ckpt.dir else " (no --ckpt-dir: not saved)"
        print(f"interrupted (Ctrl-C): stopped after {summary['steps_run']} steps{saved}", file=sys.stderr)
        return 130
    curve = summary["reward_curve"]
    if curve:
        n = max(1, len(curve) // 10)
        print(f"done: {summary['steps_run']} steps, reward first 10% {sum(curve[:n]) / n:.3f}, "
              f"last 10% {sum(curve[-n:]) / n:.3f}, weight version {summary['weight_version']}")
    return 0


if __name__ == "__main__":
    # Split a CPU host into the XLA devices the mesh needs (`cpu_device_count`); only the CPU backend reads this
    # flag, and the backend starts later (in `main`), so setting it here is in time.
    _n = cpu_device_count(sys.argv[1:])
    if _n is not None:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}"
                                   ).strip()
    sys.exit(main())
