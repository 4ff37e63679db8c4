"""Executes notebooks/quickstart.ipynb top to bottom in a fresh kernel and checks its results.

The kernel is this interpreter (`sys.executable`, i.e. the venv's python): a throw-away kernel spec naming it is
written under `tmp_path` and put first on JUPYTER_PATH, so a user-level `python3` spec pointing at another python
cannot be picked up. The kernel runs with matplotlib's Agg backend, without the 8 forced host devices of
tests/conftest.py (the notebook is a single-device program, as for a user), on CPU.

Takes about 1-3 minutes on 2 CPU cores (mostly XLA compiling the sampler and the learner once).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
KERNEL = "dsv4rl-test"


def _kernel_spec(root: pathlib.Path) -> pathlib.Path:
    d = root / "kernels" / KERNEL
    d.mkdir(parents=True)
    (d / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dsv4-rl test", "language": "python"}))
    return root


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "clear the notebook's outputs before committing"


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(_kernel_spec(tmp_path / "jupyter")),
                                                                     os.environ.get("JUPYTER_PATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", os.environ["DSV4RL_TEST_XLA_FLAGS"])  # the suite's compile options, 1 device
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=600, allow_errors=False,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError (with the cell and traceback) if any cell fails

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"cell errored: {out.get('ename')}: {out.get('evalue')}"

    last = nb.cells[-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, f"the last cell printed no JSON line: {text!r}"
    res = json.loads(lines[-1])

    assert os.path.realpath(res["python"]) == os.path.realpath(sys.executable)
    curve = res["reward_curve"]
    assert len(curve) == 15
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in curve), curve
    assert math.isfinite(res["greedy_eval_reward"]) and 0.0 <= res["greedy_eval_reward"] <= 1.0
    assert math.isfinite(res["steady_step_s"]) and res["steady_step_s"] > 0
    assert res["sampler_compilations"] == 1  # every rollout and the greedy eval reuse one compiled program
    # the plot cell drew a figure (Agg backend: no image output, but no error either) and the rest printed text
    assert any(o.output_type == "stream" for c in nb.cells if c.cell_type == "code" for o in c.outputs)
