"""One-step-off asynchronous rollout across MPMD processes: `--max-staleness K >= 1` with the rollout on its own
processes (rl/roles.py). The schedule, the versions and the metrics are rl/async_loop.py's; only the two sides of
the pipeline live on different processes instead of two threads of one.

    job.inflight = rl.async_loop.start_async(job)   # MpmdAsyncActor on actor processes, MpmdAsyncRollout on rollout
    metrics = job.inflight.step(step, eval_due)      # rl.loop.run's loop, unchanged, on every process

Schedule (rl/async_loop.py): batch m is generated with exactly P(max(0, m - K)), whatever the timing, so a run's
numbers are a function of its flags. Per step s:
  rollout processes (`MpmdAsyncRollout.step`): generate the batches up to s + K that are not generated yet
    (`rl.async_loop.produce` = `rl.loop.sample_step`: prompts, `Sampler.generate`, rewards, DAPO rounds), each
    published at once as `rollout/<m>` (the RolloutRecord: RolloutBatch with its weight version, rewards, train rows,
    metrics; the generation's wall-clock interval; the data iterator's state); then the push point of step s: the
    actor's push decision and, when pushed, P(s + 1) (`rl.roles._push_now`, MpmdPusher); then the evaluation when due.
    Step 0 generates batches 0 .. K with P(0); every later step one batch, s + K, with P(s).
  actor processes (`MpmdAsyncActor`, the one-process `AsyncRollout.step` with the rollout thread replaced by the
    channel): receive batch s (`perf/train_wait_s` counts the wait), advantages, `Learner.update` (`rl.loop.
    learn_and_push`, push deferred) while the rollout processes generate batch s + K; then receive the batches up
    to s + K (the rollout has reached its push point), push P(s + 1) (or publish "no push": no signal, non-finite,
    DAPO skip), evaluate when due.
So the push always happens between two generations, and the update of step s overlaps the generation of batch
s + K. For K = 1 the step takes ~ max(rollout, update) + push instead of their sum.

Versions and metrics (process 0, the one writer): every sample carries its weight version
(`RolloutRecord.versions`, `MpmdAsyncActor.sample_versions[s]`; metrics `weight_version/sample_min|max`);
`weight_version/staleness_mean|max` (<= K); `perf/train_wait_s`, `perf/rollout_wait_s`, `perf/overlap_frac` as in
rl/async_loop.py, computed on the actor from the rollout's generation intervals, which are wall-clock times
(`time.time`: exact between processes of one host; across hosts they carry the hosts' clock offset, NTP-level).
`perf/update_end_t` and `perf/next_generate_start_t` (wall clock) show the overlap directly: the generation of batch
s + 1 starts before the update of step s ends.

Checkpoints (not supported in MPMD yet: rl/roles.check_mpmd_config refuses --ckpt-dir). Where they would hook in:
after step s the actor processes hold every in-flight batch s + 1 .. s + K (received at the push point) and the data
iterator state after them, so `AsyncRollout.save` works unchanged on the writer; resume needs the rollout processes
to start at batch s + K + 1 (`MpmdAsyncRollout.next_m`) with P(s + 1) pushed at build.
Tests: `.venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_async.py`.
"""

from __future__ import annotations

import logging
import time

from rl.async_loop import AsyncRollout, RolloutRecord, batches_by_push_point, produce
from sharding.rules import ROLLOUT

log = logging.getLogger("dsv4rl")


class MpmdAsyncActor(AsyncRollout):
    """The asynchronous loop on an actor process of an MPMD run (module docstring): `AsyncRollout.step` with the
    batches received from the rollout processes instead of a thread. Raises `sharding.mpmd.PeerTimeoutError` when
    the rollout side stops answering."""

    mpmd = True
    _clock = staticmethod(time.time)  # the rollout's intervals come from other processes: wall clock

    def __init__(self, job):
        super().__init__(job)
        self.served = job.weight_version  # the version the rollout processes hold (pushed by build_mpmd)
        self.last_generated: float | None = None  # wall time the newest received generation ended
        self.generate_start: dict[int, float] = {}

    def start(self) -> MpmdAsyncActor:
        return self  # no thread: the rollout processes generate

    def _receive(self, m: int) -> None:
        job = self.job
        pk = job.channel.receive(f"rollout/{m}", ROLLOUT, f"the rollout results of batch {m} did not arrive")
        rec: RolloutRecord = pk["record"]
        self.records[m] = rec
        job.iterator.set_state(pk["iterator"])  # the data order after batch m (DAPO rounds included)
        a, b = pk["generate"]
        self.busy.append((a, b))
        if pk["wait"][0] is not None:
            self.waits.append(tuple(pk["wait"]))
        self.events.append(("generate_start", m, a))
        self.generate_start[m] = a
        self.last_generated = b
        self.next_m = m + 1

    def _take(self, step: int) -> RolloutRecord:
        self.job.mpmd_step = step  # the push decision's tag (rl/roles.py)
        while step not in self.records:
            self._receive(self.next_m)
        return self.records.pop(step)

    def _to_push_point(self, step: int) -> None:
        while self.next_m < batches_by_push_point(step, self.k, self.end):
            self._receive(self.next_m)

    def _push(self, step: int) -> dict:
        from rl.loop import push

        job, lay = self.job, self.job.layout
        if job.weight_version != self.served:
            metrics = push(job)  # rl.roles.push_mpmd: the decision (tag = step), then the transfer
            self.served = job.weight_version
            return metrics
        if lay.process == lay.writer:
            job.channel.publish(f"push/{step}", {"push": False, "version": job.weight_version})
        return {}

    def _open_waits(self, t_end: float) -> list[tuple[float, float]]:
        # past its push point the rollout waits for the push (it has generated every batch P(step) serves)
        return [(self.last_generated, t_end)] if self.last_generated is not None else []

    def step(self, step: int, eval_due: bool) -> dict:
        metrics = super().step(step, eval_due)
        v = self.sample_versions.get(step)
        if v is not None:
            metrics["weight_version/sample_min"] = float(v.min())
            metrics["weight_version/sample_max"] = float(v.max())
        metrics["perf/update_end_t"] = next(t for name, s, t in reversed(self.events)
                                            if name == "update_end" and s == step)
        if step + 1 in self.generate_start:
            metrics["perf/next_generate_start_t"] = self.generate_start[step + 1]
        return metrics


class MpmdAsyncRollout:
    """The asynchronous loop on a rollout process of an MPMD run (module docstring): per step, the batches the
    schedule allows, then the push point. `step` returns the rollout metrics of batch `step` (process 0 writes the
    actor's). Raises `sharding.mpmd.PeerTimeoutError` when the actor side stops answering."""

    mpmd = True

    def __init__(self, job):
        self.job, self.k, self.end = job, job.cfg.staleness(), job.cfg.steps
        self.next_m = job.start_step  # the next batch to generate
        self.records: dict[int, RolloutRecord] = {}
        self.last_end: float | None = None
        self.events: list[tuple[str, int, float]] = []

    def start(self) -> MpmdAsyncRollout:
        return self

    def step(self, step: int, eval_due: bool) -> dict:
        from rl.loop import evaluate
        from rl.roles import _push_now

        job, lay = self.job, self.job.layout
        while self.next_m < batches_by_push_point(step, self.k, self.end):
            m = self.next_m
            t0 = time.time()
            self.events.append(("generate_start", m, t0))
            rec = produce(job, m)
            t1 = time.time()
            rec.metrics["mpmd/rollout_generate_calls"] = float(job.counters["generate"])  # this role's programs
            rec.metrics["mpmd/rollout_train_steps"] = float(job.counters["train_steps"])
            if lay.process == min(lay.rollout_processes):
                job.channel.publish(f"rollout/{m}", {"record": rec, "generate": (t0, t1), "wait": (self.last_end, t0),
                                                     "iterator": job.iterator.get_state()})
            self.records[m] = rec
            self.last_end, self.next_m = t1, m + 1
        metrics = dict(self.records.pop(step).metrics)
        metrics.update(_push_now(job, tag=step))  # P(step + 1), or the actor's "no push"
        if eval_due:
            metrics.update(evaluate(job, step))  # rl.roles.evaluate_mpmd: sampled and scored here, published
        metrics["weight_version"] = job.weight_version
        return metrics

    def close(self) -> None:
        pass

    def save(self, ckpt, done: int) -> None:
        raise NotImplementedError("checkpoints of an MPMD run (rl/roles.check_mpmd_config refuses --ckpt-dir)")
