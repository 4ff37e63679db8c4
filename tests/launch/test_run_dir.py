"""The run directory under faults, on `python launch/run.py` as real processes (issue 28 §1, §2).

1. A full disk: --ckpt-dir on a 7 MiB tmpfs holds the tiny job's first checkpoint (4.6 MiB) but not a second.
   The run ends at the save of step 2 with exit 2 and one line naming the step, the directory and "No space left
   on device": no traceback, no orbax/asyncio error log; the failed step's metrics are in the JSONL file and the
   step-1 checkpoint is complete.
2. That checkpoint resumes (copied to a roomy directory, the same command runs to the end), and a second run
   started on the same directory meanwhile refuses at start with one line naming the first one's pid, while the
   first completes untouched (its checkpoints, each step logged once).

The tmpfs needs mount rights (root, as in CI); without them the test skips with the reason. Three launches
sharing the session's compile cache: 6 minutes wall on 2 cores shared at a load of ~10 (the first compiles), hence
`slow`.

    .venv/bin/python -m pytest -q -m slow tests/launch/test_run_dir.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest


def _errors(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error: ")]


@pytest.mark.slow
def test_full_disk_ends_at_the_failing_save_then_resumes_and_a_second_run_refuses(tmp_path, run_env, lt):
    full = tmp_path / "full"
    full.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7M", "tmpfs", str(full)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): the full disk needs one")
    job = [*lt.TINY, "--steps", "3", "--ckpt-every", "1"]
    a = tmp_path / "a"
    try:
        rc, out = lt.launch([*job, "--ckpt-dir", full / "ckpt", "--metrics-jsonl", a / "metrics.jsonl",
                             "--tensorboard-dir", ""], run_env, tmp_path / "a.log")
        errors = _errors(out)
        assert rc == 2 and len(errors) == 1, out[-3000:]
        assert "step 2" in errors[0] and str(full / "ckpt") in errors[0] and "No space left on device" in errors[0]
        assert "Traceback" not in out and " ERROR " not in out, out[-3000:]
        assert [m["step"] for m in lt.read_metrics(a / "metrics.jsonl")] == [0, 1]  # step 2's row (index 1) is there
        assert lt.ckpt_steps(full / "ckpt") == [1]
        b = tmp_path / "b"
        shutil.copytree(full / "ckpt", b / "ckpt", ignore=shutil.ignore_patterns("*.orbax-checkpoint-tmp*"))
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True)

    cmd = [*job, *lt.outputs(b)]
    first = lt.start(cmd, run_env, tmp_path / "b.log")
    lock = b / "ckpt" / ".run.lock"
    end = time.monotonic() + 600
    while first.poll() is None and time.monotonic() < end:
        text = lock.read_text() if lock.exists() else ""
        if text.strip() and json.loads(text)["pid"] == first.pid:
            break
        time.sleep(0.05)
    assert first.poll() is None, (tmp_path / "b.log").read_text()[-3000:]
    rc2, out2 = lt.launch(cmd, run_env, tmp_path / "second.log")
    errors = _errors(out2)
    assert rc2 == 2 and len(errors) == 1 and "Traceback" not in out2, out2[-3000:]
    assert "in use by another run" in errors[0] and f"pid {first.pid}" in errors[0], errors[0]
    assert first.wait(timeout=900) == 0, (tmp_path / "b.log").read_text()[-3000:]
    log = (tmp_path / "b.log").read_text()
    assert "resumed from" in log and "at step 1 " in log
    assert lt.ckpt_steps(b / "ckpt") == [2, 3]
    assert [m["step"] for m in lt.read_metrics(b / "metrics.jsonl")] == [1, 2]
    assert lock.read_text() == ""  # released at exit
