"""The checkpoint's failures as one line each: the OS error behind a library exception, the write error the run
reports, and the filters that keep orbax's background tracebacks of a failed write out of the log (rl/run/checkpoint.py
uses them)."""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import re
import sys


def one_line(e: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, at most `limit` characters (library errors span many lines)."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk is full, read-only, not permitted, or the directory is gone).

    `str(e)` is one line naming the step, the directory and the OS error; `e.errno` is the OS error number (None
    when the library's error named none)."""

    def __init__(self, step: int, directory, code: int | None, detail: str):
        what = f"[Errno {code}] {os.strerror(code)}" if code else detail
        extra = f" ({detail})" if code and detail else ""
        super().__init__(f"checkpoint of step {step} could not be written to --ckpt-dir {directory}: {what}{extra}; "
                         "the newest complete checkpoint is kept")
        self.errno, self.step = code, step


_STRERRORS = {os.strerror(c): c for c in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                                           errno.EDQUOT, errno.EIO, errno.ENOTDIR)}


def os_error_of(e: BaseException) -> tuple[int, str] | None:
    """The OS error behind a library exception -> (errno, path or ""), or None when there is none.

    Looks through the exception chain for an OSError, then in the messages for tensorstore's
    `[os_error_code='28']` or a known strerror text ("No space left on device")."""
    seen, chain = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in chain:
        if isinstance(x, OSError) and x.errno:
            return x.errno, x.filename or ""
    for x in chain:
        text = str(x)
        m = re.search(r"os_error_code='?(\d+)", text)
        path = re.search(r'Failed (?:writing|to \w+)[^"]*"([^"]+)"', text)
        code = int(m.group(1)) if m else next((c for s, c in _STRERRORS.items() if s in text), None)
        if code:
            return code, path.group(1) if path else ""
    return None


class _QuietOrbaxErrors(logging.Filter):
    """Drops the error logs of a failed checkpoint write, which the Checkpointer reports as one line: orbax's
    ERROR records (absl logger: tracebacks from its background threads) and asyncio's "exception was never
    retrieved" records of the other writes that failed with it (their text names a checkpoint directory)."""

    dirs: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        if record.name == "asyncio":
            return not ("never retrieved" in text and self._ours(text))
        frames = []
        tb = record.exc_info[2] if record.exc_info else None
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        return not (self._ours(text) or any(f"{os.sep}orbax{os.sep}" in f for f in frames))

    def _ours(self, text: str) -> bool:
        return "orbax" in text or any(d in text for d in self.dirs)


_QUIET = _QuietOrbaxErrors()


def _closed_loop_hook(previous):
    """sys.unraisablehook that drops tensorstore's write callbacks hitting orbax's already closed event loop (the
    writes still in flight when the first failed one ended orbax's loop); everything else goes to `previous`."""

    def hook(u):
        tb, last = u.exc_traceback, None
        while tb is not None:
            last, tb = tb.tb_frame.f_code, tb.tb_next
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
                and last is not None and last.co_filename.endswith(os.path.join("asyncio", "base_events.py"))):
            previous(u)

    hook.quiet_closed_loop = True
    return hook


def quiet_orbax_errors(directory: pathlib.Path) -> None:
    """Drop orbax's and asyncio's error logs of failed writes under `directory` (reported as one line by the
    Checkpointer) and tensorstore's callbacks into orbax's closed event loop (`sys.unraisablehook`)."""
    _QUIET.dirs.add(str(directory))
    if not getattr(sys.unraisablehook, "quiet_closed_loop", False):
        sys.unraisablehook = _closed_loop_hook(sys.unraisablehook)
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)
