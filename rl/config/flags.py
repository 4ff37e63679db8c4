"""The checks of the run config's sections and the flag their messages name.

`flag(path)` is the command-line flag a message names for a path: its dotted flag (`--rollout.group_size`, which
launch/run.py takes for every knob; the historic flat spellings such as `--group-size` live only in launch/run.py's
argparse). `check_ints` and `check_choices` are the section checks (rl/config/run.py, rl/config/rollout.py) whose
ValueErrors name the field and that flag. Tests: tests/rl/test_run_config.py.
"""

from __future__ import annotations

from typing import Any

from rl.config import tree


def flag(path: str) -> str:
    """The command-line flag of a dotted path (`--learner.lr`): launch/run.py takes it for every knob."""
    return "--" + path


def check_ints(section: str, obj: Any, names: tuple[str, ...], minimum: int) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{section}.{name} ({flag(section + '.' + name)}) must be an int >= {minimum}, "
                             f"got {v!r}")


def check_choices(section: str, obj: Any) -> None:
    """Every Literal-typed knob of the section holds one of its choices."""
    for path, leaf in tree.paths(type(obj), section + ".").items():
        v = getattr(obj, leaf.field.name)
        if leaf.owner is type(obj) and leaf.choices and v not in leaf.choices and not (leaf.optional and v is None):
            raise ValueError(f"{path} ({flag(path)}) must be {'|'.join(leaf.choices)}, got {v!r}")
