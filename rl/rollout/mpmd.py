"""The rollout on processes of its own (MPMD): `ProcessRollout`, the actor's side of the rollout service contract
(rl/rollout/service.py), and `RolloutServer`, the loop the rollout processes run.

A disjoint rollout mesh whose devices are whole processes (e.g. `--mesh actor:fsdp=2,expert=2/rollout:expert=2` on 3
processes x 2 devices: processes 0-1 the actor, process 2 the rollout; `sharding.mpmd.role_layout`) runs the one loop
(rl/run/loop.py) on the actor processes, with this service behind `wiring.rollout`; the rollout processes only serve.
The two sides speak through a command queue in the host channel (`sharding.mpmd.HostChannel`):

    actor writer (process 0)  --  cmd/0, cmd/1, ...  -->  every rollout process, in order
    first rollout process     --  result/<tag>       -->  every actor process
    weights                   --  MpmdPusher.push (every process of both roles, in the order of the "push" commands)

Commands: {"op": "generate", "request": RolloutRequest} (the rollout processes run `Sampler.generate` on their mesh;
the first of them publishes the RolloutResult with its counters), {"op": "push", "version": v} (the cross-process
transfer of the learner's params, `parallel.push.mpmd.MpmdPusher`), {"op": "load_init"} (version 0 read from
--init's own FP8 blocks on the rollout, `rl.rollout.init.checkpoint_rollout_weights`), {"op": "stop"}. Only the
actor's writer numbers and publishes commands; the pipeline's schedule (rl/run/pipeline.py) makes their order a
function of the flags (a generate of batch m is sent only once P(max(0, m - K)) was pushed; a push only when no
request is in flight), so every actor process sees the same results whatever the timing.

Liveness: every wait is the channel's, which fails once a process of the other side stopped beating for the liveness
timeout (`sharding.mpmd.liveness_s`: 20 s, or `--push-timeout` when shorter), naming it
(`sharding.mpmd.PeerTimeoutError`; its heartbeat thread or launch/run.py exits with one line).
The rollout processes hold no checkpointed state: the actor checkpoints (and restores) the learner, the data order
and the in-flight batches; on resume the rollout is sent the restored weights by a push, so nothing else is needed
for the resumed run to equal the uninterrupted one.
Tests: `.venv/bin/python -m pytest -q -m slow tests/launch/test_mpmd_run.py tests/launch/test_mpmd_async_resume.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rl.rollout.init import checkpoint_rollout_weights
from rl.rollout.service import RolloutRequest, RolloutResult, RolloutService, run_request
from sharding.rules import ACTOR, ROLLOUT

log = logging.getLogger("dsv4rl")


class ProcessRollout(RolloutService):
    """The rollout service of an actor process of an MPMD run (module docstring).

    Args:
      layout: the RoleLayout (this process is an actor). channel: the HostChannel. pusher: the MpmdPusher.
      params_fn: () -> the learner's current params (`Learner.params_for_push`).
      version: the version the rollout processes serve when this is built (nothing pushed yet: -1).
    Raises (from every wait): sharding.mpmd.PeerTimeoutError naming the rollout side when it stops answering.
    """

    def __init__(self, layout, channel, pusher, params_fn: Callable[[], dict], version: int = -1):
        self.layout, self.channel, self.pusher, self.params_fn = layout, channel, pusher, params_fn
        self._version = version
        self._seq = 0
        self._lock = threading.Lock()  # the producer thread submits, the main thread pushes
        self._stats: dict = {}

    def _command(self, cmd: dict) -> None:
        with self._lock:
            if self.layout.process == self.layout.writer:
                self.channel.publish(f"cmd/{self._seq}", cmd)
            self._seq += 1

    def submit(self, request: RolloutRequest) -> str:
        self._command({"op": "generate", "request": request})
        return request.tag

    def collect(self, handle: str) -> RolloutResult:
        pk = self.channel.receive(f"result/{handle}", ROLLOUT, f"the rollout results of {handle} did not arrive")
        self._stats = pk["counters"]
        return pk["result"]

    def stats(self) -> dict:
        return dict(self._stats)

    @property
    def weight_version(self) -> int:
        return self._version

    def load_weights(self, version: int, source: str | None = None) -> dict:
        """The push of the actor's params as `version`; with `source` (--init's checkpoint at version 0) the rollout
        processes read it themselves (its own FP8 blocks, the directory their `RolloutServer(init=...)` names)."""
        if source is not None:
            self._command({"op": "load_init", "version": int(version)})
            self._version = int(version)
            return {}
        self._command({"op": "push", "version": int(version)})
        stats = self.pusher.push(self.params_fn(), int(version))
        self._version = int(version)
        return stats.metrics()

    def close(self) -> None:
        self._command({"op": "stop"})


class RolloutServer:
    """The loop of a rollout process of an MPMD run (module docstring): commands in order until "stop".

    Args:
      sampler: the rollout Sampler (its weights arrive by push or from --init). layout, channel, pusher: as
        `ProcessRollout`. init: --init's checkpoint directory (for "load_init"), config: the model config,
        progress: show load progress. tokenizer: the run's tokenizer, for multi-turn requests (--rollout.env):
        every rollout process runs the turns (rl/rollout/multiturn.py) and the environment's tools itself, so the
        next turn's prefill is the same program on all of them; an environment whose tools can answer
        differently on two processes (a wall-clock timeout) needs one rollout process.
    """

    def __init__(self, sampler, layout, channel, pusher, *, init: str | None = None, config=None,
                 progress: bool | None = None, tokenizer=None):
        self.sampler, self.layout, self.channel, self.pusher = sampler, layout, channel, pusher
        self.init, self.config, self.progress, self.tokenizer = init, config, progress, tokenizer
        self.generate_calls = 0
        self.publisher = self.layout.process == min(self.layout.rollout_processes)

    def serve(self) -> dict:
        """Serve until the actor's "stop"; returns {"generate": calls, "train_steps": 0}. Raises PeerTimeoutError
        naming the actor side when its heartbeat stops."""
        i = 0
        while True:
            cmd = self.channel.receive(f"cmd/{i}", ACTOR, "the actor's next command")
            i += 1
            op = cmd["op"]
            if op == "generate":
                req: RolloutRequest = cmd["request"]
                self.generate_calls += 1
                res = run_request(self.sampler, req, self.tokenizer)
                if self.publisher:
                    self.channel.publish(f"result/{req.tag}", {"result": res, "counters": self.counters()})
            elif op == "push":
                self.pusher.push(None, int(cmd["version"]))
            elif op == "load_init":
                self.sampler.set_weights(checkpoint_rollout_weights(self.sampler, self.init, config=self.config,
                                                                    progress=self.progress),
                                         version=int(cmd.get("version", 0)))
                log.info("MPMD: rollout weights version 0 read from %s (its own FP8 blocks)", self.init)
            elif op == "stop":
                return {"generate": self.generate_calls, "train_steps": 0}
            else:
                raise RuntimeError(f"MPMD rollout: unknown command {op!r}")

    def counters(self) -> dict:
        """This side's programs, counted (logged by the actor's writer with each step)."""
        return {"mpmd/rollout_generate_calls": float(self.generate_calls), "mpmd/rollout_train_steps": 0.0}
