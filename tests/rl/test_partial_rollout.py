"""rl/run/partial.py: partial rollouts (issue 23 point 4) in this process, on a 2-layer tiny model with fp32 rollout
weights (one learner and one sampler, compiled once for the module).

Asserted:
- a sample continued from prompt + its first g tokens with `token_offset` g draws the tokens of the uninterrupted
  sample (same keys; the same weights give the same tokens, logprobs to float tolerance); with continuous batching
  (`--rollout-slots`) too, each row cut at its own point (`max_new_tokens_per_row`);
- token versions: with K = 1 and a long tail (`--rollout.length_schedule`), some trained samples hold tokens of two
  versions; every trained token's version, logprob and token are those of the segment that drew it (so the TIS
  correction, per token on rollout logprobs, weighs it against that version); the staleness shares add up to 1;
- deterministic: the same flags give the same tokens, logprobs, versions and rewards;
- resume: a run checkpointed after 2 steps (in-flight batches + the pool) and resumed continues bitwise;
- the flags: `--partial-rollout` with `--max-staleness 0` is refused in one line.
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

STEPS = 4


@pytest.fixture(scope="module")
def parts():
    """(cfg, learner, its initial state on the host, sampler, task, tokenizer, train data)."""
    from rl.run.wiring import load_data

    cfg = RunConfig(steps=STEPS, **{"rollout.prompts_per_step": 4, "rollout.group_size": 2, "rollout.max_new_tokens": 8,
                                    "eval.every": 0, "ckpt.dir": None, "log.metrics_jsonl": None,
                                    "log.tensorboard_dir": None, "log.progress": False, "rollout.max_staleness": 1,
                                    "rollout.partial_rollout": True, "rollout.length_schedule": "0.25:3"})
    tok, task, train, *_ = load_data(cfg)
    learner, init, sampler = tiny_learner_and_sampler(cfg, tok.vocab_size, train.max_prompt_len)
    return cfg, learner, init, sampler, task, tok, train


class _Spy:
    """Wraps the rollout service: records every segment's rows (prompt index, sample, offset) and results."""

    def __init__(self, rollout):
        self.rollout, self.calls = rollout, []

    def __getattr__(self, name):
        return getattr(self.rollout, name)

    def submit(self, req):
        h = self.rollout.submit(req)
        res = self.rollout._done[h]
        self.calls.append((req, res.rb))
        return h


def _wiring(parts, ckpt=None, start_step=0, iterator_state=None, state=None, version=0):
    from rl.data.prompts import make_prompt_iterator
    from rl.run.wiring import RunWiring
    from rl.rollout.service import LocalRollout
    from rl.data.tasks import TaskReward

    cfg, learner, init, sampler, task, tok, train = parts
    learner.load_state_dict(init if state is None else state)
    rollout = LocalRollout(sampler, learner.params_for_push)
    rollout.load_weights(version)
    it = make_prompt_iterator(train, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed)
    if iterator_state is not None:
        it.set_state(iterator_state)
    wiring = RunWiring(cfg=dataclasses.replace(cfg), model_cfg=None, plan=None, tokenizer=tok, task=task,
                       train_data=train, eval_prompts=[], eval_refs=[], reward=TaskReward(task), learner=learner,
                       rollout=_Spy(rollout), iterator=it, ckpt=ckpt, logger=ListLogger(), weight_version=version)
    wiring.start_step = start_step
    return wiring


def _run(wiring, until: int, trained: dict, ckpt_at: int | None = None):
    """Steps wiring.start_step .. until - 1 of the loop (rl/run/loop.py's train_step); trained[step] = the batch."""
    from rl.run.loop import train_step
    from rl.run.pipeline import Pipeline

    pipe = Pipeline(wiring).start()
    wiring.inflight = pipe
    real_take = pipe.take

    def take(step):
        rec = real_take(step)
        trained[step] = rec
        return rec

    pipe.take = take
    try:
        for step in range(wiring.start_step, until):
            wiring.logger.log(step, train_step(wiring, pipe, step, eval_due=False))
            if ckpt_at is not None and step + 1 == ckpt_at:
                pipe.save(wiring.ckpt, ckpt_at)
                saved = (jax.tree.map(np.asarray, wiring.learner.state_dict()), wiring.iterator.get_state(),
                         wiring.weight_version)
                return saved
    finally:
        pipe.close()
    return None


class _Ckpt:
    def __init__(self, d):
        self.dir = str(d)

    def all_steps(self):
        return []


def test_continued_sample_draws_with_the_uninterrupted_keys(parts):
    from rl.rollout.engine import SamplingParams

    cfg, learner, init, sampler, task, tok, train = parts
    prompts = [train[i]["prompt_ids"][: train[i]["prompt_len"]].tolist() for i in range(8)]  # the loop's bucket
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    ids = {"seed": 3, "step": 5, "prompt_index": list(range(8)), "sample_index": [1, 0] * 4}
    whole = sampler.generate(prompts, sp, **ids)
    head = sampler.generate(prompts, sp, **ids, max_new_tokens_per_row=[3] * 8)
    tail = sampler.generate([p + head.tokens[i, :3].tolist() for i, p in enumerate(prompts)], sp, **ids,
                            max_new_tokens_per_row=[5] * 8, token_offset=[3] * 8)
    joined = np.concatenate([head.tokens[:, :3], tail.tokens[:, :5]], axis=1)
    np.testing.assert_array_equal(joined, whole.tokens)
    np.testing.assert_allclose(np.concatenate([head.logprobs[:, :3], tail.logprobs[:, :5]], axis=1),
                               whole.logprobs, atol=1e-4)
    with pytest.raises(ValueError, match="token_offset"):
        sampler.generate(prompts, sp, seed=3, token_offset=[-1] * 8)


def test_continuous_batching_honours_offsets_and_row_budgets(parts):
    """--rollout-slots with partial rollouts: the slots program draws a continued sample's tokens with its
    `token_offset` keys and stops each row at its own budget, so head + tail equal the static path's whole sample."""
    from dsv4 import abstract_model

    from rl.rollout.engine import Sampler, SamplingParams

    cfg, learner, init, sampler, task, tok, train = parts
    abstract = abstract_model(sampler.config)
    slots = Sampler(abstract, weights="fp32", max_prompt_len=sampler.max_prompt_len, slots=4)
    slots.set_weights(sampler.weight_state(), sampler.weight_version)  # the static sampler's weights, as they are
    prompts = [train[i]["prompt_ids"][: train[i]["prompt_len"]].tolist() for i in range(8)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    ids = {"seed": 3, "step": 5, "prompt_index": list(range(8)), "sample_index": [1, 0] * 4}
    whole = sampler.generate(prompts, sp, **ids)
    cut = [2, 3, 1, 4, 3, 5, 2, 6]  # a different interruption point per row
    head = slots.generate(prompts, sp, **ids, max_new_tokens_per_row=cut)
    assert (head.lengths <= np.array(cut)).all()
    tail = slots.generate([p + head.tokens[i, : head.lengths[i]].tolist() for i, p in enumerate(prompts)], sp,
                          **ids, max_new_tokens_per_row=[8 - int(n) if n < 8 else 1 for n in head.lengths],
                          token_offset=head.lengths.tolist())
    continued = 0
    for i in range(8):
        n = int(head.lengths[i])
        if head.finish_reasons[i] == "stop":  # ended inside its head: nothing to continue
            np.testing.assert_array_equal(head.tokens[i, :n], whole.tokens[i, :n])
            continue
        continued += 1
        joined = np.concatenate([head.tokens[i, :n], tail.tokens[i, : tail.lengths[i]]])
        np.testing.assert_array_equal(joined, whole.tokens[i, : whole.lengths[i]], err_msg=f"row {i}")
        assert n + int(tail.lengths[i]) == int(whole.lengths[i])
    assert continued >= 4, continued


def _chains(calls):
    """[(prompt, tokens, logprobs, versions)] of every sample the segments drew, its pieces joined in order."""
    pieces: dict = {}
    for req, rb in calls:
        seen = set()
        for r in range(len(req.prompts)):
            key = (req.prompt_index[r], req.sample_index[r])
            if key in seen:  # padding rows repeat row 0
                continue
            seen.add(key)
            c = int(rb.lengths[r])
            pieces.setdefault(key, []).append((req.token_offset[r], list(req.prompts[r]), rb.tokens[r, :c],
                                               rb.logprobs[r, :c], np.full(c, rb.weight_version)))
    out = []
    for ps in pieces.values():
        ps.sort(key=lambda x: x[0])
        out.append((ps[0][1], *(np.concatenate([x[i] for x in ps]) for i in (2, 3, 4))))
    return out


def test_token_versions_deterministic_and_resume_bitwise(parts, tmp_path):
    from rl.algo.batch import TrainBatch

    full: dict = {}
    wiring = _wiring(parts)
    _run(wiring, STEPS, full)
    chains = _chains(wiring.rollout.calls)
    spans = 0
    for step, rec in full.items():
        rb = rec.rb
        tv = rb.versions_per_token()
        valid = np.arange(rb.tokens.shape[1])[None] < rb.lengths[:, None]
        assert (tv[valid] >= 0).all() and (tv[~valid] == -1).all()
        assert tv[valid].max() <= max(0, step - 1)  # batch m's newest tokens: P(max(0, m - K))
        spans += int(sum(len(set(tv[i][valid[i]])) > 1 for i in range(len(tv))))
        m = wiring.logger.records[step]
        shares = [v for k, v in m.items() if k.startswith("rollout/token_staleness_") and k[-1].isdigit()]
        assert abs(sum(shares) - 1.0) < 1e-9 and m["rollout/partial/segments"] >= 1
        # every trained token is the one a segment drew, with that segment's logprob and version: the rollout
        # logprobs the learner's TIS weights compare with (TrainBatch.rollout_logprobs, per token) are that version's
        tb = TrainBatch.from_rollout(rb, np.ones(len(rb.lengths), np.float32))
        for i, row in enumerate(tb.rows()):
            n = int(rb.lengths[i])
            assert np.array_equal(row["response_logprobs"], rb.logprobs[i, :n])
            same = [c for c in chains if c[0] == row["prompt"].tolist() and np.array_equal(c[1], rb.tokens[i, :n])]
            assert any(np.array_equal(c[2], rb.logprobs[i, :n]) and np.array_equal(c[3], tv[i, :n]) for c in same), \
                f"step {step} row {i}: no segments drew it"
    assert spans > 0, "no trained sample was continued across a weight update"

    # the same flags again, checkpointed after 2 steps, then resumed from the files in a fresh job
    again: dict = {}
    ckpt = _Ckpt(tmp_path)
    wiring2 = _wiring(parts, ckpt=ckpt)
    state, it_state, version = _run(wiring2, STEPS, again, ckpt_at=2)
    wiring3 = _wiring(parts, ckpt=ckpt, start_step=2, iterator_state=it_state, state=state, version=version)
    _run(wiring3, STEPS, again)
    for step in range(STEPS):
        a, b = full[step], again[step]
        for f in ("tokens", "logprobs", "token_versions", "lengths", "prompt_tokens", "routing"):
            np.testing.assert_array_equal(getattr(a.rb, f), getattr(b.rb, f), err_msg=f"step {step} {f}")
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_array_equal(a.versions, b.versions)
    ra = {r["step"]: r for r in wiring.logger.records}
    rb_ = {r["step"]: r for r in wiring2.logger.records + wiring3.logger.records}
    for step in range(STEPS):
        keys = {k for k in ra[step] if not k.startswith("perf/")}
        assert keys == {k for k in rb_[step] if not k.startswith("perf/")}
        assert {k: ra[step][k] for k in keys} == {k: rb_[step][k] for k in keys}, step


def test_partial_rollout_flags():
    with pytest.raises(ValueError, match="--partial-rollout .*--max-staleness"):
        RunConfig(**{"rollout.partial_rollout": True})
    with pytest.raises(ValueError, match="length_schedule"):
        RunConfig(**{"rollout.length_schedule": "0.1"})
    cfg = RunConfig(**{"rollout.max_new_tokens": 32, "rollout.length_schedule": "0.1:4"})
    caps = cfg.rollout.length_caps(range(100))
    assert caps.count(32) == 10 and caps.count(4) == 90
