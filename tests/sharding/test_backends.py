"""sharding/backends.py: a CPU machine carrying the CUDA plugin for deviceless compiles (`make` installs the
gpu-aot extra) starts JAX without the plugin's cuDNN traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from sharding import backends


def test_skips_the_cuda_check_only_without_a_driver(monkeypatch):
    monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # an explicit platform: left alone
    assert backends.quiet_cuda_plugin_without_driver() is False
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(backends, "_has_cuda_plugin", lambda: True)
    monkeypatch.setattr(backends.glob, "glob", lambda pattern: ["/dev/nvidia0"])  # a driver: left alone
    assert backends.quiet_cuda_plugin_without_driver() is False
    assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ
    monkeypatch.setattr(backends.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(backends.ctypes.util, "find_library", lambda name: None)
    assert backends.quiet_cuda_plugin_without_driver() is True
    assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
    monkeypatch.setattr(backends, "_has_cuda_plugin", lambda: False)  # no plugin: nothing to quiet
    monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    assert backends.quiet_cuda_plugin_without_driver() is False


def test_backend_start_prints_no_traceback():
    """JAX_PLATFORMS unset, as in `make run`: JAX starts on this machine's CPU with nothing on stderr but warnings
    of one line (with the plugin installed, the version check's traceback is what this guards against)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    out = subprocess.run([sys.executable, "-c", "import sharding, jax; print(jax.default_backend())"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stdout.strip() in ("cpu", "gpu", "cuda", "rocm", "tpu")
