"""The nested run config (rl/config.py, rl/config_tree.py, launch/run.py `resolve`): precedence defaults < algo
preset < YAML < flat flag < dotted flag, nested and flat YAML keys, one-line errors naming a bad key, the resolved
config written to the run directory and read back. Pure Python: no model, no JAX computation."""

import dataclasses

import pytest

from launch import run as launch_run
from rl.config import DEFAULT_LEARNER, FLAT, LearnerConfig, LossConfig, RunConfig
from rl.config_tree import paths


def test_precedence_defaults_yaml_flat_dotted(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("learner:\n  lr: 3.0e-4\n  warmup_steps: 4\n  b2: 0.95\nrollout:\n  group_size: 6\nseed: 5\n"
                 "top_k: 7\n")  # nested sections and a flat key in one file
    cfg, _ = launch_run.resolve(["--learner.lr", "1e-6", "--config-file", str(f), "--lr", "1e-3",
                                 "--group-size", "8", "--learner.warmup_steps=2"])
    assert cfg.learner.lr == 1e-6  # dotted flag > flat flag > YAML, whatever the order on the command line
    assert cfg.learner.warmup_steps == 2  # dotted flag > YAML
    assert cfg.rollout.group_size == 8  # flat flag > YAML
    assert (cfg.learner.b2, cfg.seed, cfg.rollout.top_k) == (0.95, 5, 7)  # YAML > defaults
    assert cfg.rollout.prompts_per_step == RunConfig().rollout.prompts_per_step == 32  # defaults
    assert (cfg.flat()["lr"], cfg.flat()["group_size"]) == (cfg.learner.lr, cfg.rollout.group_size)  # the aliases
    assert not hasattr(cfg, "lr") and not hasattr(cfg, "group_size")  # flat names are spellings, not attributes


def test_algo_preset_fills_sections_and_user_knobs_win():
    dapo = RunConfig(algo="dapo")
    assert (dapo.learner.loss.clip_eps_high, dapo.learner.loss.loss_agg_mode) == (0.28, "token-mean")
    assert dapo.advantage.dynamic_sampling and dapo.advantage.dynamic_sampling_max_rounds == 4
    assert dapo.learner.loss.correction == "tis" and dapo.learner.lr == DEFAULT_LEARNER.lr  # run knobs kept
    cfg, _ = launch_run.resolve(["--algo", "dapo", "--learner.loss.clip_eps_high", "0.3",
                                 "--dapo-max-resample-batches", "1"])
    assert cfg.learner.loss.clip_eps_high == 0.3 and cfg.advantage.dynamic_sampling_max_rounds == 2
    dr = RunConfig(algo="dr_grpo", max_new_tokens=12)
    assert dr.learner.loss.norm_length == 12 and not dr.advantage.scale_by_std
    # a whole section given by the caller is taken as it is (no preset on top of it)
    own = LearnerConfig(lr=1e-5, loss=LossConfig(clip_eps_high=0.5))
    assert RunConfig(algo="dapo", learner=own).learner.loss.clip_eps_high == 0.5


def test_each_flat_name_is_one_knob():
    leaves = paths(RunConfig)
    assert all(p in leaves for p in FLAT.values()) and len(set(FLAT.values())) == len(FLAT)
    assert all(leaves[p].help for p in FLAT.values())  # every flag has its help in the field's metadata
    # the run's learner defaults are values of LearnerConfig's knobs, not a second declaration
    assert not {f.name for f in dataclasses.fields(RunConfig)} & {f.name for f in dataclasses.fields(LearnerConfig)}
    cfg = RunConfig()
    assert (cfg.learner.b2, cfg.learner.weight_decay, cfg.rollout.push_verify_every, cfg.data.reward_timeout_s) == \
        (0.99, 0.0, 10, 5.0)


@pytest.mark.parametrize("argv, needle", [
    (["--learner.lrr", "1e-6"], "--learner.lrr: unknown config key 'learner.lrr'"),
    (["--nosection.x", "1"], "unknown config key 'nosection.x'"),
    (["--learner.lr", "fast"], "--learner.lr: learner.lr must be float, got 'fast'"),
    (["--learner.temperature", "0.5"], "learner.temperature is derived from rollout.temperature"),
    (["--learner.loss.clip_eps_low", "1.5"], "learner.loss.clip_eps_low (--learner.loss.clip_eps_low) must be in [0, 1)"),
    (["--learner.offload_optimizer", "2"], "--offload-optimizer"),
    # the learner's scale knobs on the run's command line (issue 11)
    (["--ep-backend", "dense"], "learner.ep_backend (--ep-backend) must be one of"),
    (["--ep-capacity-factor", "0"], "ep_capacity_factor (--ep-capacity-factor) must be > 0, or none (dropless)"),
    (["--ep-capacity-factor", "big"], "--ep-capacity-factor: ep_capacity_factor must be float, got 'big'"),
    (["--learner.stream_optimizer", "sometimes"], "learner.stream_optimizer must be bool, got 'sometimes'"),
    (["--learner.scan_layers", "2"], "learner.scan_layers must be bool, got '2'"),
])
def test_bad_dotted_flag_is_a_one_line_error(argv, needle, capsys):
    rc = launch_run.main([*argv, "--ckpt-dir", "", "--metrics-jsonl", "", "--tensorboard-dir", ""])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


def test_bad_nested_yaml_key_names_it(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("learner:\n  loss:\n    kl_coeff: 0.1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: unknown key 'learner\.loss\.kl_coeff'"):
        launch_run.resolve(["--config-file", str(f)])


def test_resolved_config_written_atomically_and_loads_back(tmp_path):
    from rl.job import write_resolved_config

    cfg, _ = launch_run.resolve(["--algo", "dr_grpo", "--learner.b1", "0.8", "--metrics-jsonl",
                                 str(tmp_path / "run" / "metrics.jsonl"), "--ckpt-dir", "", "--eval-every", "0"])
    path = write_resolved_config(cfg)
    assert path == tmp_path / "run" / "config.yaml"
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temp file left
    again, _ = launch_run.resolve(["--config-file", str(path)])
    assert again == cfg


def test_learner_scale_knobs_are_flags_with_the_runs_defaults():
    """--scan-layers / --no-scan-layers, --stream-optimizer / --no-stream-optimizer, --ep-backend and
    --ep-capacity-factor are knobs of the learner section (one FLAT alias each); the run scans and streams by
    default, EP picks its backend itself and is dropless."""
    assert {FLAT[k] for k in ("scan_layers", "stream_optimizer", "ep_backend", "ep_capacity_factor")} == \
        {"learner.scan_layers", "learner.stream_optimizer", "learner.ep_backend", "learner.ep_capacity_factor"}
    d = RunConfig().learner
    assert (d.scan_layers, d.stream_optimizer, d.ep_backend, d.ep_capacity_factor) == (True, True, "auto", None)
    cfg, _ = launch_run.resolve(["--no-scan-layers", "--no-stream-optimizer", "--ep-backend", "padded",
                                 "--ep-capacity-factor", "1.25"])
    lc = cfg.learner
    assert (lc.scan_layers, lc.stream_optimizer, lc.ep_backend, lc.ep_capacity_factor) == (False, False, "padded",
                                                                                           1.25)
    none, _ = launch_run.resolve(["--ep-capacity-factor", "none"])
    assert none.learner.ep_capacity_factor is None
    help_text = launch_run.parser().format_help()
    assert all(f in help_text for f in ("--no-scan-layers", "--stream-optimizer", "--ep-backend",
                                        "--ep-capacity-factor"))
