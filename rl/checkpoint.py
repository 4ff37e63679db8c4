"""Checkpoints with orbax: async, atomic, resumable, config-checked.

A checkpoint at step s holds (docs/jax-stack.md §6):
- `state`: the learner's state (fp32 master params, buffers, optimizer state, update count, reference params
  when KL is on) as a flat {path: array} dict (`jax.tree_util.keystr` paths), restored straight onto the actor
  mesh's shardings;
- `meta` (JSON): step, weight version, the data iterator state (`{"next_index": k}`), the seed (all randomness
  is derived from (seed, step, prompt, sample), so seed + step is the RNG state), a fingerprint of the run
  (model config + the knobs that change the math) and the identity of the train and eval datasets
  (`file_identity`: size + content hash; checked on resume by rl/loop.py). The sampler's weights are not saved: they are a pure
  function of the params (re-pushed on restore).
Orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, so a crash mid-save leaves the
previous step as the latest. A latest checkpoint that fails to restore (corrupt or partial) falls back to the
previous one with a warning and is renamed `<step>.corrupt` (kept, but no longer a step, so the resumed run can
save that step again); a fingerprint mismatch is an error naming the differing keys, checked by `check_latest`
before the model is built.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


_MIB = 1 << 20


def file_identity(path: str | os.PathLike | None) -> dict | None:
    """Identity of a dataset file (or of every file under a directory) for resume checks; None for no path.

    {"size": bytes, "sha256": hex}: the hash covers the whole file when it is at most 2 MiB, else its first and
    last MiB and its size (a cheap fingerprint of a large file: an edit in the middle of a file whose size does
    not change goes unnoticed). A directory: the same over its files in sorted order, names included.
    Raises FileNotFoundError when the path does not exist.
    """
    if path is None:
        return None
    p = pathlib.Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h, total = hashlib.sha256(), 0
    for f in files:
        size = f.stat().st_size
        total += size
        if p.is_dir():
            h.update(str(f.relative_to(p)).encode() + b"\0")
        with open(f, "rb") as fh:
            if size <= 2 * _MIB:
                h.update(fh.read())
            else:
                h.update(fh.read(_MIB))
                fh.seek(size - _MIB)
                h.update(fh.read(_MIB))
                h.update(str(size).encode())
    return {"size": total, "sha256": h.hexdigest()}


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run with another config; the message names the differing keys."""


def _flatten(tree) -> tuple[dict, object]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): x for p, x in leaves}, treedef


def check_writable(directory: str | os.PathLike, what: str) -> pathlib.Path:
    """Create `directory` and prove it is writable (before step 1); OSError -> ValueError naming the flag."""
    d = pathlib.Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{what} {d} is not writable: {e}") from e
    return d


class Checkpointer:
    """Orbax CheckpointManager wrapper.

    Args:
      directory: checkpoint root (created). keep: how many to keep. fingerprint: JSON-able dict identifying
        the run's math (compared on restore).
      processes: the process indices that hold the saved arrays and call every method (None: all processes).
        MPMD runs pass the actor's: orbax's barriers (`MultiprocessingOptions.active_processes`) then involve
        those processes only, the first of them writes the metadata, and the rollout processes, which hold no
        learner array, never construct a Checkpointer (their state is derived: rl/roles.py). A single saving
        process in a multi-process job (`processes` of one): orbax refuses its arrays (fully addressable, hence
        "host local" to orbax once jax.process_count() > 1), so they are saved from host copies (`jax.device_get`
        at save time, blocking) and restored as numpy, then placed on the target's shardings.
    """

    def __init__(self, directory, *, keep: int = 2, fingerprint: dict, async_save: bool = True,
                 processes=None):
        self.dir = check_writable(directory, "--ckpt-dir").resolve()
        self.fingerprint = fingerprint
        self.primary = 0 if processes is None else min(processes)
        self.host_local = processes is not None and len(set(processes)) == 1 and jax.process_count() > 1
        mp = {} if processes is None else dict(create=False, multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=self.primary, active_processes=set(processes), barrier_sync_key_prefix="actor"))
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                            cleanup_tmp_directories=True, **mp)
        self.mngr = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", "meta"))
        # The manager cleans old temp dirs in a background thread; a run that stops at a startup error right
        # after this would have that thread fail at interpreter shutdown with a library traceback under the
        # one-line error. Waiting here costs one directory listing.
        wait_cleanup = getattr(self.mngr, "_maybe_await_cleanup_tmp_directory", None)
        if wait_cleanup is not None:
            wait_cleanup()

    def all_steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> None:
        """Save (asynchronously) the learner state pytree and the meta dict at `step`."""
        flat, _ = _flatten(state)
        if self.host_local:  # see the class docstring
            flat = jax.device_get(flat)
        meta = {**meta, "step": int(step), "fingerprint": self.fingerprint}
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                                     meta=ocp.args.JsonSave(meta)), force=force)

    def check_latest(self) -> dict | None:
        """Raise CheckpointMismatchError when the newest checkpoint whose meta is readable was written by another
        config. Reads only the small JSON meta, so `build` can call it before any model is made. Returns that
        meta (None when there is no readable checkpoint)."""
        for step in reversed(self.all_steps()):
            try:
                meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            except Exception:  # noqa: BLE001 - unreadable meta: `restore` falls back past this step
                continue
            self._check(meta, step)
            return meta
        return None

    def restore(self, target_state):
        """Restore the newest usable checkpoint onto `target_state`'s structure, shapes and shardings.

        Returns (state, meta) or None when there is no checkpoint. Falls back to older steps (with a warning)
        when the newest cannot be read. Raises CheckpointMismatchError on a fingerprint mismatch.
        """
        flat_target, treedef = _flatten(target_state)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in flat_target.items()}
        steps = self.all_steps()
        failed = []
        for i, step in enumerate(reversed(steps)):
            try:
                meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                self._check(meta, step)
                target = {k: np.empty(a.shape, a.dtype) for k, a in abstract.items()} if self.host_local else abstract
                got = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
            except CheckpointMismatchError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure of this step: try the previous one
                if i + 1 < len(steps):
                    log.warning("checkpoint step %d in %s cannot be restored (%s: %s); falling back to the previous "
                                "checkpoint", step, self.dir, type(e).__name__, str(e)[:200])
                    failed.append(step)
                    continue
                raise ValueError(f"no usable checkpoint in {self.dir}: step {step} failed with {e}") from e
            flat = got["state"]
            missing = sorted(set(abstract) - set(flat))
            if missing:
                raise CheckpointMismatchError(f"checkpoint {self.dir}/{step} lacks {len(missing)} tensors, e.g. "
                                              f"{missing[:5]}")
            if self.host_local:  # restored as numpy: placed on the target's shardings
                flat = {k: jax.device_put(flat[k], abstract[k].sharding) for k in abstract}
            leaves = [flat[k] for k in flat_target]
            self._set_aside(failed)
            return jax.tree_util.tree_unflatten(treedef, leaves), meta
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable checkpoints newer than the restored one to `<step>.corrupt` (kept for inspection,
        invisible to orbax), so the resumed run can save those steps again."""
        if not steps:
            return
        if jax.process_index() == self.primary:
            for step in steps:
                src, dst = self.dir / str(step), self.dir / f"{step}.corrupt"
                n = 1
                while dst.exists():
                    dst, n = self.dir / f"{step}.corrupt{n}", n + 1
                src.rename(dst)
                log.warning("unreadable checkpoint %s moved to %s", src, dst)
        self.mngr.reload()

    def _check(self, meta: dict, step: int) -> None:
        saved = meta.get("fingerprint", {})
        diff = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
        if diff:
            lines = ", ".join(f"{k}: checkpoint={saved.get(k)!r} vs run={self.fingerprint.get(k)!r}" for k in diff[:6])
            raise CheckpointMismatchError(
                f"checkpoint {self.dir}/{step} was written by a different config ({lines}); use another "
                f"--ckpt-dir or --resume never")

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()
