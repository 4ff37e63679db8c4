"""The run: its wiring, the loop and its schedule, checkpoints and metric sinks (the top of rl/).

    wiring.py             `build(cfg) -> RunWiring`: meshes, data, reward, learner, rollout service, push, checkpoints
    loop.py               `run(wiring)`: the one GRPO loop; stages.py: its stages, written once for every layout
    pipeline.py           the schedule: the rollout as producer, the learner as consumer (`--max-staleness`)
    partial.py            partial rollouts (`--partial-rollout`)
    env_task.py           the data and the reward of a multi-turn (`--rollout.env`) run
    checkpoint.py         orbax checkpoints (checkpoint_errors.py: their failures in one line; digest.py: integrity
                          digests; run_lock.py: one run at a time on a --ckpt-dir)
    eval_source.py        what an eval-only run evaluates
    sinks.py              JSONL, TensorBoard, the progress bar; wandb_sink.py: Weights & Biases

Import the modules themselves (nothing is re-exported here), e.g. `from rl.run.wiring import build`.
"""
