"""rl/async_loop.py: the one-step-off asynchronous loop (issue 14 point 2) on one host, in this process.

A 2-layer tiny model on the built-in digit task, no meshes (the sampler's `update_weights` is the push), fp32
rollout weights: one learner and one sampler shared by the tests (compiled once). Asserted:
- overlap: with K = 1, the learner's update of step n does not end before the rollout of batch n + 1 started
  (the update is held until the rollout thread reports that start; a synchronous loop would never get there);
- staleness: every trained sample's weight version is in [version - K, version], the schedule is exactly
  batch m <- P(max(0, m - K)), and the metrics report it;
- the flags: `--max-staleness` >= 0, `--async-rollout` = K 1, and `--correction none` with K >= 1 is refused.
The kill / resume test (bitwise) is tests/launch/test_async_resume.py (slow).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from rl.config import RunConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def parts():
    """(cfg, learner, sampler, task, tokenizer, train data): built once, shared by the tests below."""
    from dsv4 import DSV4Config, DSV4ForCausalLM
    from flax import nnx

    from rl.config import LearnerConfig
    from rl.learner import Learner
    from rl.loop import _data
    from rl.sampler import Sampler

    cfg = RunConfig(steps=4, prompts_per_step=4, group_size=4, max_new_tokens=4, eval_every=0, ckpt_dir=None,
                    metrics_jsonl=None, tensorboard_dir=None, progress=False, async_rollout=True)
    tok, task, train, *_ = _data(cfg)
    mc = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0,
                         vocab_size=tok.vocab_size)
    model = DSV4ForCausalLM(mc, rngs=nnx.Rngs(0))
    learner = Learner(model, LearnerConfig(lr=cfg.lr, loss=cfg.loss_config(), routing_replay=True,
                                           compute_dtype="float32", temperature=cfg.temperature))
    sampler = Sampler(model, weights="fp32", max_prompt_len=train.max_prompt_len)
    return cfg, learner, sampler, task, tok, train


def _job(parts, **overrides):
    from rl.data import make_prompt_iterator
    from rl.loop import Job

    cfg, learner, sampler, task, tok, train = parts
    cfg = dataclasses.replace(cfg, **overrides)
    from rl.tasks import TaskReward

    return Job(cfg=cfg, model_cfg=None, plan=None, tokenizer=tok, task=task, train_data=train, eval_prompts=[],
               eval_refs=[], reward=TaskReward(task), learner=learner, sampler=sampler, pusher=None,
               iterator=make_prompt_iterator(train, batch_size=cfg.prompts_per_step, seed=cfg.seed), ckpt=None,
               logger=_Logger(), weight_version=sampler.weight_version)


class _Logger:
    def __init__(self):
        self.records = []

    def log(self, step, metrics):
        self.records.append({"step": step, **metrics})

    def close(self):
        pass


def test_rollout_of_the_next_batch_overlaps_the_update(parts, monkeypatch):
    from rl import loop

    job = _job(parts, steps=3)
    learner = job.learner
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
        if step + 1 < job.cfg.steps:
            order.append(("saw_next_rollout", step, gen_started[step + 1].wait(timeout=600)))
        return real_update(self, batch)

    def on_start(name, step, t):
        if name == "generate_start" and step > 0:
            gen_started[step].set()
            update_started[step - 1].wait(timeout=600)

    monkeypatch.setattr(type(learner), "update", update)
    from rl import async_loop

    real_init = async_loop.AsyncRollout.__init__

    def init(self, job_):
        real_init(self, job_)
        self.events = _Events(on_start)

    monkeypatch.setattr(async_loop.AsyncRollout, "__init__", init)
    v0 = job.weight_version
    summary = loop.run(job)
    assert summary["steps_run"] == 3 and job.weight_version == v0 + 3
    assert [e for e in order if e[0] == "saw_next_rollout"] == [("saw_next_rollout", 0, True),
                                                                ("saw_next_rollout", 1, True)]
    ev = job.inflight.events  # the rollout of n + 1 started before the update of n ended
    t = {(name, s): x for name, s, x in ev}
    assert all(t[("generate_start", n + 1)] < t[("update_end", n)] for n in range(2))
    recs = job.logger.records
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
    from rl import loop

    k, steps = 2, 5
    job = _job(parts, steps=steps, async_rollout=False, max_staleness=k)
    v0 = job.weight_version
    loop.run(job)
    versions = job.inflight.sample_versions
    n = job.cfg.prompts_per_step * job.cfg.group_size
    assert sorted(versions) == list(range(steps))
    recs = job.logger.records
    for m in range(steps):
        assert versions[m].shape == (n,) and versions[m].dtype == np.int64
        # batch m was generated with P(max(0, m - K)); no step of this run skips its update
        assert np.all(versions[m] == v0 + max(0, m - k)), (m, versions[m])
        staleness = (v0 + m) - versions[m]
        assert 0 <= staleness.max() <= k
        assert recs[m]["weight_version/staleness_max"] == float(staleness.max())
        assert recs[m]["weight_version/staleness_mean"] == float(staleness.mean())
    assert [r["weight_version/staleness_max"] for r in recs] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert job.weight_version == v0 + steps and job.sampler.weight_version == v0 + steps


def test_flags():
    assert RunConfig().staleness() == 0
    assert RunConfig(async_rollout=True).staleness() == 1
    assert RunConfig(max_staleness=3).staleness() == 3
    assert RunConfig(async_rollout=True, max_staleness=2).staleness() == 2
    with pytest.raises(ValueError, match=r"--max-staleness.*>= 0"):
        RunConfig(max_staleness=-1)
    for kw in ({"async_rollout": True}, {"max_staleness": 2}):
        with pytest.raises(ValueError, match=r"--correction tis or --correction mis, not --correction none"):
            RunConfig(correction="none", **kw)
    RunConfig(correction="mis", max_staleness=2)
    RunConfig(correction="none")  # synchronous: no correction needed


def test_cli_refuses_async_without_correction(tmp_path, capsys):
    from launch.run import main

    out = ["--ckpt-dir", str(tmp_path / "c"), "--metrics-jsonl", "", "--tensorboard-dir", ""]
    assert main(["--async-rollout", "--correction", "none", *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--async-rollout" in err and "--correction none" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["--max-staleness", "x", *out]) == 2
    assert "max_staleness must be int" in capsys.readouterr().err


def test_async_with_rollout_processes_is_accepted_checkpoints_are_not():
    """MPMD runs (rollout on its own processes) take --max-staleness (rl/async_mpmd.py) and, synchronous,
    checkpoints; checkpoints together with --max-staleness are refused before step 1."""
    from rl.roles import check_mpmd_config

    class Layout:
        rollout_processes = (2,)

    check_mpmd_config(RunConfig(ckpt_dir=""), Layout())
    check_mpmd_config(RunConfig(ckpt_dir="", async_rollout=True), Layout())
    check_mpmd_config(RunConfig(ckpt_dir="", max_staleness=2), Layout())
    check_mpmd_config(RunConfig(ckpt_dir="/tmp/x"), Layout())  # synchronous MPMD checkpoints (rl/roles.py)
    with pytest.raises(ValueError, match=r"--ckpt-dir with --max-staleness 1 and the rollout on its own processes"):
        check_mpmd_config(RunConfig(ckpt_dir="/tmp/x", async_rollout=True), Layout())


@pytest.mark.parametrize("k", [1, 2])
def test_mpmd_rollout_side_follows_the_schedule(monkeypatch, k):
    """The rollout processes' side (rl/async_mpmd.py) generates, per step s, the batches up to s + K not generated
    yet, before the push point of s: batch m with P(max(0, m - K)); none past --steps. Stubs: no model, no channel."""
    import types

    from rl import async_loop, roles
    from rl.async_mpmd import MpmdAsyncRollout

    steps, trace = 5, []
    job = types.SimpleNamespace(cfg=RunConfig(steps=steps, max_staleness=k), start_step=0, weight_version=0,
                                layout=types.SimpleNamespace(process=1, rollout_processes=(1,)),
                                counters={"generate": 0, "train_steps": 0},
                                iterator=types.SimpleNamespace(get_state=lambda: {}),
                                channel=types.SimpleNamespace(publish=lambda tag, v: trace.append(("publish", tag))))

    def produce(job_, m):
        trace.append(("generate", m, job_.weight_version))
        return async_loop.RolloutRecord(step=m, rb=None, rewards=None, train_rows=None, versions=None,
                                        metrics={"rollout/reward_mean": float(m)})

    def push_now(job_, tag):
        job_.weight_version += 1
        trace.append(("push", tag))
        return {}

    monkeypatch.setattr("rl.async_mpmd.produce", produce)
    monkeypatch.setattr(roles, "_push_now", push_now)
    side = MpmdAsyncRollout(job).start()
    got = [side.step(s, eval_due=False)["rollout/reward_mean"] for s in range(steps)]
    assert got == [float(s) for s in range(steps)]
    gens = [(e[1], e[2]) for e in trace if e[0] == "generate"]
    assert gens == [(m, max(0, m - k)) for m in range(steps)]  # batch m <- P(max(0, m - K))
    for s in range(steps):  # before the push point of s: exactly the batches up to min(s + K, steps - 1)
        before = trace[: trace.index(("push", s))]
        assert {e[1] for e in before if e[0] == "generate"} == set(range(min(s + k + 1, steps)))
    assert [e[1] for e in trace if e[0] == "publish"] == [f"rollout/{m}" for m in range(steps)]
