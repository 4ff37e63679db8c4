"""The seeds' workflow as a veRL / Miles user runs it (issue 16): DAPO-style parquet in veRL layout, prompts
rendered by the checkpoint's Jinja chat template, the "Answer:" reward, eval before training and every N steps,
an eval-only run of the checkpoint, metrics to JSONL and Weights & Biases (offline).

The end-to-end job runs `launch/run.py` (and `launch/eval.py`) as processes on the tiny config (conftest.py);
flag and sink checks run in this process.

    .venv/bin/python -m pytest -q tests/launch/test_seed_workflow.py
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import types

import pytest

from launch import run as launch_run
from rl.config.run import RunConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "rl"))
from chat_fixtures import BOS, DAPO_INSTRUCTION, make_chat_tokenizer, verl_records, write_parquet  # noqa: E402

sys.path.pop(0)

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dapo(tmp_path_factory) -> dict:
    """A 20-record DAPO-style training parquet, an 8-record eval parquet (veRL layout) and a chat tokenizer folder
    whose BPE knows the instruction text (so prompts stay short)."""
    d = tmp_path_factory.mktemp("dapo")
    train = write_parquet(d / "dapo_math_17k.parquet", verl_records(20))
    # 8 eval prompts x 2 samples = the training batch's 16 rows: one sampled generate program serves both
    # (rl/rollout/engine.py compiles one per row bucket; 4 x 2 would compile a third)
    ev = write_parquet(d / "aime.parquet", verl_records(8, start=100))
    texts = [m["content"] for r in verl_records(30) for m in r["prompt"]] + ["Answer: 12", DAPO_INSTRUCTION] * 4
    tok = make_chat_tokenizer(d / "tok", texts=texts)
    return {"train": train, "eval": ev, "tok": tok}


def seed_flags(dapo: dict, out: pathlib.Path) -> list[str]:
    return ["--data-format", "verl", "--dataset", dapo["train"], "--eval-dataset", dapo["eval"],
            "--tokenizer", dapo["tok"] / "tokenizer.json", "--apply-chat-template", "--system-prompt",
            "Reason briefly.", "--thinking", "off", "--reward", "dapo", "--max-prompt-len", "96",
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4", "--eval-prompts", "8",
            "--eval-samples", "2", "--no-progress", "--ckpt-dir", out / "ckpt", "--metrics-jsonl",
            out / "metrics.jsonl", "--tensorboard-dir", ""]


def test_dry_run_shows_the_rendered_prompt(dapo, tmp_path, capsys, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="dsv4rl"):
        rc = launch_run.main([str(a) for a in [*seed_flags(dapo, tmp_path), "--dry-run"]])
    out, err = capsys.readouterr()
    assert rc == 0, err
    config = json.loads(out[out.index("config:") + 7: out.index("\n}\n") + 2])
    assert config["apply_chat_template"] is True and config["data_format"] == "verl" and config["thinking"] == "off"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{BOS}Reason briefly.<｜User｜>Solve the following math problem" in logged
    assert "reward dapo: the best prompt-independent response scores 0.0500" in logged  # 20 distinct answers
    # eval-only needs no training set: the eval set is loaded (and rendered) alone
    flags = [str(a) for a in seed_flags(dapo, tmp_path)]
    del flags[flags.index("--dataset"):flags.index("--dataset") + 2]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsv4rl"):
        rc = launch_run.main([*flags, "--eval-only", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert any("aime.parquet[row 0]" in r.getMessage() and "What is 100 + 103?" in r.getMessage()
               for r in caplog.records)


def test_yaml_thinking_on_is_a_string(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  thinking: on\n  apply_chat_template: true\n  dataset: d.parquet\n  tokenizer: t.json\n")
    cfg, _ = launch_run.resolve(["--config-file", str(f)])
    assert cfg.data.thinking == "on" and cfg.data.apply_chat_template  # YAML 1.1 reads `on` as true


def test_bad_chat_input_is_a_one_line_error(dapo, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((dapo["tok"] / "tokenizer.json").read_bytes())
    flags = [str(a) for a in seed_flags(dapo, tmp_path)]
    flags[flags.index("--tokenizer") + 1] = str(bare / "tokenizer.json")
    rc = launch_run.main(flags)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.count("error: ") == 1 and "--apply-chat-template: no chat template in" in err and str(bare) in err
    rc = launch_run.main([str(a) for a in seed_flags(dapo, tmp_path) if str(a) != "--apply-chat-template"])
    err = capsys.readouterr().err
    assert rc == 2 and "--system-prompt" in err and "--apply-chat-template" in err
    flags = [str(a) for a in seed_flags(dapo, tmp_path)]
    flags[flags.index("--max-prompt-len") + 1] = "8"
    rc = launch_run.main(flags)
    err = capsys.readouterr().err
    assert rc == 2 and "20 of 20 prompts are longer than max_prompt_len=8" in err and "--max-prompt-len" in err


def test_seed_workflow_end_to_end(dapo, tmp_path, run_env, lt):
    """Acceptance: 20-record DAPO parquet, chat template, --eval-before-train, eval every 2 steps, 2 steps; then
    `launch/eval.py` evaluates the step-2 checkpoint without training and prints the table."""
    out = tmp_path / "out"
    flags = [*seed_flags(dapo, out), "--eval-before-train", "--steps", "2", "--eval-every", "2", "--ckpt-every", "2"]
    rc, log = lt.launch(flags, run_env, tmp_path / "run.log")
    assert rc == 0, log[-3000:]
    assert "first prompt as the model sees it" in log and f"{BOS}Reason briefly.<｜User｜>Solve the following" in log
    assert "eval before training:" in log and "greedy pass@1" in log
    rows = lt.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 0, 1]
    assert rows[0]["eval/before_train"] == 1.0 and "rollout/reward_mean" not in rows[0]
    for r in rows[1:]:
        assert r["data/dropped_overlong"] == 0.0 and 0.0 <= r["rollout/reward_mean"] <= 1.0
    for r in (rows[0], rows[2]):
        assert r["eval/k"] == 2 and 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0
    assert (out / "ckpt" / "2").is_dir()

    import subprocess

    # issue 42 §3: the evaluation only reads: a read-only view of the checkpoint directory (a bind mount where this
    # host allows one, else the folder itself, mode a-w) is read, and nothing there or in config.yaml changes
    # (no lock, no temp-dir cleanup); a training-only knob that differs (--lr) is not compared
    ckpt, ro = out / "ckpt", tmp_path / "ro_ckpt"
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(ckpt), str(ro)], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode == 0
    view = ro if mounted else ckpt
    if not mounted:
        for p in [ckpt, *ckpt.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)

    def snapshot():
        return {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
                for p in [out / "config.yaml", *ckpt.rglob("*")]}

    before = snapshot()
    evflags = [str(a) for a in flags]
    evflags[evflags.index("--ckpt-dir") + 1] = str(view)
    try:
        proc = subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), *evflags, "--lr", "0.5"], cwd=REPO,
                              env=run_env, capture_output=True, text=True, timeout=900)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert snapshot() == before
    assert "resumed from" in proc.stderr and "at step 2" in proc.stderr
    table = proc.stdout[proc.stdout.index("eval: 8 prompts of"):]
    assert "weights" in table and "step 2" in table and "pass@2 (sampled)" in table
    rows = lt.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 0, 1, 2] and rows[-1]["eval/only"] == 1.0  # training rows kept
    before = log[log.index("eval before training:"):]
    print(log[log.index("first prompt as the model sees it"):][:600], before[:before.index("sampled reward mean") + 30],
          table, sep="\n")  # for the closing note (pytest -s)


# ------------------------------------------------------------------------------------------------ W&B sink

class FakeRun:
    def __init__(self, **kwargs):
        self.init_kwargs, self.rows, self.finished = kwargs, [], False

    def log(self, row, step):
        self.rows.append((step, row))

    def finish(self):
        self.finished = True


def test_wandb_sink_logs_the_same_names_and_config(tmp_path, monkeypatch):
    from rl.run.sinks import MetricsLogger

    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = RunConfig(**{"log.wandb_project": "dsv4-seed", "log.metrics_jsonl": str(tmp_path / "m" / "metrics.jsonl"),
                       "log.tensorboard_dir": None, "ckpt.dir": None})
    logger = MetricsLogger(cfg)
    logger.open(None)
    logger.log(3, {"rollout/reward_mean": 0.5, "eval/pass@1": 0.25, "perf/x": math.nan, "weight_version": 4})
    logger.close()
    (run,) = runs
    assert run.init_kwargs["project"] == "dsv4-seed" and run.init_kwargs["config"]["log.wandb_project"] == "dsv4-seed"
    assert run.init_kwargs["config"]["rollout.group_size"] == cfg.rollout.group_size and run.init_kwargs["dir"] == str(tmp_path / "m")
    assert run.rows == [(3, {"rollout/reward_mean": 0.5, "eval/pass@1": 0.25, "weight_version": 4})]
    assert run.finished
    assert json.loads((tmp_path / "m" / "metrics.jsonl").read_text())["eval/pass@1"] == 0.25  # JSONL unchanged


def test_wandb_missing_is_a_one_line_error(tmp_path, monkeypatch):
    from rl.run.sinks import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    logger = MetricsLogger(RunConfig(**{"log.wandb_project": "p", "log.metrics_jsonl": None,
                                        "log.tensorboard_dir": None, "ckpt.dir": None}))
    with pytest.raises(ValueError, match=r"--wandb-project needs the wandb package.*\.\[wandb\]"):
        logger.open(None)


def test_wandb_offline_real(tmp_path, monkeypatch):
    """The real package in offline mode (no network): the run is written under WANDB_DIR/wandb/offline-run-*."""
    pytest.importorskip("wandb")
    from rl.run.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb's run-stop checker stops a script by SIGINT to its main thread (`wandb.sdk.lib.interrupt.interrupt_main`,
    # polled from a thread for as long as the run lives and "best-effort" stopped at finish): here that would be a
    # KeyboardInterrupt raised wherever pytest's main thread is (e.g. inside jax's gc callback), so record it instead
    from wandb.sdk.lib import interrupt
    stops = []
    monkeypatch.setattr(interrupt, "interrupt_main", lambda: stops.append(1))
    sink = WandbSink("dsv4-test", {"steps": 2})
    sink.log(0, {"rollout/reward_mean": 0.25, "eval/pass@1": 0.5})
    sink.log(1, {"rollout/reward_mean": 0.5})
    sink.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert not stops  # an offline run is never asked to stop
