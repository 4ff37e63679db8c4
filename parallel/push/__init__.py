"""The actor -> rollout weight push: one `Pusher` protocol (`push(params, version) -> PushStats`), three transports.

    protocol.py  `Pusher`, `PushStats` (what a push reports; `metrics()`: the loop's perf/weight_push_*),
                 `PushVerificationError`
    local.py     in one process, between two meshes or colocated (`WeightPusher`), or without a mesh plan
                 (`SamplerPusher`: the sampler's own `update_weights`)
    mpmd.py      across the processes of one run (`MpmdPusher`: cross-process `jax.device_put`)
    job.py       between two jobs (`JobPusher`, `WeightReceiver`: `jax.experimental.transfer`)
    transfer.py  transfer layouts (how a tensor is cut on each side) and the helpers every push shares
    verify.py    verification rows (checksums, NaN/inf, the e4m3 rounding bound) and their verdict
    tensors.py   the in-process push's static plan; memory.py: its per-device peak bytes

Import the modules themselves (nothing is re-exported here), e.g. `from parallel.push.local import WeightPusher`.
"""
