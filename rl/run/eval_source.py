"""What an evaluation-only run (`launch/run.py --eval-only`, `launch/eval.py`) evaluates, decided by reading only.

    ckpt_dir = eval_checkpoint_dir(cfg)   # the --ckpt-dir whose newest step is evaluated, or None: --init's weights
    reader = eval_reader(ckpt_dir, fp)     # a read-only Checkpointer comparing only EVAL_COMPARED-type knobs

An eval-only run evaluates a checkpoint or refuses. With `--resume auto` (the default) it evaluates the newest
checkpoint of --ckpt-dir; when that directory is missing or holds no checkpoint it evaluates `--init`'s weights,
and when `--init` is `random` too there is nothing to evaluate: one line naming the directory (random weights are
never evaluated silently). A step folder given as --ckpt-dir (`run/ckpt/3` instead of `run/ckpt`) is refused in
one line naming the directory to give. It only reads: no directory is created, no run lock taken (a training run
may be writing the directory meanwhile), no config.yaml written, nothing renamed (a read-only checkpoint directory
works: `Checkpointer(read_only=True)`). Only what changes the evaluated weights is compared with the checkpoint's
fingerprint (`rl.run.wiring.fingerprint`): the model config and the knobs that shape the saved state (KL reference
weights, stacked layers, the FP8-aware learner), not the training-only knobs in `EVAL_IGNORED` (lr, seed, group
size, prompts per step, ...).
"""

from __future__ import annotations

import logging
import pathlib

from rl.run.checkpoint import Checkpointer
from rl.config.run import RunConfig

log = logging.getLogger("dsv4rl")

# fingerprint keys an evaluation does not compare: training-only knobs (the evaluated weights are the checkpoint's
# whatever they were), the data (an evaluation may use another set) and --init (the model config is compared)
EVAL_IGNORED = ("init", "task", "task_digits", "dataset", "prompts_per_step", "group_size", "max_new_tokens",
                "algo", "seed", "routing_replay", "lr", "max_staleness")
_STEP_ITEMS = ("_CHECKPOINT_METADATA", "state", "meta")  # what an orbax step folder of rl/run/checkpoint.py holds


def checkpoint_steps(directory: str | pathlib.Path) -> list[int]:
    """The complete checkpoint steps of a --ckpt-dir (its digit-named folders; orbax's `<s>.orbax-checkpoint-tmp`
    and `<s>.corrupt` are not steps), sorted; [] when the directory is missing or unreadable."""
    try:
        return sorted(int(p.name) for p in pathlib.Path(directory).iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def is_step_folder(directory: str | pathlib.Path) -> bool:
    """Whether `directory` is one checkpoint's step folder (`<ckpt-dir>/<step>`), not a checkpoint directory."""
    d = pathlib.Path(directory)
    return d.is_dir() and any((d / name).exists() for name in _STEP_ITEMS)


def eval_checkpoint_dir(cfg: RunConfig) -> pathlib.Path | None:
    """The checkpoint directory an eval-only run restores its newest step from, or None: it evaluates `--init`.

    Reads only (creates nothing). Raises ValueError (one line naming the path) when --ckpt-dir is a step folder,
    or when there is nothing to evaluate: no checkpoint (--ckpt-dir missing, empty, '' or --resume never) and
    --init random."""
    d, init = cfg.ckpt.dir, cfg.model.init
    if d and is_step_folder(d):
        path = pathlib.Path(d)
        raise ValueError(f"--ckpt-dir {path} is the folder of one checkpoint (step {path.name}), not a checkpoint "
                         f"directory: give --ckpt-dir {path.parent} (its newest step is evaluated)")
    if d and cfg.ckpt.resume == "auto":
        path = pathlib.Path(d)
        if checkpoint_steps(path):
            return path
        what = ("does not exist" if not path.exists() else "is not a directory" if not path.is_dir()
                else "holds no checkpoint")
    elif d:
        what = "is not read (--resume never)"
    else:
        what = None
    if init == "random":
        where = f"--ckpt-dir {d} {what}" if d else "no --ckpt-dir is given"
        raise ValueError(f"--eval-only: nothing to evaluate: {where} and --init is random; give the --ckpt-dir of a "
                         f"training run (--resume auto) or --init CHECKPOINT")
    if d:
        log.info("--eval-only: --ckpt-dir %s %s: evaluating --init %s", d, what, init)
    return None


def _not_read_only_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Given directory is read only")  # orbax's, for every reader


def eval_reader(directory: pathlib.Path, fingerprint: dict, processes=None) -> Checkpointer:
    """A read-only Checkpointer of `directory` for an evaluation: no lock, nothing created or renamed, the
    fingerprint compared without `EVAL_IGNORED` (a mismatch: CheckpointMismatchError naming the fields)."""
    absl = logging.getLogger("absl")
    if _not_read_only_notice not in absl.filters:
        absl.addFilter(_not_read_only_notice)
    return Checkpointer(directory, fingerprint=fingerprint, processes=processes, read_only=True,
                        ignore=EVAL_IGNORED)
