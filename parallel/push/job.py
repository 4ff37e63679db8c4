"""The actor -> rollout weight push between two independent JAX jobs, by `jax.experimental.transfer`.

    # actor job (its plan's rollout mesh is a stand-in of the rollout job's: same shape and axes, actor devices)
    pusher = JobPusher(plan, standin_sampler, abstract_state, actor_shardings)
    address = pusher.start(host)                 # this process's transfer server (every process of the actor job)
    pusher.deliver = hand_off                    # Served -> None: offers + the rollout's pull (rl/rollout/two_job.py)
    stats = pusher.push(params, version)         # `protocol.Pusher`: stage, then deliver
    #   = served = pusher.stage(params, version)  (wire arrays in the rollout's tiling, kept until the next push)
    #     pusher.offer(served, uuid)               (this process's server waits for one pull of its shards)
    # rollout job
    receiver = WeightReceiver(sampler, host)
    receiver.pull(addresses, pusher.holders, uuid, version)  # one pull per actor process; set_weights

Staging is the MPMD push's (`mpmd.MpmdPusher`, one jit per tensor: bf16 cast, FP8 quantisation with
`dsv4.quant.quantize_rollout_fp8` for FP8-stored tensors, every dim cut exactly as the rollout cuts it), so the wire
is FP8 blocks + scales (about 1.1 B per parameter) and the rollout never holds a bf16 copy. The actor job has no
rollout devices: its plan's rollout mesh is a stand-in (the rollout job's mesh shape and axis names over actor
devices, `sharding.mesh.build_job_plan`); the tiling it yields equals the rollout job's real one, which the rollout
checks at registration (`tiling`: a list both sides compute; a mismatch is a one-line error naming the flags).

Per-process servers (an actor job of several processes, e.g. the seed layout's 16 devices on 2 nodes). Each rollout
device's slice of a wire array (a position of the rollout mesh) is taken from one actor device holding that slice
(`mpmd.plan_transfer` with `spread`: the holders are spread over the actor processes); `holders` says,
per wire array, which actor process serves each position. Every actor process runs a transfer server and offers
its own positions' shards as single-device arrays; the rollout pulls from every process the positions it serves
(one `pull` per process, single-device shapes on the matching rollout device) and assembles each wire array from
its shards (`jax.make_array_from_single_device_arrays`). No host gathers the weights: 16 devices' worth never
crosses one node's network card (what the seeds avoided); each node sends its share. The addresses travel over the
host channel with every pull (rl/rollout/two_job.py).

Recovery: the staged arrays of the served version stay alive on the actor until the next push replaces them, so a
rollout job that restarts pulls exactly the weights the in-flight batches were being generated with (the learner may
have moved on by then). Cost: one rollout-tiled copy of the weights on the actor's devices (FP8: ~1.1 B/param).
Push verification (`--rollout.push_verify_every`) is the MPMD push's business; this push is not verified.

Sources: docs/jax-stack.md §2.5 (`start_transfer_server`, `await_pull`, `connect(addr).pull`, run on CPU between
independent processes); marin's `post_training/weight_transfer` (a trainer's transfer server, samplers pulling by
an increasing id) read for the pattern.
Tests: `.venv/bin/python -m pytest -q tests/launch/test_two_jobs.py`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from dsv4 import quant
from parallel.push.mpmd import MpmdPusher
from parallel.push.protocol import PushStats
from parallel.push.transfer import flat_state


def start_server(host: str):
    """A transfer server of this process's backend on `host` (a free port); `.address()` names it."""
    client = jax.devices()[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


def wire_targets(sampler) -> list[tuple[str, tuple | None, list[jax.ShapeDtypeStruct]]]:
    """[(key, qmeta | None, [ShapeDtypeStruct with the rollout sharding, per wire array])] in the push's order
    (`MpmdPusher.tensors`): a dense tensor crosses as one array, an FP8-stored one as (q, scale)."""
    stored = sampler.abstract_weights()
    out = []
    for k, r in sampler.rollout_shardings().items():
        x = stored[k]
        if isinstance(x, quant.QuantizedTensor):
            qmeta = (x.kind, x.fmt, tuple(x.block), tuple(x.shape))
            arrays = [x.q, x.scale]
        else:
            qmeta, arrays = None, [x]
        out.append((k, qmeta, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding or r) for a in arrays]))
    return out


def tiling(sampler) -> list[tuple]:
    """What both jobs must agree on: per wire array (key, shape, dtype, mesh axis sizes, spec), as plain values."""
    return [(k, tuple(s.shape), str(s.dtype), tuple(s.sharding.mesh.shape.items()), str(s.sharding.spec))
            for k, _, specs in wire_targets(sampler) for s in specs]


@dataclasses.dataclass
class Served:
    """The staged wire arrays of one version on the actor: `staged` (actor mesh, rollout tiling) and `shards`
    (this process's single-device buffers of them that it serves, in `JobPusher.holders` order: what its transfer
    server offers)."""

    version: int
    staged: list
    shards: list
    nbytes: int


class JobPusher(MpmdPusher):
    """The actor job's side (module docstring), built on every process of the actor job. Args as `MpmdPusher` without
    the layout and channel: `plan` with the stand-in rollout mesh, the stand-in `sampler` (abstract model on that
    mesh), `abstract_state`, `actor_shardings`. `holders`: per wire array, the actor process serving each position
    of the rollout mesh (a list of ints per array, sent to the rollout at registration). Raises MeshSpecError as
    `MpmdPusher` when the actor mesh cannot cut a tensor as the rollout does.

    `deliver`: Served -> None, what `push` does once a version is staged: the hand-off to the rollout job (offers
    and the rollout's pull over the link, recovery: `rl.rollout.two_job.JobRollout` sets it); None: stage only."""

    def __init__(self, plan, sampler, abstract_state, actor_shardings):
        super().__init__(plan, None, sampler, abstract_state, actor_shardings, None, spread=True)
        self.tiling = tiling(sampler)
        self.holders = [[d.process_index for d in w.transfer_sharding.mesh.devices.flat]
                        for t in self.tensors for w in t.wires]
        self.server = None
        self.deliver: Callable[[Served], None] | None = None

    def push(self, params, version: int) -> PushStats:
        """`protocol.Pusher`: stage `params` as `version` (`stage`), then `deliver` it. Returns PushStats (this
        process's wall time, the staged wire bytes; not verified: module docstring). Raises what `stage` and
        `deliver` raise."""
        t0 = time.perf_counter()
        served = self.stage(params, version)
        if self.deliver is not None:
            self.deliver(served)
        return PushStats(version=int(version), seconds=time.perf_counter() - t0, bytes=served.nbytes,
                         n_tensors=len(self.tensors), n_params=self.n_params)

    def start(self, host: str) -> str:
        """Start this process's transfer server on `host` (once); returns its address."""
        if self.server is None:
            self.server = start_server(host)
        return self.server.address()

    def stage(self, params, version: int) -> Served:
        """Stage the learner's `params` ({key: array} / nnx.State) as `version`: every wire array in the rollout's
        tiling on the actor mesh (waits until they are computed; every actor process calls it: one SPMD program)."""
        flat = flat_state(params)
        staged, shards, me = [], [], jax.process_index()
        for t in self.tensors:
            ys, _, _ = self.stage_tensor(t, flat[t.key], False)
            staged += ys
            for w, y in zip(t.wires, ys):
                local = {s.device: s.data for s in y.addressable_shards}
                shards += [local[d] for d in w.transfer_sharding.mesh.devices.flat if d.process_index == me]
        jax.block_until_ready(staged)
        return Served(version=int(version), staged=staged, shards=shards, nbytes=self.wire_bytes)

    def offer(self, served: Served, uuid: int) -> None:
        """Let one pull of this process's shards of `served` happen under `uuid` (nothing when it serves none);
        `start` first."""
        if served.shards:
            self.server.await_pull(int(uuid), served.shards)


class WeightReceiver:
    """The rollout job's side: pulls a version from the actor's transfer server into `sampler` (its shardings,
    its stored formats) and swaps it in."""

    def __init__(self, sampler, host: str):
        self.sampler, self.host = sampler, host
        self.targets = wire_targets(sampler)
        self.server = None
        self._conns: dict[str, object] = {}

    def pull(self, addresses: list[str], holders: list[list[int]], uuid: int, version: int) -> dict:
        """Pull wire arrays `uuid` from the actor processes' transfer servers (`addresses[p]`: process p's; `holders`:
        `JobPusher.holders`), make them weight `version`. Returns PushStats (this side's wall time and the pulled
        wire bytes; `metrics()`: {"perf/weight_push_s", "perf/weight_push_gbps"})."""
        t0 = time.perf_counter()
        if self.server is None:
            self.server = start_server(self.host)
        specs = [s for _, _, ss in self.targets for s in ss]
        if len(holders) != len(specs):
            raise ValueError(f"the actor serves {len(holders)} wire arrays, this rollout expects {len(specs)}")
        want: dict[int, list] = {}  # actor process -> [(wire array, position, single-device spec)]
        for i, s in enumerate(specs):
            one = s.sharding.shard_shape(s.shape)
            for pos, d in enumerate(s.sharding.mesh.devices.flat):
                want.setdefault(holders[i][pos], []).append(
                    (i, pos, jax.ShapeDtypeStruct(one, s.dtype, sharding=SingleDeviceSharding(d))))
        got: dict[tuple[int, int], jax.Array] = {}
        for p, items in sorted(want.items()):
            if addresses[p] not in self._conns:
                self._conns[addresses[p]] = self.server.connect(addresses[p])
            for (i, pos, _), x in zip(items, self._conns[addresses[p]].pull(int(uuid), [x for *_, x in items])):
                got[i, pos] = x
        arrays = iter([jax.make_array_from_single_device_arrays(
            s.shape, s.sharding, [got[i, pos] for pos in range(s.sharding.mesh.devices.size)])
            for i, s in enumerate(specs)])
        wstate = {}
        for k, qmeta, ss in self.targets:
            got_k = [next(arrays) for _ in ss]
            if qmeta is None:
                wstate[k] = got_k[0]
            else:
                kind, fmt, block, shape = qmeta
                wstate[k] = quant.QuantizedTensor(q=got_k[0], scale=got_k[1], kind=kind, fmt=fmt, block=block,
                                                  shape=shape)
        jax.block_until_ready(jax.tree.leaves(wstate))
        self.sampler.set_weights(wstate, version)
        return PushStats(version=int(version), seconds=time.perf_counter() - t0,
                         bytes=sum(s.size * s.dtype.itemsize for s in specs), n_tensors=len(self.targets),
                         n_params=sum(math.prod(qmeta[3] if qmeta else ss[0].shape) for _, qmeta, ss in self.targets))
