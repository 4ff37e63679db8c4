"""rl/run/pipeline.py: the one-step-off asynchronous schedule (issue 14 point 2) on one host, in this process, and the
one loop over the rollout service contract (rl/rollout/service.py) driven by a fake service.

A 2-layer tiny model on the built-in digit task, no meshes (the sampler's `update_weights` is the push), fp32
rollout weights: one learner and one sampler shared by the tests (compiled once). Asserted:
- overlap: with K = 1, the learner's update of step n does not end before the rollout of batch n + 1 started
  (the update is held until the rollout thread reports that start; a synchronous loop would never get there);
- staleness: every trained sample's weight version is in [version - K, version], the schedule is exactly
  batch m <- P(max(0, m - K)), and the metrics report it;
- the flags: `--max-staleness` >= 0, `--async-rollout` = K 1, and `--correction none` with K >= 1 is refused;
- the loop over a fake rollout service (no compile): the same schedule for K = 0, 1, 2 whatever serves the rollout.
The kill / resume tests (bitwise) are tests/launch/test_resume.py and test_mpmd_async_resume.py (slow).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import threading

import numpy as np
import pytest

from rl.config.run import RunConfig

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from fake_rollout import ListLogger  # noqa: E402  (tests/rl/fake_rollout.py)

sys.path.pop(0)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def parts():
    """(cfg, learner, sampler, task, tokenizer, train data): built once, shared by the tests below."""
    from dsv4 import DSV4Config, DSV4ForCausalLM
    from flax import nnx

    from rl.config.algo import LearnerConfig
    from rl.algo.learner import Learner
    from rl.run.wiring import load_data
    from rl.rollout.engine import Sampler

    cfg = RunConfig(steps=4, **{"rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 4,
                                "eval.every": 0, "ckpt.dir": None, "log.metrics_jsonl": None,
                                "log.tensorboard_dir": None, "log.progress": False, "rollout.async_rollout": True})
    tok, task, train, *_ = load_data(cfg)
    mc = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0,
                         vocab_size=tok.vocab_size)
    model = DSV4ForCausalLM(mc, rngs=nnx.Rngs(0))
    learner = Learner(model, LearnerConfig(lr=cfg.learner.lr, loss=cfg.loss_config(), routing_replay=True,
                                           compute_dtype="float32", temperature=cfg.rollout.temperature))
    sampler = Sampler(model, weights="fp32", max_prompt_len=train.max_prompt_len)
    return cfg, learner, sampler, task, tok, train


def _wiring(parts, **overrides):
    from rl.data.prompts import make_prompt_iterator
    from rl.run.wiring import RunWiring
    from rl.rollout.service import LocalRollout
    from rl.data.tasks import TaskReward

    cfg, learner, sampler, task, tok, train = parts
    cfg = dataclasses.replace(cfg, **overrides)
    return RunWiring(cfg=cfg, model_cfg=None, plan=None, tokenizer=tok, task=task, train_data=train, eval_prompts=[],
                     eval_refs=[], reward=TaskReward(task), learner=learner,
                     rollout=LocalRollout(sampler, learner.params_for_push),
                     iterator=make_prompt_iterator(train, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed),
                     ckpt=None, logger=ListLogger(), weight_version=sampler.weight_version)


def test_rollout_of_the_next_batch_overlaps_the_update(parts, monkeypatch):
    from rl.run import loop

    wiring = _wiring(parts, steps=3)
    learner = wiring.learner
    real_update = type(learner).update
    # a rendezvous: update n waits until the rollout of batch n + 1 has started, which waits until update n has
    # started; both are then in progress at once (a synchronous loop would time out here)
    update_started = {s: threading.Event() for s in range(3)}
    gen_started = {s: threading.Event() for s in range(3)}
    order = []

    def update(self, batch):
        step = sum(e[0] == "update_start" for e in order)
        order.append(("update_start", step))
        update_started[step].set()
        if step + 1 < wiring.cfg.steps:
            order.append(("saw_next_rollout", step, gen_started[step + 1].wait(timeout=600)))
        return real_update(self, batch)

    def on_start(name, step, t):
        if name == "generate_start" and step > 0:
            gen_started[step].set()
            update_started[step - 1].wait(timeout=600)

    monkeypatch.setattr(type(learner), "update", update)
    from rl.run import pipeline

    real_init = pipeline.Pipeline.__init__

    def init(self, wiring_):
        real_init(self, wiring_)
        self.events = _Events(on_start)

    monkeypatch.setattr(pipeline.Pipeline, "__init__", init)
    v0 = wiring.weight_version
    summary = loop.run(wiring)
    assert summary["steps_run"] == 3 and wiring.weight_version == v0 + 3
    assert [e for e in order if e[0] == "saw_next_rollout"] == [("saw_next_rollout", 0, True),
                                                                ("saw_next_rollout", 1, True)]
    ev = wiring.inflight.events  # the rollout of n + 1 started before the update of n ended
    t = {(name, s): x for name, s, x in ev}
    assert all(t[("generate_start", n + 1)] < t[("update_end", n)] for n in range(2))
    recs = wiring.logger.records
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert [r["weight_version/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    for r in recs:
        assert {"perf/rollout_wait_s", "perf/train_wait_s", "perf/overlap_frac"} <= set(r)
        assert 0.0 <= r["perf/overlap_frac"] <= 1.0 + 1e-9
    assert recs[0]["perf/overlap_frac"] > 0  # the held update overlapped the rollout of batch 1


class _Events(list):
    """A list that also calls `hook(*item)` on append (the rollout thread's events)."""

    def __init__(self, hook):
        super().__init__()
        self.hook = hook

    def append(self, item):
        super().append(item)
        self.hook(*item)


def test_staleness_is_bounded_by_k_and_versions_are_per_sample(parts):
    from rl.run import loop

    k, steps = 2, 5
    wiring = _wiring(parts, steps=steps, **{"rollout.async_rollout": False, "rollout.max_staleness": k})
    v0 = wiring.weight_version
    loop.run(wiring)
    versions = wiring.inflight.sample_versions
    n = wiring.cfg.rollout.prompts_per_step * wiring.cfg.rollout.group_size
    assert sorted(versions) == list(range(steps))
    recs = wiring.logger.records
    for m in range(steps):
        assert versions[m].shape == (n,) and versions[m].dtype == np.int64
        # batch m was generated with P(max(0, m - K)); no step of this run skips its update
        assert np.all(versions[m] == v0 + max(0, m - k)), (m, versions[m])
        staleness = (v0 + m) - versions[m]
        assert 0 <= staleness.max() <= k
        assert recs[m]["weight_version/staleness_max"] == float(staleness.max())
        assert recs[m]["weight_version/staleness_mean"] == float(staleness.mean())
    assert [r["weight_version/staleness_max"] for r in recs] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert wiring.weight_version == v0 + steps and wiring.rollout.weight_version == v0 + steps


def test_flags():
    assert RunConfig().staleness() == 0
    assert RunConfig(**{"rollout.async_rollout": True}).staleness() == 1
    assert RunConfig(**{"rollout.max_staleness": 3}).staleness() == 3
    assert RunConfig(**{"rollout.async_rollout": True, "rollout.max_staleness": 2}).staleness() == 2
    with pytest.raises(ValueError, match=r"--max-staleness.*>= 0"):
        RunConfig(**{"rollout.max_staleness": -1})
    for kw in ({"rollout.async_rollout": True}, {"rollout.max_staleness": 2}):
        with pytest.raises(ValueError, match=r"--correction tis or --correction mis, not --correction none"):
            RunConfig(**kw, **{"learner.loss.correction": "none"})
    RunConfig(**{"learner.loss.correction": "mis", "rollout.max_staleness": 2})
    RunConfig(**{"learner.loss.correction": "none"})  # synchronous: no correction needed


def test_cli_refuses_async_without_correction(tmp_path, capsys):
    from launch.run import main

    out = ["--ckpt-dir", str(tmp_path / "c"), "--metrics-jsonl", "", "--tensorboard-dir", ""]
    assert main(["--async-rollout", "--correction", "none", *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--async-rollout" in err and "--correction none" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["--max-staleness", "x", *out]) == 2
    assert "max_staleness must be int" in capsys.readouterr().err


def _alternating_reward(refs, responses):
    """Rewards 1, 0, 1, 0, ... (every group has signal: each step updates and pushes)."""
    r = (np.arange(len(responses)) % 2).astype(np.float32)
    return r, r > 0, {}


def _fake_wiring(steps: int, trace: list, **kw):
    """A RunWiring over the fake rollout service and learner of tests/rl/fake_rollout.py (nothing compiles)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    try:
        from fake_rollout import FakeLearner, FakeRollout
    finally:
        sys.path.pop(0)
    from rl.data.prompts import PromptDataset, make_prompt_iterator
    from rl.run.wiring import RunWiring
    from rl.data.tasks import DigitTask

    cfg = RunConfig(steps=steps, **kw, **{"rollout.prompts_per_step": 2, "rollout.group_size": 4,
                                          "rollout.max_new_tokens": 4, "eval.every": 0, "ckpt.dir": "",
                                          "log.metrics_jsonl": "", "log.tensorboard_dir": "", "log.progress": False})
    task = DigitTask(kind="copy", n_digits=3, seed=0)
    train = PromptDataset.from_task(task, "train")
    return RunWiring(cfg=cfg, model_cfg=None, plan=None, tokenizer=task.tokenizer, task=task, train_data=train,
                     eval_prompts=[], eval_refs=[], reward=_alternating_reward, learner=FakeLearner(),
                     rollout=FakeRollout(task.tokenizer.vocab_size, task.tokenizer.eos_id, trace),
                     iterator=make_prompt_iterator(train, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed),
                     ckpt=None, logger=ListLogger())


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_one_loop_over_a_fake_rollout_service_follows_the_schedule(k):
    """The loop (rl/run/loop.py + rl/run/pipeline.py) asks the service for batch m with P(max(0, m - K)) served, and
    pushes P(s + 1) only after every batch that needs P(s) was generated: batches 0 .. min(s + K, steps - 1). K = 0 is
    the synchronous loop (sample, learn, push, in turn). The same code serves every layout: the service is the only
    thing the loop knows of the rollout."""
    from rl.run import loop

    steps, trace = 5, []
    wiring = _fake_wiring(steps, trace, **{"rollout.max_staleness": k, "learner.loss.correction": "tis"})
    summary = loop.run(wiring)
    assert summary["steps_run"] == steps and wiring.weight_version == steps == wiring.rollout.weight_version
    gens = [(int(tag.split("/")[1]), v) for op, tag, *rest in trace if op == "generate" for v in rest]
    assert gens == [(m, max(0, m - k)) for m in range(steps)]  # batch m <- P(max(0, m - K))
    for s in range(steps):  # before the push of P(s + 1): exactly the batches up to min(s + K, steps - 1)
        before = trace[: trace.index(("push", s + 1))]
        assert {int(e[1].split("/")[1]) for e in before if e[0] == "generate"} == set(range(min(s + k + 1, steps)))
    recs = wiring.logger.records
    assert [r["step"] for r in recs] == list(range(steps))
    assert [r["train/updates"] for r in recs] == [float(s + 1) for s in range(steps)]
    if k:
        assert [r["weight_version/staleness_max"] for r in recs] == [float(min(s, k)) for s in range(steps)]
    else:
        assert not any(key.startswith("weight_version/") for key in recs[0])  # the synchronous loop's metrics


def test_the_loop_logs_the_same_numbers_whatever_the_schedule_when_staleness_is_zero():
    """`--max-staleness 0` through the pipeline is the synchronous loop: a second run logs equal metrics."""
    from rl.run import loop

    runs = []
    for _ in range(2):
        wiring = _fake_wiring(3, [], **{"rollout.max_staleness": 0})
        loop.run(wiring)
        runs.append([{k: v for k, v in r.items() if not k.startswith("perf/")} for r in wiring.logger.records])
    assert runs[0] == runs[1] and len(runs[0]) == 3
