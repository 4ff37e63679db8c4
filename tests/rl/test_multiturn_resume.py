"""Multi-turn resume is bitwise in the single-process layout (issue 39 point 6), in this process.

The key-lookup job (`--rollout.env key_lookup --rollout.max_turns 2`, rl/run/env_task.py) on a 2-layer tiny model with
fp32 rollout weights and the synchronous loop (one learner and one sampler, compiled once for the module): STEPS
steps uninterrupted, then again checkpointed after step AT by rl/run/loop.py's `save` into a real `Checkpointer`
(learner state, data order, weight version), restored from those files into a fresh job and run to the end. Every
step's batch (tokens, loss mask, logprobs, routing, rewards), every non-`perf/` metric and the final learner state
must equal the uninterrupted run's bit for bit. In the synchronous loop no trajectory is in flight at a checkpoint:
each step's rows, all their turns and tool calls, are generated and trained within the step, and a turn's samples
are keyed by (seed, step, prompt, sample, token offset), so the resumed run regenerates them exactly.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

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


def _wiring(parts, ckpt=None):
    """A job at step 0, or, with a checkpoint directory holding one, at its step with its state restored."""
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
