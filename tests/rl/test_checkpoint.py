"""rl/checkpoint.py: write failures end with one line and keep the newest checkpoint (issue 28 §2); a checkpoint of
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

from rl.checkpoint import CheckpointMismatchError, Checkpointer, CheckpointWriteError, fingerprint_diff


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
    decision to that content check (rl/job.py::same_data): the same file at a new path resumes."""
    ck = Checkpointer(tmp_path, fingerprint={"dataset": "/old/train.jsonl", "seed": 0}, async_save=False)
    ck.save(1, {"w": jnp.zeros(2)}, {"data_identity": {"dataset": {"size": 1, "sha256": "ab"}}})
    ck.close()
    meta = Checkpointer(tmp_path, fingerprint={"dataset": "/new/train.jsonl", "seed": 0}).check_latest()
    assert meta["step"] == 1
    with pytest.raises(CheckpointMismatchError, match="seed: checkpoint=0 run=1"):
        Checkpointer(tmp_path, fingerprint={"dataset": "/new/train.jsonl", "seed": 1}).check_latest()
