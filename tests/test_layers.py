"""Imports flow one way: sharding -> dsv4 -> parallel -> rl -> launch (docs/architecture.md).

Every module of the five packages is parsed (not imported) and each `import` / `from ... import` statement,
at module level or inside a function, is checked: a module may import its own layer and the layers below it,
never one above. Function-level imports count too, so a late import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("sharding", "dsv4", "parallel", "rl", "launch")
# The only upward import, by name: the documented CLI `python -m sharding.plan` forwards to launch/plan.py.
ALLOWED = {("sharding/plan/__main__.py", "launch")}


def _imported_packages(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def _modules():
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))


def test_every_layer_has_modules():
    for layer in LAYERS:
        assert list((ROOT / layer).glob("*.py")), f"no modules in {layer}/"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_downward(path):
    rel = path.relative_to(ROOT).as_posix()
    rank = LAYERS.index(rel.split("/")[0])
    upward = [f"{rel}:{line} imports {pkg} (layer {LAYERS.index(pkg)} > {rank})"
              for line, pkg in _imported_packages(path)
              if pkg in LAYERS and LAYERS.index(pkg) > rank and (rel, pkg) not in ALLOWED]
    assert not upward, "\n".join(upward)


def test_allowed_exceptions_still_exist():
    """An allowance that is no longer needed is removed, so the list stays the truth."""
    for rel, pkg in ALLOWED:
        assert pkg in {p for _, p in _imported_packages(ROOT / rel)}, f"{rel} no longer imports {pkg}"


def test_test_module_basenames_are_unique():
    """tests/ has no __init__.py files, so pytest imports each test module by its basename: two test files with
    one name in different folders fail at collection ("import file mismatch")."""
    names = [p.name for p in (ROOT / "tests").rglob("*.py") if p.name != "conftest.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
