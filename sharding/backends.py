"""Backend start-up on machines that carry the CUDA plugin only for deviceless compiles.

The `gpu-aot` extra (installed by `make`) adds the CUDA PJRT plugin without the CUDA libraries: the planner's
deviceless XLA:GPU compiles need nothing more (launch/gpu_target.py). But at backend start-up, with JAX_PLATFORMS
unset, the plugin checks the cuDNN / cuBLAS versions and, finding no library, prints a 20-line traceback ("Unable to
load cuDNN") before JAX falls back to CPU: on every `make run` of a CPU machine. With no NVIDIA driver there is no
GPU whose libraries could mismatch, so `quiet_cuda_plugin_without_driver` skips that check there (JAX's own
`JAX_SKIP_CUDA_CONSTRAINTS_CHECK`); the CUDA backend then fails to start silently and JAX runs on CPU as before.
A machine with a driver, or an explicit JAX_PLATFORMS, is left alone.
"""

from __future__ import annotations

import ctypes.util
import glob
import importlib.util
import os


def quiet_cuda_plugin_without_driver() -> bool:
    """Sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 when the CUDA plugin is installed, JAX_PLATFORMS is unset and the
    machine has no NVIDIA driver (no /dev/nvidia*, no libcuda). Returns whether it did. Call before JAX starts a
    backend (importing jax starts none)."""
    if "JAX_PLATFORMS" in os.environ or "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ:
        return False
    if importlib.util.find_spec("jax_plugins") is None or not _has_cuda_plugin():
        return False
    if glob.glob("/dev/nvidia*") or ctypes.util.find_library("cuda"):
        return False
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return True


def _has_cuda_plugin() -> bool:
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
    except (ImportError, ValueError):
        return False
