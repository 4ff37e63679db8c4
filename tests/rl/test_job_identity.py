"""rl/rollout/job_identity.py: a rollout job's identity (model config, tokenizer, sampling knobs, dtypes) from the
resolved config objects; equal flags -> equal digests; a same-shape foreign model config (issue 42, reproduction 2) or
another tokenizer, sampling knob or dtype -> one line naming the part and its fields. The registration that uses it:
tests/rl/test_rollout_job.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from dsv4.config import DSV4Config
from rl.config.run import RunConfig
from rl.rollout.job_identity import identity_mismatch, job_identity
from rl.data.tasks import DigitTask

TOK = DigitTask(kind="copy", n_digits=3, seed=0).tokenizer


def _ident(cfg=None, model=None, tok=TOK, max_prompt_len=8):
    return job_identity(cfg or RunConfig(), model or DSV4Config.preset("tiny"), tok, max_prompt_len=max_prompt_len)


def test_equal_flags_equal_digests():
    a, b = _ident(), _ident()
    assert a == b and len(a["digest"]) == 64 and identity_mismatch(a, b) is None
    assert set(a["parts"]) == {"model config", "tokenizer", "sampling", "dtypes"}
    assert a["parts"]["model config"]["rope_theta"] == 10000.0  # every field of the resolved config


def test_a_same_shape_foreign_model_config_is_named_with_its_fields():
    foreign = dataclasses.replace(DSV4Config.preset("tiny"), rope_theta=20000.0, routed_scaling_factor=2.0)
    why = identity_mismatch(_ident(), _ident(model=foreign))
    assert why == ("model config differs (rope_theta: 20000.0 in the rollout job, 10000.0 in the actor; "
                   "routed_scaling_factor: 2.0 in the rollout job, 1.5 in the actor)")


def test_tokenizer_sampling_and_dtypes_each_named():
    cfg = RunConfig()
    other = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, top_p=0.9, dtype="fp32"))
    tok = SimpleNamespace(vocab_size=TOK.vocab_size, eos_id=TOK.eos_id + 1, bos_id=TOK.bos_id, pad_id=TOK.pad_id)
    why = identity_mismatch(_ident(), _ident(cfg=other, tok=tok))
    assert why.startswith("tokenizer differs (eos_id: 3 in the rollout job, 2 in the actor; kind: ") and "\n" not in why
    assert ", sampling differs (top_p: 0.9 in the rollout job, 1.0 in the actor)" in why
    assert why.endswith(", dtypes differs (dtype: 'fp32' in the rollout job, 'fp8' in the actor)")
    assert "model config" not in why
    assert identity_mismatch(_ident(), None).startswith("the rollout job sent no identity")
    assert identity_mismatch(None, None) is None  # neither side built one: nothing to compare
