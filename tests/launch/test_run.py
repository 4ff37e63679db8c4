"""Tests for launch/run.py: every YAML in launch/configs resolves, flags override YAML, bad input ends with exit
status 2 and a one-line error naming the problem (never a traceback), `--dry-run` prints config, meshes and
memory plan, and a real GSM8K job (HF tokenizer, official-format checkpoint) trains, evaluates, checkpoints and
resumes.

Input errors run `launch.run.main([...])` in this process: each fails before any model is built (8 forced host
devices here, `--mesh auto`). The GSM8K job runs `launch/run.py` as a process (tests/launch/conftest.py).

    .venv/bin/python -m pytest -q tests/launch/test_run.py
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest
import yaml

from launch import run as launch_run
from rl.config.run import RunConfig
from rl.rollout.two_job import RolloutJobError

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "launch" / "configs"
YAMLS = sorted(CONFIGS.glob("*.yaml"))
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4", "--eval-prompts", "8",
        "--eval-samples", "2", "--no-progress"]  # as conftest.TINY


def main(argv, capsys) -> tuple[int, str, str]:
    """launch.run.main(argv) -> (exit status, stdout, stderr)."""
    rc = launch_run.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, err: str, *needles: str) -> None:
    """Exit 2 with one `error: ...` line naming every needle, and no traceback."""
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ------------------------------------------------------------------------------------------------ configs

def test_configs_present():
    assert {p.name for p in YAMLS} >= {"tiny_cpu.yaml", "gsm8k_tiny.yaml", "flash_seed_mi308x.yaml"}


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_every_yaml_resolves(path):
    cfg, _ = launch_run.resolve(["--config-file", str(path)])
    assert isinstance(cfg, RunConfig)
    keys = {k.replace("-", "_") for k in yaml.safe_load(path.read_text())}
    assert keys <= {f.name for f in dataclasses.fields(RunConfig)}
    for k in keys:  # every key of the file arrived (None: '' for an output path)
        assert getattr(cfg, k) is not None or k in ("ckpt_dir", "metrics_jsonl", "tensorboard_dir"), k


def test_tiny_cpu_yaml_is_the_default_run():
    cfg, _ = launch_run.resolve(["--config-file", str(CONFIGS / "tiny_cpu.yaml")])
    assert cfg == RunConfig()


def test_flash_seed_layout():
    from sharding.mesh import ACTOR, ROLLOUT, parse_mesh_spec

    cfg, _ = launch_run.resolve(["--config-file", str(CONFIGS / "flash_seed_mi308x.yaml")])
    spec = parse_mesh_spec(cfg.mesh)
    assert (spec.size(ACTOR), spec.size(ROLLOUT)) == (16, 8)  # 2 actor nodes + 1 rollout node of 8 GPUs
    assert (cfg.model.config, cfg.rollout.dtype, cfg.learner.compute_dtype) == ("flash", "fp8_e4m3fnuz", "bfloat16")
    assert cfg.model.init.startswith("/path/to/") and cfg.data.dataset and cfg.data.tokenizer and cfg.ckpt.dir


def test_cli_overrides_yaml(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("steps: 7\nrollout.group-size: 6\nlearner.routing_replay: false\nlearner.lr: 3.0e-4\nckpt:\n  dir: a/ckpt\n"
                 "seed: 5\n")
    cfg, _ = launch_run.resolve(["--config-file", str(f), "--group-size", "8", "--routing-replay", "--ckpt-dir", "",
                                 "--lr", "1e-3"])
    assert (cfg.steps, cfg.seed) == (7, 5)  # from the file
    assert (cfg.rollout.group_size, cfg.learner.routing_replay, cfg.ckpt.dir, cfg.learner.lr) == (8, True, None, 1e-3)  # flags win
    assert cfg.rollout.prompts_per_step == RunConfig().rollout.prompts_per_step  # neither: the default


# ------------------------------------------------------------------------------------------------ bad input

@pytest.fixture
def gsm(tmp_path, small_tokenizer, lt):
    """Flags of a GSM8K-layout job on tmp data with the small tokenizer; outputs under tmp."""
    def flags(dataset, *extra):
        return ["--dataset", dataset, "--tokenizer", small_tokenizer, *TINY, *lt.outputs(tmp_path / "out"), *extra]
    return flags


def test_malformed_jsonl_line_names_file_and_line(tmp_path, gsm, capsys, caplog, lt):
    cut = '{"question": "How many", "answer": '
    data = lt.write_jsonl(tmp_path / "train.jsonl", lt.gsm8k_records(6), {3: cut})
    rc, _, err = main(gsm(data), capsys)
    assert_user_error(rc, err, f"{data}:3", f"invalid JSON: Expecting value at column {len(cut) + 1}")  # not 1
    rc, out, err = main(gsm(data, "--on-bad-record", "skip", "--dry-run"), capsys)  # skip: the run proceeds
    assert rc == 0, err
    assert "meshes:" in out and "memory plan" in out
    assert any(f"{data}:3" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_missing_field(tmp_path, gsm, capsys, lt):
    records = lt.gsm8k_records(4)
    del records[1]["answer"]
    data = lt.write_jsonl(tmp_path / "train.jsonl", records)
    rc, _, err = main(gsm(data), capsys)
    assert_user_error(rc, err, f"{data}:2", "missing field 'answer'")
    rc, _, err = main(gsm(data, "--prompt-field", "problem"), capsys)
    assert_user_error(rc, err, f"{data}:1", "missing field 'problem'")


def test_empty_dataset(tmp_path, gsm, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rc, _, err = main(gsm(empty), capsys)
    assert_user_error(rc, err, str(empty), "no records")
    rc, _, err = main(gsm(tmp_path / "nope.jsonl"), capsys)
    assert_user_error(rc, err, "nope.jsonl", "no such file")


def test_prompt_longer_than_max_prompt_len(tmp_path, gsm, capsys, lt):
    data = lt.write_jsonl(tmp_path / "train.jsonl", lt.gsm8k_records(4))
    rc, _, err = main(gsm(data, "--max-prompt-len", "5"), capsys)
    assert_user_error(rc, err, f"{data}:1", "max_prompt_len=5")


def test_tokenizer_larger_than_model_vocab(tmp_path, gsm, small_tokenizer, hf_tiny_checkpoint, capsys, lt):
    from dsv4 import DSV4Config
    from rl.data.tokenizer import load_tokenizer

    n = load_tokenizer(small_tokenizer).vocab_size
    data = lt.write_jsonl(tmp_path / "train.jsonl", lt.gsm8k_records(4))
    small = tmp_path / "small" / "config.json"  # --config PATH/config.json with fewer ids than the tokenizer
    small.parent.mkdir()
    small.write_text(json.dumps(DSV4Config.tiny(vocab_size=n - 8).to_hf_dict()))
    rc, _, err = main(gsm(data, "--config", small), capsys)
    assert_user_error(rc, err, f"tokenizer has {n} tokens", f"vocab_size is {n - 8}")
    # --init of an official-format tiny checkpoint (256 ids) with a bigger tokenizer: refused before loading it
    from tokenizers import Tokenizer

    big = lt.train_bpe(["x"], tmp_path / "big" / "tokenizer.json")
    t = Tokenizer.from_file(str(big))
    t.add_tokens([f"<extra_{i}>" for i in range(300)])
    t.save(str(big))
    n = load_tokenizer(big).vocab_size
    assert n > 256  # else the job below would start training in this process
    rc, _, err = main(["--dataset", data, "--tokenizer", big, "--init", hf_tiny_checkpoint, *TINY,
                       *lt.outputs(tmp_path / "o")], capsys)
    assert_user_error(rc, err, f"tokenizer has {n} tokens", "vocab_size is 256")


def test_bad_mesh_spec(tmp_path, capsys, lt):
    rc, _, err = main(["--mesh", "actor:fsdp=x", *TINY, *lt.outputs(tmp_path)], capsys)
    assert_user_error(rc, err, "actor:fsdp", "'x'")
    rc, _, err = main(["--mesh", "actor:fsdp=3/rollout:tensor=7", *TINY, *lt.outputs(tmp_path)], capsys)
    assert_user_error(rc, err, "devices")


def test_cpu_device_count_follows_the_mesh_spec(monkeypatch):
    """launch/run.py splits a CPU host into as many devices as --mesh needs (per process), 2 for auto; the user's
    XLA_FLAGS count or --cpu-devices-per-process wins (None: run.py sets nothing)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    count = launch_run.cpu_device_count
    assert count(["--mesh", "actor:fsdp=4/rollout:expert=2"]) == 6
    assert count(["--mesh", "actor:fsdp=4,expert=2"]) == 8  # colocated
    assert count(["--mesh", "actor:fsdp=4/rollout:expert=2", "--num-processes", "2"]) == 3
    assert count(["--steps", "3"]) == 2  # auto
    assert count(["--mesh", "actor:fsdp=4", "--cpu-devices-per-process", "2"]) is None
    assert count(["--mesh", "actor:fsdp=x"]) is None  # main reports the bad spec
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert count(["--mesh", "actor:fsdp=4/rollout:expert=2"]) is None


def test_mesh_larger_than_the_cpu_devices_names_the_flag(tmp_path, capsys, lt):
    rc, _, err = main(["--mesh", "actor:fsdp=8/rollout:expert=2", *TINY, *lt.outputs(tmp_path)], capsys)
    assert_user_error(rc, err, "needs 8 devices and rollout 2", "only 8 are present", "--cpu-devices-per-process 10",
                      "xla_force_host_platform_device_count=10")


def test_six_device_cpu_mesh_from_the_cli_without_xla_flags(tmp_path, run_env, lt):
    """`python launch/run.py --mesh actor:fsdp=2,expert=2/rollout:expert=2` on a CPU host with no device count in
    XLA_FLAGS: the launcher gives the host the 6 devices the spec needs (a dry run stops after the meshes)."""
    assert "device_count" not in run_env["XLA_FLAGS"]
    rc, out = lt.launch(["--dry-run", "--mesh", "actor:fsdp=2,expert=2/rollout:expert=2", *TINY,
                         *lt.outputs(tmp_path)], run_env, tmp_path / "run.log", timeout=600)
    assert rc == 0, out[-3000:]
    assert "actor: data=1 fsdp=2 expert=2 tensor=1 devices [0, 1, 2, 3]" in out, out[-3000:]
    assert "rollout: data=1 fsdp=1 expert=2 tensor=1 devices [4, 5]" in out and "not buildable" not in out


@pytest.mark.parametrize("flag", ["--ckpt-dir", "--metrics-jsonl", "--tensorboard-dir"])
def test_unwritable_output_is_an_error_before_step_1(tmp_path, flag, capsys, lt):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    flags = dict(zip(lt.outputs(tmp_path)[::2], lt.outputs(tmp_path)[1::2]))
    flags[flag] = str(blocker / "sub" / ("m.jsonl" if flag == "--metrics-jsonl" else "d"))
    rc, _, err = main([*TINY, *[x for kv in flags.items() for x in kv]], capsys)
    assert_user_error(rc, err, flag, "not writable", str(blocker))


def test_rollout_slots_on_cpu_plan_for_the_hosts_memory(tmp_path, capsys, lt, monkeypatch):
    """Issue 42 §9: on XLA:CPU the --rollout-slots check plans for this host's RAM (all devices share it), not an
    assumed H200: 6.6 M slots of the tiny job, which an H200's plan holds, are refused on a 23.5 GiB host."""
    from parallel.plan import plan
    from rl.rollout import slots
    from rl.rollout.host_memory import cpu_kv_budget

    monkeypatch.setattr(slots, "host_memory_bytes", lambda: int(23.5 * 2**30))
    rc, _, err = main(["--rollout-slots", "6600000", *TINY, *lt.outputs(tmp_path)], capsys)
    assert_user_error(rc, err, "--rollout-slots 6600000", "(memory plan on this host's 23.5 GiB of RAM, XLA:CPU)")
    assert not (tmp_path / "ckpt").exists()  # refused before anything is written
    report = plan("tiny", "actor:fsdp=2/rollout:expert=2", "h200", learner=RunConfig().learner)
    gib = 2**30
    h200, host = cpu_kv_budget(report, 140 * gib), cpu_kv_budget(report, 23.5 * gib)  # one RAM for 4 devices
    assert report.rollout.margin > h200 > host > 0 and cpu_kv_budget(report, 0) == 0.0
    assert h200 - host == pytest.approx((140 - 23.5) * gib * 0.9 * 0.9 / 2)  # usable 90%, reserve 10%, 2 devices


def test_overridden_settings_get_one_warning_each(tmp_path, capsys, caplog, lt):
    """--exact-rollout turns the rollout engine's speculation and slots off for training, and
    --rollout.draft_tokens means nothing without --rollout.speculative: one warning line each, at start."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dsv4rl"):
        rc, _, err = main(["--dry-run", "--exact-rollout", "--rollout-dtype", "bf16", "--rollout.speculative", "mtp",
                           "--rollout-slots", "4", *TINY, *lt.outputs(tmp_path)], capsys)
    assert rc == 0, err
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "--exact-rollout" in r.getMessage()]
    assert len(lines) == 1
    assert "--rollout.speculative mtp and --rollout-slots 4 apply to the evaluation only" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsv4rl"):
        rc, _, err = main(["--dry-run", "--rollout.draft_tokens", "3", *TINY, *lt.outputs(tmp_path)], capsys)
    assert rc == 0, err
    lines = [r.getMessage() for r in caplog.records if "draft_tokens" in r.getMessage()]
    assert lines == ["--rollout.draft_tokens 3 is ignored: speculative decoding is off (add --rollout.speculative "
                     "mtp)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsv4rl"):  # the defaults, or speculation on: nothing to say
        rc, _, err = main(["--dry-run", "--rollout.speculative", "mtp", "--rollout.draft_tokens", "3", *TINY,
                           *lt.outputs(tmp_path)], capsys)
    assert rc == 0 and not [r for r in caplog.records if "draft_tokens" in r.getMessage()], err


def test_unknown_remat_policy(tmp_path, capsys, lt):
    rc, _, err = main(["--remat", "full", *TINY, *lt.outputs(tmp_path)], capsys)
    assert_user_error(rc, err, "--remat", "block|dots|none", "'full'")


def test_rollout_slots_flag(tmp_path, capsys, lt):
    rc, _, err = main(["--rollout-slots", "many", *TINY, *lt.outputs(tmp_path)], capsys)
    assert_user_error(rc, err, "--rollout-slots", "'many'")
    rc, _, err = main(["--rollout-slots", "1000000000", *TINY, *lt.outputs(tmp_path)], capsys)
    assert_user_error(rc, err, "--rollout-slots 1000000000", "memory plan")


def test_yaml_errors(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text("steps: 3\ngrup_size: 4\n")
    rc, _, err = main(["--config-file", f], capsys)
    assert_user_error(rc, err, str(f), "unknown key 'grup_size'")
    f.write_text("steps: many\n")
    rc, _, err = main(["--config-file", f], capsys)
    assert_user_error(rc, err, "steps must be int", "'many'")
    f.write_text("steps: 3\nlearner:\n  lr: [1e-6\n  b1: 0.9\n")
    rc, _, err = main(["--config-file", f], capsys)
    assert_user_error(rc, err, "not valid YAML", f"{f}:4:")
    assert len(err.strip().splitlines()) == 1, err  # one line, not PyYAML's four
    rc, _, err = main(["--config-file", tmp_path / "missing.yaml"], capsys)
    assert_user_error(rc, err, "missing.yaml")
    rc, _, err = main(["--group-size", "1"], capsys)
    assert_user_error(rc, err, "group_size")


def test_checkpoint_of_another_config(tmp_path, capsys, lt):
    """A checkpoint whose fingerprint differs (here: group size 4 vs 8) is refused before the model is built;
    --resume never refuses to overwrite an existing checkpoint directory."""
    import jax.numpy as jnp

    from rl.run.checkpoint import Checkpointer
    from rl.run.wiring import fingerprint, resolve_model_config

    argv = [*TINY, *lt.outputs(tmp_path)]
    cfg, _ = launch_run.resolve(argv)
    assert cfg.rollout.group_size == 4
    ck = Checkpointer(tmp_path / "ckpt", fingerprint=fingerprint(cfg, resolve_model_config(cfg, 16)), async_save=False)
    ck.save(3, {"w": jnp.zeros(2)}, {"data": {"next_index": 3}, "weight_version": 3, "seed": 0})
    ck.close()
    rc, _, err = main([*argv, "--group-size", "8"], capsys)
    assert_user_error(rc, err, "different config", "group_size: checkpoint=4 run=8", str(tmp_path / "ckpt"))
    rc, _, err = main([*argv, "--resume", "never"], capsys)
    assert_user_error(rc, err, "already holds checkpoints", "[3]")


HOLDER = """
import sys, time
from rl.run import run_lock
run_lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_run_refused_by_the_lock_writes_nothing(tmp_path, capsys, lt):
    """Issue 42 §8: a second run on a --ckpt-dir another process holds refuses in one line and writes nothing:
    the first run's config.yaml, metrics and TensorBoard folder stay as they were (the lock comes first)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    (out / "ckpt").mkdir(parents=True)
    (out / "config.yaml").write_text("# the first run's\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / "ckpt")], stdout=subprocess.PIPE, env=env)
    try:
        assert holder.stdout.readline().strip() == b"held"
        before = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in out.rglob("*")}
        rc, _, err = main([*TINY, "--steps", "1", *lt.outputs(out)], capsys)
        assert_user_error(rc, err, "in use by another run", f"pid {holder.pid}", str(out / "ckpt"))
        after = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in out.rglob("*")}
        assert after == before
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------------------------------------ eval-only

def test_eval_only_with_nothing_to_evaluate_refuses_and_creates_nothing(tmp_path, capsys, lt):
    """Issue 42 §3: --eval-only (launch/eval.py) on a missing, empty or step-folder --ckpt-dir, or with no
    checkpoint read at all, and --init random: one line naming the path, and nothing created or locked."""
    out = tmp_path / "out"
    run = ["--eval-only", *TINY, *lt.outputs(out)]
    rc, _, err = main(run, capsys)
    assert_user_error(rc, err, "nothing to evaluate", f"--ckpt-dir {out / 'ckpt'} does not exist", "--init is random")
    assert not out.exists()
    (out / "ckpt").mkdir(parents=True)
    rc, _, err = main(run, capsys)
    assert_user_error(rc, err, "nothing to evaluate", f"--ckpt-dir {out / 'ckpt'} holds no checkpoint")
    (out / "ckpt" / "3" / "state").mkdir(parents=True)
    rc, _, err = main([*run, "--ckpt-dir", out / "ckpt" / "3"], capsys)
    assert_user_error(rc, err, f"--ckpt-dir {out / 'ckpt' / '3'} is the folder of one checkpoint (step 3)",
                      f"give --ckpt-dir {out / 'ckpt'}")
    rc, _, err = main([*run, "--ckpt-dir", ""], capsys)
    assert_user_error(rc, err, "nothing to evaluate: no --ckpt-dir is given and --init is random")
    rc, _, err = main([*run, "--resume", "never"], capsys)
    assert_user_error(rc, err, "nothing to evaluate", "is not read (--resume never)")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["ckpt", "ckpt/3", "ckpt/3/state"]


def test_eval_only_compares_only_what_is_evaluated(tmp_path, lt):
    """An evaluation reads a checkpoint whose training-only knobs differ (lr, seed, group size, prompts per step,
    algo, max new tokens) without a lock; a knob that shapes the saved state (KL's reference weights) or another
    model is refused naming the field and what to give."""
    import jax.numpy as jnp

    from rl.run.checkpoint import CheckpointMismatchError, Checkpointer
    from rl.run.eval_source import eval_checkpoint_dir, eval_reader
    from rl.run.wiring import fingerprint, resolve_model_config
    from rl.run.run_lock import LOCK_NAME

    cfg, _ = launch_run.resolve([*TINY, *lt.outputs(tmp_path)])
    ck = Checkpointer(tmp_path / "ckpt", fingerprint=fingerprint(cfg, resolve_model_config(cfg, 16)), async_save=False)
    ck.save(3, {"w": jnp.zeros(2)}, {"data": {"next_index": 3}, "weight_version": 3, "seed": 0})
    ck.close()
    (tmp_path / "ckpt" / LOCK_NAME).unlink()
    other, _ = launch_run.resolve([*TINY, *lt.outputs(tmp_path), "--eval-only", "--lr", "1e-3", "--seed", "7",
                                   "--group-size", "8", "--prompts-per-step", "2", "--algo", "dapo",
                                   "--max-new-tokens", "16"])
    assert eval_checkpoint_dir(other) == tmp_path / "ckpt"
    init, _ = launch_run.resolve([*TINY, "--eval-only", "--init", str(tmp_path / "hf"), "--ckpt-dir",
                                  str(tmp_path / "none")])
    assert eval_checkpoint_dir(init) is None and not (tmp_path / "none").exists()  # no checkpoint: --init evaluated
    reader = eval_reader(tmp_path / "ckpt", fingerprint(other, resolve_model_config(other, 16)))
    assert reader.check_latest()["step"] == 3
    assert not (tmp_path / "ckpt" / LOCK_NAME).exists()  # a reader takes no lock
    kl, _ = launch_run.resolve([*TINY, *lt.outputs(tmp_path), "--eval-only", "--kl-coef", "0.01"])
    with pytest.raises(CheckpointMismatchError, match=r"kl_coef: checkpoint=0\.0 run=0\.01.*checkpoint's values"):
        eval_reader(tmp_path / "ckpt", fingerprint(kl, resolve_model_config(kl, 16))).check_latest()
    with pytest.raises(CheckpointMismatchError, match=r"model\.vocab_size: checkpoint=16 run=32"):
        eval_reader(tmp_path / "ckpt", fingerprint(cfg, resolve_model_config(cfg, 32))).check_latest()


# ------------------------------------------------------------------------------------------------ dry run

def test_dry_run_prints_config_meshes_and_memory_plan(tmp_path, capsys, lt):
    rc, out, err = main(["--dry-run", *TINY, *lt.outputs(tmp_path)], capsys)
    assert rc == 0, err
    config = json.loads(out[out.index("config:") + 7: out.index("\n}\n") + 2])
    assert config["group_size"] == 4 and config["mesh"] == "auto"
    assert "meshes: actor:" in out and "rollout:" in out
    assert "memory plan (gpu " in out and "PLAN role=actor" in out and "role=rollout" in out
    assert not (tmp_path / "ckpt").exists()  # a dry run writes nothing


def test_dry_run_says_so_when_the_plan_fails(tmp_path, capsys, lt, monkeypatch):
    """The memory plan is advice: a plan that raises is reported in one line and the dry run still succeeds."""
    def failing(*a, **k):
        raise RuntimeError("no plan today")

    monkeypatch.setattr(launch_run, "plan", failing)
    rc, out, err = main(["--dry-run", *TINY, *lt.outputs(tmp_path)], capsys)
    assert rc == 0, err
    assert "meshes: actor:" in out and "memory plan: unavailable for mesh" in out and "no plan today" in out


def test_a_lost_rollout_job_is_one_line_and_status_1(tmp_path, capsys, lt, monkeypatch):
    """The two-job layout's actor when its rollout job does not come back (rl/rollout/two_job.py `RolloutJobError`,
    raised in the loop): one `error:` line, status 1, through os._exit (the link's threads may hold the process)."""
    def lost(cfg):
        raise RolloutJobError("the rollout job h pid 7 is gone and no rollout job registered at 127.0.0.1:1 within "
                              "3 s (--rollout-restart-timeout)")

    def exit_now(status):
        raise SystemExit(status)

    monkeypatch.setattr(launch_run, "build", lost)
    monkeypatch.setattr(launch_run.os, "_exit", exit_now)
    with pytest.raises(SystemExit) as e:
        launch_run.main([*TINY, *lt.outputs(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: the rollout job h pid 7 is gone") and "(--rollout-restart-timeout)" in err


def test_dry_run_of_a_mesh_larger_than_the_machine_still_plans(tmp_path, capsys, lt):
    rc, out, err = main(["--dry-run", "--mesh", "actor:fsdp=2,expert=8/rollout:expert=8", "--rollout-dtype",
                         "fp8_e4m3fnuz", *TINY, *lt.outputs(tmp_path)], capsys)
    assert rc == 0, err
    assert "not buildable on this machine's 8 devices" in out
    assert "memory plan (gpu mi308x" in out and "on 3 node(s)" in out and "PLAN role=actor" in out


# ------------------------------------------------------------------------------------------------ real input

def _gsm8k_lines(path: pathlib.Path, n: int, max_chars: int = 200) -> list[str]:
    """The first `n` lines of a GSM8K file whose question has at most `max_chars` characters."""
    out = []
    with open(path) as f:
        for line in f:
            if len(json.loads(line)["question"]) <= max_chars:
                out.append(line.rstrip("\n"))
                if len(out) == n:
                    break
    return out


def test_gsm8k_job_trains_evaluates_and_checkpoints(shared_dir, tmp_path, hf_tiny_checkpoint, run_env, lt):
    """Issue §5: real GSM8K lines, a Hugging Face BPE tokenizer.json, an official-format checkpoint (transformers
    save_pretrained) as --init; 4 steps with eval every 3 and a checkpoint every 3 (and the last). (Its resume was a
    second launch of ~30 s of CPU; resuming is tests/launch/test_resume.py's and test_mpmd_async_resume.py's, --init in MPMD
    test_mpmd_run.py's, and test_seed_workflow.py's eval run's.)"""
    src = shared_dir / "data" / "gsm8k"
    if not (src / "train.jsonl").is_file() or not (src / "test.jsonl").is_file():
        pytest.skip(f"{src} has no GSM8K train.jsonl / test.jsonl")
    train, test = _gsm8k_lines(src / "train.jsonl", 32), _gsm8k_lines(src / "test.jsonl", 8)
    (tmp_path / "train.jsonl").write_text("\n".join(train) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(test) + "\n")
    texts = [r["question"] + "\n" + r["answer"] for r in map(json.loads, train + test)]
    tok = lt.train_bpe(texts, tmp_path / "tok" / "tokenizer.json", vocab_size=256)
    out = tmp_path / "out"
    args = ["--config-file", CONFIGS / "gsm8k_tiny.yaml", "--init", hf_tiny_checkpoint, "--config", "tiny",
            "--dataset", tmp_path / "train.jsonl", "--eval-dataset", tmp_path / "test.jsonl", "--tokenizer", tok,
            *TINY, "--max-prompt-len", "128", "--eval-every", "3", "--ckpt-every", "3", *lt.outputs(out)]
    rc, log1 = lt.launch([*args, "--steps", "4"], run_env, tmp_path / "run.log")
    assert rc == 0, log1[-3000:]

    rows = lt.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # A step whose groups all score alike has no learning signal: no update, no push (issue 15 class 6); the
    # random tiny model usually scores 0 on GSM8K, so which steps train is read from the metrics.
    for r in rows:
        trained = r["train/skipped_no_signal"] == 0
        for k in ("rollout/reward_mean", "rollout/response_len_mean", "perf/step_s", "perf/rollout_tok_per_s",
                  "weight_version") + (("train/pg_loss", "train/loss", "train/grad_norm", "perf/weight_push_s")
                                       if trained else ()):
            assert k in r, (r["step"], k)
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
    trained = np.cumsum([r["train/skipped_no_signal"] == 0 for r in rows]).tolist()
    assert [r["weight_version"] for r in rows] == trained
    for r in (rows[2], rows[3]):  # eval every 3 steps and at the last step
        assert {"eval/pass@1", "eval/pass@k", "eval/greedy_pass@1", "eval/k"} <= set(r) and r["eval/k"] == 2
        assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0
    assert "eval/pass@1" not in rows[0] and "eval/pass@1" not in rows[1]
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.isdigit()) == ["3", "4"]
