"""The model side of the in-process loop tests that run the real learner and sampler (tests/rl/test_partial_rollout.py,
test_multiturn_resume.py): a 2-layer tiny model of the run's tokenizer, its fp32 Learner and an fp32 Sampler."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM
from rl.config.algo import LearnerConfig
from rl.algo.learner import Learner
from rl.rollout.engine import Sampler


def tiny_learner_and_sampler(cfg, vocab_size: int, max_prompt_len: int):
    """(learner, its initial state_dict on the host, sampler) for RunConfig `cfg`: the learner with the run's lr, loss
    and temperature, routing replay on, fp32; the sampler's prompts up to `max_prompt_len` + --max-new-tokens (a
    continued sample or a later turn re-prefills its tokens so far)."""
    mc = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0,
                         vocab_size=vocab_size)
    model = DSV4ForCausalLM(mc, rngs=nnx.Rngs(0))
    learner = Learner(model, LearnerConfig(lr=cfg.learner.lr, loss=cfg.loss_config(), routing_replay=True,
                                           compute_dtype="float32", temperature=cfg.rollout.temperature))
    init = jax.tree.map(np.asarray, learner.state_dict())
    sampler = Sampler(model, weights="fp32", max_prompt_len=max_prompt_len + cfg.rollout.max_new_tokens)
    return learner, init, sampler
