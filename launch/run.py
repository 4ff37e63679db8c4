"""GRPO post-training of DeepSeek-V4 in JAX: the main job.

    python launch/run.py --mesh auto                      # embedded default: tiny model, built-in task, CPU
    python launch/run.py --config-file launch/configs/gsm8k_tiny.yaml --steps 3 --tokenizer PATH/tokenizer.json
    python launch/run.py --config flash --init /ckpt/DeepSeek-V4-Flash --dataset gsm8k/train.jsonl \
        --tokenizer /ckpt/DeepSeek-V4-Flash/tokenizer.json --mesh actor:fsdp=2,expert=8/rollout:expert=8 \
        --coordinator host0:1234 --num-processes 3 --process-id $RANK

Every flag is a field of `rl.config.RunConfig` (`--group-size` <-> `group_size`); `--config-file FILE.yaml`
sets fields from a YAML mapping and flags given on the command line override it. `--dry-run` prints the
resolved config, the meshes and the memory plan, then exits. Bad input (files, fields, flags) ends with a
one-line error naming what is wrong and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import sys
import typing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # runnable as a script from a fresh clone

from rl.config import RunConfig  # noqa: E402  (pure dataclasses: importing it starts no JAX backend)

log = logging.getLogger("dsv4rl")

_HELP = {
    "mesh": "device meshes: 'auto', or e.g. actor:fsdp=2,expert=2/rollout:expert=2,tensor=2 (actor only = colocated)",
    "config": "model config: tiny | small | flash | PATH/config.json",
    "init": "random, or an official-format DeepSeek-V4 checkpoint directory (safetensors + config.json)",
    "task": "built-in verifiable task when no --dataset is given: copy | reverse (3 digits, partial credit)",
    "task_digits": "digits per built-in task prompt",
    "dataset": "prompt dataset (jsonl or parquet; GSM8K layout by default)",
    "tokenizer": "Hugging Face tokenizer.json (required with --dataset)",
    "prompt_field": "dataset field of the prompt: a string or a list of chat messages; dotted path "
                    "(default: the --data-format's)",
    "answer_field": "dataset field of the answer, dotted path, e.g. reward_model.ground_truth (default: the "
                    "--data-format's)",
    "data_format": "dataset layout: gsm8k (question, answer '... #### n') | verl (prompt = chat messages, "
                   "reward_model.ground_truth) | miles (prompt, label); sets field defaults and --reward auto",
    "apply_chat_template": "render each prompt as a one-turn conversation with the tokenizer folder's Jinja chat "
                           "template (tokenizer_config.json or chat_template.jinja), as transformers does; DeepSeek-V4's format "
                           "when the folder ships encoding/encoding_dsv4.py",
    "system_prompt": "system message of the conversation (with --apply-chat-template)",
    "thinking": "with --apply-chat-template: on | off sets the template's enable_thinking / thinking switch; "
                "auto leaves the template's default",
    "on_overlong_prompt": "prompt longer than --max-prompt-len: drop (counted: log + metric data/dropped_overlong) "
                          "| fail",
    "eval_only": "no training: evaluate --init (or the newest checkpoint in --ckpt-dir) on the eval prompts, "
                 "print the table, write the metrics, exit",
    "eval_before_train": "evaluate once before the first step (veRL's val_before_train; ignored by --eval-only)",
    "wandb_project": "Weights & Biases project (optional extra: pip install -e '.[wandb]'; WANDB_MODE=offline "
                     "needs no network)",
    "chat_template": "python format string for the prompt, e.g. 'Question: {prompt}\\nAnswer:'",
    "eval_dataset": "held-out prompts for eval (default: the first --eval-prompts training prompts)",
    "reward": "auto (the --data-format's) | task | gsm8k | gsm8k+format | math (last \\boxed{}) | dapo "
              "('Answer:' line, else boxed) | aime (integer); rl/math_rewards.py",
    "max_prompt_len": "longest prompt in tokens",
    "on_bad_record": "malformed dataset record: fail (error with file:line) | skip (counted)",
    "steps": "GRPO steps", "prompts_per_step": "prompts per step", "group_size": "samples per prompt (G)",
    "max_new_tokens": "response length limit", "temperature": "sampling temperature (0 = greedy)",
    "top_p": "nucleus sampling", "top_k": "top-k sampling (0 = off)",
    "rollout_dtype": "rollout weights: fp8 | fp8_e4m3fnuz (MI300/MI308) | bf16 | fp32 | auto",
    "rollout_compute_dtype": "rollout matmul dtype: auto (fp32 on CPU, bf16 on GPU) | bfloat16 | float32",
    "algo": "grpo | dr_grpo | dapo | gspo", "lr": "peak learning rate",
    "dapo_max_resample_batches": "DAPO: extra prompt batches sampled per step to fill the batch with groups "
                                 "whose rewards differ",
    "dapo_on_budget_exhausted": "DAPO, fewer such groups than --prompts-per-step after the resampling budget: "
                                "train (on the kept groups) | skip (the step)", "warmup_steps": "linear LR warmup",
    "kl_coef": "KL-to-reference coefficient (0: no reference model kept)", "kl_estimator": "k1 | k2 | k3",
    "correction": "rollout/train mismatch correction: none | tis | mis (IcePop)",
    "correction_level": "token | sequence | geometric", "tis_clip": "TIS weight clamp C",
    "mis_low": "MIS lower bound", "mis_high": "MIS upper bound",
    "routing_replay": "force the rollout's experts in training", "freeze_router": "freeze router weights",
    "micro_batch_size": "rows per micro-batch (exact accumulation)", "compute_dtype": "learner matmul dtype",
    "eval_every": "eval every N steps (0 = never)", "eval_prompts": "held-out prompts",
    "eval_samples": "k of pass@k (samples per eval prompt)", "ckpt_dir": "checkpoint directory ('' = none)",
    "ckpt_every": "checkpoint every N steps", "resume": "auto | never", "keep_checkpoints": "checkpoints kept",
    "allow_dataset_change": "resume although --dataset / --eval-dataset changed since the checkpoint (keeps the "
                            "learner state, restarts the data order); otherwise that is an error",
    "metrics_jsonl": "per-step metrics file ('' = none)", "tensorboard_dir": "TensorBoard dir ('' = none)",
    "seed": "seed of data order, sampling and init", "progress": "progress bar",
    "remat": "per-layer rematerialisation of the learner: block | dots | none",
    "scan_layers": "run the learner's layers under lax.scan per group of identical layers (compile time flat in "
                   "depth; the learner state and its checkpoints are then in the stacked layout)",
}


def _type_of(field) -> tuple[type, bool]:
    t = typing.get_type_hints(RunConfig)[field.name]
    optional = type(None) in typing.get_args(t)
    args = [a for a in typing.get_args(t) if a is not type(None)]
    base = args[0] if optional and args else t
    if typing.get_origin(base) is typing.Literal:
        base = str
    return base, optional


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/run.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config-file", help="YAML file of RunConfig fields (flags override it)")
    p.add_argument("--dry-run", action="store_true", help="print config, meshes and memory plan, then exit")
    p.add_argument("--log-level", default="INFO")
    defaults = RunConfig()
    for f in dataclasses.fields(RunConfig):
        base, optional = _type_of(f)
        flag = "--" + f.name.replace("_", "-")
        if base is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{_HELP.get(f.name, '')} (default: {getattr(defaults, f.name)})")
        else:
            p.add_argument(flag, type=str, default=None, metavar=base.__name__.upper(),
                           help=f"{_HELP.get(f.name, '')} (default: {getattr(defaults, f.name)})")
    from sharding.distributed import add_distributed_args

    add_distributed_args(p)
    return p


def _convert(name: str, raw, source: str):
    field = {f.name: f for f in dataclasses.fields(RunConfig)}[name]
    base, optional = _type_of(field)
    if raw is None or (optional and isinstance(raw, str) and raw.lower() in ("", "none", "null")):
        return None
    if name == "thinking" and isinstance(raw, bool):  # YAML 1.1 reads an unquoted `thinking: on` as true
        return "on" if raw else "off"
    if isinstance(raw, base) and not (base is int and isinstance(raw, bool)):
        return raw
    try:
        if base is bool:
            return {"true": True, "false": False, "1": True, "0": False}[str(raw).lower()]
        return base(raw)
    except (ValueError, KeyError):
        raise ValueError(f"{source}: {name} must be {base.__name__}, got {raw!r}") from None


def resolve(argv=None) -> tuple[RunConfig, argparse.Namespace]:
    """argv -> RunConfig (YAML file, then command-line overrides). ValueError names the bad key/flag."""
    args = parser().parse_args(argv)
    values = {}
    if args.config_file:
        import yaml

        try:
            data = yaml.safe_load(pathlib.Path(args.config_file).read_text()) or {}
        except OSError as e:
            raise ValueError(f"--config-file {args.config_file}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"--config-file {args.config_file}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config-file {args.config_file}: expected a mapping of RunConfig fields")
        names = {f.name for f in dataclasses.fields(RunConfig)}
        for k, v in data.items():
            key = k.replace("-", "_")
            if key not in names:
                raise ValueError(f"--config-file {args.config_file}: unknown key {k!r}")
            values[key] = _convert(key, v, args.config_file)
    for f in dataclasses.fields(RunConfig):
        raw = getattr(args, f.name)
        if raw is not None:
            values[f.name] = _convert(f.name, raw, "--" + f.name.replace("_", "-"))
    for k in ("ckpt_dir", "metrics_jsonl", "tensorboard_dir"):
        if values.get(k) == "":
            values[k] = None
    return RunConfig(**values), args


def dry_run(cfg: RunConfig) -> None:
    """Print the resolved config, the meshes and the memory plan. Loads the data (bad input fails here too) but
    builds no model; a mesh larger than this machine is still planned."""
    from rl.loop import _data, resolve_model_config
    from sharding.mesh import build_mesh_plan, parse_mesh_spec

    print("config:", json.dumps(dataclasses.asdict(cfg), indent=1, default=str))
    tok, *_ = _data(cfg)
    mc = resolve_model_config(cfg, tok.vocab_size)
    spec = parse_mesh_spec(cfg.mesh)  # a malformed spec is an error (exit 2), not a planning note
    try:
        print("meshes:", build_mesh_plan(spec, config=mc).describe())
    except ValueError as e:  # a flash mesh larger than this machine is still plannable
        print(f"meshes: {spec} is not buildable on this machine's {_n_devices()} devices ({e}); planning only")
    print(_memory_plan(cfg, mc, str(spec)))


def _memory_plan(cfg: RunConfig, model_cfg, spec: str) -> str:
    """parallel/plan.py's table for this mesh, on the detected GPU (else MI308X for fp8_e4m3fnuz, else H200)."""
    try:
        from parallel.plan import GPUS, plan
    except ImportError as e:
        return f"memory plan: unavailable (parallel/plan.py cannot be imported: {e})"
    import jax

    kind = jax.devices()[0].device_kind.lower().replace(" ", "")
    gpu = next((g for g in GPUS if g in kind), None)
    note = "detected" if gpu else "assumed: no known GPU here"
    gpu = gpu or ("mi308x" if cfg.rollout_dtype == "fp8_e4m3fnuz" else "h200")
    seq = cfg.max_prompt_len + cfg.max_new_tokens
    try:
        report = plan(model_cfg, spec, gpu, rollout_seq_len=seq, config_name=cfg.config,
                      offload_optimizer=cfg.offload_optimizer, train_mtp=False, freeze_router=cfg.freeze_router)
    except Exception as e:  # noqa: BLE001 - the plan is advice; the run itself checks the mesh
        return f"memory plan: unavailable for mesh {spec} on {gpu} ({type(e).__name__}: {e})"
    return f"memory plan (gpu {gpu}, {note}; sequences of {seq} tokens):\n{report.table()}\n{report.line()}"


def _n_devices() -> int:
    import jax

    return jax.device_count()


def main(argv=None) -> int:
    """Entry point (importable). Returns the exit status."""
    try:
        cfg, args = resolve(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "orbax", "jax._src", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from sharding.distributed import initialize_from_args

        info = initialize_from_args(args)
        if info.process_count > 1:
            log.info("process %d of %d (%s)", info.process_id, info.process_count, info.source)
        if args.dry_run:
            dry_run(cfg)
            return 0
        from rl.loop import build, run

        job = build(cfg)
        if cfg.eval_only:
            from rl.loop import run_eval

            run_eval(job)
            return 0
        summary = run(job)
    except (ValueError, OSError) as e:  # user errors (bad input, files, permissions): one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler is installed (startup, compiles)
        print("interrupted (Ctrl-C) before the first step: nothing to save", file=sys.stderr)
        return 130
    if summary.get("signal") == "SIGINT":
        saved = "; checkpoint saved: rerun the same command to resume" if cfg.ckpt_dir else " (no --ckpt-dir: not saved)"
        print(f"interrupted (Ctrl-C): stopped after {summary['steps_run']} steps{saved}", file=sys.stderr)
        return 130
    curve = summary["reward_curve"]
    if curve:
        n = max(1, len(curve) // 10)
        print(f"done: {summary['steps_run']} steps, reward first 10% {sum(curve[:n]) / n:.3f}, "
              f"last 10% {sum(curve[-n:]) / n:.3f}, weight version {summary['weight_version']}")
    return 0


if __name__ == "__main__":
    # On a CPU-only machine, split the host into 2 XLA devices so that `--mesh auto` makes two real, disjoint
    # meshes (actor 1 + rollout 1) with a real cross-mesh push. Only the CPU backend reads this flag.
    # (Not with --cpu-devices-per-process, which sets the CPU device count itself for multi-process runs.)
    if ("xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
            and not any(a.startswith("--cpu-devices-per-process") for a in sys.argv)):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    sys.exit(main())
