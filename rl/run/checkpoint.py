"""Checkpoints with orbax: async, atomic, resumable, config-checked.

A checkpoint at step s holds (docs/jax-stack.md §6):
- `state`: the learner's state (fp32 master params, buffers, optimizer state, update count, reference params
  when KL is on) as a flat {path: array} dict (`jax.tree_util.keystr` paths), restored straight onto the actor
  mesh's shardings;
- `meta` (JSON): step, weight version, the data iterator state (`{"next_index": k}`), the seed (all randomness
  is derived from (seed, step, prompt, sample), so seed + step is the RNG state), a fingerprint of the run
  (model config + the knobs that change the math) and the identity of the train and eval datasets
  (`file_identity`: size + content hash; checked on resume by rl/run/loop.py). The sampler's weights are not saved: they
  are a pure function of the params (re-pushed on restore).
Orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, so a crash mid-save leaves the
previous step as the latest. Each save records a digest of every array in the meta (`digests`: rl/run/digest.py,
computed on device, layout-independent; orbax's crc32c covers only the zarr shard index, not the data), checked on
restore. A latest checkpoint that fails to restore (unreadable, partial, an array off its digest, its in-flight
batches file bad) falls back to the previous one with one warning line and is renamed `<step>.corrupt` (kept, but
no longer a step, so the resumed run can save that step again); none usable is one line
(`NoUsableCheckpointError`); a fingerprint mismatch is an error naming the differing fields (`field: checkpoint=..
run=..`, a few at most; the model config field by field), checked by `check_latest` before the model is built.
The dataset *path* is not compared when the checkpoint records the datasets' identity: the content check of
rl/run/wiring.py::same_data decides (the same file at a new path resumes; a changed one names --allow-dataset-change).

One run at a time: the Checkpointer takes the directory's run lock (rl/run/run_lock.py) before it touches anything,
so a second run on the same --ckpt-dir refuses at start with one line naming the running owner.

Write failures (ENOSPC, EROFS, EACCES, a vanished directory) end the run with one line, `CheckpointWriteError` (an
OSError) naming the step, the directory and the OS error: `save` first proves the directory writable and, from the
second save on, that it has room for one more checkpoint of the newest one's size (when one process writes), so the
usual faults stop the run at the failing save; a fault that only shows inside orbax's background write is raised at
the next `save` / `wait` / `close`. orbax's ERROR logs (tracebacks from its background threads; the exception itself
still reaches the caller, which reports it) and asyncio's "exception was never retrieved" records of the writes that
failed with it are dropped (`_QuietOrbaxErrors`), and so are the "Event loop is closed" reports of the writes still
in flight when the first one failed (`sys.unraisablehook`, narrowly: that error from asyncio only). The newest
complete checkpoint is never touched: orbax writes into a temp directory and renames it only when complete.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp

from rl.run import run_lock
from rl.run.checkpoint_errors import CheckpointWriteError, one_line, os_error_of, quiet_orbax_errors
from rl.run.digest import ALGO, array_digests

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


class CheckpointDigestError(ValueError):
    """A restored array does not match the digest saved with it; the message names the array and the step."""


class NoUsableCheckpointError(ValueError):
    """Every checkpoint of the directory is unreadable or corrupt; the message is one line naming them."""


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]} is" if len(steps) == 1 else f"steps {', '.join(map(str, sorted(steps)))} are"


def _dir_bytes(path: pathlib.Path) -> int:
    """Bytes of the files under `path` (0 when it is gone)."""
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def _flatten(tree) -> tuple[dict, object]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): x for p, x in leaves}, treedef


def check_writable(directory: str | os.PathLike, what: str, probe: bool = True) -> pathlib.Path:
    """Create `directory` and prove it is writable (before step 1; `probe=False`: create only); OSError ->
    ValueError naming the flag."""
    d = pathlib.Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not probe:
            return d
        probe = d / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{what} {d} is not writable: {e}") from e
    return d


_SHOWN = 4  # differing fields named in a mismatch error


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def fingerprint_diff(saved: dict, run: dict, ignore=()) -> list[str]:
    """The fields that differ between a checkpoint's fingerprint and the run's, as `field: checkpoint=A run=B`
    (sorted). The model config (a JSON text under "model") is compared field by field (`model.hidden_size: ...`).
    Keys in `ignore` are skipped (the dataset path when the datasets' content identity is checked instead)."""
    out = []
    for k in sorted(set(saved) | set(run)):
        if k in ignore or saved.get(k) == run.get(k):
            continue
        a, b = saved.get(k), run.get(k)
        if k == "model" and isinstance(a, str) and isinstance(b, str):
            try:
                ma, mb = json.loads(a), json.loads(b)
            except ValueError:
                ma = mb = None
            if isinstance(ma, dict) and isinstance(mb, dict):
                out += [f"model.{f}: checkpoint={_short(ma.get(f))} run={_short(mb.get(f))}"
                        for f in sorted(set(ma) | set(mb)) if ma.get(f) != mb.get(f)]
                continue
        out.append(f"{k}: checkpoint={_short(a)} run={_short(b)}")
    return out


class Checkpointer:
    """Orbax CheckpointManager wrapper.

    Args:
      directory: checkpoint root (created). keep: how many to keep. fingerprint: JSON-able dict identifying
        the run's math (compared on restore; keys in `ignore` skipped).
      read_only: a reader (--eval-only): `directory` must exist; nothing in it is created, locked, cleaned, renamed
        or saved (a read-only file system works).
      processes: the process indices that hold the saved arrays and call every method (None: all processes).
        MPMD runs pass the actor's: orbax's barriers (`MultiprocessingOptions.active_processes`) then involve
        those processes only, the first of them writes the metadata, and the rollout processes, which hold no
        learner array, never construct a Checkpointer (their state is derived: rl/roles.py). A single saving
        process in a multi-process job (`processes` of one): orbax refuses its arrays (fully addressable, hence
        "host local" to orbax once jax.process_count() > 1), so they are saved from host copies (`jax.device_get`
        at save time, blocking) and restored as numpy, then placed on the target's shardings.
      digest: record the arrays' digests with each save (False: only benchmarks/ckpt_digest.py's baseline).
    """

    def __init__(self, directory, *, keep: int = 2, fingerprint: dict, async_save: bool = True,
                 processes=None, read_only: bool = False, ignore: tuple[str, ...] = (), digest: bool = True):
        self.read_only, self.ignore = read_only, tuple(ignore)
        self.dir = pathlib.Path(directory if read_only else check_writable(directory, "--ckpt-dir", False)).resolve()
        self.fingerprint, self.digest = fingerprint, digest
        self.primary = 0 if processes is None else min(processes)
        self.host_local = processes is not None and len(set(processes)) == 1 and jax.process_count() > 1
        # the run lock first, before any write in the directory (a refused run writes nothing there), and before
        # the manager below deletes temp dirs, which may be another live run's unfinished save. A reader takes none.
        try:
            self._lock = None if read_only else run_lock.acquire(self.dir, primary=self.primary, processes=processes)
        except OSError as e:  # the lock file cannot be created
            raise ValueError(f"--ckpt-dir {self.dir} is not writable: {e}") from e
        self._release = weakref.finalize(self, run_lock.release, self._lock)  # also at interpreter exit
        if not read_only:
            try:
                check_writable(self.dir, "--ckpt-dir")
            except BaseException:
                self._release()
                raise
        quiet_orbax_errors(self.dir)
        self._pending: int | None = None  # the step whose asynchronous write may still fail
        self._failed: CheckpointWriteError | None = None
        mp = {} if processes is None else dict(create=False, multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=self.primary, active_processes=set(processes), barrier_sync_key_prefix="actor"))
        ro = dict(read_only=True, create=False, max_to_keep=None, cleanup_tmp_directories=False) if read_only else {}
        opts = ocp.CheckpointManagerOptions(**{**dict(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                      cleanup_tmp_directories=True), **mp, **ro})
        try:
            self.mngr = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", "meta"))
        except BaseException:
            self._release()
            raise
        # The manager cleans old temp dirs in a background thread; a run that stops at a startup error right
        # after this would have that thread fail at interpreter shutdown with a library traceback under the
        # one-line error. Waiting here costs one directory listing.
        wait_cleanup = getattr(self.mngr, "_maybe_await_cleanup_tmp_directory", None)
        if wait_cleanup is not None:
            wait_cleanup()

    def all_steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> None:
        """Save (asynchronously) the learner state pytree and the meta dict at `step`.

        Raises CheckpointWriteError (one line: step, directory, OS error) when the directory is not writable,
        has no room for a checkpoint of the newest one's size (both checked first when one process writes: with
        several, a verdict of one process alone would leave the others at orbax's barriers), or the previous
        asynchronous save failed."""
        if self.read_only:
            raise RuntimeError(f"Checkpointer({self.dir}, read_only=True) cannot save")
        if self._failed is not None:
            raise self._failed
        self._finish()  # the previous save's background error, if any, belongs to that step
        if jax.process_count() == 1 or self.host_local:  # one writer: no other process waits at orbax's barriers
            self._preflight(step)
        flat, _ = _flatten(state)
        # the arrays' digests, on their devices, before any host copy (rl/run/digest.py: layout-independent)
        digests = {"digests": {"algo": ALGO, "arrays": array_digests(flat)}} if self.digest else {}
        if self.host_local:  # see the class docstring
            flat = jax.device_get(flat)
        meta = {**meta, "step": int(step), "fingerprint": self.fingerprint, **digests}
        self._pending = int(step)
        try:
            self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                                         meta=ocp.args.JsonSave(meta)), force=force)
        except Exception as e:  # noqa: BLE001 - an OS fault becomes one line; anything else is re-raised
            self._fail(step, e)
            raise

    def _preflight(self, step: int) -> None:
        """Prove `self.dir` writable (a small file written, synced and removed) and, when a complete checkpoint
        exists, that the disk has room for one more of its size. Raises CheckpointWriteError."""
        probe = self.dir / f".write-probe-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"ok")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
            free = shutil.disk_usage(self.dir).free
        except OSError as e:
            self._failed = CheckpointWriteError(step, self.dir, e.errno, "")
            raise self._failed from None
        steps = self.all_steps()
        need = _dir_bytes(self.dir / str(steps[-1])) if steps else 0
        if need > free:
            self._failed = CheckpointWriteError(step, self.dir, errno.ENOSPC,
                                                f"a checkpoint takes {need / 2**20:.1f} MiB (step {steps[-1]}), "
                                                f"{free / 2**20:.1f} MiB are free")
            raise self._failed

    def _fail(self, step: int | None, e: BaseException) -> None:
        """An exception of an orbax call: when an OS error lies behind it, remember and raise it as one line."""
        found = os_error_of(e)
        if found is None:
            return
        code, path = found
        self._failed = CheckpointWriteError(step if step is not None else -1, self.dir, code,
                                            path if path and not path.startswith(str(self.dir)) else "")
        raise self._failed from None

    def _finish(self) -> None:
        """Wait for the pending asynchronous save; its failure -> CheckpointWriteError naming its step."""
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            step, self._pending = self._pending, None
            self._fail(step, e)
            raise
        self._pending = None

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

    def restore(self, target_state, check=None):
        """Restore the newest usable checkpoint onto `target_state`'s structure, shapes and shardings.

        A step is usable when its meta and arrays read, every array matches the digest saved with it (rl/run/digest.py;
        a checkpoint saved before digests were recorded is read unverified) and `check(step)` (the in-flight
        batches file: rl/run/pipeline.py::read_inflight) raises nothing. Unusable steps newer than the restored one
        are passed over with one warning line each (naming the step and, for a digest mismatch, the array) and
        moved to `<step>.corrupt`. Returns (state, meta) or None when there is no checkpoint.
        Raises CheckpointMismatchError on a fingerprint mismatch, NoUsableCheckpointError (one line) when no step
        is usable.
        """
        flat_target, treedef = _flatten(target_state)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in flat_target.items()}
        steps = self.all_steps()
        failed = []
        for i, step in enumerate(reversed(steps)):
            try:
                meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                self._check(meta, step)
                if check is not None:
                    check(step)
                target = {k: np.empty(a.shape, a.dtype) for k, a in abstract.items()} if self.host_local else abstract
                flat = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
                missing = sorted(set(abstract) - set(flat))
                if missing:
                    raise CheckpointMismatchError(f"checkpoint {self.dir}/{step} lacks {len(missing)} tensors, e.g. "
                                                  f"{missing[:5]}")
                if self.host_local:  # restored as numpy: placed on the target's shardings
                    flat = {k: jax.device_put(flat[k], abstract[k].sharding) for k in abstract}
                self._verify(meta, flat, step)
            except CheckpointMismatchError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure of this step: try the previous one
                failed.append(step)
                if i + 1 < len(steps):
                    log.warning("checkpoint step %d in %s cannot be restored (%s); falling back to the previous "
                                "checkpoint", step, self.dir, one_line(e))
                    continue
                raise NoUsableCheckpointError(
                    f"no usable checkpoint in --ckpt-dir {self.dir}: {_steps(failed)} unreadable (step {step}: "
                    f"{one_line(e)}); restore the files or use another --ckpt-dir") from None
            leaves = [flat[k] for k in flat_target]
            self._set_aside(failed)
            return jax.tree_util.tree_unflatten(treedef, leaves), meta
        return None

    def _verify(self, meta: dict, flat: dict, step: int) -> None:
        """Compare the restored arrays with the digests saved with them. Raises CheckpointDigestError naming the
        first array that differs and the step."""
        saved = meta.get("digests")
        if not saved or saved.get("algo") != ALGO:
            log.info("checkpoint step %d in %s has no array digests (saved before they were recorded): not verified",
                     step, self.dir)
            return
        got = array_digests(flat)
        bad = [k for k in sorted(got) if saved["arrays"].get(k) != got[k]]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise CheckpointDigestError(f"array {bad[0]}{more} of step {step} does not match the digest saved "
                                        "with it: the data is corrupt")

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable checkpoints newer than the restored one to `<step>.corrupt` (kept for inspection,
        invisible to orbax), so the resumed run can save those steps again."""
        if not steps:
            return
        if self.read_only:  # a reader changes nothing: the unreadable steps stay where they are
            log.warning("unreadable checkpoint step(s) %s in %s left in place (read-only)", steps, self.dir)
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
        diff = fingerprint_diff(meta.get("fingerprint", {}), self.fingerprint,
                                ignore=self.ignore + (("dataset",) if meta.get("data_identity") else ()))
        if diff:
            shown = ", ".join(diff[:_SHOWN]) + (f", and {len(diff) - _SHOWN} more" if len(diff) > _SHOWN else "")
            fix = ("give the checkpoint's values of these flags (an evaluation compares only the model and the "
                   "knobs that shape the saved state)") if self.read_only else \
                "use another --ckpt-dir or --resume never"
            raise CheckpointMismatchError(
                f"checkpoint {self.dir}/{step} was written by a different config ({shown}); {fix}")

    def wait(self) -> None:
        """Wait for the pending save. Raises its CheckpointWriteError (once: after a reported failure, nothing)."""
        if self._failed is not None:
            return
        self._finish()

    def close(self) -> None:
        """Wait for the pending save, close the manager and release the run lock (also on a failed save)."""
        try:
            self.wait()
        finally:
            try:
                self.mngr.close()
            except Exception:  # noqa: BLE001 - a failure already reported by wait/save comes back here
                if self._failed is None:
                    raise
            finally:
                self._release()
