"""Each compile of `python -m launch.plan --compile` in a child process of its own, so that XLA aborting (a failed
CHECK: `F... hlo_instruction.cc:1615] Invalid binary instruction opcode copy`, a C++ stack, SIGABRT) ends that
compile only: the planner prints one line naming the role, the target and what to try, and goes on with the other
role's program.

    python -m launch.compile_child      # internal: a pickled job on stdin, the pickled result on stdout

The parent (`compile_in_child`) starts `python -m launch.compile_child` with the environment the compile needs (an
XLA:CPU target: `--xla_force_host_platform_device_count` = the mesh's devices and JAX_PLATFORMS=cpu, so the
planner itself needs no devices; a GPU target: JAX_PLATFORMS=cpu, the abstract devices made in the child from the
`launch.gpu_target.Target`), sends (function, keyword arguments, target), and reads back the function's result
(`launch.aot.CompileReport` / `RolloutCompileReport`, plain dataclasses). The child's stderr (JAX's and XLA's
warnings) goes to a log file: replayed on the planner's stderr after a compile that worked, kept and named in the
error line after one that did not. Why a fresh interpreter, not a fork of the planner: a forked JAX process is
unsafe (its runtime threads), and the device count is fixed when a process's XLA:CPU backend starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
DEVICE_FLAG = "--xla_force_host_platform_device_count"
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] (.*)$", re.M)  # absl's fatal line: F<mmdd> <time> <tid> file:line] msg


class CompileFailed(RuntimeError):
    """A compile's child process aborted or raised (not a ValueError): `str()` is the one line to print."""


@dataclasses.dataclass(frozen=True)
class Job:
    """What a child runs: `fn` ("module:function") called with `kwargs`; with `gpu_target` (a
    `launch.gpu_target.Target`) `kwargs["devices"]` = `n_devices` abstract GPUs of it first."""

    fn: str
    kwargs: dict
    gpu_target: object = None
    n_devices: int = 0
    gpus_per_node: int = 8


def child_env(n_devices: int, gpu: bool, environ=None) -> dict:
    """The child's environment: `environ` (default os.environ) with JAX_PLATFORMS=cpu, this checkout first on
    PYTHONPATH, and (XLA:CPU, `gpu` False) XLA_FLAGS' device count set to `n_devices` (its other flags kept)."""
    env = dict(os.environ if environ is None else environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    if not gpu:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
        env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_FLAG}={n_devices}"])
    return env


def compile_in_child(job: Job, *, role: str, target: str, hint: str, n_devices: int, gpu: bool):
    """Run `job` in a fresh `python -m launch.compile_child` (module docstring) -> its result.

    Args: role: "actor" | "rollout" (named in the error). target: how the compile is named, e.g. "XLA:CPU, --target
      cpu". hint: what to try instead (ends the error line). n_devices: XLA:CPU devices the child gets (the mesh's).
      gpu: a GPU target (abstract devices, no device count).
    Raises: ValueError (the function's own, message kept: bad sizes for the planner to print as today);
      CompileFailed (one line: an abort with XLA's fatal message and signal, or another exception, and the log file).
    """
    log = tempfile.NamedTemporaryFile(prefix=f"dsv4-plan-{role}-compile-", suffix=".log", delete=False)
    with log:
        proc = subprocess.run([sys.executable, "-m", "launch.compile_child"], input=pickle.dumps(job),
                              stdout=subprocess.PIPE, stderr=log, env=child_env(n_devices, gpu), cwd=REPO)
    text = pathlib.Path(log.name).read_text(errors="replace")
    result = None
    if proc.stdout:
        try:
            result = pickle.loads(proc.stdout)
        except Exception:  # noqa: BLE001  (a child cut off mid-write: reported below as its exit)
            result = None
    what = f"the {role} compile ({target})"
    if proc.returncode == 0 and result is not None and result[0] == "ok":
        sys.stderr.write(text)
        sys.stderr.flush()
        os.unlink(log.name)
        return result[1]
    if result is not None and result[0] == "error":
        kind, message = result[1], result[2]
        if kind == "ValueError":
            os.unlink(log.name)
            raise ValueError(message)
        raise CompileFailed(f"{what} failed: {kind}: {message.splitlines()[0] if message else ''}; try {hint} "
                            f"(its log: {log.name})")
    fatal = _FATAL.search(text)
    said = f": `F {fatal.group(1)} {fatal.group(2)}`" if fatal else ""
    how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
           else f"exit status {proc.returncode}")
    raise CompileFailed(f"{what} aborted inside XLA{said} ({how}); try {hint} (XLA's log with its C++ stack: "
                        f"{log.name})")


def _child() -> int:
    """The child's side: the job from stdin, its result pickled to the stdout it was given (anything the job prints
    goes to stderr: the log)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    job: Job = pickle.loads(sys.stdin.buffer.read())
    try:
        module, name = job.fn.split(":")
        fn = getattr(importlib.import_module(module), name)
        kwargs = dict(job.kwargs)
        if job.gpu_target is not None:
            gt = importlib.import_module("launch.gpu_target")
            kwargs["devices"] = gt.topology_devices(job.gpu_target, job.n_devices, job.gpus_per_node)
        result = ("ok", fn(**kwargs))
    except Exception as e:  # noqa: BLE001  (sent to the parent: it decides what is one line)
        traceback.print_exc()
        result = ("error", type(e).__name__, str(e))
    pickle.dump(result, out)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child())
