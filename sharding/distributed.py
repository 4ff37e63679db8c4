"""Multi-process start-up: `maybe_initialize_distributed`, called once, before any other JAX call.

One JAX program spans every host; each host runs one process that sees its local accelerators, and
`jax.distributed.initialize` joins them so `jax.devices()` lists the global devices (process-major order,
which `sharding/mesh.py` slices into the actor and rollout meshes). Where the settings come from, first match
wins (flags override environment variables one by one):

1. flags `--coordinator HOST:PORT --num-processes N --process-id I` (`add_distributed_args`), else the
   environment variables
     JAX_COORDINATOR_ADDRESS  HOST:PORT of process 0's coordinator service (jax reads it too),
     JAX_NUM_PROCESSES        total number of processes N,
     JAX_PROCESS_ID           this process's index in [0, N).
   N == 1 is a single-process run (no-op). N > 1 needs a coordinator and a process id.
2. a cluster launcher: SLURM (`SLURM_NTASKS` > 1 inside a job, i.e. `srun`) or Open MPI
   (`OMPI_COMM_WORLD_SIZE` > 1, i.e. `mpirun`): jax's own cluster detection fills the process settings in (a
   coordinator from 1. is still passed on).
3. nothing: single process, nothing is initialised (`DistributedInfo(process_count=1, source="single")`).

The coordination service (the job's key-value store and heartbeat monitor) does not live in process 0, where
`jax.distributed.initialize` would start it, but in a sidecar process that process 0 starts and that does nothing
else (`sharding/coordination.py`, its lifetime rules there): a SIGKILL of process 0 then leaves the store to the
survivors, which report its death in one line (`sharding.mpmd`), instead of aborting them all in jaxlib C++.
Process 0 connects as a client only (`_connect_client`, mirroring jax's `State.initialize` without the service:
jax 0.10.2 has no public switch for that; `tests/sharding/test_coordination.py` fails loudly if jax changes what
it mirrors); every other process calls `jax.distributed.initialize` as before. A SLURM / Open MPI job gets its
settings from jax's cluster detection first, so that the sidecar starts on the process whose id is 0. At a normal
exit process 0 runs jax's shutdown barrier (`jax.distributed.shutdown()`) and then stops its sidecar.

It must run before anything touches the XLA backend (`jax.devices()`, creating an array, jit); if the
backend already exists and a multi-process run is requested it raises `DistributedInitError` instead of
jax's later, vaguer failure. `local_device_ids` (flag `--local-device-ids 0,1`) restricts the accelerators
a process uses (jax also sets the ROCm/CUDA visible devices from it).

CPU recipe for tests (measured in docs/jax-stack.md §8): `cpu_devices_per_process=4` sets
`jax_num_cpu_devices` and, for multi-process runs, `jax_cpu_collectives_implementation=gloo`, so two
processes on one machine make one 8-device global mesh. Do not also force
`--xla_force_host_platform_device_count` in XLA_FLAGS.

Source: jax docs "Multi-host and multi-process environments" and `jax.distributed.initialize`'s docstring.
Tests: `.venv/bin/python -m pytest -q tests/sharding/test_distributed.py`.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import inspect
import logging
import math
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax._src import clusters  # private: SLURM / Open MPI detection, to know which process starts the sidecar
from jax._src import distributed as jd  # private: the process id / coordinator jax.distributed was started with
from jax._src import xla_bridge  # private: whether the backends have started
from jax._src.lib import _jax  # private: process 0's client-only connection (`_connect_client`)

from sharding.coordination import GRACE_MARGIN_S, Sidecar, start_sidecar
from sharding.mpmd import LIVENESS_S, configure_transfer, transfer_socket_address

log = logging.getLogger("dsv4rl")

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


class DistributedInitError(ValueError):
    """Bad or conflicting distributed settings, or initialisation requested too late (a user error: one line)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedInfo:
    """What `maybe_initialize_distributed` did. `source`: "flags", "env", "slurm", "ompi" or "single"."""

    process_id: int
    process_count: int
    coordinator: str | None
    source: str

    @property
    def is_multiprocess(self) -> bool:
        return self.process_count > 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Settings:
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "flags" | "env" | "slurm" | "ompi" | "single"


def check_coordinator(address: str) -> str:
    """Return `address` if it is HOST:PORT (`[ipv6]:PORT` allowed, port 1-65535); else DistributedInitError."""
    m = _HOST_PORT.match(address.strip())
    if not m or not 1 <= int(m.group(1)) <= 65535:
        raise DistributedInitError(f"coordinator {address!r} is not HOST:PORT (e.g. 10.0.0.1:12355)")
    return address.strip()


def _int_setting(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedInitError(f"{name} must be an integer, got {value!r}") from None


def _cluster_size(env: Mapping[str, str]) -> tuple[str, int] | None:
    """("slurm"|"ompi", size) when a launcher started more than one task, else None."""
    if "SLURM_JOB_ID" in env and (_int_setting(env.get("SLURM_NTASKS"), "SLURM_NTASKS") or 1) > 1:
        return "slurm", int(env["SLURM_NTASKS"])
    if (_int_setting(env.get("OMPI_COMM_WORLD_SIZE"), "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "ompi", int(env["OMPI_COMM_WORLD_SIZE"])
    return None


def resolve_settings(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, env: Mapping[str, str] | None = None) -> _Settings:
    """Decide what to do from flags and `env` (default `os.environ`) without touching jax (rules in the
    module docstring). Raises DistributedInitError for invalid or incomplete settings."""
    env = os.environ if env is None else env
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    coordinator = coordinator if coordinator is not None else (env.get(ENV_COORDINATOR) or None)
    n = num_processes if num_processes is not None else _int_setting(env.get(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _int_setting(env.get(ENV_PROCESS_ID), ENV_PROCESS_ID)
    source = "flags" if explicit else "env"
    if coordinator is not None:
        coordinator = check_coordinator(coordinator)
    if n is not None:
        if n < 1:
            raise DistributedInitError(f"num_processes must be >= 1, got {n}")
        if pid is not None and not 0 <= pid < n:
            raise DistributedInitError(f"process_id {pid} is not in [0, {n}) for num_processes={n}")
        if n == 1:
            return _Settings(coordinator=coordinator, num_processes=1, process_id=0, source="single")
        if coordinator is None:
            raise DistributedInitError(f"num_processes={n} needs a coordinator: pass --coordinator HOST:PORT "
                                       f"or set {ENV_COORDINATOR}")
        if pid is None:
            raise DistributedInitError(f"num_processes={n} needs this process's id: pass --process-id I "
                                       f"or set {ENV_PROCESS_ID}")
        return _Settings(coordinator=coordinator, num_processes=n, process_id=pid, source=source)
    if pid is not None:
        raise DistributedInitError(f"process_id {pid} given without num_processes (--num-processes or "
                                   f"{ENV_NUM_PROCESSES})")
    cluster = _cluster_size(env)
    if cluster is not None:
        return _Settings(coordinator=coordinator, num_processes=None, process_id=None, source=cluster[0])
    if coordinator is not None:
        raise DistributedInitError(f"coordinator {coordinator!r} given but the process count is unknown: pass "
                                   f"--num-processes N (or set {ENV_NUM_PROCESSES}), or launch with srun/mpirun")
    return _Settings(coordinator=None, num_processes=1, process_id=0, source="single")


def _backend_initialized() -> bool:
    try:  # private, but the only way to ask without initialising it
        return bool(xla_bridge.backends_are_initialized())
    except AttributeError:  # API moved: let jax.distributed.initialize complain itself
        return False


def maybe_initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
                                 *, cpu_devices_per_process: int | None = None,
                                 initialization_timeout: int = 300, transfer_address: str | None = None,
                                 transfer_timeout_s: float | None = None, transfers: bool = True,
                                 heartbeat_timeout_s: float | None = None) -> DistributedInfo:
    """Join the processes of a multi-process run, or do nothing on a single process.

    Args:
      coordinator, num_processes, process_id: as the flags / env vars in the module docstring.
      local_device_ids: accelerator ids this process uses (default: all it sees).
      cpu_devices_per_process: CPU-only runs/tests: this many CPU devices per process (+ gloo collectives).
      initialization_timeout: seconds to wait for all processes to reach the coordinator.
      transfer_address: HOST:PORT this process serves cross-process device transfers on (multi-process runs;
        default: the address towards the coordinator, port = coordinator port + 1 + process id;
        `sharding.mpmd.configure_transfer`). transfer_timeout_s: jax's cross-host transfer timeout.
      transfers: False skips the transfer setup (a colocated mesh never moves arrays between processes).
      heartbeat_timeout_s: jax's coordination heartbeat timeout (seconds; None: jax's default, 100). A process
        silent for it is declared dead by the service, which then ends every other process with a C++ abort (no
        project line): `heartbeat_timeout(push_timeout)` keeps it behind the project's own detection.
    Returns:
      DistributedInfo(process_id, process_count, coordinator, source).
    Raises:
      DistributedInitError: invalid settings (coordinator not HOST:PORT, process_id outside [0, N), ...),
        or a multi-process run requested after the JAX backend was already initialised.
      sharding.coordination.SidecarError: process 0 could not start the coordination service on the coordinator's
        port (in use?).
    """
    settings = resolve_settings(coordinator, num_processes, process_id)
    multi = settings.source != "single"
    if _backend_initialized() and (multi or cpu_devices_per_process is not None):
        raise DistributedInitError(
            "maybe_initialize_distributed must run before any JAX call that initialises the backend "
            "(jax.devices(), array creation, jit); it was called after, with "
            + (f"a {settings.source} multi-process setup" if multi else f"cpu_devices_per_process="
               f"{cpu_devices_per_process}"))
    if cpu_devices_per_process is not None:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices_per_process))
        if multi:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not multi:
        return DistributedInfo(process_id=0, process_count=1, coordinator=settings.coordinator, source="single")
    if transfers and settings.process_id is not None and (settings.coordinator or transfer_address):
        # before the join: a refused process holds up no other
        check_bindable(transfer_socket_address(settings.coordinator or "", settings.process_id, transfer_address),
                       settings.process_id)
    _join(settings, local_device_ids, initialization_timeout, heartbeat_timeout_s)
    if transfers:
        _configure_transfer(settings.coordinator, transfer_address, transfer_timeout_s)
    return DistributedInfo(process_id=jax.process_index(), process_count=jax.process_count(),
                           coordinator=settings.coordinator or os.environ.get(ENV_COORDINATOR),
                           source=settings.source)


SHUTDOWN_TIMEOUT_S = 300  # jax's shutdown barrier, at most (seconds; jax.distributed.initialize's default)


def _jax_default(name: str) -> int:
    """A default of `jax.distributed.initialize` (its signature is public)."""
    return int(inspect.signature(jax.distributed.initialize).parameters[name].default)


def _join(settings: _Settings, local_device_ids: Sequence[int] | None, initialization_timeout: int,
          heartbeat_timeout_s: float | None) -> Sidecar | None:
    """Join the job (module docstring): process 0 starts the coordination sidecar and connects as a client only;
    the others call `jax.distributed.initialize`. Returns process 0's Sidecar (stopped at exit), else None.
    Raises sharding.coordination.SidecarError when the sidecar cannot listen on the coordinator's port."""
    coordinator, n, pid = settings.coordinator, settings.num_processes, settings.process_id
    local = list(local_device_ids) if local_device_ids is not None else None
    if settings.source in ("slurm", "ompi"):  # jax's own detection, now rather than inside initialize
        coordinator, n, pid, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            coordinator, n, pid, local, None, initialization_timeout)
    beat = int(math.ceil(heartbeat_timeout_s)) if heartbeat_timeout_s is not None else \
        _jax_default("heartbeat_timeout_seconds")
    if pid != 0:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid,
                                   local_device_ids=local, initialization_timeout=initialization_timeout,
                                   heartbeat_timeout_seconds=beat, shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
        return None
    # where jax would bind its in-process service: JAX_COORDINATOR_BIND_ADDRESS, else every address, same port
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or "[::]:" + coordinator.rsplit(":", 1)[1]
    sidecar = start_sidecar(bind, n, heartbeat_timeout_s=beat, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
                            grace=sidecar_grace_s(beat))
    log.info("coordination service on %s in sidecar process %d (sharding/coordination.py)", bind, sidecar.pid)
    atexit.register(_end_cleanly, sidecar)  # before HostChannel's (sharding/mpmd.py), so it runs after it
    _connect_client(coordinator, n, local, initialization_timeout, beat)
    return sidecar


# What `_connect_client` sets on jax's State, as State.initialize does (the service aside); a test compares it with
# the assignments in jax's source, so a jax that sets something new fails loudly instead of half-initialising.
STATE_FIELDS = ("client", "coordinator_address", "num_processes", "partition_index", "process_id", "service")


def _connect_client(coordinator: str, num_processes: int, local_device_ids: Sequence[int] | None,
                    initialization_timeout: int, heartbeat_timeout: int) -> None:
    """Process 0 as a client only: jax's `State.initialize` (jax/_src/distributed.py, 0.10.2) without starting the
    coordination service (the sidecar serves it). Private use, kept here alone: jax has no public way to do it."""
    st = jd.global_state
    if st.client is not None or st.service is not None:
        raise DistributedInitError("jax.distributed is initialised already (maybe_initialize_distributed runs once)")
    if local_device_ids:
        visible = ",".join(str(x) for x in local_device_ids)
        jax.config.update("jax_cuda_visible_devices", visible)
        jax.config.update("jax_rocm_visible_devices", visible)
    st.coordinator_address, st.process_id, st.num_processes, st.service = coordinator, 0, num_processes, None
    st.client = _jax.get_distributed_runtime_client(coordinator, 0, init_timeout=initialization_timeout,
                                                    use_compression=True, heartbeat_timeout=heartbeat_timeout)
    st.client.connect()
    st.initialize_preemption_sync_manager()
    index = os.environ.get("JAX_PARTITION_INDEX")
    st.partition_index = int(index) if index is not None else None


def _end_cleanly(sidecar: Sidecar) -> None:
    """Process 0's normal exit (atexit): jax's shutdown barrier (every process has arrived), then the sidecar's
    clean end (sharding/coordination.py rule 1). An exit that skips this (os._exit, a signal) leaves the sidecar
    serving for its grace only."""
    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - a failed barrier: the sidecar must end all the same
        pass
    sidecar.stop()


def sidecar_grace_s(heartbeat_timeout_s: float) -> float:
    """Seconds process 0's coordination sidecar keeps serving after process 0 died or exited on a failure
    (sharding/coordination.py rule 2): the survivors' own detection of a dead process (the project's heartbeats,
    `sharding.mpmd.LIVENESS_S` at most, or a failure posted in the store, read within a second) + `GRACE_MARGIN_S`,
    and never more than jax's heartbeat timeout + the margin: 30 s at the defaults, so no sidecar outlives its run
    by minutes (issue 42)."""
    return min(LIVENESS_S, float(heartbeat_timeout_s)) + GRACE_MARGIN_S


JAX_HEARTBEAT_MARGIN_S = 30.0  # after --push-timeout: our wait's poll (<= 2 s) + report_failure's grace (5 s) + slack


def heartbeat_timeout(push_timeout_s: float) -> float:
    """jax's heartbeat timeout for an MPMD run (seconds): `--push-timeout` + `JAX_HEARTBEAT_MARGIN_S`, so that a dead
    process is first found by the project's heartbeats (sharding/mpmd.py: one line naming its side, the others told
    through the key-value store) and never by jax's (a C++ "Check failure" abort of every other process). jax's
    default (100 s) was shorter than the default --push-timeout (600 s): the abort came first (issue 23)."""
    return float(push_timeout_s) + JAX_HEARTBEAT_MARGIN_S


def _configure_transfer(coordinator: str | None, address: str | None, timeout_s: float | None) -> None:
    """Cross-process device_put (an MPMD rollout on its own processes) needs jax's socket-transfer flags before the
    backend starts; set them for every multi-process run (sharding/mpmd.py)."""
    coordinator = (coordinator or os.environ.get(ENV_COORDINATOR)
                   or getattr(jd.global_state, "coordinator_address", None))
    if address is None and not coordinator:
        return
    if address is not None:
        check_coordinator(address)
    configure_transfer(transfer_socket_address(coordinator or "", jd.global_state.process_id, address), timeout_s)


def check_bindable(address: str, process_id: int) -> None:
    """Raise DistributedInitError (one line) unless this host can listen on `address` (HOST:PORT), the socket jax
    binds for cross-process transfers at the first one: in use (the default port is the coordinator's + 1 + process
    id) or not an address of this host would otherwise surface as a `bind` error in the middle of a weight push."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as e:
            raise DistributedInitError(f"process {process_id} cannot listen on its transfer address {address} "
                                       f"({e.strerror or e}): pass --transfer-address HOST:PORT, a free port of this "
                                       "host (default: the coordinator's port + 1 + process id)") from None


def _device_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--local-device-ids must be a comma list of integers, got {text!r}")


def add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--coordinator`, `--num-processes`, `--process-id`, `--local-device-ids`,
    `--cpu-devices-per-process` (all default None: fall back to env / cluster detection). Returns `parser`."""
    group = parser.add_argument_group("distributed (else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
                                      "JAX_PROCESS_ID, else SLURM / Open MPI detection)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's coordinator address")
    group.add_argument("--num-processes", type=int, default=None, metavar="N", help="total processes")
    group.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, in [0, N)")
    group.add_argument("--local-device-ids", type=_device_ids, default=None, metavar="0,1,...",
                       help="accelerators this process uses")
    group.add_argument("--transfer-address", default=None, metavar="HOST:PORT",
                       help="this process's socket for cross-process weight transfers (MPMD rollout); default: the "
                            "address towards the coordinator, port = coordinator port + 1 + process id")
    group.add_argument("--cpu-devices-per-process", type=int, default=None, metavar="K",
                       help="CPU devices per process (CPU runs and tests)")
    return parser


def initialize_from_args(args: argparse.Namespace, transfer_timeout_s: float | None = None,
                         transfers: bool = True) -> DistributedInfo:
    """`maybe_initialize_distributed` with the values parsed from `add_distributed_args`' flags. A run that may be
    MPMD (`transfers`: a rollout mesh of its own) gets jax's heartbeat timeout from `transfer_timeout_s`
    (--push-timeout: `heartbeat_timeout`)."""
    beat = heartbeat_timeout(transfer_timeout_s) if transfers and transfer_timeout_s is not None else None
    return maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                        args.local_device_ids, cpu_devices_per_process=args.cpu_devices_per_process,
                                        transfer_address=getattr(args, "transfer_address", None),
                                        transfer_timeout_s=transfer_timeout_s, transfers=transfers,
                                        heartbeat_timeout_s=beat)
