"""Reading `launch/run.py --config-file FILE.yaml`: a YAML mapping of config keys, strictly.

    data = load_config_file("run.yaml")     # dict; ValueError (one line naming FILE:LINE:COLUMN) otherwise

Strict where PyYAML is lenient: a key given twice in one mapping (PyYAML keeps the last value silently) is an
error naming the file, the key and both lines; a merge (`<<: *base`) may still be overridden by the mapping's own
keys. Not valid YAML: one line `FILE:LINE:COLUMN: not valid YAML: <problem>` (not PyYAML's four). The values'
types are checked against the knobs by `rl.config.tree.convert`.
"""

from __future__ import annotations

import pathlib

import yaml


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader refusing a key repeated in one mapping (merged keys excepted)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    continue
                if first is not key_node.start_mark:
                    raise DuplicateKeyError(key, first, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping repeats `key`: first at mark `first`, again at `again` (PyYAML marks, 0-based)."""

    def __init__(self, key, first, again):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.again = key, first, again


def load_config_file(path: str | pathlib.Path) -> dict:
    """The mapping of a --config-file (an empty file: {}). Raises ValueError, one line naming the file:
    unreadable (OS error), not valid YAML (FILE:LINE:COLUMN), a repeated key (FILE:LINE:COLUMN, the key and the
    line of its first value), or not a mapping."""
    try:
        data = yaml.load(pathlib.Path(path).read_text(), Loader=_StrictLoader) or {}
    except OSError as e:
        raise ValueError(f"--config-file {path}: {e.strerror}") from None
    except DuplicateKeyError as e:
        raise ValueError(f"--config-file {path}:{e.again.line + 1}:{e.again.column + 1}: key {e.key!r} is given "
                         f"twice (first on line {e.first.line + 1}); give each key once") from None
    except yaml.YAMLError as e:
        raise ValueError(yaml_error(path, e)) from None
    if not isinstance(data, dict):
        raise ValueError(f"--config-file {path}: expected a mapping of config keys")
    return data


def yaml_error(path, e: yaml.YAMLError) -> str:
    """A PyYAML error -> one line `--config-file FILE:LINE:COLUMN: not valid YAML: <problem> (<context>)`."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(e, "problem", None) or type(e).__name__
    context = getattr(e, "context", None)
    text = f"{problem} ({context})" if context else problem
    return f"--config-file {where}: not valid YAML: {' '.join(str(text).split())}"
