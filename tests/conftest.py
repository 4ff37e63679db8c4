"""Test setup: 8 forced host devices (so meshes, EP and cross-mesh pushes are real), fp32 matmuls, seeds.

XLA_FLAGS must be set before jax is imported anywhere, hence at the top of conftest.
"""
import os
import tempfile

# The XLA:CPU compile options of the whole suite: the in-process tests and every process a test starts (which read
# $DSV4RL_TEST_XLA_FLAGS; their device count is their own). Tests are compile-bound, and both options compile the
# same HLO faster: optimisation level 0 of the CPU backend (~2.5x), and the LLVM-IR fusion emitters instead of the
# MLIR ones, which build and run a pass pipeline per fusion (measured on tests/rl/test_learner.py's GRPO-steps test:
# its 100 programs compile in 6.5 s instead of 12.0 s), and one LLVM module per program instead of several compiled
# on threads (`parallel_codegen_split_count`: the split modules repeat work; the suite's two workers keep both cores
# busy anyway; measured: a cold tiny 2-step `launch/run.py` job 59.3 -> 54.3 s of CPU, tests/rl/test_sampler.py's
# FP8-vs-BF16 test 26.6 -> 20.8 s). None is a flag of the project's own runs.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")
os.environ["DSV4RL_TEST_XLA_FLAGS"] = TEST_XLA_FLAGS
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
                           + TEST_XLA_FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compile cache for the session, shared by the pytest-xdist workers: tests that build the same tiny
# programs in new jit wrappers (a Sampler, a Learner, a push per test) load them instead of compiling them again.
# Loading an executable changes no number, and memory_analysis() reads the same figures from it.
# $DSV4RL_TEST_JAX_CACHE keeps it between sessions.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ.get("DSV4RL_TEST_JAX_CACHE") or os.path.join(
    tempfile.gettempdir(), "dsv4rl-jax-cache-" + os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def shared_dir():
    """The read-only ../shared folder beside the checkout; tests that need it skip where it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (it exists only beside the development checkout)")
    return SHARED


def pytest_collection_modifyitems(config, items):
    """Test files with slow (multi-process, 1-3 min each) tests run first: `make test` hands whole files to two
    pytest-xdist workers in this order (`--dist loadfile --no-loadscope-reorder`), so the long files start early
    and the many short ones fill the end, instead of one long launched job running alone at the end (measured:
    the async MPMD kill/resume test, 173 s, was the last to start). Order inside a file is kept."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: collection order otherwise
