"""Settings a run overrides or ignores, said once: one warning line each (launch/run.py logs them at start).

    for line in overridden_settings(cfg, given): log.warning(line)

`given` is the set of dotted paths the user set (YAML file or flags), so a knob left at its default never warns.
- `--exact-rollout` draws the training samples from the learner's own forward (rl/rollout/exact.py): the rollout engine's
  speculative decoding (`--rollout.speculative`) and continuous batching (`--rollout-slots`) then serve the
  evaluation only.
- `--rollout.draft_tokens` without `--rollout.speculative mtp` drafts nothing.
"""

from __future__ import annotations

from collections.abc import Collection

from rl.config.run import RunConfig


def overridden_settings(cfg: RunConfig, given: Collection[str]) -> list[str]:
    """One line per setting of `cfg` that the run overrides or ignores; `given`: the dotted paths the user set."""
    r, out = cfg.rollout, []
    if r.exact:
        off = [f"--rollout.speculative {r.speculative}" if r.speculative != "off" else "",
               f"--rollout-slots {r.slots}" if r.slots != 0 else ""]
        off = [x for x in off if x]
        if off:
            out.append(f"--exact-rollout draws the training samples from the learner's forward: {' and '.join(off)} "
                       f"apply to the evaluation only")
    if "rollout.draft_tokens" in given and r.speculative == "off":
        out.append(f"--rollout.draft_tokens {r.draft_tokens} is ignored: speculative decoding is off (add "
                   f"--rollout.speculative mtp)")
    return out
