"""The algorithm: the RL math and the learner that applies it on the actor mesh.

    advantages.py     group-relative advantages (GRPO, Dr.GRPO, RLOO) and DAPO dynamic sampling, pure
    losses.py         policy-gradient losses (clipping, KL, TIS / MIS / IcePop, aggregation), pure
    logprobs.py       per-token log-probabilities: the one place the loss calls the model
    replay.py         routing-replay input checks
    metrics.py        metric math: masked means, reward / length statistics, pass@k
    batch.py          `RolloutBatch` (the sampler's output) -> `TrainBatch` (the learner's input)
    batching.py       learner input at its real size: rows trimmed and cut into token-budget micro-batches
    optim.py          mixed-precision optimizer state (fp32 masters, AdamW)
    learner.py        `Learner`: the jitted update step; learner_state.py: its state and where it lives;
                      learner_step.py: the math traced inside its jits

Import the modules themselves (nothing is re-exported here), e.g. `from rl.algo.learner import Learner`.
"""
