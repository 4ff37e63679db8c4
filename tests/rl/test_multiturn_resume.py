"""Multi-turn resume is bitwise in the single-process layout and through the MPMD rollout server (issue 39 point 6),
in this process.

The key-lookup job (`--rollout.env key_lookup --rollout.max_turns 2`, rl/run/env_task.py) on a 2-layer tiny model with
fp32 rollout weights and the synchronous loop (one learner and one sampler, compiled once for the module): STEPS
steps uninterrupted, then again checkpointed after step AT by rl/run/loop.py's `save` into a real `Checkpointer`
(learner state, data order, weight version), restored from those files into a fresh job and run to the end. Every
step's batch (tokens, loss mask, logprobs, routing, rewards), every non-`perf/` metric and the final learner state
must equal the uninterrupted run's bit for bit. In the synchronous loop no trajectory is in flight at a checkpoint:
each step's rows, all their turns and tool calls, are generated and trained within the step, and a turn's samples
are keyed by (seed, step, prompt, sample, token offset), so the resumed run regenerates them exactly.

MPMD: the same checkpoint restored into a job whose rollout is the MPMD actor side (`rl.rollout.mpmd.ProcessRollout`)
talking to a `RolloutServer` on a thread, as a rollout process runs it (the run's tokenizer given, every multi-turn
request served by the server's own `run_request`), through an in-memory host channel that pickles every command and
result as `sharding.mpmd.HostChannel` does; the push is the one-process push (the two sides share the sampler). Its
steps after the checkpoint equal the uninterrupted run's bitwise as well. What stays for the launched MPMD tests
(tests/launch/test_mpmd_run.py, test_mpmd_async_resume.py, single-turn): the processes, the cross-process push and
the channel's transport.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import sys
import threading
import types

import jax
import numpy as np
import pytest

from rl.config.run import RunConfig

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fake_rollout import ListLogger  # noqa: E402  (tests/rl/fake_rollout.py)
from tiny_learner import tiny_learner_and_sampler  # noqa: E402  (tests/rl/tiny_learner.py)

sys.path.pop(0)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STEPS, AT = 3, 1


@pytest.fixture(scope="module")
def parts():
    """(cfg, learner, its initial state on the host, sampler, tokenizer, train data, reward)."""
    from rl.run.wiring import load_data

    cfg = RunConfig.from_overrides([
        ("rollout.env", "key_lookup"), ("rollout.max_turns", 2), ("steps", STEPS), ("rollout.prompts_per_step", 2),
        ("rollout.group_size", 4), ("rollout.max_new_tokens", 12), ("data.task_digits", 1), ("learner.lr", 2e-2),
        ("eval.every", 0), ("ckpt.dir", ""), ("log.metrics_jsonl", ""), ("log.tensorboard_dir", ""),
        ("log.progress", False)])
    tok, _, train, _, _, reward, _ = load_data(cfg)
    learner, init, sampler = tiny_learner_and_sampler(cfg, tok.vocab_size, train.max_prompt_len)
    return cfg, learner, init, sampler, tok, train, reward


class Channel:
    """The MPMD host channel in one process: values pickled by key; a receive waits for its key (60 s)."""

    def __init__(self):
        self.values, self.cv = {}, threading.Condition()

    def publish(self, key, value):
        with self.cv:
            self.values[key] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            self.cv.notify_all()

    def receive(self, key, role, what=""):
        with self.cv:
            assert self.cv.wait_for(lambda: key in self.values, timeout=60), f"{role}: {what}"
            return pickle.loads(self.values.pop(key))


class SharedPusher:
    """The MPMD push in one process: the actor's push sets the (shared) sampler's weights; the server's is a no-op."""

    def __init__(self, sampler):
        from parallel.push.local import SamplerPusher

        self.local = SamplerPusher(sampler)

    def push(self, params, version):
        return None if params is None else self.local.push(params, version)


def _mpmd_rollout(sampler, tok, params_fn):
    """The actor's ProcessRollout of an MPMD pair over one Channel, its server serving on a started thread (the
    rollout's `server_thread`)."""
    from rl.rollout.mpmd import ProcessRollout, RolloutServer

    channel, pusher = Channel(), SharedPusher(sampler)
    server = RolloutServer(sampler, types.SimpleNamespace(process=1, rollout_processes=(1,)), channel, pusher,
                           tokenizer=tok)
    thread = threading.Thread(target=server.serve, name="rollout-server", daemon=True)
    thread.start()
    rollout = ProcessRollout(types.SimpleNamespace(process=0, writer=0, rollout_processes=(1,)), channel, pusher,
                             params_fn)
    rollout.server_thread = thread
    return rollout


def _wiring(parts, ckpt=None, mpmd=False):
    """A job at step 0, or, with a checkpoint directory holding one, at its step with its state restored; with
    `mpmd`, its rollout is the MPMD pair (`_mpmd_rollout`)."""
    from rl.data.prompts import make_prompt_iterator
    from rl.run.wiring import RunWiring
    from rl.rollout.service import LocalRollout

    cfg, learner, init, sampler, tok, train, reward = parts
    learner.load_state_dict(init)
    it = make_prompt_iterator(train, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed)
    start, version = 0, 0
    restored = None if ckpt is None else ckpt.restore(learner.state_dict())  # as rl/run/wiring.py's build resumes
    if restored is not None:
        state, meta = restored
        learner.load_state_dict(state)
        it.set_state(meta["data"])
        start, version = int(meta["step"]), int(meta["weight_version"])
    if mpmd:
        rollout = _mpmd_rollout(sampler, tok, learner.params_for_push)
    else:
        rollout = LocalRollout(sampler, learner.params_for_push, tokenizer=tok)
    rollout.load_weights(version)
    wiring = RunWiring(cfg=dataclasses.replace(cfg), model_cfg=None, plan=None, tokenizer=tok, task=None,
                       train_data=train, eval_prompts=[], eval_refs=[], reward=reward, learner=learner, rollout=rollout,
                       iterator=it, ckpt=ckpt, logger=ListLogger(), weight_version=version)
    wiring.start_step = start
    return wiring


def _run(wiring, until: int, trained: dict, ckpt_at: int | None = None) -> None:
    """Steps wiring.start_step .. until - 1 of the loop (rl/run/loop.py's train_step); trained[step] = the batch; with
    `ckpt_at`, rl/run/loop.py's checkpoint after that many steps, then stop (the interruption)."""
    from rl.run import loop
    from rl.run.pipeline import Pipeline

    pipe = Pipeline(wiring).start()
    wiring.inflight = pipe
    real_take = pipe.take

    def take(step):
        trained[step] = rec = real_take(step)
        return rec

    pipe.take = take
    try:
        for step in range(wiring.start_step, until):
            wiring.logger.log(step, loop.train_step(wiring, pipe, step, eval_due=False))
            if ckpt_at is not None and step + 1 == ckpt_at:
                loop.save(wiring, ckpt_at, force=True)
                wiring.ckpt.wait()
                return
    finally:
        pipe.close()


def test_multiturn_resume_is_bitwise_in_one_process(parts, tmp_path):
    from rl.run.checkpoint import Checkpointer

    full: dict = {}
    wiring = _wiring(parts)
    _run(wiring, STEPS, full)
    final = jax.tree.map(np.asarray, wiring.learner.state_dict())
    assert any(rec.rb.loss_mask is not None and (rec.rb.loss_mask == 0).any() for rec in full.values()), \
        "no environment turn in the run: nothing multi-turn to resume"

    def ckpt():
        return Checkpointer(tmp_path / "ckpt", keep=2, fingerprint={"run": "multiturn"}, async_save=False)

    again: dict = {}
    first = _wiring(parts, ckpt())
    _run(first, STEPS, again, ckpt_at=AT)
    resumed = _wiring(parts, ckpt())
    assert resumed.start_step == AT and resumed.weight_version == wiring.logger.records[AT - 1]["weight_version"]
    _run(resumed, STEPS, again)
    for step in range(STEPS):
        a, b = full[step], again[step]
        for f in ("tokens", "loss_mask", "logprobs", "lengths", "prompt_tokens", "routing"):
            np.testing.assert_array_equal(getattr(a.rb, f), getattr(b.rb, f), err_msg=f"step {step} {f}")
        np.testing.assert_array_equal(a.rewards, b.rewards)
    ra = {r["step"]: r for r in wiring.logger.records}
    rb = {r["step"]: r for r in first.logger.records + resumed.logger.records}
    assert sorted(rb) == list(range(STEPS))
    for step in range(STEPS):
        keys = {k for k in ra[step] if not k.startswith("perf/")}
        assert "rollout/tool_calls_per_traj" in keys and keys == {k for k in rb[step] if not k.startswith("perf/")}
        assert {k: ra[step][k] for k in keys} == {k: rb[step][k] for k in keys}, step
    got = jax.tree.map(np.asarray, resumed.learner.state_dict())
    jax.tree.map(np.testing.assert_array_equal, final, got)

    # the same checkpoint resumed with the MPMD rollout server (module docstring)
    mpmd: dict = {}
    wiring_m = _wiring(parts, ckpt(), mpmd=True)
    assert wiring_m.start_step == AT
    try:
        _run(wiring_m, STEPS, mpmd)
    finally:
        wiring_m.rollout.close()  # the "stop" command
        wiring_m.rollout.server_thread.join(timeout=60)
    assert not wiring_m.rollout.server_thread.is_alive()
    assert sorted(mpmd) == list(range(AT, STEPS))
    assert any((mpmd[s].rb.loss_mask == 0).any() for s in mpmd), "no environment turn through the MPMD server"
    for step in range(AT, STEPS):
        a, b = full[step], mpmd[step]
        for f in ("tokens", "loss_mask", "logprobs", "lengths", "prompt_tokens", "routing"):
            np.testing.assert_array_equal(getattr(a.rb, f), getattr(b.rb, f), err_msg=f"MPMD step {step} {f}")
        np.testing.assert_array_equal(a.rewards, b.rewards)
    rm = {r["step"]: r for r in wiring_m.logger.records}
    for step in range(AT, STEPS):  # the MPMD run adds its own counters (mpmd/...)
        keys = {k for k in ra[step] if not k.startswith("perf/")}
        assert keys <= set(rm[step]) and {k: ra[step][k] for k in keys} == {k: rm[step][k] for k in keys}, step
    assert rm[STEPS - 1]["mpmd/rollout_generate_calls"] == STEPS - AT
    jax.tree.map(np.testing.assert_array_equal, final, jax.tree.map(np.asarray, wiring_m.learner.state_dict()))
