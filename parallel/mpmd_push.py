"""The actor -> rollout weight push across processes (MPMD; the roles and host messages are `sharding/mpmd.py`).

jax moves an array between processes only when the source and destination HLO shardings are identical (same tiling,
other devices: `jax/_src/dispatch.py::_is_supported_cross_host_transfer`; docs/jax-stack.md §2.4). So per tensor:
1. actor processes: one jit casts the learner's tensor to its wire dtype (as `parallel/push.py`) and reshards it on
   the actor mesh so that every dim is cut exactly as the rollout cuts it (`staged_sharding`);
2. for each rollout device an actor device holding the same slice is chosen; those buffers are wrapped, without a
   copy, as an array on a *transfer mesh* (those actor devices, the rollout mesh's shape and axis names) with the
   rollout's spec: identical tiling by construction (`plan_transfer`);
3. every process calls `jax.device_put` onto the rollout sharding (rollout processes pass an empty handle built
   with `dtype=`, as they hold no shard of the source); the rollout waits for its copies and acks the chunk through
   the HostChannel; only then do the actor processes free the staged copies (a sender that deletes them before the
   receiver pulled them loses the transfer);
4. rollout processes: `Sampler.quantize_weights` (FP8) and `set_weights`.
A tensor the transfer cannot serve (the actor mesh cannot cut it as the rollout does, or holds fewer copies of a
slice than the rollout) is a `MeshSpecError` when the pusher is built, before step 1. Verification (checksums,
`parallel/push.py`) is not done on this path yet.

Tests: `.venv/bin/python -m pytest -q tests/sharding/test_mpmd.py`; benchmark `benchmarks/mpmd_push.py`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dsv4 import quant
from parallel.transfer import FP8_SOURCE_DTYPE, _cast_reshard, _flat, _realize, _splits
from sharding.mesh import MeshSpecError
from sharding.mpmd import HostChannel, RoleLayout
from sharding.rules import ROLLOUT

@dataclasses.dataclass(frozen=True)
class _Plan:
    key: str
    shape: tuple[int, ...]
    wire_dtype: Any
    actor_sharding: NamedSharding      # the learner's layout
    staged_sharding: NamedSharding     # actor mesh, every dim cut as the rollout cuts it
    transfer_sharding: NamedSharding   # transfer mesh (actor devices), identical tiling to rollout_sharding
    rollout_sharding: NamedSharding

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.wire_dtype).itemsize


def _index_key(index, shape) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def plan_transfer(key: str, shape: tuple[int, ...], wire_dtype, actor_sh: NamedSharding,
                  rollout_sh: NamedSharding) -> _Plan:
    """The staged (actor mesh) and transfer (actor devices, rollout tiling) shardings of one tensor (module
    docstring, point 1). Raises MeshSpecError when the actor mesh cannot cut the tensor as the rollout does or holds
    fewer copies of a slice than the rollout needs."""
    ndim = len(shape)
    target = _splits(rollout_sh, ndim)
    spec = _realize(actor_sh.mesh, target, rollout_sh.spec)
    a_axes = dict(actor_sh.mesh.shape)
    if spec is None:
        raise MeshSpecError(
            f"MPMD push: {key} {list(shape)} is cut {list(target)} on the rollout mesh {dict(rollout_sh.mesh.shape)} "
            f"(spec {rollout_sh.spec}), which the actor mesh {a_axes} cannot express; cross-process transfers need "
            "identical tilings: choose axis sizes whose products match")
    staged = NamedSharding(actor_sh.mesh, spec)
    holders: dict[tuple, list] = {}
    for dev, idx in staged.devices_indices_map(shape).items():
        holders.setdefault(_index_key(idx, shape), []).append(dev)
    r_map = rollout_sh.devices_indices_map(shape)
    chosen = []
    for dev in rollout_sh.mesh.devices.flat:
        free = holders.get(_index_key(r_map[dev], shape), [])
        if not free:
            raise MeshSpecError(
                f"MPMD push: {key}: the rollout mesh {dict(rollout_sh.mesh.shape)} keeps more copies of a slice than "
                f"the actor mesh {a_axes} has devices for; give the actor at least as many devices as the rollout")
        chosen.append(free.pop(0))
    r_mesh = rollout_sh.mesh
    t_mesh = Mesh(np.array(chosen, dtype=object).reshape(r_mesh.devices.shape), r_mesh.axis_names,
                  axis_types=r_mesh.axis_types)
    transfer = NamedSharding(t_mesh, rollout_sh.spec)
    return _Plan(key=key, shape=tuple(shape), wire_dtype=np.dtype(wire_dtype), actor_sharding=actor_sh,
                 staged_sharding=staged, transfer_sharding=transfer, rollout_sharding=rollout_sh)


class MpmdPusher:
    """The actor -> rollout weight push across processes (module docstring, point 1). Built on every process.

    Args:
      plan: the MeshPlan; layout: its RoleLayout (mpmd). sampler: the rollout `Sampler` (built on every process from
        the abstract model: its shardings and quantisation are used; only rollout processes hold weights).
      abstract_state: {key: ShapeDtypeStruct} (or nnx.State) of every pushed tensor, in the learner's dtypes.
      actor_shardings: {key: NamedSharding} of those tensors on the actor mesh.
      channel: the HostChannel (receipts, liveness, its timeout). chunk_bytes: wire bytes confirmed per receipt.
    Raises:
      MeshSpecError: a tensor the transfer cannot serve (`plan_transfer`).
    """

    def __init__(self, plan, layout: RoleLayout, sampler, abstract_state, actor_shardings, channel: HostChannel, *,
                 chunk_bytes: int = 256 * 2**20):
        self.plan, self.layout, self.sampler, self.channel = plan, layout, sampler, channel
        self.colocated = False
        flat = _flat(abstract_state)
        a_sh = _flat(actor_shardings)
        rollout_sh = sampler.rollout_shardings()
        missing = sorted(set(rollout_sh) - set(flat))
        if missing:
            raise ValueError(f"MpmdPusher: the actor state lacks {len(missing)} sampler tensors: {missing[:5]}")
        stored = jax.eval_shape(sampler._quantize_fn, {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                                       for k, v in flat.items() if k in rollout_sh})
        self.tensors = []
        for k, r in rollout_sh.items():
            out = stored[k]
            wire = FP8_SOURCE_DTYPE if isinstance(out, quant.QuantizedTensor) else out.dtype
            self.tensors.append(plan_transfer(k, tuple(flat[k].shape), wire, a_sh[k], r))
        chunks, cur, size = [], [], 0
        for t in self.tensors:
            if cur and size + t.nbytes > chunk_bytes:
                chunks.append(cur)
                cur, size = [], 0
            cur.append(t)
            size += t.nbytes
        self.chunks = chunks + ([cur] if cur else [])
        self.wire_bytes = sum(t.nbytes for t in self.tensors)
        self.n_pushes = 0
        self._cpu = plan.actor.devices.flat[0].platform == "cpu"

    def _stage(self, t: _Plan, x) -> tuple[Any, Any]:
        """Actor side: (staged copy on the actor mesh, its transfer-mesh view)."""
        with jax.set_mesh(t.actor_sharding.mesh):
            y = _cast_reshard(x, t.wire_dtype, t.staged_sharding)
        if self._cpu:
            y.block_until_ready()
        local = {s.device: s.data for s in y.addressable_shards}
        shards = [local[d] for d in t.transfer_sharding.mesh.devices.flat if d in local]
        view = jax.make_array_from_single_device_arrays(t.shape, t.transfer_sharding, shards, dtype=t.wire_dtype)
        return y, view

    def push(self, params, version: int) -> dict:
        """Push `params` (actor processes: {key: array} / nnx.State of the learner's tensors; rollout processes:
        None) as weight `version`. Every process calls it in the same order. Rollout processes swap the new weights
        into the sampler. Returns {"perf/weight_push_s", "perf/weight_push_gbps"} (this process's wall time).
        Raises PeerTimeoutError naming the side that did not confirm in time."""
        t0 = time.perf_counter()
        flat = _flat(params) if self.layout.is_actor else None
        raw = {}
        for c, chunk in enumerate(self.chunks):
            staged, handles = [], []
            for t in chunk:
                if self.layout.is_actor:
                    y, view = self._stage(t, flat[t.key])
                    staged.append(y)
                else:
                    # a handle on the actor's devices: no local shards, hence dtype= (the callback is never read)
                    view = jax.make_array_from_single_device_arrays(t.shape, t.transfer_sharding, [],
                                                                    dtype=t.wire_dtype)
                handles.append(view)
            out = jax.device_put(handles, [t.rollout_sharding for t in chunk], may_alias=False)
            if self.layout.is_rollout:
                jax.block_until_ready(out)
                raw.update(zip((t.key for t in chunk), out))
            # the receiver holds its copies: only now may the sender free the staged buffers
            tag = f"push/{version}/{c}"
            if self.layout.is_rollout:
                self.channel.ack(tag)
            else:
                self.channel.wait_acks(tag, ROLLOUT, f"weight push of version {version}, chunk "
                                                     f"{c + 1}/{len(self.chunks)} was not confirmed")
            for y in staged:
                y.delete()
        if self.layout.is_rollout:
            wstate = self.sampler.quantize_weights(raw)
            jax.block_until_ready(wstate)
            kept = {s.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(wstate) for s in leaf.addressable_shards}
            for x in raw.values():
                if not x.is_deleted() and not ({s.data.unsafe_buffer_pointer() for s in x.addressable_shards} & kept):
                    x.delete()
            self.sampler.set_weights(wstate, version)
        self.n_pushes += 1
        dt = time.perf_counter() - t0
        return {"perf/weight_push_s": dt, "perf/weight_push_gbps": self.wire_bytes / dt / 1e9}
