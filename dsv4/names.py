"""Parameter names: the one definition of how a parameter's path becomes its string key.

Every module that keys parameters by name (checkpoint load and export, the sampler's weight state, the push,
the learner's optimizer labels, the planner) reads these, so a name means the same thing everywhere:

    param_key(("layers", 1, "ffn", "experts", "w1"))      -> "layers/1/ffn/experts/w1"   (nnx flat-state path)
    tree_key(jax key path of a State leaf)                 -> "layers/1/ffn/experts/w1"   (`.value` keys dropped)
    official_key(("layers", 1, "ffn", "experts", "w1"))   -> "layers.1.ffn.experts.w1"   (official checkpoint key)

The NNX module tree mirrors the official checkpoint's names (dsv4/model.py), so the official key of a parameter
is its path joined with "."; only the stacked routed experts differ (`EXPERT_KEY`: one [E, ...] array here, one
tensor per expert in the checkpoint, dsv4/io/convert.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax

# official key of a stacked routed-expert array: group 1 = "layers.3.ffn.experts", group 2 = w1 | w2 | w3
EXPERT_KEY = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")


def param_key(path: Iterable) -> str:
    """An nnx path (`nnx.to_flat_state` keys: str and int entries) -> "layers/1/ffn/experts/w1"."""
    return "/".join(str(p) for p in path)


def official_key(path: Iterable) -> str:
    """An nnx path -> its official checkpoint key "layers.1.ffn.experts.w1" (experts still stacked)."""
    return ".".join(str(p) for p in path)


def tree_key(path: Iterable) -> str:
    """A jax key path of a State leaf (`jax.tree_util.tree_leaves_with_path`) -> "layers/1/ffn/gate/weight"
    (the dict keys only: the Variable's own `.value` entry and other non-dict keys are dropped), the same string
    as `param_key` of the leaf's nnx path."""
    return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
