"""The rollout service contract: what the loop asks of a rollout engine, wherever the engine runs.

    handle = service.submit(RolloutRequest(prompts, params, seed=, step=, prompt_index=, sample_index=, tag=))
    result = service.collect(handle)          # RolloutResult: the RolloutBatch (its weight version inside) + stats
    metrics = service.load_weights(version)   # the actor's current params become the served version (the push)
    service.load_weights(0, source=path)      # or: the engine reads a checkpoint's own FP8 blocks itself (--init)
    service.weight_version                    # the version the rollout serves now
    service.stats()                           # counters of the engine's side (MPMD: `mpmd/rollout_*`), {} here
    service.close()

A request carries the deterministic sample ids: every row's randomness is a function of (seed, step, prompt index,
sample index), DAPO rounds offsetting the prompt index (rl/run/stages.py), so a request gives the same tokens whichever
service serves it and whenever. Evaluation is two requests (rl/run/stages.py::evaluate), so every service evaluates.

Implementations:
- `LocalRollout` (here): the `rl.rollout.engine.Sampler` in this process: one mesh, two disjoint meshes of this process,
  or colocated; the push is `parallel.push.local.WeightPusher` (or `SamplerPusher`, the sampler's own
  `update_weights`, without a mesh plan);
- `rl.rollout.mpmd.ProcessRollout`: the rollout on processes of its own (MPMD), a command queue over the host
  channel; `rl.rollout.mpmd.RolloutServer` is the other side;
- `rl.rollout.two_job.JobRollout`: the rollout as a JAX job of its own, restartable (`RolloutJobServer` its loop);
- `rl.rollout.exact.ExactRollout`: exact mode, training requests drawn from the learner's own forward;
- tests drive the loop with a fake (tests/rl/fake_rollout.py).
Every engine's `load_weights` is `pusher.push(params_fn(), version).metrics()` with its `parallel.push` transport
(`parallel.push.protocol.Pusher`). Where the roles live decides the schedule's cost, not its shape: the loop
(rl/run/loop.py, rl/run/pipeline.py) is one.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Sequence

from parallel.push.local import SamplerPusher
from parallel.push.protocol import Pusher
from rl.algo.batch import RolloutBatch
from rl.rollout.engine import SamplingParams
from rl.rollout.init import checkpoint_rollout_weights
from rl.rollout.multiturn import MultiTurn, generate_multiturn


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """One batch to generate: `prompts` (N token-id lists, one per row: a prompt repeated `group_size` times is N
    rows), the sampling parameters, the randomness ids (seed, step, prompt_index [N], sample_index [N]; None: row
    index and 0, as `Sampler.generate`), and a `tag` unique within the run (e.g. "train/<step>/<round>",
    "eval/<step>/<version>/greedy") that names the request in messages and logs. Optional per-row [N] ints:
    `max_new_tokens_per_row` (length limits <= params.max_new_tokens: `--rollout.length_schedule`, the segments of
    partial rollouts) and `token_offset` (index of each row's first new token in its sample: a partial rollout
    continued from prompt + its first g tokens; rl/run/partial.py); None: params.max_new_tokens and 0. `train`: a
    training batch's request (stage 2, `rl.run.stages.sample`); exact mode draws these from the learner. `multiturn`: a
    multi-turn agentic request (rl/rollout/multiturn.py: the environment and each row's data); the engine then
    needs the run's tokenizer, and the per-row length and offset fields stay None."""

    prompts: Sequence[Sequence[int]]
    params: SamplingParams
    seed: int
    step: int = 0
    prompt_index: Sequence[int] | None = None
    sample_index: Sequence[int] | None = None
    tag: str = ""
    max_new_tokens_per_row: Sequence[int] | None = None
    token_offset: Sequence[int] | None = None
    train: bool = False
    multiturn: MultiTurn | None = None


@dataclasses.dataclass
class RolloutResult:
    """A generated request: `rb` (RolloutBatch; `rb.weight_version` = the weights it was sampled with), `stats`
    (the generation's counters, e.g. continuous batching's `rollout/slots/*`), `t0` / `t1` (wall-clock seconds,
    `time.time()`, when the engine started and finished it)."""

    rb: RolloutBatch
    stats: dict
    t0: float
    t1: float


def run_request(sampler, req: RolloutRequest, tokenizer=None) -> RolloutResult:
    """Generate `req` with a Sampler in this process (the engine of `LocalRollout` and of the MPMD rollout
    processes). A multi-turn request (`req.multiturn`) runs `rl.rollout.multiturn.generate_multiturn` with
    `tokenizer`. Raises ValueError (one line) for a multi-turn request without a tokenizer, with per-row lengths or
    offsets, or on an engine with speculative decoding."""
    t0 = time.time()
    if req.multiturn is not None:
        if tokenizer is None:
            raise ValueError("multi-turn request (--rollout.env): this rollout engine was built without the run's "
                             "tokenizer")
        if req.max_new_tokens_per_row is not None or req.token_offset is not None:
            raise ValueError("multi-turn request (--rollout.env): per-row length limits and token offsets "
                             "(--rollout.length_schedule, --partial-rollout) are not combined with it")
        if getattr(sampler, "speculative", "off") != "off":
            raise ValueError("multi-turn request (--rollout.env) is not supported with --rollout.speculative mtp")
        rb, stats = generate_multiturn(sampler, tokenizer, req.prompts, req.params, req.multiturn, seed=req.seed,
                                       step=req.step, prompt_index=req.prompt_index, sample_index=req.sample_index)
        return RolloutResult(rb=rb, stats={**dict(getattr(sampler, "last_stats", None) or {}), **stats}, t0=t0,
                             t1=time.time())
    rb = sampler.generate([list(p) for p in req.prompts], req.params, seed=req.seed, step=req.step,
                          prompt_index=req.prompt_index, sample_index=req.sample_index,
                          max_new_tokens_per_row=req.max_new_tokens_per_row, token_offset=req.token_offset)
    return RolloutResult(rb=rb, stats=dict(getattr(sampler, "last_stats", None) or {}), t0=t0, t1=time.time())


class RolloutService(abc.ABC):
    """The rollout as the loop sees it (module docstring). `submit` and `collect` may be called from the
    pipeline's producer thread, `load_weights` from the main thread; the schedule (rl/run/pipeline.py) never calls
    `load_weights` while a request is in flight."""

    generate_calls: int = 0  # generate programs run by this process (the roles' counters in MPMD logs)

    @abc.abstractmethod
    def submit(self, request: RolloutRequest):
        """Start generating `request`; returns a handle for `collect`."""

    @abc.abstractmethod
    def collect(self, handle) -> RolloutResult:
        """Wait for the request of `handle` and return it (each handle once)."""

    @abc.abstractmethod
    def load_weights(self, version: int, source: str | None = None) -> dict:
        """Make the actor's current params the served weights, as `version`; returns perf metrics
        (`perf/weight_push_s`, `perf/weight_push_gbps`). `source`: a checkpoint directory holding those weights
        (--init at version 0): an engine that can read it itself does (`rl.rollout.init`: its own FP8 blocks, no
        push; returns {}), one that cannot pushes the actor's params, which hold the same weights."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights the rollout serves now."""

    def stats(self) -> dict:
        """Counters of the engine's side, logged with each step (MPMD: the rollout processes' programs)."""
        return {}

    def close(self) -> None:
        """Release the engine (MPMD: tell the rollout processes that the run is over)."""


class LocalRollout(RolloutService):
    """The Sampler in this process. `submit` generates at once (in the calling thread: the pipeline's producer
    thread when the run is asynchronous), so `collect` only hands the result over.

    Args:
      sampler: the rl.rollout.engine.Sampler (on the rollout mesh, or unmeshed in tests).
      params_fn: () -> the learner's current params (`Learner.params_for_push`), read by `load_weights`.
      pusher: the actor -> rollout push (`parallel.push.local.WeightPusher`); None: `SamplerPusher(sampler)`
        (`Sampler.update_weights`).
      config, progress: the model config a `load_weights(source=...)` checkpoint is checked against, and whether
        its read shows progress (`rl.rollout.init.checkpoint_rollout_weights`).
      tokenizer: the run's tokenizer, for multi-turn requests (`RolloutRequest.multiturn`); None: refused.
    """

    def __init__(self, sampler, params_fn: Callable[[], dict] | None = None, pusher: Pusher | None = None, *,
                 config=None, progress: bool | None = None, tokenizer=None):
        self.sampler, self.params_fn, self.config, self.progress = sampler, params_fn, config, progress
        self.tokenizer = tokenizer
        self.pusher = SamplerPusher(sampler) if pusher is None else pusher
        self._done: dict[int, RolloutResult] = {}
        self._next = 0

    def submit(self, request: RolloutRequest) -> int:
        self.generate_calls += 1
        handle, self._next = self._next, self._next + 1
        self._done[handle] = run_request(self.sampler, request, self.tokenizer)
        return handle

    def collect(self, handle: int) -> RolloutResult:
        return self._done.pop(handle)

    @property
    def weight_version(self) -> int:
        return self.sampler.weight_version

    def load_weights(self, version: int, source: str | None = None) -> dict:
        if source is not None:
            self.sampler.set_weights(checkpoint_rollout_weights(self.sampler, source, config=self.config,
                                                                progress=self.progress), version=version)
            return {}
        return self.pusher.push(self.params_fn(), version).metrics()
