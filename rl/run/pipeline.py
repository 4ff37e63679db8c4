"""The one schedule: the rollout as producer (stages 1-3, `rl.run.stages.produce`), the learner as consumer, joined by
a bounded queue of `RolloutRecord`s. `--max-staleness K` is the queue's bound (`--async-rollout` = K 1):

    pipe = Pipeline(wiring).start()
    rec = pipe.take(step)          # the batch of step `step`; releases P(step) to the producer
    ...                            # advantages, update (rl/run/loop.py)
    pipe.to_push_point(step)       # every batch that needs P(step) is generated: the push may happen
    pipe.close()

K = 0: synchronous; `take` produces the batch in the calling thread with the current weights, `to_push_point` has
nothing to wait for: exactly the classic loop. K >= 1: the producer is a thread. P(j) = the learner's params after j
steps. Batch m (the prompts, samples and rewards of step m) is generated with exactly P(max(0, m - K)), so every run
with the same flags samples with the same weights whatever the timing (a SIGKILLed and resumed run reproduces the
uninterrupted one bitwise on CPU):
- the producer generates batches in order; it may start batch m once the rollout serves P(m - K), i.e. it never
  runs more than K batches ahead of the weights;
- step s on the main thread: take batch s (`perf/train_wait_s` counts the wait), advantages, `Learner.update`
  (while the producer generates batch s + K with P(s): the overlap), then wait until batch s + K is done (the last
  one that needs P(s)), push P(s + 1) while the producer is between generations, evaluate on P(s + 1) when due, and
  let the producer go on with batch s + K + 1 (the next `take`).
For K = 1 that is the usual one-step-off pipeline: step time ~ max(rollout, update) + push instead of the sum.
Only the last K batches use P(0) twice. Where the rollout runs (this process, or processes of its own behind
`rl.rollout.mpmd.ProcessRollout`) changes nothing here: the producer talks to `wiring.rollout`.

Versions. Every sample carries the weight version it was generated with (`RolloutRecord.versions`;
`Pipeline.sample_versions[s]` [N] int per trained step). Metrics (K >= 1): `weight_version/staleness_mean|max`
(<= K), `weight_version/sample_min|max`, `perf/train_wait_s` (learner idle, waiting for batches),
`perf/rollout_wait_s` (the producer idle within the step, waiting for weights), `perf/overlap_frac` (overlapped time
of the update and the rollout work within the step / the shorter of the two: 1 = the shorter role is fully hidden,
0 = they alternate as in the synchronous loop), `perf/update_end_t` and `perf/next_generate_start_t` (wall clock:
the generation of batch s + 1 starts before the update of step s ends).

Partial rollouts (`--partial-rollout`, rl/run/partial.py): the producer keeps a pool of groups across batches and
generates in segments of decode steps; batch m is the first P groups that finished, generated up to then with
P(max(0, m - K)) and earlier versions (every response token records its own: `RolloutBatch.token_versions`);
`weight_version/*` then describe each sample's oldest token, and `rollout/token_staleness_<j>` (j = 0 .. max(2K,
the largest seen); `_mean`, `_max`) the share of response tokens j versions older than the learner. The pool
(tokens, logprobs, routing, versions of the unfinished and undrawn groups) is saved with the in-flight batches
(`pool/*` in the same file), so a resumed run continues bitwise.

Checkpoints. A checkpoint after `done` steps also holds the in-flight batches done .. done + K - 1 (generated with
older weights than the checkpoint's): `<ckpt_dir>/inflight/<done>.npz`, written atomically (temp file, fsync,
rename) with a digest (rl/run/digest.py) before the orbax save by the metrics writer, deleted once older than every kept
checkpoint. A missing, truncated or corrupt one makes its checkpoint unusable: the restore passes over it to the
previous checkpoint (`read_inflight`), which resumes bitwise. The data iterator's
state in the checkpoint is the one after those batches (the producer is held while the main thread saves). On
resume they are loaded, the rollout serves P(done) (`rl.run.wiring.build` pushes it), and the producer continues with
batch done + K: the same schedule as the uninterrupted run, in every layout. Batches past `--steps` are never generated,
so a run resumed with a larger `--steps` generates its first K new batches with P(done) (logged).

Threads: JAX dispatch and `jax.set_mesh` are thread-safe / thread-local; the producer runs the rollout requests and
the rewards, the main thread the learner, the push and the evaluation (the producer is then held, so the rollout is
never used by two threads at once). An exception in the producer is re-raised by `take` / `to_push_point`.
"""

from __future__ import annotations

import json
import logging
import pathlib
import threading
import time

import jax
import numpy as np

from rl.algo.batch import ROWS_LAYOUT, RolloutBatch
from rl.run.digest import read_npz, write_npz
from rl.run.partial import PartialPool, token_staleness_metrics
from rl.run.stages import RolloutRecord, produce

log = logging.getLogger("dsv4rl")

_clock = time.time  # wall clock: the rollout's times may come from other processes (MPMD)


def batches_by_push_point(step: int, k: int, end: int) -> int:
    """The schedule: at the push point of step `step` (P(step + 1) about to be pushed), batches 0 .. n - 1 are
    generated, n = min(step + K + 1, end): the last batch needing P(step) is step + K (batch m uses
    P(max(0, m - K))), and batches >= end (--steps) are never generated."""
    return min(step + k + 1, end)


def inflight_path(ckpt_dir, done: int) -> pathlib.Path:
    """The in-flight batches file of the checkpoint after `done` steps: `<ckpt_dir>/inflight/<done>.npz`."""
    return pathlib.Path(ckpt_dir) / "inflight" / f"{done}.npz"


def read_inflight(ckpt_dir, done: int) -> dict[str, np.ndarray]:
    """The verified arrays of the in-flight batches file of checkpoint step `done` ({name: numpy array}).

    Raises ValueError (one line naming the file and the step) when the file is missing, unreadable (truncated: a
    crash or a full disk) or does not match its digest (rl/run/digest.py). `Checkpointer.restore` calls it for each
    candidate step (`check=`), so such a checkpoint is passed over like one whose arrays are unreadable: the
    previous checkpoint, with its own in-flight file, is restored and the run stays bitwise equal to the
    uninterrupted one (the batches cannot be drawn again bitwise: they were generated with older weights than
    the checkpoint's)."""
    path = inflight_path(ckpt_dir, done)
    if not path.exists():
        raise ValueError(f"checkpoint step {done} has no in-flight batches file {path}")
    try:
        return read_npz(path, f"the in-flight batches file of checkpoint step {done}")
    except ValueError as e:
        raise ValueError(str(e)) from None


def overlap(intervals, lo: float, hi: float) -> float:
    """Total length of the intervals [(a, b)] inside [lo, hi]."""
    return float(sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals))


class Pipeline:
    """The producer and the queue of the loop (module docstring).

    Args:
      wiring: a built `rl.run.wiring.RunWiring` (`wiring.start_step`, the rollout serving P(start_step), the data
        iterator at the checkpoint's state). With K >= 1 and a resumed run the in-flight batches are read from
        `<ckpt_dir>/inflight/<start_step>.npz`.
    Raises:
      ValueError: a resumed asynchronous run whose checkpoint lacks its in-flight batches file.
    """

    def __init__(self, wiring):
        self.wiring, self.k = wiring, wiring.cfg.staleness()
        self.end = wiring.cfg.steps  # batches >= end are never generated
        self.cond = threading.Condition()
        self.records: dict[int, RolloutRecord] = {}
        self.released = wiring.start_step  # the rollout serves P(released); the producer may generate m <= released + K
        self.next_m = wiring.start_step  # the next batch the producer generates
        self.error: BaseException | None = None
        self.closed = False
        self.busy: list[tuple[float, float]] = []  # rollout work intervals (wall clock)
        self.waits: list[tuple[float, float]] = []  # producer idle intervals, waiting for weights
        self.sample_versions: dict[int, np.ndarray] = {}  # step -> [N] weight version of each trained sample
        self.events: list[tuple[str, int, float]] = []  # ("generate_start" | "update_end", step, wall clock)
        self.thread = None
        self.partial = None
        if self.k == 0:
            return
        if wiring.cfg.rollout.partial_rollout:  # --partial-rollout: batches from a pool of in-flight groups
            self.partial = PartialPool(wiring)
        if wiring.start_step > 0 and wiring.ckpt is not None:
            self._load(wiring.ckpt.dir, wiring.start_step)
        # SPMD over processes: the two threads' collectives may interleave differently (MPMD has no such issue)
        split = wiring.layout is not None and wiring.layout.split_roles
        if jax.process_count() > 1 and not split:
            log.warning("--max-staleness %d with %d processes: tested on one process only (the rollout thread's "
                        "host collectives run beside the learner's)", self.k, jax.process_count())
        self.thread = threading.Thread(target=self._work, name="rollout", daemon=True)

    def start(self) -> Pipeline:
        if self.thread is not None:
            self.thread.start()
        return self

    # -------------------------------------------------------------- producer

    def _produce(self, m: int) -> RolloutRecord:
        t0 = _clock()
        self.events.append(("generate_start", m, t0))
        rec = self.partial.produce(m) if self.partial is not None else produce(self.wiring, m)
        with self.cond:
            self.busy.append((t0, _clock()))
        return rec

    def _work(self) -> None:
        try:
            while True:
                with self.cond:
                    t0 = _clock()
                    while not self.closed and (self.next_m > self.released + self.k or self.next_m >= self.end):
                        self.cond.wait()
                    self.waits.append((t0, _clock()))
                    if self.closed:
                        return
                    m = self.next_m
                rec = self._produce(m)
                with self.cond:
                    self.records[m] = rec
                    self.next_m = m + 1
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread by `take` / `to_push_point`
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _wait(self, ready) -> None:
        """Block the main thread until `ready()` (under the lock); re-raise a producer failure."""
        with self.cond:
            while not ready():
                if self.error is not None:
                    raise self.error
                if not self.thread.is_alive():
                    raise RuntimeError("the rollout thread ended unexpectedly")
                self.cond.wait(timeout=1.0)

    # -------------------------------------------------------------- consumer (main thread)

    def take(self, step: int) -> RolloutRecord:
        """Release P(step) to the producer (batches up to step + K may be generated) and return batch `step`."""
        if self.thread is None:  # synchronous: the batch is generated now, with P(step)
            self.next_m = step + 1
            return self._produce(step)
        with self.cond:
            self.released = step
            self.cond.notify_all()
        self._wait(lambda: step in self.records)
        return self.records.pop(step)

    def to_push_point(self, step: int) -> None:
        """Wait until the producer has finished every batch that needs P(step) (up to step + K)."""
        if self.thread is not None:
            self._wait(lambda: self.next_m >= batches_by_push_point(step, self.k, self.end))

    def step_metrics(self, step: int, t_step: float, u0: float, u1: float) -> dict:
        """The asynchronous schedule's metrics of step `step` (module docstring), {} for K = 0. Call at the end
        of the step."""
        if self.thread is None:
            return {}
        t_end = _clock()
        with self.cond:
            busy = [(a, b) for a, b in self.busy if b > t_step]
            waits = [(a, b) for a, b in self.waits if b > t_step]
            self.busy, self.waits = busy, waits
        shorter = min(overlap(busy, t_step, t_end), u1 - u0)
        m = {"perf/rollout_wait_s": overlap(waits, t_step, t_end),
             "perf/overlap_frac": overlap(busy, u0, u1) / shorter if shorter > 0 else 0.0,
             "perf/update_end_t": u1}
        nxt = [t for name, s, t in self.events if name == "generate_start" and s == step + 1]
        if nxt:
            m["perf/next_generate_start_t"] = nxt[0]
        return m

    def staleness_metrics(self, step: int, rec: RolloutRecord) -> dict:
        """`weight_version/*` of a trained batch (K >= 1; {} for K = 0, whose staleness is 0 by construction)."""
        if self.thread is None or rec.rb is None:
            return {}
        self.sample_versions[step] = rec.versions
        staleness = self.wiring.weight_version - rec.versions
        out = {"weight_version/staleness_mean": float(staleness.mean()),
               "weight_version/staleness_max": float(staleness.max()),
               "weight_version/sample_min": float(rec.versions.min()),
               "weight_version/sample_max": float(rec.versions.max())}
        if self.partial is not None:  # a sample's oldest token above; per token here
            out.update(token_staleness_metrics(rec.rb, self.wiring.weight_version, self.k))
        return out

    def close(self) -> None:
        """Stop the producer (a generation in progress finishes first)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout=600)

    # -------------------------------------------------------------- checkpoints

    def save(self, ckpt, done: int) -> None:
        """K >= 1: write the in-flight batches done .. done + K - 1 (those generated) to
        `<ckpt.dir>/inflight/<done>.npz` atomically (the metrics writer only); delete the files older than every
        kept checkpoint. Call between steps (producer held)."""
        lay = self.wiring.layout
        writer = lay.writer if lay is not None and lay.split_roles else 0
        if self.thread is None or jax.process_index() != writer:
            return
        d = pathlib.Path(ckpt.dir) / "inflight"
        d.mkdir(exist_ok=True)
        for stale in d.glob(".*.tmp"):  # a write cut short by a kill
            stale.unlink(missing_ok=True)
        arrays: dict[str, np.ndarray] = {}
        with self.cond:
            recs = [self.records[m] for m in sorted(self.records) if done <= m < done + self.k]
        for i, r in enumerate(recs):
            p = f"{i}/"
            arrays[p + "meta"] = np.array(json.dumps({"step": r.step, "metrics": r.metrics}))
            if r.rb is None:
                continue
            rb = r.rb
            for f in ("tokens", "logprobs", "routing", "lengths", "prompt_tokens", "prompt_lengths"):
                arrays[p + f] = getattr(rb, f)
            arrays[p + "finish_reasons"] = np.array(rb.finish_reasons, dtype=str)
            arrays[p + "weight_version"] = np.array(rb.weight_version, np.int64)
            if rb.token_versions is not None:  # partial rollouts
                arrays[p + "token_versions"] = rb.token_versions
                arrays[p + "versions"] = np.asarray(r.versions)
            if rb.loss_mask is not None:  # multi-turn rollouts
                arrays[p + "loss_mask"] = rb.loss_mask
            arrays[p + "rewards"] = np.asarray(r.rewards)
            if r.train_rows is not None:
                arrays[p + "train_rows"] = np.asarray(r.train_rows)
        arrays["count"] = np.array(len(recs))
        arrays["layout"] = np.array(ROWS_LAYOUT)  # the rollouts' row layout (rl/batch.py)
        if self.partial is not None:
            arrays.update(self.partial.state_arrays("pool/"))
        write_npz(d / f"{done}.npz", arrays)  # with its digest; temp file, fsync, rename
        kept = ckpt.all_steps()
        oldest = min([*kept, done])
        for old in d.glob("*.npz"):
            if old.stem.isdigit() and int(old.stem) < oldest:
                old.unlink(missing_ok=True)

    def _load(self, ckpt_dir, done: int) -> None:
        path = inflight_path(ckpt_dir, done)
        z = read_inflight(ckpt_dir, done)
        rollouts = any(f"{i}/tokens" in z for i in range(int(z["count"])))
        if rollouts and ("layout" not in z or str(z["layout"]) != ROWS_LAYOUT):
            raise ValueError(f"the in-flight batches file {path} holds rollouts in the left-padded layout of an "
                             f"older version; resume with that version or from another --ckpt-dir")
        for i in range(int(z["count"])):
            p = f"{i}/"
            meta = json.loads(str(z[p + "meta"]))
            rb = rewards = rows = versions = None
            if p + "tokens" in z:
                rb = RolloutBatch(**{f: z[p + f] for f in ("tokens", "logprobs", "routing", "lengths",
                                                           "prompt_tokens", "prompt_lengths")},
                                  finish_reasons=[str(x) for x in z[p + "finish_reasons"]],
                                  weight_version=int(z[p + "weight_version"]),
                                  token_versions=z[p + "token_versions"] if p + "token_versions" in z else None,
                                  loss_mask=z[p + "loss_mask"] if p + "loss_mask" in z else None)
                rewards = z[p + "rewards"]
                rows = z[p + "train_rows"] if p + "train_rows" in z else None
                versions = (z[p + "versions"] if p + "versions" in z
                            else np.full(len(rewards), rb.weight_version, np.int64))
            m = int(meta["step"])
            self.records[m] = RolloutRecord(step=m, rb=rb, rewards=rewards, train_rows=rows, versions=versions,
                                            metrics=meta["metrics"])
        if self.partial is not None:
            if "pool/count" not in z:
                raise ValueError(f"--partial-rollout: the in-flight batches file {path} has no partial-rollout "
                                 f"pool (written without --partial-rollout); use the run's own flags or another "
                                 f"--ckpt-dir")
            self.partial.load(z, "pool/")
        self.next_m = done + len(self.records)
        if len(self.records) < min(self.k, self.end - done):
            log.info("resume: %d in-flight batches in %s; batches %d.. are generated with weight version %d",
                     len(self.records), path, self.next_m, self.wiring.weight_version)
