"""Nested frozen-dataclass configs: knobs with their help in the field's metadata, dotted paths, overrides.

A config tree is a frozen dataclass whose fields are knobs (leaves) or sections (fields whose type is itself
a dataclass, e.g. `RunConfig.learner.loss`). Every leaf has one dotted path (`learner.loss.kl_coef`); a knob
is declared once, with its default and help (`knob(...)`), and validated by its class's `__post_init__`.

    paths(RunConfig)                        -> {"steps": Leaf, ..., "learner.lr": Leaf, ...}
    build(obj, {"learner.lr": 1e-6})        -> a copy of obj with those leaves replaced (each section rebuilt
                                               once, so validation sees the final values together)
    convert(leaf, raw, source, name)        -> a YAML / command-line value as the leaf's type
    to_tree(obj) / flatten(mapping)         -> nested dict of leaves / {dotted path: value}

Errors are ValueError with one line naming the key and where it came from (file, flag).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

_NONE_WORDS = ("", "none", "null")


def knob(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its help text in `metadata["help"]` (shown by `launch/run.py --help`)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


def default(cls: type, name: str) -> Any:
    """The declared default of knob `name` of config class `cls` (its `knob(...)` default or factory), for library
    signatures that take the same knob: `Sampler(max_prompt_len=default(DataConfig, "max_prompt_len"))`."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One knob of a tree: its dotted `path`, the owning dataclass `owner`, the field, and its value type
    (`base`: bool | int | float | str, Literals as str; `optional`: None allowed; `choices`: a Literal's)."""

    path: str
    owner: type
    field: dataclasses.Field
    base: type
    optional: bool
    choices: tuple | None

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")


def _is_section(t) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


@functools.cache
def paths(cls: type, prefix: str = "") -> dict[str, Leaf]:
    """{dotted path: Leaf} of every knob under `cls`, sections expanded depth-first in field order."""
    out = {}
    for f in dataclasses.fields(cls):
        t = _hints(cls)[f.name]
        path = prefix + f.name
        if _is_section(t):
            out.update(paths(t, path + "."))
            continue
        args = typing.get_args(t)
        optional = type(None) in args and (typing.get_origin(t) in (typing.Union, types.UnionType))
        base = next((a for a in args if a is not type(None)), t) if optional else t
        choices = None
        if typing.get_origin(base) is typing.Literal:
            choices, base = typing.get_args(base), str
        out[path] = Leaf(path, cls, f, base if isinstance(base, type) else str, optional, choices)
    return out


@functools.cache
def sections(cls: type, prefix: str = "") -> dict[str, type]:
    """{dotted path: dataclass} of every section under `cls` (not `cls` itself)."""
    out = {}
    for f in dataclasses.fields(cls):
        t = _hints(cls)[f.name]
        if _is_section(t):
            out[prefix + f.name] = t
            out.update(sections(t, prefix + f.name + "."))
    return out


def convert(leaf: Leaf, raw: Any, source: str, name: str | None = None) -> Any:
    """`raw` (a YAML value or a command-line string) as `leaf`'s type, exactly: a YAML float is an int only when
    integral (2.7 and 4.9 are refused, not truncated), a YAML number is never a bool nor a YAML bool a number
    (command-line words true/false/1/0/yes/no are bools). ValueError: "`source`: `name` must be <type>, got <raw>"
    (name defaults to the leaf's path)."""
    name = name or leaf.path
    if raw is None or (leaf.optional and isinstance(raw, str) and raw.lower() in _NONE_WORDS):
        if leaf.optional:
            return None
        raise ValueError(f"{source}: {name} must be {leaf.base.__name__}, got {raw!r}")
    if leaf.choices and isinstance(raw, bool) and "on" in leaf.choices:  # YAML 1.1 reads an unquoted `on` as true
        return "on" if raw else "off"
    base = leaf.base
    if isinstance(raw, base) and not (base is not bool and isinstance(raw, bool)):
        return raw
    if base is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if base is int and isinstance(raw, float) and raw.is_integer():  # YAML 1.0e+3: exactly an int
        return int(raw)
    try:
        if isinstance(raw, (dict, list, bool)) or (base in (int, bool) and isinstance(raw, (int, float))):
            raise ValueError  # a value of another type is refused, never truncated (2.7 -> 2) or reinterpreted
        if base is bool:
            return {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}[str(raw).lower()]
        return base(raw)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{source}: {name} must be {base.__name__}, got {raw!r}") from None


def flatten(mapping: dict, cls: type, source: str, prefix: str = "") -> dict[str, tuple[str, Any]]:
    """A (possibly nested) mapping of knobs -> {dotted path: (key as written, value)}, in order.

    Keys may be nested sections (`learner: {lr: 1e-6}`) or dotted (`learner.lr`); `-` may stand for `_`.
    ValueError names `source` and an unknown key, or two spellings of one knob (`learner.lr` and
    `learner: {lr: ...}`)."""
    leaves, secs, out = paths(cls), sections(cls), {}
    for k, v in mapping.items():
        key = prefix + str(k).replace("-", "_")
        if key in secs and isinstance(v, dict):
            found = flatten(v, cls, source, key + ".")
        elif key in leaves:
            found = {key: (prefix + str(k), v)}
        else:
            raise ValueError(f"{source}: unknown key {prefix + str(k)!r}")
        for path, (written, _) in found.items():
            if path in out:  # two spellings of one knob (`learner.lr`, `learner: {lr}`): which one wins is not obvious
                raise ValueError(f"{source}: {path} is set twice (a dotted key and a section's); give it once")
        out.update(found)
    return out


def split_paths(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """{dotted path: value} -> ({top-level name: value}, {section name: {path inside it: value}}), order kept."""
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, v in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = v
        else:
            direct[head] = v
    return direct, nested


def build(obj: Any, values: dict[str, Any], rename=None) -> Any:
    """A copy of the dataclass `obj` with the leaves `values` ({path relative to obj: value}; a section path
    replaces the whole section) set. Each changed section is rebuilt once (one `__post_init__` on the final
    values). `rename(owner, ValueError)` may reword a section's error (e.g. to name the command-line flag)."""
    direct, nested = split_paths(values)
    for head, sub in nested.items():
        base = direct.get(head, getattr(obj, head))
        direct[head] = build(base, sub, rename)
    if not direct:
        return obj
    try:
        return dataclasses.replace(obj, **direct)
    except ValueError as e:
        if rename is None:
            raise
        raise rename(type(obj), e) from None


def to_tree(obj: Any, skip: frozenset = frozenset(), prefix: str = "") -> dict:
    """The dataclass tree as nested dicts of plain values (section -> dict), leaving out the paths in `skip`."""
    out = {}
    for f in dataclasses.fields(obj):
        v, path = getattr(obj, f.name), prefix + f.name
        if path in skip:
            continue
        out[f.name] = to_tree(v, skip, path + ".") if dataclasses.is_dataclass(v) else v
    return out


def get(obj: Any, path: str) -> Any:
    for p in path.split("."):
        obj = getattr(obj, p)
    return obj
