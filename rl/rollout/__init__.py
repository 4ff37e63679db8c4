"""The rollout: the engine that generates training samples, and the service the loop talks to.

    engine.py       `Sampler` (the rollout engine: jitted prefill + decode, weights, caches) and `SamplingParams`
    layerwise.py    the layer-by-layer model the engine runs (each layer dequantised right before it runs)
    sampling.py     the token draw (temperature, top-k, top-p) and the per-row keys every path shares
    slots.py        continuous batching (decode slots refilled as samples finish); the slot plan against the KV budget
    speculative.py  speculative decoding with the MTP block as the draft
    init.py         the first weights straight from a checkpoint's own FP8 blocks
    service.py      the contract (`RolloutService`: submit / collect / load_weights / ...) and `LocalRollout`
    mpmd.py         the engine on processes of its own (`ProcessRollout`, `RolloutServer`)
    two_job.py      the engine as a job of its own (`JobRollout`, `RolloutJobServer`)
    exact.py        exact mode: training samples drawn from the learner's own forward
    job_identity.py what a rollout job must share with its actor job (the two-job layout's registration check)
    host_memory.py  the KV-cache budget of a rollout on XLA:CPU (the host's memory)

The weight format (how the rollout stores each learner weight) is the model's: `dsv4/rollout_format.py`.
Import the modules themselves (nothing is re-exported here), e.g. `from rl.rollout.engine import Sampler`.
"""
