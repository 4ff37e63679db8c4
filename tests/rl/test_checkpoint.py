"""rl/run/checkpoint.py: write failures end with one line and keep the newest checkpoint (issue 28 §2); a checkpoint of
another config names the differing fields (§5); a moved dataset file is judged by its content (§5).

The storage faults are real: a directory removed under the run (everywhere), and, where this process may mount
(root, as in CI), a tmpfs too small for the next checkpoint and a bind mount remounted read-only (chmod does not
stop root). Each case checks: `CheckpointWriteError` at the failing save, one line naming the step, the
directory and the OS error, no orbax/asyncio error logs, and the newest complete checkpoint restorable.

    .venv/bin/python -m pytest -q tests/rl/test_checkpoint.py
"""

from __future__ import annotations

import errno
import json
import logging
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from rl.run.checkpoint import CheckpointMismatchError, Checkpointer, fingerprint_diff
from rl.run.checkpoint_errors import CheckpointWriteError


def _state(seed: int, n: int = 4):
    """n random float32 [64, 1024] arrays (256 KiB each; random: they do not compress)."""
    rng = np.random.default_rng(seed)
    return {f"w{i}": jnp.asarray(rng.standard_normal((64, 1024), dtype=np.float32)) for i in range(n)}


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount here ({r.stderr.strip() or r.returncode}): the fault needs a mount")


@pytest.fixture
def mounts():
    done = []
    yield lambda *args: (_mount(*args), done.append(args[-1]))
    for target in reversed(done):  # already unmounted by the test: a harmless error
        subprocess.run(["umount", "-l", target], capture_output=True)  # lazy: a failed test may hold files open


def _assert_one_line_fault(e: CheckpointWriteError, step: int, directory, code: int, caplog, capfd) -> None:
    msg = str(e)
    assert "\n" not in msg and e.errno == code and isinstance(e, OSError)
    assert f"step {step}" in msg and str(directory) in msg and f"[Errno {code}] " in msg, msg
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # orbax's background errors: dropped
    assert "Traceback" not in capfd.readouterr().err


def _restore_newest(directory, step: int, state) -> None:
    ck = Checkpointer(directory, fingerprint={"run": 1})
    got, meta = ck.restore(_state(0, len(state)))
    assert meta["step"] == step
    assert all(np.array_equal(np.asarray(got[k]), np.asarray(state[k])) for k in state)
    ck.close()


def test_vanished_directory_ends_at_the_failing_save(tmp_path, caplog, capfd):
    d = tmp_path / "ckpt"
    ck = Checkpointer(d, fingerprint={"run": 1})
    ck.save(1, _state(1), {"x": 1})
    ck.wait()
    import shutil

    shutil.rmtree(d)
    with pytest.raises(CheckpointWriteError) as e:
        ck.save(2, _state(2), {"x": 2})
    _assert_one_line_fault(e.value, 2, d, errno.ENOENT, caplog, capfd)
    ck.wait()  # the failure is reported once: the loop's final wait does not raise it again
    ck.close()


def test_full_disk_first_and_later_saves(tmp_path, mounts, caplog, capfd):
    """A 1.5 MiB tmpfs: 4 arrays (1 MiB) fit once; the second save is refused before it starts (no room for one
    more of that size). 16 arrays (4 MiB) do not fit at all: orbax's background write fails and the next call
    reports it as one line naming that step."""
    d = tmp_path / "full"
    d.mkdir()
    mounts("-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(d))
    first = _state(1)
    ck = Checkpointer(d / "ckpt", fingerprint={"run": 1})
    ck.save(1, first, {"x": 1})
    with pytest.raises(CheckpointWriteError) as e:
        ck.save(2, _state(2), {"x": 2})
    _assert_one_line_fault(e.value, 2, d / "ckpt", errno.ENOSPC, caplog, capfd)
    assert "MiB are free" in str(e.value) and ck.all_steps() == [1]
    ck.close()
    _restore_newest(d / "ckpt", 1, first)

    big = Checkpointer(d / "big", fingerprint={"run": 1})
    big.save(7, _state(3, 16), {"x": 7})  # asynchronous: the failure shows inside orbax's threads
    with pytest.raises(CheckpointWriteError) as e:
        big.wait()
    _assert_one_line_fault(e.value, 7, d / "big", errno.ENOSPC, caplog, capfd)
    assert big.all_steps() == []
    big.close()


def test_read_only_directory(tmp_path, mounts, caplog, capfd):
    """The directory turns read-only mid-run: a read-only bind mount of it over itself (a remount of the mount in
    use would be refused while the run lock's file is open for writing)."""
    d = tmp_path / "ro"
    ck = Checkpointer(d, fingerprint={"run": 1})
    first = _state(1)
    ck.save(1, first, {"x": 1})
    ck.wait()
    mounts("--bind", "-o", "ro", str(d), str(d))
    with pytest.raises(CheckpointWriteError) as e:
        ck.save(2, _state(2), {"x": 2})
    _assert_one_line_fault(e.value, 2, d, errno.EROFS, caplog, capfd)
    ck.close()
    subprocess.run(["umount", str(d)], check=True)
    _restore_newest(d, 1, first)


def test_config_mismatch_names_the_differing_fields():
    model = {"hidden_size": 64, "num_layers": 4, "vocab_size": 256, "rope_theta": 10000.0}
    saved = {"model": json.dumps(model), "group_size": 4, "lr": 1e-6, "dataset": "a.jsonl"}
    run = {"model": json.dumps({**model, "hidden_size": 128, "num_layers": 8}), "group_size": 8, "lr": 1e-6,
           "dataset": "b.jsonl"}
    assert fingerprint_diff(saved, run) == ["dataset: checkpoint='a.jsonl' run='b.jsonl'",
                                            "group_size: checkpoint=4 run=8",
                                            "model.hidden_size: checkpoint=64 run=128",
                                            "model.num_layers: checkpoint=4 run=8"]
    assert fingerprint_diff(saved, run, ignore=("dataset",))[0] == "group_size: checkpoint=4 run=8"


def test_checkpoint_of_another_model_is_one_short_line(tmp_path):
    from dsv4 import DSV4Config

    def fp(mc):
        return {"model": json.dumps(mc.to_dict(), sort_keys=True, default=str), "seed": 0}

    ck = Checkpointer(tmp_path, fingerprint=fp(DSV4Config.tiny()), async_save=False)
    ck.save(1, {"w": jnp.zeros(2)}, {"x": 1})
    ck.close()
    small = DSV4Config.preset("small")
    with pytest.raises(CheckpointMismatchError) as e:
        Checkpointer(tmp_path, fingerprint=fp(small)).check_latest()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 600 and "{" not in msg, msg
    assert f"model.hidden_size: checkpoint={DSV4Config.tiny().hidden_size} run={small.hidden_size}" in msg
    assert "more" in msg or msg.count("checkpoint=") <= 4


def test_moved_dataset_file_is_judged_by_its_content(tmp_path):
    """The fingerprint keeps the --dataset path, but a checkpoint that records the datasets' identity leaves the
    decision to that content check (rl/run/wiring.py::same_data): the same file at a new path resumes."""
    ck = Checkpointer(tmp_path, fingerprint={"dataset": "/old/train.jsonl", "seed": 0}, async_save=False)
    ck.save(1, {"w": jnp.zeros(2)}, {"data_identity": {"dataset": {"size": 1, "sha256": "ab"}}})
    ck.close()
    meta = Checkpointer(tmp_path, fingerprint={"dataset": "/new/train.jsonl", "seed": 0}).check_latest()
    assert meta["step"] == 1
    with pytest.raises(CheckpointMismatchError, match="seed: checkpoint=0 run=1"):
        Checkpointer(tmp_path, fingerprint={"dataset": "/new/train.jsonl", "seed": 1}).check_latest()


# ------------------------------------------------------------------------------------------------ issue 42: digests

def _flip_middle(step_dir, n: int = 64) -> None:
    """Flip `n` bytes in the middle of the step's largest data file (issue 42, reproduction 1)."""
    data = sorted((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)[-1]
    b = bytearray(data.read_bytes())
    m = len(b) // 2
    b[m:m + n] = bytes(x ^ 0xFF for x in b[m:m + n])
    data.write_bytes(bytes(b))


def _two_steps(directory, **kw) -> dict:
    ck = Checkpointer(directory, keep=3, fingerprint={"run": 1}, async_save=False, **kw)
    states = {s: _state(s, 2) for s in (1, 2)}
    for s, st in states.items():
        ck.save(s, st, {"x": s})
    ck.close()
    return states


def test_flipped_bytes_are_caught_by_the_digest(tmp_path, caplog):
    """64 bytes flipped in the middle of the newest checkpoint's largest data file decode to other numbers without
    an error (orbax / TensorStore check no array data: the `digest=False` run restores them); the digest catches
    them: one warning naming the array and the step, the step moved to `2.corrupt`, step 1 restored bitwise."""
    plain = _two_steps(tmp_path / "plain", digest=False)
    _flip_middle(tmp_path / "plain" / "2")
    got, meta = Checkpointer(tmp_path / "plain", fingerprint={"run": 1}).restore(_state(0, 2))
    assert meta["step"] == 2 and not all(np.array_equal(np.asarray(got[k]), np.asarray(plain[2][k])) for k in got)

    states = _two_steps(tmp_path / "ck")
    _flip_middle(tmp_path / "ck" / "2")
    caplog.clear()
    ck = Checkpointer(tmp_path / "ck", keep=3, fingerprint={"run": 1})
    got, meta = ck.restore(_state(0, 2))
    assert meta["step"] == 1 and all(np.array_equal(np.asarray(got[k]), np.asarray(states[1][k])) for k in got)
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "step 2" in warned[0] and "array ['w" in warned[0] and "does not match the digest" in warned[0], warned
    assert (tmp_path / "ck" / "2.corrupt").is_dir() and ck.all_steps() == [1]
    ck.close()


def test_bad_inflight_file_passes_over_its_checkpoint(tmp_path, caplog):
    """The in-flight batches file of the newest checkpoint cut in half (issue 42, reproduction 4): its checkpoint is
    passed over like an unreadable one (`check=` rl.run.pipeline.read_inflight) and the previous one, whose own file
    is intact, is restored; the run resumes from there (bitwise: tests/launch/test_resume.py)."""
    from rl.run.digest import write_npz
    from rl.run.pipeline import inflight_path, read_inflight

    states = _two_steps(tmp_path)
    (tmp_path / "inflight").mkdir()
    for s in (1, 2):
        write_npz(inflight_path(tmp_path, s), {"count": np.array(1), "0/tokens": np.full((4, 8), s, np.int32)})
    path = inflight_path(tmp_path, 2)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    ck = Checkpointer(tmp_path, keep=3, fingerprint={"run": 1})
    got, meta = ck.restore(_state(0, 2), check=lambda step: read_inflight(tmp_path, step))
    assert meta["step"] == 1 and np.array_equal(np.asarray(got["w0"]), np.asarray(states[1]["w0"]))
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and "in-flight batches file of checkpoint step 2" in warned[0], warned
    assert "BadZipFile" in warned[0] and "\n" not in warned[0]
    assert read_inflight(tmp_path, 1)["0/tokens"][0, 0] == 1 and ck.all_steps() == [1]
    ck.close()


def test_no_usable_checkpoint_is_one_line(tmp_path, caplog, capfd):
    """Every checkpoint unreadable (issue 42, reproduction 5): one line naming the directory and the steps; the
    warnings of the steps passed over are one line each; no traceback, no library log."""
    from rl.run.checkpoint import NoUsableCheckpointError

    _two_steps(tmp_path)
    _flip_middle(tmp_path / "2")
    for f in (tmp_path / "1" / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:16])
    caplog.clear()
    ck = Checkpointer(tmp_path, keep=3, fingerprint={"run": 1})
    with pytest.raises(NoUsableCheckpointError) as e:
        ck.restore(_state(0, 2))
    ck.close()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and str(tmp_path) in msg and "steps 1, 2 are unreadable" in msg, msg
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert all("\n" not in r.getMessage() for r in caplog.records) and len(caplog.records) < 10
    assert "Traceback" not in capfd.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit()) == ["1", "2"]  # left as they were
