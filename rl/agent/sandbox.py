"""The sandboxed Python tool: model-written code runs in a child process under limits, never in the run's process.

`run_python(code, limits)` writes the code to a fresh scratch directory, runs `python -I main.py` there and returns a
`SandboxResult` (output, error); nothing it does raises into the caller. `python_tool(limits)` is the same as an
environment tool handler (rl/agent/env.py): the output, or a ToolError the model reads as "error: ...".

What each limit protects against (`SandboxLimits`; the rlimits are set by rl/agent/sandbox_exec.py, a fresh
interpreter that then execs the model's Python: no Python runs between fork and exec in the run's process):
- `cpu_s` (RLIMIT_CPU): busy loops; the kernel sends SIGXCPU at the limit (SIGKILL one second later);
- `memory_bytes` (RLIMIT_AS): allocation bombs (`[0] * 10**10`) and runaway recursion; a MemoryError at the limit;
- `file_bytes` (RLIMIT_FSIZE): filling the disk (writing 1 GB); SIGXFSZ at the limit. It also caps the output
  file the child's stdout and stderr go to, so a print loop cannot fill the run's disk or memory either;
- `processes` (RLIMIT_NPROC, over the user's tasks counted at the call): fork bombs; `fork` fails with EAGAIN. The
  kernel exempts root from RLIMIT_NPROC, so when the run is root a seccomp filter (x86_64) makes fork / vfork /
  clone of a new process fail with EAGAIN instead (threads stay allowed): the code starts no process at all;
- `wall_s`: sleeping or blocked code that uses no CPU; the parent kills the child's whole process group;
- `output_bytes`: what the model reads back; longer output is cut and reported as an error (the tokens are the
  run's budget, and a model that prints megabytes should learn not to);
- network: the child runs in a network namespace of its own with no interface up (`bwrap --unshare-net` when
  bubblewrap is installed, else `unshare --net --map-root-user` where unprivileged user namespaces are allowed);
  where neither works only the rlimits apply, `sandbox_mode()` says "rlimits" and a warning is logged once;
- files: the child's working directory, HOME and TMPDIR are the scratch directory, removed after the call; with
  bubblewrap the rest of the file system is read-only. `python -I` ignores PYTHON* variables and the user's
  site-packages, and the environment passed is minimal (no credentials from the run's environment).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rl.agent.env import ToolError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits of one sandboxed run (module docstring says what each protects against). Raises ValueError naming
    the field for a non-positive limit."""

    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 16
    wall_s: float = 10.0
    output_bytes: int = 4096

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0, got {getattr(self, f.name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """output: stdout + stderr as text (at most `output_bytes`); error: None, or one line saying why the run is a
    tool error (exit status, signal, limit, timeout, output too long); seconds: wall time of the call."""

    output: str
    error: str | None
    seconds: float


@functools.lru_cache(maxsize=1)
def sandbox_mode() -> str:
    """"bwrap" (bubblewrap found), "unshare" (`unshare --net --map-root-user` works here) or "rlimits" (neither:
    no network isolation; logged once)."""
    if shutil.which("bwrap"):
        return "bwrap"
    if shutil.which("unshare"):
        try:
            if subprocess.run(["unshare", "--net", "--map-root-user", "true"], capture_output=True,
                              timeout=10).returncode == 0:
                return "unshare"
        except (OSError, subprocess.SubprocessError):
            pass
    log.warning("sandbox: neither bubblewrap nor unprivileged unshare works here: the Python tool runs under "
                "rlimits only, WITH network access")
    return "rlimits"


def _user_tasks() -> int:
    """Tasks (processes and threads) of this user now: RLIMIT_NPROC counts them all, so the child's limit is this
    plus `processes`."""
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return n


SANDBOX_EXEC = pathlib.Path(__file__).with_name("sandbox_exec.py")


def _command(mode: str, scratch: str, limits: SandboxLimits, nproc: int, no_fork: bool) -> list[str]:
    """The child's argv: the namespace wrapper of `mode`, then rl/agent/sandbox_exec.py (sets the limits in a fresh
    interpreter, then execs), then `python -I main.py`."""
    py = [sys.executable, "-I", "-S", str(SANDBOX_EXEC), str(limits.cpu_s), str(limits.memory_bytes),
          str(limits.file_bytes), str(nproc), str(int(no_fork)), "--", sys.executable, "-I", "main.py"]
    if mode == "bwrap":
        return ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--bind", scratch, scratch,
                "--unshare-net", "--unshare-pid", "--die-with-parent", "--chdir", scratch, *py]
    if mode == "unshare":
        return ["unshare", "--net", "--map-root-user", *py]
    return py


_SIGNALS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit", signal.SIGKILL: "killed",
            signal.SIGSEGV: "segmentation fault"}


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in the sandbox (module docstring) -> SandboxResult. Never raises for anything `code` does."""
    t0 = time.perf_counter()
    nproc = _user_tasks() + limits.processes
    with tempfile.TemporaryDirectory(prefix="dsv4rl-sandbox-") as scratch, \
            tempfile.TemporaryFile(prefix="dsv4rl-sandbox-out-") as out:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        timed_out = False
        try:
            proc = subprocess.Popen(_command(sandbox_mode(), scratch, limits, nproc, no_fork=os.getuid() == 0),
                                    cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            return SandboxResult("", f"sandbox could not start: {e}", time.perf_counter() - t0)
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it forked
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        raw = out.read(limits.output_bytes + 1)
        out.seek(max(0, out.seek(0, os.SEEK_END) - 400))
        tail = out.read().decode("utf-8", errors="replace").strip().splitlines()[-1:]
    text = raw[:limits.output_bytes].decode("utf-8", errors="replace")
    rc = proc.returncode
    if timed_out:
        error = f"wall time limit: stopped after {limits.wall_s:g} s"
    elif rc < 0:
        error = f"stopped by {_SIGNALS.get(-rc, signal.Signals(-rc).name)}"
    elif rc > 0:
        error = f"exit status {rc}: " + " ".join(tail)
    elif len(raw) > limits.output_bytes:
        error = f"output longer than {limits.output_bytes} bytes (cut)"
    else:
        error = None
    return SandboxResult(text, error, time.perf_counter() - t0)


def python_tool(limits: SandboxLimits = SandboxLimits()):
    """A tool handler (rl/agent/env.py `ToolFn`) running the `code` argument in the sandbox: its output, or a
    ToolError saying why it failed (with the output's last line)."""
    def run(args: dict, data: str) -> str:
        del data
        code = args.get("code")
        if not isinstance(code, str):
            raise ToolError("python needs a string argument 'code'")
        res = run_python(code, limits)
        if res.error is not None:
            raise ToolError(res.error)
        return res.output
    return run
