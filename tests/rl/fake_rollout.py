"""A fake rollout service and a fake learner for loop tests that compile nothing (rl/rollout/service.py contract).

`FakeRollout` answers a request with tokens that are a function of the request's sample ids and of the weight
version it serves (so a test can tell which weights sampled which batch), and records every call in `trace`:
("generate", tag, served version) and ("push", version). `FakeLearner` counts updates and returns metrics that are
a function of the batch, so two runs that train on the same batches log the same numbers. `ListLogger`: the
loop's metrics sink, keeping every step's record in `records`.
"""

from __future__ import annotations

import numpy as np

from rl.algo.batch import RolloutBatch
from rl.rollout.service import RolloutResult, RolloutService


class FakeRollout(RolloutService):
    def __init__(self, vocab: int, eos: int, trace: list, version: int = 0):
        self.vocab, self.eos, self.trace, self._version = vocab, eos, trace, version
        self._done: dict[str, RolloutResult] = {}

    def submit(self, req):
        self.generate_calls += 1
        self.trace.append(("generate", req.tag, self._version))
        n, t = len(req.prompts), req.params.max_new_tokens
        pi = np.arange(n) if req.prompt_index is None else np.asarray(req.prompt_index)
        si = np.zeros(n, np.int64) if req.sample_index is None else np.asarray(req.sample_index)
        seed = (req.seed * 1_000_003 + req.step * 7_919 + pi * 104_729 + si * 31 + self._version * 13) % 2**31
        tokens = np.stack([np.random.default_rng(int(s)).integers(3, self.vocab, t) for s in seed]).astype(np.int32)
        lengths = np.full(n, t, np.int32)
        p = max(len(x) for x in req.prompts)
        prompt = np.zeros((n, p), np.int32)
        for i, x in enumerate(req.prompts):
            prompt[i, : len(x)] = x  # left-aligned (rl/batch.py)
        rb = RolloutBatch(tokens=tokens, logprobs=-np.ones((n, t), np.float32),
                          routing=np.zeros((n, p + t, 1, 1), np.int32), lengths=lengths,
                          finish_reasons=["length"] * n, prompt_tokens=prompt,
                          prompt_lengths=np.array([len(x) for x in req.prompts], np.int32),
                          weight_version=self._version)
        self._done[req.tag] = RolloutResult(rb=rb, stats={}, t0=0.0, t1=0.0)
        return req.tag

    def collect(self, handle):
        return self._done.pop(handle)

    @property
    def weight_version(self) -> int:
        return self._version

    def load_weights(self, version: int, source: str | None = None) -> dict:
        self.trace.append(("push", version))
        self._version = version
        return {"perf/weight_push_s": 0.0}


class FakeLearner:
    def __init__(self):
        self.updates = 0

    def update(self, batch) -> dict:
        self.updates += 1
        adv = np.asarray(batch.advantages, np.float64)
        return {"train/pg_loss": float(np.abs(adv).sum()), "train/updates": float(self.updates)}

    def params_for_push(self):
        return {}

    def state_dict(self) -> dict:
        return {"updates": np.array(self.updates)}


class ListLogger:
    """The loop's metrics sink for tests: `records` = [{"step": s, **metrics}] in logging order."""

    def __init__(self):
        self.records = []

    def log(self, step, metrics):
        self.records.append({"step": step, **metrics})

    def close(self):
        pass
