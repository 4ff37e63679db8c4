"""What a rollout job must share with its actor job (the two-job layout, rl/rollout/two_job.py): everything that changes the
numbers it generates, compared at registration.

    ident = job_identity(cfg, shapes_cfg, tokenizer, max_prompt_len=max_prompt)  # {"digest", "parts": {...}}
    why = identity_mismatch(actor_ident, rollout_ident)   # None when the digests are equal, else one line

Why. The registration used to compare only the tiling of the weights (shapes, dtypes, meshes): a rollout job started
with a config.json that differs from the actor's in a field that changes no shape (`rope_theta`,
`routed_scaling_factor`) was accepted and generated samples from another model, silently (issue 42, reproduction 2).
Now each job builds its identity from its resolved config objects, four parts, each a canonical JSON object:

- "model config": every field of the resolved `DSV4Config` the rollout model is built from (`to_dict`);
- "tokenizer": its kind, vocabulary size, special ids, chat template and (a tokenizer.json) the sha256 of its file;
- "sampling": the sampler's knobs (prefill chunk, slots, speculative decoding, expert dispatch, the prompt bucket)
  and the request's (temperature, top-p, top-k, response length, eos handling, length schedule) as configured;
- "dtypes": the rollout's weights, compute and KV cache dtypes and the learner's param dtype, as configured.

The digest is the sha256 of the canonical JSON (sorted keys, no spaces) of the four parts; equal digests are a
match. Configured values, not values resolved per device ("auto" slots or compute dtype), so two jobs on different
hardware agree when their flags do. What both jobs derive from the same flags only (the layout's addresses,
timeouts, the job flag itself) is not part of it.

Tests: `.venv/bin/python -m pytest -q tests/rl/test_job_identity.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from rl.config.run import RunConfig
from rl.config.rollout import RolloutConfig

PARTS = ("model config", "tokenizer", "sampling", "dtypes")
SAMPLING_KNOBS = ("max_new_tokens", "temperature", "top_p", "top_k", "slots", "prefill_chunk", "ep_backend",
                  "ep_capacity_factor", "speculative", "draft_tokens", "ignore_eos", "length_schedule",
                  "partial_rollout", "partial_segment")
DTYPE_KNOBS = tuple(f.name for f in dataclasses.fields(RolloutConfig) if f.name.endswith("dtype"))  # weights, compute, KV cache
SHOWN = 3  # differing fields named per part in a refusal line


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_identity(tokenizer) -> dict:
    """A `TokenizerLike` as plain values: {"kind", "vocab_size", "eos_id", "bos_id", "pad_id", "chat_template",
    "sha256"} ("sha256": the tokenizer.json's bytes, None for a built-in task's tokenizer). Raises OSError when the
    file cannot be read."""
    path = getattr(tokenizer, "path", None)
    return {"kind": type(tokenizer).__name__, "vocab_size": int(tokenizer.vocab_size),
            "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "pad_id": tokenizer.pad_id,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "sha256": _file_sha256(path) if path and os.path.isfile(path) else None}


def job_identity(cfg: RunConfig, model_cfg, tokenizer, *, max_prompt_len: int) -> dict:
    """The identity of a job of the two-job layout (module docstring): {"digest": sha256 hex str, "parts": {part:
    dict}}. `model_cfg`: the resolved `DSV4Config` the rollout model is built from; `tokenizer`: the run's
    `TokenizerLike`; `max_prompt_len`: the rollout's prompt bucket (tokens, `rl.run.wiring.prompt_bucket`)."""
    r = cfg.rollout
    parts = {
        "model config": json.loads(_canonical(model_cfg.to_dict())),
        "tokenizer": tokenizer_identity(tokenizer),
        "sampling": {**{k: getattr(r, k) for k in SAMPLING_KNOBS}, "max_prompt_len": int(max_prompt_len)},
        "dtypes": {**{k: getattr(r, k) for k in DTYPE_KNOBS}, "param_dtype": cfg.learner.param_dtype},
    }
    parts = json.loads(_canonical(parts))  # plain JSON values: what the digest hashes is what travels
    return {"digest": hashlib.sha256(_canonical(parts).encode()).hexdigest(), "parts": parts}


def _fields(a: dict, b: dict) -> list[str]:
    return sorted(k for k in {*a, *b} if a.get(k, "<absent>") != b.get(k, "<absent>"))


def identity_mismatch(actor: dict | None, rollout: dict | None) -> str | None:
    """None when the two identities' digests are equal, else one line naming each part that differs and (up to
    `SHOWN` per part) its fields with both values, e.g. "model config differs (rope_theta: 20000.0 in the rollout
    job, 10000.0 in the actor)". A side that sent no identity (an older build) -> one line saying so."""
    if actor is None and rollout is None:  # neither job built one (a caller of the classes, not a run): no check
        return None
    if actor is None or rollout is None:
        return f"the {'actor' if actor is None else 'rollout job'} sent no identity (a build from before issue 42?)"
    if actor.get("digest") == rollout.get("digest"):
        return None
    out = []
    pa, pr = actor.get("parts", {}), rollout.get("parts", {})
    for part in PARTS:
        a, b = pa.get(part, {}), pr.get(part, {})
        diff = _fields(a, b)
        if not diff:
            continue
        shown = "; ".join(f"{k}: {b.get(k, '<absent>')!r} in the rollout job, {a.get(k, '<absent>')!r} in the actor"
                          for k in diff[:SHOWN])
        more = f"; and {len(diff) - SHOWN} more" if len(diff) > SHOWN else ""
        out.append(f"{part} differs ({shown}{more})")
    return ", ".join(out) or "the identity digests differ"
