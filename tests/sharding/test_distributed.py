"""Tests for sharding/distributed.py: setting resolution (flags > env > SLURM/Open MPI > single), validation
messages, the too-late guard, and a real 2-process x 4-CPU-device (gloo) sharded DeepSeek-V4 tiny forward with
the EP dispatch whose logits equal the same forward on the 8 in-process devices (tests/sharding/dist_worker.py)."""

import argparse
import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import portpicker
import pytest

from sharding import distributed as dist
from sharding.mesh import build_mesh_plan

WORKER = pathlib.Path(__file__).with_name("dist_worker.py")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _resolve(env=None, **kw):
    return dist.resolve_settings(env=env or {}, **kw)


def test_single_process_by_default():
    s = _resolve()
    assert (s.source, s.num_processes, s.process_id) == ("single", 1, 0)
    assert _resolve(num_processes=1).source == "single"


def test_flags_then_env():
    s = _resolve(coordinator="10.0.0.1:1234", num_processes=4, process_id=3)
    assert (s.source, s.coordinator, s.num_processes, s.process_id) == ("flags", "10.0.0.1:1234", 4, 3)
    env = {"JAX_COORDINATOR_ADDRESS": "node0:5000", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    s = _resolve(env=env)
    assert (s.source, s.coordinator, s.num_processes, s.process_id) == ("env", "node0:5000", 2, 1)
    s = _resolve(env=env, process_id=0)  # a flag overrides its env var only
    assert (s.source, s.coordinator, s.num_processes, s.process_id) == ("flags", "node0:5000", 2, 0)
    assert _resolve(coordinator="[::1]:99", num_processes=2, process_id=0).coordinator == "[::1]:99"


def test_cluster_detection():
    assert _resolve(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}).source == "slurm"
    assert _resolve(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).source == "single"
    assert _resolve(env={"OMPI_COMM_WORLD_SIZE": "2"}).source == "ompi"
    s = _resolve(env={"OMPI_COMM_WORLD_SIZE": "2", "JAX_COORDINATOR_ADDRESS": "h:1"})
    assert (s.source, s.coordinator, s.num_processes) == ("ompi", "h:1", None)


@pytest.mark.parametrize("kw, env, msg", [
    (dict(coordinator="nohost", num_processes=2, process_id=0), {}, "coordinator 'nohost' is not HOST:PORT"),
    (dict(coordinator="h:99999", num_processes=2, process_id=0), {}, "is not HOST:PORT"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), {}, "process_id 2 is not in [0, 2)"),
    (dict(coordinator="h:1", num_processes=2, process_id=-1), {}, "process_id -1 is not in [0, 2)"),
    (dict(num_processes=0), {}, "num_processes must be >= 1"),
    (dict(num_processes=2, process_id=0), {}, "needs a coordinator"),
    (dict(coordinator="h:1", num_processes=2), {}, "needs this process's id"),
    (dict(process_id=1), {}, "given without num_processes"),
    (dict(coordinator="h:1"), {}, "the process count is unknown"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer, got 'two'"),
])
def test_invalid_settings(kw, env, msg):
    with pytest.raises(dist.DistributedInitError) as e:
        _resolve(env=env, **kw)
    assert msg in str(e.value)


def test_too_late_after_backend_init(monkeypatch):
    jax.devices()  # the test process's backend exists
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(dist.DistributedInitError, match="must run before any JAX call"):
        dist.maybe_initialize_distributed("127.0.0.1:1", num_processes=2, process_id=0)
    # a single-process call stays a no-op
    info = dist.maybe_initialize_distributed()
    assert (info.process_count, info.process_id, info.source) == (1, 0, "single")


def test_argparse_flags():
    parser = dist.add_distributed_args(argparse.ArgumentParser())
    args = parser.parse_args(["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1",
                              "--local-device-ids", "0,1", "--cpu-devices-per-process", "4"])
    assert (args.coordinator, args.num_processes, args.process_id, args.local_device_ids,
            args.cpu_devices_per_process) == ("h:1", 2, 1, [0, 1], 4)
    args = parser.parse_args([])
    assert args.coordinator is None and args.num_processes is None and args.local_device_ids is None


def _load_worker():
    spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_processes_match_single_process(tmp_path):
    port = portpicker.pick_unused_port()
    out = tmp_path / "result.npy"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    # no forced 8 devices in the workers; the suite's compile options
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ["DSV4RL_TEST_XLA_FLAGS"], PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), "--cpu-devices-per-process", "4", "--out", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    deadline = time.monotonic() + 240  # two concurrent model compiles on two shared cores
    logs = []
    try:
        # the in-process reference (8 devices) compiles while the workers run: three compiles share two cores
        worker = _load_worker()
        expected = np.asarray(worker.compute(build_mesh_plan(worker.MESH_SPEC).actor))
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        pytest.fail("workers timed out after 240 s:\n" + "\n----\n".join(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(logs)
    assert "local devices 4, global 8" in logs[0]

    got = np.load(out)
    assert got.shape == expected.shape == (worker.B, worker.S, worker.CFG.vocab_size)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_transfer_address_in_use_is_one_line_before_the_join():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        said = rf"process 1 cannot listen on its transfer address {address} \(Address already in use\): pass --transfer"
        with pytest.raises(dist.DistributedInitError, match=said):
            dist.check_bindable(address, 1)
    dist.check_bindable(address, 1)  # free again
