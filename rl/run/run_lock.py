"""The run-directory lock: one run at a time on a --ckpt-dir.

Two runs started on one checkpoint directory (the same command launched twice by a scheduler) would replace each
other's checkpoints and log every step twice. So the Checkpointer (rl/run/checkpoint.py) takes this lock before it
touches the directory, and a second run refuses at start with one line naming the running owner:

    --ckpt-dir /runs/a/ckpt is in use by another run (host node3, pid 4711, since 2026-12-01T21:50:02Z); ...

The lock is an OS advisory lock (`fcntl.flock`, exclusive, non-blocking) on `<dir>/.run.lock`, held for the life
of the process (or until `release`). The kernel drops it when its owner dies, however it dies (SIGKILL, OOM, a
lost node), so a stale lock needs no heartbeat or timeout: a run that finds the file filled in but unlocked takes
it over and logs whose lock it took (the previous owner ended without releasing it). The file records the
owner (host, pid, start time) for the refusal message and is emptied on release. flock works across hosts on
NFSv4 and on Lustre mounted with `flock`; where the file system cannot lock at all (ENOLCK, EOPNOTSUPP) the run
goes on with a warning that a second run would not be detected.

Within one process the lock is shared: a second Checkpointer on the same directory (a notebook building a job
again) takes a reference to the held lock instead of refusing. Multi-process runs: only one process (the
checkpoint's primary) takes the lock; it publishes the verdict through JAX's distributed key-value store and the
other processes raise the same one-line error (`acquire(..., processes=...)`).

Tests: `.venv/bin/python -m pytest -q tests/rl/test_run_lock.py`.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import socket
import threading

import jax
from jax._src import distributed

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
_VERDICT_TIMEOUT_MS = 300_000  # other processes wait this long for the primary's verdict


class RunDirLockedError(ValueError):
    """Another live run holds the directory's lock; the message names it (host, pid, start time)."""


_held: dict[str, list] = {}  # lock path -> [fd, references] (this process)
_guard = threading.Lock()
_verdicts = {"n": 0}  # key counter of the multi-process verdicts


def _describe(record: str) -> str:
    try:
        owner = json.loads(record)
        return f"host {owner['host']}, pid {owner['pid']}, since {owner['since']}"
    except (ValueError, KeyError, TypeError):
        return record.strip()[:200] or "owner unknown"


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace")


def _take(directory: pathlib.Path, flag: str) -> str | None:
    """Lock `directory` in this process -> the lock path (None: the file system cannot lock)."""
    path = str(directory / LOCK_NAME)
    with _guard:
        if path in _held:
            _held[path][1] += 1
            return path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe(_read(fd))
            os.close(fd)
            raise RunDirLockedError(f"{flag} {directory} is in use by another run ({owner}); wait for it to end, "
                                    f"stop it, or use another {flag}") from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                log.warning("%s %s: the file system cannot lock %s (%s); a second run on this directory would not "
                            "be detected", flag, directory, LOCK_NAME, e.strerror)
                return None
            raise
        previous = _read(fd)
        if previous.strip():
            log.warning("%s %s: took over the run lock of %s, which ended without releasing it", flag, directory,
                        _describe(previous))
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)
        _held[path] = [fd, 1]
        return path


def release(path: str | None) -> None:
    """Drop one reference to the lock `acquire` returned; the last one empties the file and unlocks it."""
    if path is None:
        return
    with _guard:
        entry = _held.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[path]
        fd = entry[0]
        try:
            os.ftruncate(fd, 0)
        except OSError:  # the directory vanished or went read-only: the kernel lock is what counts
            pass
        os.close(fd)  # closing the only descriptor releases the flock


def acquire(directory: str | os.PathLike, *, flag: str = "--ckpt-dir", primary: int = 0,
            processes=None) -> str | None:
    """Take the run lock of `directory` (which must exist) -> a handle for `release` (None: not locked here).

    Single process: lock, or raise RunDirLockedError naming the owner. Multi-process (`jax.process_count() > 1`):
    process `primary` locks and publishes the verdict; the other processes of `processes` (default: all) wait for
    it and raise the same error when it refused. Raises OSError when the lock file cannot be created.
    """
    if jax.process_count() == 1:
        return _take(pathlib.Path(directory), flag)
    client = distributed.global_state.client
    _verdicts["n"] += 1
    key = f"dsv4rl/run_lock/{_verdicts['n']}"
    if jax.process_index() == primary:
        try:
            handle = _take(pathlib.Path(directory), flag)
        except RunDirLockedError as e:
            client.key_value_set(key, f"refused\n{e}")
            raise
        client.key_value_set(key, "ok")
        return handle
    if processes is not None and jax.process_index() not in set(processes):
        return None
    verdict = client.blocking_key_value_get(key, _VERDICT_TIMEOUT_MS)
    if verdict.startswith("refused\n"):
        raise RunDirLockedError(verdict.split("\n", 1)[1])
    return None
