"""The actor -> rollout weight push between two independent JAX jobs, by `jax.experimental.transfer`.

    # actor job (its plan's rollout mesh is a stand-in of the rollout job's: same shape and axes, actor devices)
    pusher = JobPusher(plan, standin_sampler, abstract_state, actor_shardings)
    served = pusher.stage(params, version)       # wire arrays in the rollout's tiling, kept until the next push
    pusher.offer(served, uuid)                    # the transfer server waits for one pull of them under `uuid`
    # rollout job
    receiver = WeightReceiver(sampler)
    receiver.pull(actor_transfer_address, uuid, version)   # arrives in the sampler's shardings; set_weights

Staging is the MPMD push's (`parallel.mpmd_push.MpmdPusher`, one jit per tensor: bf16 cast, FP8 quantisation with
`dsv4.quant.quantize_rollout_fp8` for FP8-stored tensors, every dim cut exactly as the rollout cuts it), so the wire
is FP8 blocks + scales (about 1.1 B per parameter) and the rollout never holds a bf16 copy. The actor job has no
rollout devices: its plan's rollout mesh is a stand-in (the rollout job's mesh shape and axis names over actor
devices, `sharding.mesh.build_job_plan`); the tiling it yields equals the rollout job's real one, which the rollout
checks at registration (`tiling`: a list both sides compute; a mismatch is a one-line error naming the flags).
The transfer pairs shards by their index in the tiling: the transfer view (`_Plan.transfer_sharding`) holds the
staged shards in the rollout mesh's order, and the rollout pulls `ShapeDtypeStruct`s with its own shardings.

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
import time

import jax
from jax.experimental import transfer

from dsv4 import quant
from parallel.mpmd_push import MpmdPusher
from parallel.transfer import _flat


def start_server(host: str):
    """A transfer server of this process's backend on `host` (a free port); `.address()` names it."""
    client = jax.devices()[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


def wire_targets(sampler) -> list[tuple[str, tuple | None, list[jax.ShapeDtypeStruct]]]:
    """[(key, qmeta | None, [ShapeDtypeStruct with the rollout sharding, per wire array])] in the push's order
    (`MpmdPusher.tensors`): a dense tensor crosses as one array, an FP8-stored one as (q, scale)."""
    stored = sampler._abstract_wstate()
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
    """The staged wire arrays of one version on the actor: `staged` (actor mesh, rollout tiling) and `views`
    (the same buffers as arrays on the transfer mesh, what the transfer server offers)."""

    version: int
    staged: list
    views: list
    nbytes: int


class JobPusher(MpmdPusher):
    """The actor job's side (module docstring). Args as `MpmdPusher` without the layout and channel: `plan` with
    the stand-in rollout mesh, the stand-in `sampler` (abstract model on that mesh), `abstract_state`,
    `actor_shardings`. Raises MeshSpecError as `MpmdPusher` when the actor mesh cannot cut a tensor as the
    rollout does."""

    def __init__(self, plan, sampler, abstract_state, actor_shardings):
        super().__init__(plan, None, sampler, abstract_state, actor_shardings, None)
        self.tiling = tiling(sampler)
        self.server = None

    def stage(self, params, version: int) -> Served:
        """Stage the learner's `params` ({key: array} / nnx.State) as `version`: every wire array in the rollout's
        tiling on the actor mesh (waits until they are computed)."""
        flat = _flat(params)
        staged, views = [], []
        for t in self.tensors:
            ys, vs, _ = self._stage(t, flat[t.key], False)
            staged += ys
            views += vs
        jax.block_until_ready(staged)
        return Served(version=int(version), staged=staged, views=views, nbytes=self.wire_bytes)

    def offer(self, served: Served, uuid: int, host: str) -> str:
        """Let one pull of `served` happen under `uuid`; returns this job's transfer server address."""
        if self.server is None:
            self.server = start_server(host)
        self.server.await_pull(int(uuid), served.views)
        return self.server.address()


class WeightReceiver:
    """The rollout job's side: pulls a version from the actor's transfer server into `sampler` (its shardings,
    its stored formats) and swaps it in."""

    def __init__(self, sampler, host: str):
        self.sampler, self.host = sampler, host
        self.targets = wire_targets(sampler)
        self.server = None
        self._conns: dict[str, object] = {}

    def pull(self, address: str, uuid: int, version: int) -> dict:
        """Pull wire arrays `uuid` from the actor's transfer server `address`, make them weight `version`.
        Returns {"perf/weight_push_s", "perf/weight_push_gbps"} (this side's wall time)."""
        t0 = time.perf_counter()
        if self.server is None:
            self.server = start_server(self.host)
        if address not in self._conns:
            self._conns[address] = self.server.connect(address)
        specs = [s for _, _, ss in self.targets for s in ss]
        arrays = iter(self._conns[address].pull(int(uuid), specs))
        wstate = {}
        for k, qmeta, ss in self.targets:
            got = [next(arrays) for _ in ss]
            if qmeta is None:
                wstate[k] = got[0]
            else:
                kind, fmt, block, shape = qmeta
                wstate[k] = quant.QuantizedTensor(q=got[0], scale=got[1], kind=kind, fmt=fmt, block=block,
                                                  shape=shape)
        jax.block_until_ready(jax.tree.leaves(wstate))
        self.sampler.set_weights(wstate, version)
        dt = time.perf_counter() - t0
        nbytes = sum(s.size * s.dtype.itemsize for s in specs)
        return {"perf/weight_push_s": dt, "perf/weight_push_gbps": nbytes / dt / 1e9}
