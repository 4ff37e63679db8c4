"""Graceful interruption and tracebacks (issue 15 class 4), on `python launch/run.py` as a real process.

- A startup error raised after the checkpoint directory is opened (a truncated `--init` safetensors file) prints
  the one-line error only: no library (orbax) traceback from its background thread at exit.
- Ctrl-C (SIGINT) is handled like SIGTERM: the current step finishes, is checkpointed, the process exits 130
  with one line. A second Ctrl-C exits at once, status 130, and the newest complete checkpoint stays loadable.

The Ctrl-C test launches the default job (tiny model, built-in digit task) twice; with the session's shared
compile cache that is about 1-2 minutes on 2 busy cores, hence `slow`.
"""

from __future__ import annotations

import shutil
import signal
import time

import pytest


def test_startup_error_after_ckpt_dir_is_one_line(tmp_path, hf_tiny_checkpoint, run_env, lt):
    init = tmp_path / "init"
    shutil.copytree(hf_tiny_checkpoint, init)
    st = init / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    rc, out = lt.launch(["--init", init, "--config", "tiny", "--steps", "1", *lt.TINY, *lt.outputs(tmp_path / "o")],
                        run_env, tmp_path / "run.log")
    assert rc == 2, out[-3000:]
    assert "error: " in out and "model.safetensors" in out
    assert "Traceback" not in out, out[-3000:]


def _wait_for_metrics(proc, path, n: int, lt, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and len(lt.read_metrics(path)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} logged steps in {path} (exit {proc.poll()})")


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130_and_second_ctrl_c_exits_at_once(tmp_path, run_env, lt):
    out_dir, log = tmp_path / "out", tmp_path / "run.log"
    cmd = [*lt.TINY, "--steps", "40", "--ckpt-every", "100", "--eval-every", "0", *lt.outputs(out_dir)]
    proc = lt.start(cmd, run_env, log)
    _wait_for_metrics(proc, out_dir / "metrics.jsonl", 1, lt)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=600)
    text = log.read_text(errors="replace")
    assert rc == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "interrupted (Ctrl-C)" in text and "SIGINT" in text
    logged = [r["step"] for r in lt.read_metrics(out_dir / "metrics.jsonl")]
    steps = lt.ckpt_steps(out_dir / "ckpt")
    assert steps and steps[-1] == len(logged) == logged[-1] + 1  # the last completed step is checkpointed
    before = lt.load_state(out_dir / "ckpt", steps[-1])

    # restart (resumes), then Ctrl-C twice: out at once with 130; the newest complete checkpoint is intact
    offset = log.stat().st_size
    proc = lt.start(cmd, run_env, log)
    _wait_for_metrics(proc, out_dir / "metrics.jsonl", len(logged) + 1, lt)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    text = log.read_bytes()[offset:].decode(errors="replace")
    assert rc == 130, text[-3000:]
    assert "resumed from" in text and "interrupted again" in text and "Traceback" not in text, text[-3000:]
    newest = lt.ckpt_steps(out_dir / "ckpt")[-1]
    assert newest >= steps[-1]
    state = lt.load_state(out_dir / "ckpt", newest)
    assert len(state) == len(before) > 100
