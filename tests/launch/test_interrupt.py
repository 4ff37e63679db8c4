"""Graceful interruption and tracebacks (issue 15 class 4), on `python launch/run.py` as a real process.

- A startup error raised after the checkpoint directory is opened (a truncated `--init` safetensors file) prints
  the one-line error only: no library (orbax) traceback from its background thread at exit.

Ctrl-C (SIGINT handled like SIGTERM, exit 130 with one line; a second Ctrl-C exits at once and keeps the newest
complete checkpoint) is checked inside the kill/resume sequence of tests/launch/test_resume.py, whose launched job
it shares.
"""

from __future__ import annotations

import shutil


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
