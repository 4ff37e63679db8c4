"""A learner test batch: N ragged rows [left-padded prompt | response, right-padded] of a model, with the routing
and the rollout logprobs of its own forward (tests/rl/test_learner_scan.py, test_learner_pipeline.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rl.algo.batch import TrainBatch
from rl.algo.logprobs import token_logprobs


def ragged_batch(model, n: int, p: int, t: int, seed: int = 0) -> TrainBatch:
    """n rows of prompt <= p and response <= t tokens (row 0's response t long), random ids below the model's
    vocabulary, random advantages; routing recorded from the model's forward."""
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(1, p + 1, n), rng.integers(1, t + 1, n)
    rlen[0] = t
    am, rm = np.zeros((n, p + t), np.int32), np.zeros((n, p + t), np.int32)
    for i in range(n):
        am[i, p - plen[i]:p + rlen[i]] = 1
        rm[i, p:p + rlen[i]] = 1
    ids = np.where(am > 0, rng.integers(1, model.config.vocab_size, (n, p + t)), 0).astype(np.int32)
    lp, _, routing = jax.jit(lambda i, m: token_logprobs(model, i, m))(ids, am)
    return TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(am), response_mask=jnp.asarray(rm),
                      rollout_logprobs=lp * rm, advantages=jnp.asarray(rng.normal(size=n), jnp.float32),
                      routing=routing)
