"""The nested run config (rl/config/run.py, rl/config/tree.py, launch/run.py `resolve`): precedence defaults < algo
preset < YAML < flat flag < dotted flag, nested and dotted YAML keys, one-line errors naming a bad key, the resolved
config written to the run directory and read back. Pure Python: no model, no JAX computation."""

import dataclasses
import re
import types

import pytest

from launch import run as launch_run
from rl.config.algo import LearnerConfig, LossConfig
from rl.config.run import DEFAULT_LEARNER, RunConfig
from rl.config.file import load_config_file
from rl.config.tree import paths
from rl.run.stages import sampling_params


def test_precedence_defaults_yaml_flat_dotted(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("learner:\n  lr: 3.0e-4\n  warmup_steps: 4\n  b2: 0.95\nrollout:\n  group_size: 6\nseed: 5\n"
                 "rollout.top_k: 7\n")  # nested sections and a dotted key in one file
    cfg, _ = launch_run.resolve(["--learner.lr", "1e-6", "--config-file", str(f), "--lr", "1e-3",
                                 "--group-size", "8", "--learner.warmup_steps=2"])
    assert cfg.learner.lr == 1e-6  # dotted flag > flat flag > YAML, whatever the order on the command line
    assert cfg.learner.warmup_steps == 2  # dotted flag > YAML
    assert cfg.rollout.group_size == 8  # flat flag > YAML
    assert (cfg.learner.b2, cfg.seed, cfg.rollout.top_k) == (0.95, 5, 7)  # YAML > defaults
    assert cfg.rollout.prompts_per_step == RunConfig().rollout.prompts_per_step == 32  # defaults
    flat = launch_run.flat_values(cfg)  # the flat flags' names: launch/run.py's argparse only
    assert (flat["lr"], flat["group_size"]) == (cfg.learner.lr, cfg.rollout.group_size)
    assert not hasattr(cfg, "lr") and not hasattr(cfg, "group_size")  # flat names are spellings, not attributes


def test_flat_names_live_only_in_the_cli():
    """RunConfig and the YAML file take dotted paths (or sections); a flat name is an unknown key there, named
    with the dotted path it may mean. The CLI's flat flags keep working (launch.run.FLAT)."""
    with pytest.raises(ValueError, match=r"^RunConfig: unknown key 'group_size' \(a dotted path: "
                                         r"rollout.group_size\?\)"):
        RunConfig(group_size=4)
    assert RunConfig(**{"rollout.group_size": 4}).rollout.group_size == 4
    assert launch_run.resolve(["--group-size", "4"])[0].rollout.group_size == 4


def test_algo_preset_fills_sections_and_user_knobs_win():
    dapo = RunConfig(algo="dapo")
    assert (dapo.learner.loss.clip_eps_high, dapo.learner.loss.loss_agg_mode) == (0.28, "token-mean")
    assert dapo.advantage.dynamic_sampling and dapo.advantage.dynamic_sampling_max_rounds == 4
    assert dapo.learner.loss.correction == "tis" and dapo.learner.lr == DEFAULT_LEARNER.lr  # run knobs kept
    cfg, _ = launch_run.resolve(["--algo", "dapo", "--learner.loss.clip_eps_high", "0.3",
                                 "--dapo-max-resample-batches", "1"])
    assert cfg.learner.loss.clip_eps_high == 0.3 and cfg.advantage.dynamic_sampling_max_rounds == 2
    dr = RunConfig(algo="dr_grpo", **{"rollout.max_new_tokens": 12})
    assert dr.learner.loss.norm_length == 12 and not dr.advantage.scale_by_std
    # a whole section given by the caller is taken as it is (no preset on top of it)
    own = LearnerConfig(lr=1e-5, loss=LossConfig(clip_eps_high=0.5))
    assert RunConfig(algo="dapo", learner=own).learner.loss.clip_eps_high == 0.5


def test_each_flat_name_is_one_knob():
    leaves = paths(RunConfig)
    flat = launch_run.FLAT
    assert all(p in leaves for p in flat.values()) and len(set(flat.values())) == len(flat)
    assert all(leaves[p].help for p in flat.values())  # every flag has its help in the field's metadata
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
    from rl.run.wiring import write_resolved_config

    cfg, _ = launch_run.resolve(["--algo", "dr_grpo", "--learner.b1", "0.8", "--metrics-jsonl",
                                 str(tmp_path / "run" / "metrics.jsonl"), "--ckpt-dir", "", "--eval-every", "0"])
    path = write_resolved_config(cfg)
    assert path == tmp_path / "run" / "config.yaml"
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temp file left
    again, _ = launch_run.resolve(["--config-file", str(path)])
    assert again == cfg


def test_learner_scale_knobs_are_flags_with_the_runs_defaults():
    """--scan-layers / --no-scan-layers, --stream-optimizer / --no-stream-optimizer, --ep-backend and
    --ep-capacity-factor are knobs of the learner section (one flat flag each); the run scans and streams by
    default, EP picks its backend itself and is dropless."""
    assert {launch_run.FLAT[k] for k in ("scan_layers", "stream_optimizer", "ep_backend", "ep_capacity_factor")} == \
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
    flat_help = " ".join(help_text.split())  # each flag says its knob's default once (no argparse "(default: None)")
    assert "(default: 80) (default" not in flat_help and "(default: 80)" in flat_help
    assert "format's) (default" not in flat_help  # a knob whose help says its default gets no second one


# -- each knob one default (issue 22, point 5) ----------------------------------------------------------------------

def test_the_runs_learner_is_the_library_learner_with_its_recipe_values():
    """`Learner(model, LearnerConfig())` is the run's learner in every structural knob (scanned layers, param dtype,
    streamed offload, EP backend and capacity, trained MTP / router, remat, ...): DEFAULT_LEARNER changes only the
    recipe values listed in RECIPE_KNOBS (lr, b2, fp32 compute for the CPU run, routing replay + TIS)."""
    from rl.config.run import RECIPE_KNOBS

    lib = LearnerConfig()
    differ = sorted(f.name for f in dataclasses.fields(LearnerConfig)
                    if getattr(DEFAULT_LEARNER, f.name) != getattr(lib, f.name))
    assert differ == sorted(RECIPE_KNOBS)
    assert (lib.scan_layers, lib.stream_optimizer, lib.param_dtype, lib.train_mtp) == (True, True, "auto", False)
    run = RunConfig().learner  # the section: DEFAULT_LEARNER (+ the derived temperature)
    assert all(getattr(run, f.name) == getattr(lib, f.name) for f in dataclasses.fields(LearnerConfig)
               if f.name not in (*RECIPE_KNOBS, "temperature"))


def test_planner_reads_the_runs_config():
    """`python -m launch.plan` plans the run launch/run.py would start with the same flags: the run's config (the
    same YAML, flat and dotted flags, the same defaults) for every knob the run defines; the planner's own flags
    are only where / what to plan and compile, none of them a spelling of a run knob."""
    from launch import plan as launch_plan

    run_flags = ["--mesh", "actor:fsdp=2", "--learner.train_mtp", "--ep-backend", "padded", "--ep-capacity-factor",
                 "1.5", "--max-prompt-len", "64", "--max-new-tokens", "32", "--kv-cache-dtype", "bf16"]
    args, cfg = launch_plan.resolve(["--gpu", "h200", *run_flags])
    assert args.gpu == "h200" and cfg == launch_run.resolve(run_flags)[0]
    assert cfg.learner == dataclasses.replace(RunConfig().learner, train_mtp=True, ep_backend="padded",
                                              ep_capacity_factor=1.5)
    assert launch_plan.seq_len(cfg) == 96 and launch_plan.kv_layout(cfg) == "bf16"
    assert launch_plan.kv_layout(RunConfig()) == "fp8"  # the run's default: auto with FP8 rollout weights
    own = {o for a in launch_plan.parser()._actions for o in a.option_strings} - {"-h", "--help"}
    assert not own & {o for a in launch_run.parser()._actions for o in a.option_strings}
    assert not own & {"--kv-dtype", "--seq-len", "--rollout-seq-len", "--train-seq-len", "--rollout-context",
                      "--rollout-prompt-len", "--rollout-batch", "--micro-batch-tokens", "--speculative-k"}


def test_max_prompt_len_and_the_rollout_knobs_have_one_default():
    """max_prompt_len had four defaults (run 256, Sampler 1024, PromptDataset.from_records 512, planner 1024): the
    library signatures now read the run's field, as do the sampler's rollout dtype, slots and prefill chunk,
    SamplingParams (temperature, top-p, top-k, max_new_tokens: 64 before, the run's 4 now) and the planner's
    --compile rollout program (launch.aot.compile_rollout)."""
    import inspect

    from launch.aot import compile_rollout
    from rl.config.run import DataConfig
    from rl.config.rollout import RolloutConfig
    from rl.config.tree import default
    from rl.data.prompts import PromptDataset, load_records
    from rl.rollout.engine import SamplingParams
    from rl.rollout.settings import EngineSettings

    sampler = EngineSettings()  # the engine's knobs (`Sampler(model, settings)` or its fields as keywords)
    records = inspect.signature(PromptDataset.from_records).parameters
    rollout = inspect.signature(compile_rollout).parameters
    run = RunConfig()
    assert sampler.max_prompt_len == records["max_prompt_len"].default == run.data.max_prompt_len == \
        rollout["prompt_len"].default == default(DataConfig, "max_prompt_len")
    assert (sampler.weights, sampler.slots, sampler.prefill_chunk) == (
        run.rollout.dtype, run.rollout.slots, run.rollout.prefill_chunk)
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens) == (
        run.rollout.temperature, run.rollout.top_p, run.rollout.top_k, run.rollout.max_new_tokens)
    assert rollout["rollout"].default == run.rollout == RolloutConfig()  # the planner compiles the run's knobs
    assert records["on_bad_record"].default == inspect.signature(load_records).parameters["on_bad_record"].default \
        == run.data.on_bad_record


def test_ignore_eos_lets_training_samples_run_to_their_limit():
    """--rollout.ignore_eos (benchmarks: responses of the lengths the schedule says): no stop id in the training
    SamplingParams; the default stops at the tokenizer's eos."""
    cfg, _ = launch_run.resolve(["--rollout.ignore_eos", "--max-new-tokens", "8"])
    wiring = types.SimpleNamespace(cfg=cfg, tokenizer=types.SimpleNamespace(eos_id=1))
    assert cfg.rollout.ignore_eos and sampling_params(wiring).stop_token_ids == ()
    wiring.cfg, _ = launch_run.resolve(["--max-new-tokens", "8"])
    assert sampling_params(wiring).stop_token_ids == (1,) and sampling_params(wiring).max_new_tokens == 8


@pytest.mark.parametrize("text, needle", [
    ("steps: 2.7\n", "steps must be int, got 2.7"),  # refused, not truncated to 2
    ("rollout:\n  group_size: 4.9\n", "rollout.group_size must be int, got 4.9"),
    ("steps: true\n", "steps must be int, got True"),  # a YAML bool is not a number
    ("learner.routing_replay: 1\n", "learner.routing_replay must be bool, got 1"),  # nor a YAML number a bool
    ("learner:\n  lr: true\n", "learner.lr must be float, got True"),
])
def test_yaml_values_must_fit_their_type_exactly(tmp_path, text, needle):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        launch_run.resolve(["--config-file", str(f)])
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_yaml_integral_floats_and_flag_words_still_convert(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("steps: 3.0\nlearner:\n  max_tokens_per_micro_batch: 1.0e+3\n  routing_replay: no\n  lr: 1\n")
    cfg, _ = launch_run.resolve(["--config-file", str(f), "--scan-layers", "--learner.freeze_router", "1"])
    assert (cfg.steps, cfg.learner.max_tokens_per_micro_batch, cfg.learner.routing_replay, cfg.learner.lr) == \
        (3, 1000, False, 1.0)
    assert type(cfg.steps) is int and cfg.learner.scan_layers is True and cfg.learner.freeze_router is True


def test_yaml_repeated_key_is_refused_naming_file_key_and_lines(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("steps: 3\nseed: 1\nsteps: 5\n")  # PyYAML alone keeps 5 silently
    with pytest.raises(ValueError) as e:
        launch_run.resolve(["--config-file", str(f)])
    assert str(e.value) == f"--config-file {f}:3:1: key 'steps' is given twice (first on line 1); give each key once"
    f.write_text("learner:\n  lr: 1.0e-3\n  b1: 0.8\n  lr: 2.0e-3\n")  # inside a section
    with pytest.raises(ValueError, match=rf"{re.escape(str(f))}:4:3: key 'lr' is given twice \(first on line 2\)"):
        launch_run.resolve(["--config-file", str(f)])
    f.write_text("learner.lr: 1.0e-3\nlearner:\n  lr: 2.0e-3\n")  # two spellings of one knob
    with pytest.raises(ValueError, match=r"learner\.lr is set twice \(a dotted key and a section's\); give it once"):
        launch_run.resolve(["--config-file", str(f)])
    f.write_text("a: &b {steps: 3, seed: 1}\nc:\n  <<: *b\n  steps: 4\n")  # a merge's key overridden: no repeat
    assert load_config_file(f)["c"] == {"steps": 4, "seed": 1}
