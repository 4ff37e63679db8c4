"""Dataset identity on resume (issue 15 class 5): a checkpoint records the size and content hash of --dataset
and --eval-dataset; the same path with edited content is an error naming the flag (before any model is built),
unless --allow-dataset-change, which keeps the learner state and restarts the data order.

In-process and fast: the checkpoint is written by `rl.run.checkpoint.Checkpointer` with the run's own fingerprint and
a placeholder state, so `launch.run.main` stops at the check without building the model.
"""

from __future__ import annotations

import numpy as np
import pytest


def _cfg_args(tmp_path, small_tokenizer, lt):
    train = lt.write_jsonl(tmp_path / "train.jsonl", lt.gsm8k_records(12))
    test = lt.write_jsonl(tmp_path / "test.jsonl", lt.gsm8k_records(4))
    return train, test, ["--dataset", str(train), "--eval-dataset", str(test), "--tokenizer", str(small_tokenizer),
                         "--max-prompt-len", "128", "--mesh", "actor:data=4/rollout:data=4", *map(str, lt.TINY), "--ckpt-dir", str(tmp_path / "ckpt"),
                         "--metrics-jsonl", "", "--tensorboard-dir", ""]


def _checkpoint_of(argv):
    """A step-3 checkpoint as `build` + `save` would write it for the run `argv` (placeholder learner state)."""
    from launch.run import resolve
    from rl.run.checkpoint import Checkpointer, file_identity
    from rl.run.wiring import load_data, fingerprint, resolve_model_config

    cfg, _ = resolve(argv)
    tok = load_data(cfg)[0]
    ck = Checkpointer(cfg.ckpt.dir, fingerprint=fingerprint(cfg, resolve_model_config(cfg, tok.vocab_size)),
                      async_save=False)
    ident = {"dataset": file_identity(cfg.data.dataset), "eval_dataset": file_identity(cfg.data.eval_dataset)}
    ck.save(3, {"w": np.zeros(2, np.float32)}, {"data": {"next_index": 12}, "weight_version": 3, "data_identity": ident})
    ck.close()
    return cfg, ident


def test_changed_dataset_is_refused_on_resume(tmp_path, small_tokenizer, lt, capsys):
    from launch.run import main, resolve
    from rl.run.checkpoint import file_identity
    from rl.run.wiring import same_data

    train, test, argv = _cfg_args(tmp_path, small_tokenizer, lt)
    cfg, ident = _checkpoint_of(argv)
    meta = {"step": 3, "data_identity": ident}
    assert same_data(cfg, meta, ident)

    # same path, same size, edited content (two digits swapped in one answer)
    text = train.read_text()
    i = text.index("#### 7")
    edited = text[:i] + "#### 9" + text[i + 6:]
    assert len(edited) == len(text) and edited != text
    train.write_text(edited)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--dataset" in err and "changed" in err and "--allow-dataset-change" in err and "Traceback" not in err

    # the eval set is checked too
    train.write_text(text)
    test.write_text(test.read_text() + lt.json.dumps(lt.gsm8k_records(1)[0]) + "\n")
    assert main(argv) == 2
    assert "--eval-dataset" in capsys.readouterr().err

    # --allow-dataset-change: accepted, the data order restarts (same_data says so; the learner state is kept)
    now = {"dataset": file_identity(train), "eval_dataset": file_identity(test)}
    allow, _ = resolve([*argv, "--allow-dataset-change"])
    assert same_data(allow, meta, now) is False
    with pytest.raises(ValueError, match="--eval-dataset"):
        same_data(cfg, meta, now)


def test_moved_dataset_resumes_and_a_changed_one_names_allow_dataset_change(tmp_path, small_tokenizer, lt, capsys):
    """The same file at a new --dataset path: the checkpoint's fingerprint names the old path, but its recorded
    content identity decides, so the run resumes with its data order (it was refused with a hint to --resume never).
    Different content at the new path is refused with the hint to --allow-dataset-change."""
    import shutil

    from launch.run import main, resolve
    from rl.run.checkpoint import Checkpointer, file_identity
    from rl.run.wiring import load_data, fingerprint, resolve_model_config, same_data

    train, test, argv = _cfg_args(tmp_path, small_tokenizer, lt)
    _checkpoint_of(argv)
    moved = tmp_path / "moved" / "train.jsonl"
    moved.parent.mkdir()
    shutil.move(train, moved)
    argv_moved = [str(moved) if a == str(train) else a for a in argv]
    cfg, _ = resolve(argv_moved)
    ck = Checkpointer(cfg.ckpt.dir, fingerprint=fingerprint(cfg, resolve_model_config(cfg, load_data(cfg)[0].vocab_size)))
    meta = ck.check_latest()  # no "different config" for the path alone
    ident = {"dataset": file_identity(cfg.data.dataset), "eval_dataset": file_identity(cfg.data.eval_dataset)}
    assert same_data(cfg, meta, ident) is True  # the data order resumes
    ck.close()

    moved.write_text(moved.read_text().replace("#### 7", "#### 9", 1))
    assert main(argv_moved) == 2
    err = capsys.readouterr().err
    assert "--allow-dataset-change" in err and "--resume never" not in err and "Traceback" not in err, err
