"""DAPO dynamic sampling in the loop (`rl.run.stages.dynamic_rollout`) and the batch concatenation it relies on
(`rl.algo.batch.concat_rollouts`). The sampler is replaced by a fake that returns chosen rewards, so no model is
compiled: what is tested is the bookkeeping (which groups are kept, the resampling budget, the layout)."""

import types

import numpy as np
import pytest

from rl.run import stages
from rl.config.run import RunConfig
from rl.algo.batch import RolloutBatch, concat_rollouts

L, K = 2, 1  # routing [.., L, k]


def fake_batch(n: int, p: int, t: int, seed: int, version: int = 3) -> RolloutBatch:
    """n rows with prompt bucket p, response width t; every value tells its origin."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, p + 1, n)
    lens = rng.integers(1, t + 1, n)
    prompt = np.zeros((n, p), np.int32)
    for i in range(n):
        prompt[i, : plen[i]] = rng.integers(1, 50, plen[i])  # left-aligned (rl/batch.py)
    tokens = np.where(np.arange(t)[None] < lens[:, None], rng.integers(1, 50, (n, t)), 0).astype(np.int32)
    logprobs = np.where(tokens > 0, -rng.random((n, t)), 0).astype(np.float32)
    routing = rng.integers(0, 8, (n, p + t, L, K)).astype(np.int32)
    return RolloutBatch(tokens=tokens, logprobs=logprobs, routing=routing, lengths=lens.astype(np.int32),
                        finish_reasons=["stop" if x % 2 else "length" for x in range(n)], prompt_tokens=prompt,
                        prompt_lengths=plen.astype(np.int32), weight_version=version)


def unpadded(rb: RolloutBatch, i: int):
    """Row i without padding: (prompt, response, response logprobs, prompt routing, response routing)."""
    ids, mask, resp, lp = rb.sequences()
    p = int(rb.prompt_lengths[i])  # the joined row [prompt | response | pad] (rl/batch.py)
    r = resp[i].astype(bool)
    return (ids[i, :p], ids[i][r], lp[i][r], rb.routing[i, :p], rb.routing[i][r])


def test_concat_rollouts_keeps_every_row_and_the_layout():
    a, b = fake_batch(4, 8, 5, seed=0), fake_batch(6, 16, 7, seed=1)
    cat = concat_rollouts([(a, np.array([3, 0])), (b, np.array([5, 1, 2]))])
    assert cat.prompt_tokens.shape == (5, 16) and cat.tokens.shape == (5, 7)
    assert cat.routing.shape == (5, 16 + 7, L, K)
    for j, (src, i) in enumerate([(a, 3), (a, 0), (b, 5), (b, 1), (b, 2)]):
        for x, y in zip(unpadded(cat, j), unpadded(src, i)):
            np.testing.assert_array_equal(x, y)
        assert cat.finish_reasons[j] == src.finish_reasons[i]
    # new padding: routing -1 on it, tokens 0
    ids, mask, _, _ = cat.sequences()
    assert (cat.routing[:2, 8 + 5:] == -1).all()  # empty columns at the right
    assert (ids[mask == 0] == 0).all()
    with pytest.raises(ValueError, match="weight versions"):
        concat_rollouts([(a, [0]), (fake_batch(2, 8, 5, seed=2, version=4), [0])])


G, N = 4, 3  # group size, prompts per step


def fake_wiring(monkeypatch, reward_rounds, **cfg_kw):
    """A RunWiring whose rollout returns the given rewards per round ([N * G] each) and records each call."""
    cfg = RunConfig(algo="dapo", **cfg_kw, **{"rollout.prompts_per_step": N, "rollout.group_size": G})
    calls = []

    def batches():
        k = 0
        while True:
            yield {"prompt_ids": np.full((N, 2), k, np.int32), "prompt_len": np.full(N, 2), "reference": ["r"] * N,
                   "index": np.arange(k * N, (k + 1) * N, dtype=np.int64)}
            k += 1

    def rollout(wiring, prompts, refs, step, round_index=0, data_index=None):
        calls.append(round_index)
        rb = fake_batch(N * G, 4, 3, seed=round_index)
        return rb, np.asarray(reward_rounds[round_index], np.float32), {"perf/rollout_s": 0.1}

    monkeypatch.setattr(stages, "rollout", rollout)
    it = batches()
    wiring = types.SimpleNamespace(cfg=cfg, iterator=it)
    return wiring, next(it), calls


def test_resamples_until_the_batch_holds_groups_with_signal(monkeypatch):
    r0 = [1, 0, 0, 0] + [1, 1, 1, 1] + [0, 0, 0, 0]  # one group with signal ([1,0,0,0] is kept)
    r1 = [0, 0, 0, 0] + [0, 1, 1, 0] + [0.5, 0.5, 0.5, 0.5]  # one more
    r2 = [1, 0, 1, 1] + [0, 0, 0, 1] + [1, 0, 0, 0]  # two more: one extra is discarded
    wiring, first, calls = fake_wiring(monkeypatch, [r0, r1, r2])
    rb, rewards, train_rows, m = stages.dynamic_rollout(wiring, step=0, first=first)
    assert calls == [0, 1, 2]
    np.testing.assert_array_equal(rewards, np.array([1, 0, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1], np.float32))
    assert train_rows.all() and rb.tokens.shape[0] == N * G
    assert m["rollout/dynamic_sampling/rounds"] == 3 and m["rollout/dynamic_sampling/kept_groups"] == 3
    assert m["rollout/dynamic_sampling/budget_hit"] == 0 and m["rollout/dynamic_sampling/skipped_step"] == 0
    assert m["rollout/dynamic_sampling/sampled_groups"] == 9
    assert m["rollout/reward_mean"] == pytest.approx(np.mean(r0))  # statistics of the first round


def test_budget_exhausted_trains_on_the_kept_groups(monkeypatch):
    r0 = [1, 0, 0, 0] + [1, 1, 1, 1] + [0, 0, 0, 0]
    r1 = [0, 0, 0, 0] * 3
    wiring, first, calls = fake_wiring(monkeypatch, [r0, r1], **{"dapo.max_resample_batches": 1})
    rb, rewards, train_rows, m = stages.dynamic_rollout(wiring, step=5, first=first)
    assert calls == [0, 1]
    assert rb.tokens.shape[0] == N * G  # same shape every step: fillers, masked out of the loss
    np.testing.assert_array_equal(train_rows, np.repeat([True, False, False], G))
    np.testing.assert_array_equal(rewards[:G], [1, 0, 0, 0])
    assert m["rollout/dynamic_sampling/budget_hit"] == 1 and m["rollout/dynamic_sampling/skipped_step"] == 0
    assert m["rollout/dynamic_sampling/kept_frac"] == pytest.approx(1 / 6)


def test_budget_exhausted_skip_mode_and_no_signal_at_all(monkeypatch):
    r0 = [1, 0, 0, 0] + [1, 1, 1, 1] + [0, 0, 0, 0]
    wiring, first, _ = fake_wiring(monkeypatch, [r0], **{"dapo.max_resample_batches": 0,
                                                         "dapo.on_budget_exhausted": "skip"})
    rb, rewards, train_rows, m = stages.dynamic_rollout(wiring, step=0, first=first)
    assert rb is None and m["rollout/dynamic_sampling/skipped_step"] == 1
    wiring, first, _ = fake_wiring(monkeypatch, [[1] * 12], **{"dapo.max_resample_batches": 0})
    rb, _, _, m = stages.dynamic_rollout(wiring, step=0, first=first)
    assert rb is None and m["rollout/dynamic_sampling/kept_groups"] == 0  # nothing to train on: skipped


def test_dapo_flags_validate():
    with pytest.raises(ValueError, match="--dapo.max_resample_batches"):  # the dotted flag
        RunConfig(**{"dapo.max_resample_batches": -1})
    with pytest.raises(ValueError, match="--dapo.on_budget_exhausted"):
        RunConfig(**{"dapo.on_budget_exhausted": "maybe"})
    from launch.run import resolve  # the command line names its flat flag

    with pytest.raises(ValueError, match=r"\(--dapo-on-budget-exhausted\) must be train\|skip"):
        resolve(["--dapo-on-budget-exhausted", "maybe"])
    cfg = RunConfig(algo="dapo", **{"dapo.max_resample_batches": 2})
    assert cfg.advantage_config().dynamic_sampling_max_rounds == 3
