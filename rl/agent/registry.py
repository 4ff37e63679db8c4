"""The environments by name: `--rollout.env` -> `rl.agent.env.Environment` (as `rl.data.math_rewards.make_reward` is for
`--reward`). Each factory takes keyword options (its own knobs) and returns a frozen Environment.

    key_lookup    rl/agent/key_lookup.py: a `lookup` tool returns a key's value; reward: the right call (shaped), then
                  the value copied
    python_math   rl/agent/python_math.py: a sandboxed `python` tool; reward: the final answer, as the math rewards
"""

from __future__ import annotations

from collections.abc import Callable

from rl.agent.env import Environment
from rl.agent.key_lookup import key_lookup_env
from rl.agent.python_math import python_math_env

ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"key_lookup": key_lookup_env, "python_math": python_math_env}


def make_env(name: str, **options) -> Environment:
    """`--rollout.env` name -> Environment. Raises ValueError (one line, naming the flag) for an unknown name."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"--rollout.env must be one of {'|'.join(sorted(ENVIRONMENTS))}, got {name!r}")
    return ENVIRONMENTS[name](**options)
