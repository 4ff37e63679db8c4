"""Ray placement of the two-job layout: `python launch/run.py --launcher ray [--ray-address ADDR] ...run flags...`.

    ray start --head --port 6379                                   # node 0 (then `ray start --address node0:6379`
    python launch/run.py --launcher ray --ray-address auto ...     #   on the other nodes), or no --ray-address: a
                                                                   #   local cluster started (and stopped) here

The launcher starts the actor job and the rollout job of the two-job layout (rl/rollout/two_job.py) as Ray actors and
waits for the actor job; its exit status and one-line error are the launcher's. Placement: one placement group per
process, one bundle per device ({"GPU": 1, "CPU": 1} on a cluster with GPUs, {"CPU": 1} per CPU device otherwise),
strategy STRICT_PACK (a process's devices on one node). A process holds a node's worth of devices, so on nodes of
that many devices each group fills a node of its own: the seed layout `actor:fsdp=2,expert=8/rollout:expert=8` on
3 nodes x 8 GPUs = the actor job on nodes 0-1 (two processes of 8 bundles), the rollout job on node 2 (8 bundles).
Node numbers are Ray's choice; the launcher logs where each process landed. Devices per process = the rollout
mesh's size (the rollout job is one process); the actor job takes actor size / that many processes (one
`jax.distributed` job over them: rl/rollout/two_job.py, its process 0 talks to the rollout, every process serves its
shards of the weights).

Each process of a job is a Ray actor (`JobProcess`) that runs `launch/run.py` with the run's flags plus its side's
(`--rollout-address` / `--rollout-job --actor-address`, and `--coordinator --num-processes --process-id` for an actor
job of several processes) as a child process that dies with it (Linux PR_SET_PDEATHSIG), its output forwarded line by
line to the driver (Ray's log forwarding). The rollout's Ray actor has `max_restarts=-1`: when it dies (its node, a
`ray.kill(no_restart=False)`, a SIGKILL of its pid) or its run.py exits non-zero (but 2: bad input), Ray starts
it again, the new rollout job registers and the actor job recovers in place (rl/rollout/two_job.py: served weights
pulled, in-flight requests regenerated under the same sample ids; `rollout/restarts`, `rollout/recovery_s`). Ray
restarts without a limit of its own: the actor job's crash-loop policy (`MAX_RESTARTS` within `RESTART_WINDOW_S`)
and `--rollout-restart-timeout` are the one policy that ends a run. The actor job's Ray actor is not restarted: its
death ends the run, which resumes from its checkpoint with the same command (as in the other layouts).
Stopping (issue 42): SIGTERM or Ctrl-C to the launcher reaches the actor job as a plain run gets them (the
`SignalRelay`: the step finishes, is saved, exit 0 for SIGTERM, 130 for Ctrl-C; a second signal makes it exit at
once, the newest complete checkpoint kept); the jobs run in process groups of their own, so a terminal's Ctrl-C
reaches them once, through the launcher. Whatever ends the launcher, its Ray actors are killed (their run.py with
them) and a local cluster it started is stopped. `--ray-address HOST:PORT` is probed (name, TCP connect) before
`ray.init`, which would retry an unreachable GCS silently for about two minutes, and `ray.init` runs under a
watchdog: nothing answering within `--ray-connect-timeout` (15 s) is one line, exit 2.
The channel's HMAC key: `$DSV4RL_ROLLOUT_AUTHKEY` if set, else a random one made here (the actor listens on its
node's address, not loopback), given to both jobs through Ray. The driver's JAX_*, XLA_*, DSV4RL_* variables travel
to the jobs; every node needs this checkout at the same path (the jobs run `<repo>/launch/run.py`).

Why not Ray Train's `JaxTrainer` (ray.train.v2.jax, read in ray 2.60): it runs one SPMD worker group, one
`jax.distributed` job whose workers all run the same function, and it fails and restarts the group as a whole
(`FailureConfig`). That fits the actor job alone (one SPMD program over nodes 0-1); the two-job layout is two
independent JAX jobs with different programs and opposite failure policies (the rollout restarts alone while the
actor keeps its state), so a trainer would either couple them into one group (a rollout death restarts the actor)
or need a trainer per job, each with its own driver. It also calls `jax.distributed.initialize` itself, before our
`sharding.distributed` sets the CPU device count and the transfer options. Plain actors in placement groups, as the
seeds did (slime/Miles: a placement group of one bundle per GPU, actor and rollout groups carved from it), keep our
own start-up and give the rollout its own restart policy.

Tests: `.venv/bin/python -m pytest -q tests/launch/test_two_jobs.py` (skips the Ray run without the [ray] extra).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from launch.ray_guard import Interrupted, LaunchError, SignalRelay, connect_watchdog, probe_address
from sharding.job_link import ENV_AUTHKEY
from sharding.mesh import parse_mesh_spec

REPO = pathlib.Path(__file__).resolve().parents[1]
RUN_PY = REPO / "launch" / "run.py"
ENV_PREFIXES = ("JAX_", "XLA_", "DSV4RL_", "TF_CPP_")  # the driver's variables the jobs get
LAUNCHER_FLAGS = ("--launcher", "--ray-address", "--ray-connect-timeout")
CONNECT_TIMEOUT_S = 15.0  # --ray-connect-timeout's default: Ray's own GCS connect retries for ~2 minutes
VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")  # what Ray sets per GPU
SIDE_FLAGS = ("--rollout-address", "--rollout-job", "--actor-address", "--coordinator", "--num-processes",
              "--process-id")


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--launcher {process,ray}` and `--ray-address` (not knobs of the run: they say where its jobs run)."""
    g = parser.add_argument_group("launcher")
    g.add_argument("--launcher", choices=("process", "ray"), default="process",
                   help="process: this process is the job (or one process of it); ray: start the two-job layout's "
                        "actor job and rollout job as Ray actors in placement groups (launch/ray_run.py; the [ray] "
                        "extra)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --launcher ray: a running cluster (auto, HOST:PORT); unset: start a local one for "
                        "this run")
    g.add_argument("--ray-connect-timeout", type=float, default=CONNECT_TIMEOUT_S, metavar="SECONDS",
                   help="with --ray-address: give up (one line, exit 2) when the cluster there does not answer "
                        "within this many seconds (default %(default)s)")
    return parser


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """The processes of the two jobs. `devices`: devices per process (bundles per placement group);
    `actor_processes`: processes of the actor job (the rollout job is one)."""

    devices: int
    actor_processes: int

    @property
    def bundles(self) -> int:
        return self.devices * (self.actor_processes + 1)


def placement(mesh: str) -> Placement:
    """--mesh -> Placement: devices per process = the rollout mesh's size; the actor job its size / that.
    LaunchError (one line naming --mesh) for a mesh without a rollout of its own or an actor it does not divide."""
    if "rollout:" not in mesh:
        raise LaunchError(f"--launcher ray starts the two-job layout: --mesh needs a rollout section of its own "
                          f"(e.g. actor:data=1/rollout:data=1), got {mesh!r}")
    spec = parse_mesh_spec(mesh)
    a, r = spec.size("actor"), spec.size("rollout")
    if a % r:
        raise LaunchError(f"--launcher ray: --mesh {mesh}: the actor's {a} devices are not whole processes of the "
                          f"rollout's {r} (a process holds a node's worth of devices: the rollout job's)")
    return Placement(devices=r, actor_processes=a // r)


def job_argv(argv: list[str]) -> list[str]:
    """The run's flags without the launcher's (`LAUNCHER_FLAGS`, with their values). LaunchError when a side's own
    flag is given (`SIDE_FLAGS`: the launcher sets them)."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if name in SIDE_FLAGS:
            raise LaunchError(f"{name}: --launcher ray sets it for each job (drop it)")
        if name in LAUNCHER_FLAGS:
            i += 1 if "=" in tok else 2
            continue
        out.append(tok)
        i += 1
    return out


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the Ray actor's process dies (Linux PR_SET_PDEATHSIG = 1), and gets
    SIGINT and SIGTERM as a plain run does: Ray starts its processes with SIGINT blocked (a mask the child would
    inherit through exec, so a Ctrl-C passed on would never arrive). Its own process group: a Ctrl-C at the
    terminal reaches the launcher, which passes it on once (`SignalRelay`), not the jobs directly as well (the
    actor job would see two: "interrupted again", no save)."""
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)
        libc.signal.restype = ctypes.c_void_p
        for s in (signal.SIGINT, signal.SIGTERM):  # SIG_DFL: an ignored signal stays ignored through exec
            libc.signal(ctypes.c_int(s), ctypes.c_void_p(0))
    except (OSError, AttributeError):
        pass


class JobProcess:
    """One process of a job as a Ray actor (module docstring): starts `launch/run.py argv` at construction (again
    at each restart: Ray re-runs the constructor), forwards its output, remembers its last `error:` line.

    Args: side: "actor" | "rollout". argv: run.py's arguments. env: variables set for the child (over the worker's).
      restart_on_failure: exit this Ray actor's process when the child exits non-zero, except 2 (bad input: the
        same again), so that Ray restarts it.
    """

    def __init__(self, side: str, argv: list[str], env: dict, restart_on_failure: bool):
        self.side, self.argv, self.env, self.restart = side, list(argv), dict(env), restart_on_failure
        self.error, self.rc = "", None
        self._done = threading.Event()
        self._started = threading.Event()
        self.child_pid = None
        threading.Thread(target=self._run, name=f"dsv4-{side}-job", daemon=True).start()
        self._started.wait(60)

    def _run(self) -> None:
        # this thread lives as long as the child: PR_SET_PDEATHSIG fires when the thread that forked it ends
        env = {k: v for k, v in os.environ.items() if not (k in VISIBLE_DEVICES and not v)}  # Ray's "" for num_gpus=0
        proc = subprocess.Popen([sys.executable, str(RUN_PY), *self.argv], cwd=REPO, env={**env, **self.env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self.child_pid = proc.pid
        print(f"ray: the {self.side} job: Ray actor pid {os.getpid()} on {socket.gethostname()} started "
              f"launch/run.py pid {proc.pid}", flush=True)
        self._started.set()
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("error:"):
                self.error = line
            print(line, flush=True)
        self.rc = proc.wait()
        if self.rc not in (0, 2) and self.restart:  # 2: bad input, which a restart would only repeat
            print(f"ray: the {self.side} job exited {self.rc}: its Ray actor exits for Ray to restart it", flush=True)
            sys.stdout.flush()
            os._exit(1)
        self._done.set()

    def wait(self) -> dict:
        """Block until the child ends -> {"rc", "error" (its last `error:` line or ""), "pid"}."""
        self._done.wait()
        return {"rc": self.rc, "error": self.error, "pid": self.child_pid}

    def send_signal(self, signum: int) -> bool:
        """Send `signum` to the child (`SignalRelay`; needs the actor's max_concurrency > 1, `wait` holds one
        thread) -> whether it was still running."""
        if self.child_pid is None or self.rc is not None:
            return False
        try:
            os.kill(self.child_pid, signum)
        except ProcessLookupError:
            return False
        return True


def node_ip() -> str:
    """This Ray node's address (run inside a Ray worker)."""
    import ray

    return ray.util.get_node_ip_address()


def _free_port_on_node() -> tuple[str, int]:
    """(this node's address, a free TCP port on it): the actor job's --rollout-address, its coordinator."""
    host = node_ip()
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


def _probe() -> dict:
    """Inside a bundle: {"node": address, "env": the visible-accelerator variables Ray set for it}."""
    return {"node": node_ip(), "env": {k: os.environ[k] for k in VISIBLE_DEVICES if os.environ.get(k)}}


def _visible_env(probes: list[dict]) -> dict:
    """The bundles' visible-accelerator variables joined: the child process sees every device of its group."""
    out: dict[str, list[str]] = {}
    for p in probes:
        for k, v in p["env"].items():
            out.setdefault(k, []).extend(x for x in v.split(",") if x)
    return {k: ",".join(v) for k, v in out.items()}


def launch(argv: list[str], mesh: str, address: str | None, log=print,
           connect_timeout: float = CONNECT_TIMEOUT_S) -> int:
    """Run the two-job layout under Ray (module docstring) -> the actor job's exit status (130 / 128 + signal
    when the launcher was interrupted: `SignalRelay`).

    Args: argv: the run's flags (launcher flags included: dropped here). mesh: the resolved --mesh.
      address: --ray-address (None: a local cluster, started and stopped here). log: one line -> shown.
      connect_timeout: seconds for reaching `address` (`probe_address`, then a watchdog over `ray.init`).
    Raises LaunchError (bad input or an unreachable address, one line); a missing `ray` is one line too (exit 2).
    """
    place = placement(mesh)
    args = job_argv(argv)
    if not connect_timeout > 0:
        raise LaunchError(f"--ray-connect-timeout {connect_timeout:g}: expected seconds > 0")
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise LaunchError("--launcher ray needs the [ray] extra: pip install -e '.[ray]'") from None
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    env.setdefault(ENV_AUTHKEY, secrets.token_hex(16))
    env["PYTHONUNBUFFERED"] = "1"
    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO)}}
    relay = SignalRelay().install()
    groups, actors = [], []
    try:
        _connect(ray, address, connect_timeout, runtime_env, place.bundles + 1)
        relay.install()  # again: ray.init's driver makes SIGTERM a sys.exit (rc -6 at teardown)
        return _run_jobs(ray, placement_group, PlacementGroupSchedulingStrategy, place, args, env, relay, groups,
                         actors, log)
    except KeyboardInterrupt as e:  # `Interrupted`, or a plain one from inside ray.get
        sig = e.signum if isinstance(e, Interrupted) else (relay.received or [signal.SIGINT])[-1]
        print(f"interrupted ({signal.Signals(sig).name}) before the jobs started: nothing to save", file=sys.stderr)
        return 128 + sig
    finally:
        relay.armed = True  # a signal during the teardown is only recorded: the teardown must finish
        if ray.is_initialized():
            for a in actors:
                ray.kill(a, no_restart=True)
            for g in groups:
                remove_placement_group(g)
            time.sleep(0.5)  # let Ray's log monitor forward the last lines
            ray.shutdown()  # a local cluster started here stops with it
        relay.restore()


def _connect(ray, address: str | None, timeout_s: float, runtime_env: dict, num_cpus: int) -> None:
    """`ray.init`: to the cluster at `address` (probed, then under a watchdog: `timeout_s`), or a local cluster of
    `num_cpus` CPUs for this run only ("local": never one another user started on this machine)."""
    if not address:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                 object_store_memory=100 * 2**20, log_to_driver=True)
        return
    probe_address(address, timeout_s)
    watchdog = connect_watchdog(address, timeout_s)
    try:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    except ConnectionError as e:
        raise LaunchError(f"--ray-address {address}: {e} (is a cluster running there, `ray start --head`? Ray's "
                          "token authentication (on by default in ray 2.60) also needs RAY_AUTH_MODE=token "
                          "here, with the cluster's ~/.ray/auth_token)") from None
    finally:
        watchdog.cancel()


def _run_jobs(ray, placement_group, PlacementGroupSchedulingStrategy, place: Placement, args: list[str], env: dict,
              relay: SignalRelay, groups: list, actors: list, log) -> int:
    """`launch`'s body on a connected Ray: place the groups, start the jobs (appended to `groups` and `actors`, the
    rollout's last, for `launch` to remove), relay signals while the actor job runs -> the exit status."""
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    n_groups = place.actor_processes + 1
    for _ in range(n_groups):
        groups.append(placement_group([dict(bundle)] * place.devices, strategy="STRICT_PACK"))
    log(f"ray: {n_groups} placement groups of {place.devices} bundles {bundle} (STRICT_PACK) for "
        f"{place.actor_processes} actor process(es) and 1 rollout process; waiting for the cluster to hold them")
    ray.get([g.ready() for g in groups])

    def at(g, i=0):  # bundle i of placement group g
        return PlacementGroupSchedulingStrategy(placement_group=g, placement_group_bundle_index=i)

    probe = ray.remote(_probe)
    probes = [ray.get([probe.options(num_cpus=0, num_gpus=1 if gpu else 0, scheduling_strategy=at(g, i)).remote()
                       for i in range(place.devices)]) for g in groups]
    nodes = [p[0]["node"] for p in probes]
    port_on = ray.remote(_free_port_on_node)
    host, port = ray.get(port_on.options(num_cpus=0, scheduling_strategy=at(groups[0])).remote())
    actor_address = f"{host}:{port}"
    coordinator = None
    if place.actor_processes > 1:
        coordinator = "%s:%d" % ray.get(port_on.options(num_cpus=0, scheduling_strategy=at(groups[0])).remote())
    remote = ray.remote(JobProcess)
    jobs = []
    for i in range(place.actor_processes):
        side = ["--rollout-address", actor_address]
        if coordinator:
            side += ["--coordinator", coordinator, "--num-processes", str(place.actor_processes),
                     "--process-id", str(i)]
        jobs.append(remote.options(num_cpus=1, max_restarts=0, max_concurrency=2,  # wait + send_signal
                                   scheduling_strategy=at(groups[i])).remote(
            "actor", [*args, *side], {**env, **_visible_env(probes[i])}, False))
        actors.append(jobs[-1])
    rollout = remote.options(num_cpus=1, max_restarts=-1, max_task_retries=0,
                             scheduling_strategy=at(groups[-1])).remote(
        "rollout", [*args, "--rollout-job", "--actor-address", actor_address],
        {**env, **_visible_env(probes[-1])}, True)
    actors.append(rollout)
    log(f"ray: the actor job on {', '.join(nodes[:-1])} (listening at {actor_address}), the rollout job on "
        f"{nodes[-1]} (Ray restarts it when it dies)")
    relay.arm()
    try:
        waits = [a.wait.remote() for a in jobs]
        while len(ray.wait(waits, num_returns=len(waits), timeout=0.5)[0]) < len(waits):
            for got, sent in relay.take():
                how = ("finishes the step, saves, exits" if sent == got else "exits at once, the newest complete "
                       "checkpoint kept")
                log(f"ray: {signal.Signals(got).name}: passed to the actor job as {signal.Signals(sent).name} (it "
                    f"{how}{'; a second signal exits at once' if sent == got else ''})")
                ray.get([a.send_signal.remote(sent) for a in jobs], timeout=30)
        results = ray.get(waits)
    except ray.exceptions.RayActorError as e:
        print(f"error: the actor job's Ray actor died ({type(e).__name__}); rerun the same command to resume "
              "from its checkpoint", file=sys.stderr)
        return 1
    bad = next((r for r in results if r["rc"] != 0), None)
    if bad is None:
        try:
            ray.get(rollout.wait.remote(), timeout=60)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            pass  # the run is done; the rollout is stopped by `launch` either way
        return 0
    if relay.first is not None and bad["rc"] == 130:  # Ctrl-C: the job said what it saved (its line above)
        return 130
    if relay.first is not None and bad["rc"] is not None and bad["rc"] < 0:  # before the job's own handler
        print(f"interrupted ({signal.Signals(relay.first).name}): the actor job stopped before its first step "
              f"(killed by {signal.Signals(-bad['rc']).name}): nothing saved", file=sys.stderr)
        return 128 - bad["rc"]
    print(bad["error"] or f"error: the actor job exited {bad['rc']} (its output above)", file=sys.stderr)
    return bad["rc"] if bad["rc"] and bad["rc"] > 0 else 1
