"""The GRPO loop, one for every layout and schedule: batch -> sample -> score -> advantages -> update -> push, then
eval and checkpoint.

    wiring = rl.run.wiring.build(RunConfig(...))  # meshes, model, learner (actor mesh), rollout service, data, sinks
    summary = run(wiring)                         # the loop; returns {"reward_curve": [...], ...}

The stages are rl/run/stages.py (they know nothing of schedules); the schedule is rl/run/pipeline.py: the rollout as
producer, the learner as consumer, one bounded queue between them (`--max-staleness K`: K = 0 synchronous, K >= 1
K steps off). Where the rollout runs is behind `wiring.rollout` (rl/rollout/service.py: this process, or processes of
its own in MPMD, rl/rollout/mpmd.py), decided once by `build`; a rollout process of an MPMD run serves instead of
running this loop (`wiring.server`). Per step (`train_step`): take the step's batch from the pipeline, advantages,
update, wait for the push point, push, evaluate when due, metrics (rl/run/sinks.py: JSONL, TensorBoard, W&B, progress
bar), a checkpoint every `ckpt.every` (with the in-flight batches when K >= 1). Resume (`resume="auto"`) restores the
newest usable checkpoint and continues bitwise-identically on CPU: randomness is a function of (seed, step, prompt,
sample), and batch m is always generated with P(max(0, m - K)). SIGTERM and SIGINT finish the current step, save,
exit.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

from rl.algo.metrics import format_eval_table
from rl.run.pipeline import Pipeline
from rl.run.sinks import progress_bar
from rl.run.stages import advantages, evaluate, learn, push
from rl.run.wiring import RunWiring

log = logging.getLogger("dsv4rl")

_clock = time.time


def train_step(wiring: RunWiring, pipe: Pipeline, step: int, eval_due: bool) -> dict:
    """One GRPO step on the main thread: the step's batch from the pipeline (stages 1-3), advantages, update, the
    push point, push, evaluation when due. Returns the step's metrics (the pipeline's `weight_version/*` and
    overlap metrics too when K >= 1)."""
    t_step = _clock()
    rec = pipe.take(step)
    train_wait = _clock() - t_step
    metrics = dict(rec.metrics)
    u0 = u1 = _clock()
    if rec.rb is not None:  # None: DAPO skipped the step (no update, no push, same weight version)
        metrics.update(pipe.staleness_metrics(step, rec))
        adv, am = advantages(wiring, rec.rewards, rec.train_rows)  # 4. advantages (DAPO fillers: out of the loss)
        metrics.update(am)
        metrics.update(wiring.data_metrics)
        u0 = _clock()
        metrics.update(learn(wiring, rec.rb, adv, rec.train_rows))  # 5. update
        u1 = _clock()
    pipe.events.append(("update_end", step, u1))
    t0 = _clock()
    pipe.to_push_point(step)  # K >= 1: the producer has finished every batch that needs P(step)
    train_wait += _clock() - t0
    metrics.update(push(wiring))  # 6. push (when the update changed the weights)
    metrics["weight_version"] = wiring.weight_version
    metrics["perf/step_s"] = _clock() - t_step
    if eval_due:
        metrics.update(evaluate(wiring, step))
    if pipe.k:
        metrics["perf/train_wait_s"] = train_wait
        metrics.update(pipe.step_metrics(step, t_step, u0, u1))
    return metrics


def save(wiring: RunWiring, step: int, *, force: bool = False) -> None:
    """Checkpoint after `step` steps: the learner state, the data order, the weight version (and, K >= 1, the
    in-flight batches first)."""
    if wiring.ckpt is None:
        return
    if wiring.inflight is not None:
        wiring.inflight.save(wiring.ckpt, step)
    meta = {"data": wiring.iterator.get_state(), "weight_version": wiring.weight_version, "seed": wiring.cfg.seed,
            "data_identity": wiring.data_identity}
    wiring.ckpt.save(step, wiring.learner.state_dict(), meta, force=force)


def run(wiring: RunWiring) -> dict:
    """The loop from `wiring.start_step` to `cfg.steps`. Returns a summary with the reward curve.

    SIGTERM and SIGINT (Ctrl-C) are handled alike: the current step finishes, a checkpoint of it is saved and
    the loop ends (`summary["signal"]` names the signal). A second Ctrl-C exits the process at once (status
    130): an unfinished save is only an orbax temp directory, so the newest complete checkpoint is untouched.
    On a rollout process of an MPMD run: serve the actor until it stops (`rl.rollout.mpmd.RolloutServer`).
    """
    if wiring.server is not None:
        counters = wiring.server.serve()
        _log_role(wiring, counters["generate"], counters["train_steps"])
        return {"reward_curve": [], "steps_run": 0, "weight_version": wiring.server.sampler.weight_version,
                "stopped_by_signal": False, "signal": None}
    cfg = wiring.cfg
    stop = {"flag": False, "signal": None}

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        extra = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        log.warning("%s: finishing the current step, saving, exiting%s", name, extra)
        stop["flag"], stop["signal"] = True, name

    handled = (signal.SIGTERM, signal.SIGINT)
    main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, on_signal) for s in handled} if main_thread else None
    watch = _SecondInterrupt(handled) if main_thread else None
    curve = []
    bar = progress_bar(cfg, wiring.start_step)
    try:
        if cfg.eval.before_train and wiring.start_step == 0:  # veRL's val_before_train
            ev = evaluate(wiring, 0)
            log.info("eval before training:\n%s", eval_table(ev, wiring))
            wiring.logger.log(0, {**ev, "eval/before_train": 1.0})
        wiring.inflight = Pipeline(wiring).start()
        for step in range(wiring.start_step, cfg.steps):
            eval_due = bool(cfg.eval.every) and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps)
            metrics = train_step(wiring, wiring.inflight, step, eval_due)
            wiring.logger.log(step, metrics)
            curve.append(metrics["rollout/reward_mean"])
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}",
                                tok_s=f"{metrics['perf/rollout_tok_per_s']:.0f}")
            done = step + 1
            saved = bool(cfg.ckpt.every) and (done % cfg.ckpt.every == 0 or done == cfg.steps)
            if saved:
                save(wiring, done)
            if stop["flag"]:
                if not saved:
                    save(wiring, done, force=True)
                break
    finally:
        if wiring.inflight is not None:
            wiring.inflight.close()
        wiring.rollout.close()
        if bar is not None:
            bar.close()
        if wiring.ckpt is not None:
            wiring.ckpt.wait()
        wiring.logger.close()
        _log_role(wiring, wiring.rollout.generate_calls, wiring.counters["train_steps"])
        if old is not None:
            watch.close()
            for s, handler in old.items():
                signal.signal(s, handler)
    return {"reward_curve": curve, "steps_run": len(curve), "weight_version": wiring.weight_version,
            "stopped_by_signal": stop["flag"], "signal": stop["signal"]}


class _SecondInterrupt:
    """Exit at once (status 130) on a SIGINT that comes after any of `handled`, even while the main thread is inside
    a long XLA call. Python runs a signal's handler on the main thread between bytecodes, and two signals that come
    while it waits in C are one call of the handler: a second Ctrl-C during a device step would only finish the step.
    The C-level handler also writes each signal's number to the wakeup fd (`signal.set_wakeup_fd`), one byte per
    signal as it arrives, which this watcher thread reads. An unfinished save is only an orbax temp directory, so
    the newest complete checkpoint is untouched."""

    def __init__(self, handled: tuple[int, ...]):
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._handled = handled
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="second-interrupt", daemon=True).start()

    def _watch(self) -> None:
        seen = False
        while data := self._read.recv(64):
            for signum in data:
                if signum == signal.SIGINT and seen:
                    sys.stderr.write("\ninterrupted again: exiting now; the newest complete checkpoint is kept\n")
                    sys.stderr.flush()
                    os._exit(130)
                seen = seen or signum in self._handled

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        self._write.close()  # the watcher reads the end of the stream and returns
        self._read.close()


# A child forked without exec (a fork-started worker pool; spawned and exec'd ones close the socket) would write its
# own signals to the watcher's socket: a terminal's Ctrl-C, sent to the whole process group, would count twice.
os.register_at_fork(after_in_child=lambda: signal.set_wakeup_fd(-1))


def _log_role(wiring: RunWiring, generate_calls: int, train_steps: int) -> None:
    if wiring.layout is not None and wiring.layout.split_roles:  # the roles' programs, counted (tests read this line)
        log.info("role %s (process %d): generate calls %d, train steps %d", wiring.layout.role, wiring.layout.process,
                 generate_calls, train_steps)


def run_eval(wiring: RunWiring) -> dict:
    """--eval-only: one evaluation of the loaded weights (`--init`, or the newest checkpoint of --ckpt-dir with
    --resume auto) on the eval prompts, logged as step `wiring.start_step`; prints the table. Returns the metrics.
    On a rollout process of an MPMD run: serve the actor's requests until it stops."""
    if wiring.server is not None:
        wiring.server.serve()
        return {}
    try:
        ev = evaluate(wiring, wiring.start_step)
        wiring.logger.log(wiring.start_step, {**ev, "eval/only": 1.0})
    finally:
        wiring.rollout.close()
        wiring.logger.close()
    print(eval_table(ev, wiring))
    return ev


def eval_table(metrics: dict, wiring: RunWiring) -> str:
    """The eval metrics as a small text table (rl.algo.metrics.format_eval_table) naming the eval set."""
    cfg = wiring.cfg
    source = cfg.data.eval_dataset or (f"the first {len(wiring.eval_prompts)} training prompts" if cfg.data.dataset
                                       else "the task's eval split")
    return format_eval_table(metrics, n_prompts=len(wiring.eval_prompts), source=source,
                             weights=cfg.model.init if wiring.start_step == 0 else
                             f"{cfg.ckpt.dir} step {wiring.start_step}")
