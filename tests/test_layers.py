"""Imports flow one way: sharding -> dsv4 -> parallel -> rl -> launch (docs/architecture.md, docs/style.md rule 17).

Every module of the five packages is parsed (not imported) and each `import` / `from ... import` statement, at
module level or inside a function, is checked:
- a module imports its own layer and the layers below it, never one above (no exception);
- the module graph (function-level imports included, so a late import cannot hide a cycle) has no cycle, inside a
  package or across them;
- no import runs inside a function, except the short allow-list `LAZY_OK` below: each a heavy library that only
  one optional path needs. A late import to dodge a cycle is what the cycle check forbids; one for no reason is
  noise that hides the module's real dependencies.
- no module reaches into another's private names in parallel/ and rl/ (docs/style.md rule 19): no
  `from m import _x` and no `m._x` where either side is in `PRIVATE_SCOPE` (tests and benchmarks included); what
  another module needs is public, with a docstring.
The checks are functions of a root folder, so `test_*_detects_*` run them on planted packages under tmp_path.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("sharding", "dsv4", "parallel", "rl", "launch")
# (file, imported top-level module) -> why the import waits for the first call
LAZY_OK = {
    ("rl/run/wandb_sink.py", "wandb"): "the optional [wandb] extra: absent unless installed; --wandb-project asks for "
                                       "it",
    ("rl/data/answers.py", "math_verify"): "sympy-backed (~0.5 s warm, seconds cold); only the math-answer comparison "
                                           "(`math_verify_equal`) needs it",
    ("rl/data/rewards.py", "math_verify"): "the reward worker preloads it before its first deadline",
    ("launch/ray_run.py", "ray"): "the optional [ray] extra: absent unless installed; only --launcher ray (and the Ray "
                                  "workers it starts) needs it",
    ("rl/run/sinks.py", "tensorboardX"): "the heaviest import of the run (~1.4 s warm: protobuf); only "
                                         "--tensorboard-dir needs it",
}


@dataclasses.dataclass(frozen=True)
class Import:
    line: int
    target: str  # the project module it resolves to, or the absolute name of an outside module
    top: str  # top-level package of the imported name
    in_function: bool


def modules(root: pathlib.Path, layers=LAYERS) -> dict[str, pathlib.Path]:
    """{dotted module name: file} of every .py file under `root/<layer>/` (a package's `__init__` is the package)."""
    out = {}
    for layer in layers:
        for f in sorted((root / layer).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _resolve(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: pathlib.Path, mods) -> list[Import]:
    """Every import statement of `path` (module `module`), with the project module each name resolves to
    (`from pkg import sub` -> `pkg.sub` when that is a module) and whether it runs inside a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[Import] = []

    def visit(node, in_fn: bool):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend(Import(child.lineno, _resolve(a.name, mods) or a.name, a.name.split(".")[0], in_fn)
                           for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([child.module] if child.module else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    target = _resolve(full if full in mods else base, mods) or base
                    out.append(Import(child.lineno, target, base.split(".")[0], in_fn))
            visit(child, fn)

    visit(tree, False)
    return out


def import_graph(root: pathlib.Path, layers=LAYERS) -> dict[str, set[str]]:
    """{module: project modules it imports (at any level, function-level included)}; a submodule importing its
    own package's `__init__` counts (the package imports its submodules: that is a cycle at import time)."""
    mods = modules(root, layers)
    return {m: {i.target for i in imports(m, f, mods) if i.target in mods and i.target != m} for m, f in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in a stable order."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def function_level_imports(root: pathlib.Path, rel: str, allowed=LAZY_OK) -> list[str]:
    """'file:line imports X inside a function' for every function-level import of `root/rel` not in `allowed`."""
    mods = modules(root, (rel.split("/")[0],))
    module = next(m for m, f in mods.items() if f == root / rel)
    late = [i for i in imports(module, root / rel, mods) if i.in_function and (rel, i.top) not in allowed]
    return list(dict.fromkeys(f"{rel}:{i.line} imports {i.target} inside a function" for i in late))


def upward_imports(root: pathlib.Path, rel: str, layers=LAYERS) -> list[str]:
    mods = modules(root, layers)
    module = next(m for m, f in mods.items() if f == root / rel)
    rank = layers.index(rel.split("/")[0])
    up = [i for i in imports(module, root / rel, mods) if i.top in layers and layers.index(i.top) > rank]
    return list(dict.fromkeys(f"{rel}:{i.line} imports {i.target} (layer {layers.index(i.top)} > {rank})" for i in up))


PRIVATE_SCOPE = ("parallel", "rl")


# a cheap text filter before parsing: a private name after `import` / in an import list, or `name._x` not on self/cls
_MAYBE_PRIVATE = re.compile(r"import\b[^\n]*[\s,(]_[A-Za-z]|import\s*\([^)]*[\s,(]_[A-Za-z]"
                            r"|(?<![\w.])(?!self\.|cls\.)[A-Za-z]\w*\._[A-Za-z]")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_crossings(root: pathlib.Path, scope=PRIVATE_SCOPE, layers=LAYERS,
                      readers=("tests", "benchmarks")) -> list[str]:
    """'file:line module._name' for every private name one module takes from another project module (`from m import
    _x`, or `m._x` after `import m` / `from pkg import m`), where the reader or the owner is in `scope`. Readers:
    the layers' modules and the .py files under `readers` (`tests/rl/...` reads for `rl`)."""
    mods = modules(root, layers)
    files = dict(mods)
    for d in readers:
        files.update({f.relative_to(root).with_suffix("").as_posix().replace("/", "."): f
                      for f in sorted((root / d).rglob("*.py"))})
    out = []
    for me, path in files.items():
        text = path.read_text()
        if not _MAYBE_PRIVATE.search(text):  # most files: no `import _x` and no `name._x` but self._x / cls._x
            continue
        tree = ast.parse(text, filename=str(path))
        rel = path.relative_to(root).as_posix()
        bound = {}  # local name -> project module it names
        found = []  # (line, owner module, private name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bound.update({a.asname or a.name: a.name for a in node.names if a.name in mods})
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
                    elif _private(a.name) and _resolve(base, mods) not in (None, me):
                        found.append((node.lineno, _resolve(base, mods), a.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                    and bound.get(node.value.id, me) != me:
                found.append((node.lineno, bound[node.value.id], node.attr))
        parts = rel.split("/")  # tests/rl/test_x.py reads for rl/
        reader = parts[0] in scope or (parts[0] in readers and len(parts) > 2 and parts[1] in scope)
        out += [f"{rel}:{line} {owner}.{name}" for line, owner, name in sorted(set(found))
                if reader or owner.split(".")[0] in scope]
    return out


def _files():
    return sorted(f.relative_to(ROOT).as_posix() for f in modules(ROOT).values())


def test_every_layer_has_modules():
    for layer in LAYERS:
        assert list((ROOT / layer).glob("*.py")), f"no modules in {layer}/"


@pytest.mark.parametrize("rel", _files())
def test_imports_flow_downward(rel):
    upward = upward_imports(ROOT, rel)
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("rel", _files())
def test_no_function_level_imports(rel):
    late = function_level_imports(ROOT, rel)
    assert not late, "\n".join(late)


def test_no_private_name_crosses_modules_in_parallel_and_rl():
    found = private_crossings(ROOT)
    assert not found, "private names used across modules (make them public, with a docstring):\n" + "\n".join(found)


def test_lazy_allow_list_is_still_needed():
    """An allowance that is no longer used is removed, so the list stays the truth."""
    for rel, top in LAZY_OK:
        module = next(m for m, f in modules(ROOT).items() if f == ROOT / rel)
        found = {i.top for i in imports(module, ROOT / rel, modules(ROOT)) if i.in_function}
        assert top in found, f"{rel} no longer imports {top} inside a function: drop it from LAZY_OK"


def _plant(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_cycle_check_detects_a_planted_cycle_through_a_function_level_import(tmp_path):
    """A cycle held together by a late import (the shape CONTRIBUTING forbids) is found, and so is one through a
    package's __init__; a one-way chain is not a cycle."""
    _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from pkg import a  # dodges the cycle at import time\n    return a\n",
        "pkg/c.py": "from . import a\n",  # one way: not part of the cycle
        "top/__init__.py": "from top.x import X\n",
        "top/x.py": "from top import helper\nX = 1\n",
        "top/helper.py": "",
    })
    graph = import_graph(tmp_path, ("pkg", "top"))
    assert graph["pkg.c"] == {"pkg.a"} and graph["top.x"] == {"top.helper"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    _plant(tmp_path, {"top/x.py": "from top import helper\nfrom top import Y\nX = 1\n"})  # `from top import Y`
    assert cycles(import_graph(tmp_path, ("pkg", "top"))) == [["pkg.a", "pkg.b"], ["top", "top.x"]]


def test_function_level_import_check_detects_planted_late_imports(tmp_path):
    _plant(tmp_path, {
        "pkg/__init__.py": "import os\n",
        "pkg/m.py": ("import json\n\nclass K:\n    def method(self):\n        import pkg.n\n\n"
                     "def f():\n    g = lambda: __import__('x')\n    def inner():\n        from os import path\n"),
        "pkg/n.py": "try:\n    import yaml\nexcept ImportError:\n    yaml = None\n",  # module level: fine
    })
    assert function_level_imports(tmp_path, "pkg/m.py", allowed={}) == [
        "pkg/m.py:5 imports pkg.n inside a function", "pkg/m.py:10 imports os inside a function"]
    assert function_level_imports(tmp_path, "pkg/m.py", allowed={("pkg/m.py", "os")}) == [
        "pkg/m.py:5 imports pkg.n inside a function"]
    assert function_level_imports(tmp_path, "pkg/n.py", allowed={}) == []


def test_upward_check_detects_a_planted_upward_import(tmp_path):
    _plant(tmp_path, {"low/__init__.py": "", "low/x.py": "import os\n\ndef f():\n    import high.y\n",
                      "high/__init__.py": "", "high/y.py": "from low import x\n"})
    assert upward_imports(tmp_path, "low/x.py", ("low", "high")) == ["low/x.py:4 imports high.y (layer 1 > 0)"]
    assert upward_imports(tmp_path, "high/y.py", ("low", "high")) == []


def test_private_check_detects_planted_crossings(tmp_path):
    """`from m import _x` and `m._x` are found where the reader or the owner is in scope; a module's own private
    names, dunders and names outside the scope are not."""
    _plant(tmp_path, {
        "low/__init__.py": "", "low/a.py": "_k = 1\n",
        "pkg/__init__.py": "", "pkg/m.py": "from low import a\n_y = a._k\n\ndef f():\n    return _y, a.__name__\n",
        "pkg/n.py": "from pkg.m import _y, f\nfrom . import m\nm._y\n",
        "tests/test_x.py": "import pkg.m\nfrom low.a import _k\npkg.m.f()\n",
        "pkg/p.py": "from pkg.m import (\n    f,\n    _y,\n)\n",
        "tests/pkg/test_y.py": "from low.a import _k\n",
    })
    assert private_crossings(tmp_path, ("pkg",), ("low", "pkg")) == [
        "pkg/m.py:2 low.a._k", "pkg/n.py:1 pkg.m._y", "pkg/n.py:3 pkg.m._y", "pkg/p.py:1 pkg.m._y",
        "tests/pkg/test_y.py:1 low.a._k"]


def test_test_module_basenames_are_unique():
    """tests/ has no __init__.py files, so pytest imports each test module by its basename: two test files with
    one name in different folders fail at collection ("import file mismatch")."""
    names = [p.name for p in (ROOT / "tests").rglob("*.py") if p.name != "conftest.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
