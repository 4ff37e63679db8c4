"""benchmarks/gpu_check.sh (the GPU benchmark run) and its new benchmark, cheaply.

The script's own logic runs with a stub interpreter (`PYTHON=`) that prints a RESULT line per benchmark, so the
results file, the failure lines, the budget skip and the exit status are checked in a second; the FP8 matmul
benchmark runs for real at n = 128 on CPU. The full smoke run (`GPU_CHECK_SMOKE=1 benchmarks/gpu_check.sh`, every
benchmark at tiny sizes) takes minutes on the 2-core machine and is in benchmarks/README.md instead.
"""

import os
import pathlib
import stat
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
NAMES = ("fp8_matmul", "fp8_experts", "sampler", "learner_mfu", "weight_push", "rollout_lengths", "sampler_memory")


def _stub(tmp_path, fail: str) -> pathlib.Path:
    """A fake interpreter: prints `RESULT script=<benchmark file>` and exits 0, except for `fail` (exit 3)."""
    stub = tmp_path / "fakepython"
    stub.write_text("#!/usr/bin/env bash\n"
                    f'case "$1" in *{fail}*) echo "boom: $*"; exit 3;; esac\n'
                    'echo "some log line"\necho "RESULT script=$(basename "$1") nargs=$#"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return stub


def _run(tmp_path, stub, **env):
    out = tmp_path / "res" / "gpu_results.txt"
    full = {**os.environ, "PYTHON": str(stub), "GPU_CHECK_OUT": str(out), **env}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=60)
    return proc, out.read_text()


def test_gpu_check_writes_every_result_line_and_counts_failures(tmp_path):
    proc, text = _run(tmp_path, _stub(tmp_path, "weight_push"), GPU_CHECK_SMOKE="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one benchmark without a RESULT line
    lines = [ln for ln in text.splitlines() if not ln.startswith(("#", "    "))]
    by_name = {ln.split()[0]: ln for ln in lines}
    assert set(by_name) == set(NAMES), text
    for name in NAMES:
        if name == "weight_push":
            assert by_name[name].startswith("weight_push FAILED rc=3"), text
            assert "boom" in text  # the failed run's last log lines are kept
        else:
            assert by_name[name].startswith(f"{name} RESULT script="), text
    assert "== summary" in proc.stdout and "sampler_memory RESULT" in proc.stdout
    assert (tmp_path / "res" / "gpu_check_logs" / "sampler.log").exists()


def test_gpu_check_skips_what_the_budget_cannot_fit(tmp_path):
    proc, text = _run(tmp_path, _stub(tmp_path, "nothing"), GPU_CHECK_BUDGET_S="100", JAX_PLATFORMS="cpu")
    # full sizes, 100 s budget: the 60 s matmul runs, the 150 s sampler is skipped, ...
    assert "fp8_matmul RESULT script=fp8_matmul.py" in text
    assert "sampler SKIPPED" in text
    assert proc.returncode == sum(ln.split()[1] == "SKIPPED" for ln in text.splitlines() if not ln.startswith("#"))


def test_fp8_matmul_benchmark_runs_on_cpu():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_matmul.py"), "--sizes", "128", "--iters",
                           "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert last.startswith("RESULT ") and set(fields) == {"fp8_tflops", "bf16_tflops", "ratio", "fp8_linear_tflops",
                                                         "n", "backend"}
    assert float(fields["bf16_tflops"]) > 0 and float(fields["fp8_tflops"]) > 0 and fields["backend"] == "cpu"
