"""The run's configuration: every knob, declared once (default + help in the field), one frozen nested `RunConfig`.

    run.py      `RunConfig` (sections model, data, rollout, dapo, advantage, learner, eval, ckpt, log) and its presets
    algo.py     the algorithm's configs: `AdvantageConfig`, `LossConfig`, `LearnerConfig`
    rollout.py  the rollout section (`RolloutConfig`): sampling, engine knobs, the layouts' addresses
    tree.py     nested frozen-dataclass configs: `knob`, dotted paths, overrides, value conversion
    flags.py    the sections' checks and the flag each message names
    file.py     `--config-file FILE.yaml`, read strictly
    notes.py    settings a run overrides or ignores, one warning line each

The bottom of rl/: these modules import nothing else of rl/. Import the modules themselves (nothing is re-exported
here), e.g. `from rl.config.run import RunConfig`.
"""
