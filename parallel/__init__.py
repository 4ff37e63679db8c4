"""Parallelism above the model: what needs both the placement ground (`sharding/`) and the model (`dsv4/`).

    expert.py   expert parallelism (shard_map all-to-all dispatch, reusing `dsv4.moe`'s expert math) and
                `default_dispatch`, the one place that picks the routed-expert implementation for a layout
    padded.py   its padded per-expert buffers: a fixed capacity, or one sized per call from the loads (`lax.switch`
                over a few compiled capacities; exact at the routed cost), and the dispatch's drop counts
    push/       the actor -> rollout weight push: one `Pusher` protocol, three transports (in one process, across
                processes, between jobs), transfer layouts, FP8 quantisation, verification
    pipeline.py pipeline parallelism: the largest scanned layer group in stages over the `stage` mesh axis, the
                step's micro-batches through them (GPipe), `--learner.pipeline_stages`
    plan.py     the memory planner's arithmetic (`plan(...) -> PlanReport`; CLI `python -m launch.plan`)

Layers import downward only: sharding -> dsv4 -> parallel -> rl -> launch (`tests/test_layers.py`).
"""
