"""The actor -> rollout weight push across processes (MPMD; the roles and host messages are `sharding/mpmd.py`).

jax moves an array between processes only when the source and destination HLO shardings are identical (same tiling,
other devices: `jax/_src/dispatch.py::_is_supported_cross_host_transfer`; docs/jax-stack.md §2.4). So per tensor:
1. actor processes: one jit (`verify.stage_wires`, the in-process push's) casts the learner's tensor to bf16
   and, for a tensor the sampler stores in FP8, quantises it with `dsv4.quant.quantize_rollout_fp8` (the one path
   from learner weights to rollout FP8 weights), writing each wire array -- the dense tensor, or (q fp8, scale f32)
   -- on the actor mesh with every dim cut exactly as the rollout cuts it (`staged_sharding`). FP8 blocks + scales
   on the wire: about 1.10 B per parameter instead of 2.01 for bf16 (small config), and the rollout never holds a
   bf16 copy;
2. for each rollout device an actor device holding the same slice is chosen; those buffers are wrapped, without a
   copy, as an array on a *transfer mesh* (those actor devices, the rollout mesh's shape and axis names) with the
   rollout's spec: identical tiling by construction (`plan_transfer`);
3. every process calls `jax.device_put` onto the rollout sharding (rollout processes pass an empty handle built
   with `dtype=`, as they hold no shard of the source; they call it once every actor process acked that it staged
   the chunk, since their wait for the actors' transfer servers has only jax's fixed timeout); the rollout waits
   for its copies and acks the chunk through the HostChannel; only then do the actor processes free the staged
   copies (a sender that deletes them before the receiver pulled them loses the transfer);
4. rollout processes: the arrivals already are the stored state ({key: QuantizedTensor(q, scale) | array}, in the
   sampler's shardings); `Sampler.set_weights` swaps it in once every chunk arrived (and passed verification).
A tensor the transfer cannot serve (the actor mesh cannot cut it as the rollout does, or holds fewer copies of a
slice than the rollout) is a `MeshSpecError` when the pusher is built, before step 1.

Verification (every `verify_every`-th push, the first included; `--rollout.push_verify_every`): the colocated
push's terms (`parallel/push/verify.py`): the actor's stage jit computes the row of exactly what it sends (checksum
pairs of q and scales or of the dense wire, NaN/inf, the e4m3 rounding bound), the rollout computes the rows of what
arrived (`stored_row`); the actor's rows (10 uint32 per tensor) travel to the rollout processes through the
HostChannel, which compare them (`row_failures`) and send the verdict back, so a mismatch stops every process of
both roles with one line naming the tensor (`MpmdPushVerificationError`) and the rollout keeps its old weights.

Tests: `.venv/bin/python -m pytest -q tests/parallel/test_mpmd.py tests/parallel/test_mpmd_wire.py`; benchmark
`benchmarks/mpmd_push.py`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4 import quant
from parallel.push.protocol import PushStats, PushVerificationError
from parallel.push.transfer import FP8_SOURCE_DTYPE, chunked, dim_splits, flat_state, realize_spec
from parallel.push.verify import row_failures, slab_loop, stage_wires, stored_row
from sharding.mesh import MeshSpecError
from sharding.mpmd import HostChannel, RoleLayout
from sharding.rules import ACTOR, ROLLOUT

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
                  rollout_sh: NamedSharding, *, spread: bool = False) -> _Plan:
    """The staged (actor mesh) and transfer (actor devices, rollout tiling) shardings of one tensor (module
    docstring, point 1). `spread`: among the actor devices holding a slice, take one of the process that serves the
    fewest of this tensor's slices so far (the two-job layout, parallel/push/job.py: every actor process serves its
    share through its own transfer server; default: the first holder). Raises MeshSpecError when the actor mesh
    cannot cut the tensor as the rollout does or holds fewer copies of a slice than the rollout needs."""
    ndim = len(shape)
    target = dim_splits(rollout_sh, ndim)
    spec = realize_spec(actor_sh.mesh, target, rollout_sh.spec)
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
    chosen, served = [], {}  # served: process -> slices it serves so far
    for dev in rollout_sh.mesh.devices.flat:
        free = holders.get(_index_key(r_map[dev], shape), [])
        if not free:
            raise MeshSpecError(
                f"MPMD push: {key}: the rollout mesh {dict(rollout_sh.mesh.shape)} keeps more copies of a slice than "
                f"the actor mesh {a_axes} has devices for; give the actor at least as many devices as the rollout")
        i = min(range(len(free)), key=lambda j: served.get(free[j].process_index, 0)) if spread else 0
        chosen.append(free.pop(i))
        served[chosen[-1].process_index] = served.get(chosen[-1].process_index, 0) + 1
    r_mesh = rollout_sh.mesh
    t_mesh = Mesh(np.array(chosen, dtype=object).reshape(r_mesh.devices.shape), r_mesh.axis_names,
                  axis_types=r_mesh.axis_types)
    transfer = NamedSharding(t_mesh, rollout_sh.spec)
    return _Plan(key=key, shape=tuple(shape), wire_dtype=np.dtype(wire_dtype), actor_sharding=actor_sh,
                 staged_sharding=staged, transfer_sharding=transfer, rollout_sharding=rollout_sh)


class MpmdPushVerificationError(PushVerificationError):
    """An MPMD push whose rollout copy does not match what the actor sent (raised on every process of both roles,
    so the actor stops too); one line naming the first bad tensor. `failures`: [(tensor key, reason)]."""

    def __init__(self, version: int, failures: list[tuple[str, str]]):
        super().__init__(version, failures)
        k, why = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        self.args = (f"weight push of version {version} failed verification: {k}: {why}{more}; the rollout keeps "
                     "its previous weights",)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One pushed tensor: key, its stored format (qmeta = (kind, fmt, block, shape) of the sampler's
    QuantizedTensor, None = dense), the dtype the actor casts to before any quantisation (`dense_dtype`), its
    layout on the actor mesh, and one transfer plan per wire array ((dense,) or (q, scale))."""

    key: str
    qmeta: tuple | None
    dense_dtype: Any
    actor_sharding: NamedSharding
    wires: tuple[_Plan, ...]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.wires)

    @property
    def n_params(self) -> int:
        return math.prod(self.qmeta[3] if self.qmeta else self.wires[0].shape)


class MpmdPusher:
    """The actor -> rollout weight push across processes (module docstring). Built on every process.

    Args:
      plan: the MeshPlan; layout: its RoleLayout (`split_roles`: actor and rollout on processes of their own).
        sampler: the rollout `Sampler` (built on every process from the abstract model: its stored formats and
        shardings, `Sampler.abstract_weights()`, are used; only rollout processes hold weights).
      abstract_state: {key: ShapeDtypeStruct} (or nnx.State) of every pushed tensor, in the learner's dtypes.
      actor_shardings: {key: NamedSharding} of those tensors on the actor mesh.
      channel: the HostChannel (receipts, checksums, liveness, its timeout). chunk_bytes: wire bytes confirmed per
        receipt. verify_every: verify every k-th push (1 = always, 0 = never; the first push is verified).
      spread: `plan_transfer`'s (the two-job layout's pusher: spread the served slices over the actor processes).
    Raises:
      MeshSpecError: a tensor the transfer cannot serve (`plan_transfer`).
      ValueError: the actor state lacks a sampler tensor.
    """

    def __init__(self, plan, layout: RoleLayout, sampler, abstract_state, actor_shardings, channel: HostChannel, *,
                 chunk_bytes: int = 256 * 2**20, verify_every: int = 0, spread: bool = False):
        self.plan, self.layout, self.sampler, self.channel = plan, layout, sampler, channel
        self.colocated = False
        self.chunk_bytes, self.verify_every = int(chunk_bytes), int(verify_every)
        flat = flat_state(abstract_state)
        a_sh = flat_state(actor_shardings)
        rollout_sh = sampler.rollout_shardings()
        missing = sorted(set(rollout_sh) - set(flat))
        if missing:
            raise ValueError(f"MpmdPusher: the actor state lacks {len(missing)} sampler tensors: {missing[:5]}")
        stored = sampler.abstract_weights()  # formats, dtypes and shardings of what the sampler stores
        self.tensors = []
        for k, r in rollout_sh.items():
            out = stored[k]
            if isinstance(out, quant.QuantizedTensor):  # quantised on the actor: (q, scale) cross
                qmeta = (out.kind, out.fmt, tuple(out.block), tuple(out.shape))
                dense = np.dtype(FP8_SOURCE_DTYPE)
                arrays = [(k, out.q), (f"{k}:scale", out.scale)]
            else:
                qmeta, dense, arrays = None, np.dtype(out.dtype), [(k, out)]
            wires = tuple(plan_transfer(name, tuple(x.shape), x.dtype, a_sh[k], x.sharding or r, spread=spread)
                          for name, x in arrays)
            self.tensors.append(_Tensor(key=k, qmeta=qmeta, dense_dtype=dense, actor_sharding=a_sh[k], wires=wires))
        self.chunks = chunked(self.tensors, self.chunk_bytes)
        self.wire_bytes = sum(t.nbytes for t in self.tensors)
        self.n_params = sum(t.n_params for t in self.tensors)
        self.n_pushes = 0
        self._cpu = plan.actor.devices.flat[0].platform == "cpu"

    @property
    def wire_bytes_per_param(self) -> float:
        return self.wire_bytes / max(self.n_params, 1)

    def wants_verify(self) -> bool:
        """Whether the next push verifies (every `verify_every`-th push, the first included)."""
        return self.verify_every > 0 and self.n_pushes % self.verify_every == 0

    def stage_tensor(self, t: _Tensor, x, verify: bool) -> tuple[list, list, Any]:
        """Actor side: (staged wire arrays on the actor mesh, their transfer-mesh views, verification row | None).
        One jit (`verify.stage_wires`, as the in-process push): cast to `dense_dtype`, quantise with
        `quant.quantize_rollout_fp8` for an FP8-stored tensor, lay every wire array out in the rollout's tiling."""
        mesh = t.actor_sharding.mesh
        with jax.set_mesh(mesh):
            outs, row = stage_wires(x, t.dense_dtype, t.qmeta, tuple(w.staged_sharding for w in t.wires), verify)
        if self._cpu:  # one program at a time: concurrent collectives deadlock on CPU (gloo)
            jax.block_until_ready((outs, row))
        views = []
        for w, y in zip(t.wires, outs):
            local = {s.device: s.data for s in y.addressable_shards}
            shards = [local[d] for d in w.transfer_sharding.mesh.devices.flat if d in local]
            views.append(jax.make_array_from_single_device_arrays(w.shape, w.transfer_sharding, shards,
                                                                  dtype=w.wire_dtype))
        return list(outs), views, row

    def _arrived(self, chunk: list[_Tensor], out: list) -> list:
        """Rollout side: the chunk's arrivals (a hook for tests that corrupt one)."""
        return out

    def _handoff(self, tag: str, sender: str, what: str) -> None:
        """`sender`'s processes (ACTOR or ROLLOUT) confirm `tag` on the channel; the other role's processes wait
        for all of them (`PeerTimeoutError` naming the silent side, with `what`, after --push-timeout)."""
        if (self.layout.is_actor if sender == ACTOR else self.layout.is_rollout):
            self.channel.ack(tag)
        else:
            self.channel.wait_acks(tag, sender, what)

    def push(self, params, version: int, *, verify: bool | None = None) -> PushStats:
        """Push `params` (actor processes: {key: array} / nnx.State of the learner's tensors; rollout processes:
        None) as weight `version`. Every process calls it in the same order (verify None: the `verify_every`
        schedule, the same on every process). Rollout processes swap the new weights into the sampler after every
        chunk arrived (and, when verifying, passed). Returns PushStats (this process's wall time; `metrics()`:
        {"perf/weight_push_s", "perf/weight_push_gbps"}). Raises PeerTimeoutError naming the side that did not
        confirm in time, MpmdPushVerificationError (both roles) when a tensor's checksums differ or a check fails."""
        t0 = time.perf_counter()
        verify = self.wants_verify() if verify is None else bool(verify)
        lay = self.layout
        flat = flat_state(params) if lay.is_actor else None
        arrived, a_rows = {}, {}
        try:
            for c, chunk in enumerate(self.chunks):
                staged, handles = [], []
                for t in chunk:
                    if lay.is_actor:
                        ys, views, row = self.stage_tensor(t, flat[t.key], verify)
                        staged += ys
                        if verify:
                            a_rows[t.key] = row
                    else:
                        # a handle on the actor's devices: no local shards, hence dtype= (the callback is never read)
                        views = [jax.make_array_from_single_device_arrays(w.shape, w.transfer_sharding, [],
                                                                          dtype=w.wire_dtype) for w in t.wires]
                    handles += views
                # the rollout's device_put waits for the actor's transfer servers only jax's fixed transfer timeout:
                # it starts once every actor process has staged the chunk (compiles may take long; liveness-checked)
                where = f"weight push of version {version}, chunk {c + 1}/{len(self.chunks)}"
                self._handoff(f"staged/{version}/{c}", ACTOR, f"{where} was not staged")
                out = jax.device_put(handles, [w.rollout_sharding for t in chunk for w in t.wires], may_alias=False)
                if lay.is_rollout:
                    jax.block_until_ready(out)
                    out = iter(self._arrived(chunk, out))
                    for t in chunk:
                        arrived[t.key] = tuple(next(out) for _ in t.wires)
                # the receiver holds its copies: only now may the sender free the staged buffers
                self._handoff(f"push/{version}/{c}", ROLLOUT, f"{where} was not confirmed")
                for y in staged:
                    y.delete()
            if verify:
                self._verify(version, a_rows, arrived)
        except BaseException:
            for x in jax.tree.leaves(list(arrived.values())):
                if not x.is_deleted():
                    x.delete()
            raise
        if lay.is_rollout:
            self.sampler.set_weights(self._assemble(arrived), version)
        self.n_pushes += 1
        return PushStats(version=int(version), seconds=time.perf_counter() - t0, bytes=self.wire_bytes,
                         n_tensors=len(self.tensors), n_params=self.n_params, n_chunks=len(self.chunks),
                         verified=verify)

    def _assemble(self, arrived: dict) -> dict:
        out = {}
        for t in self.tensors:
            a = arrived[t.key]
            if t.qmeta is None:
                out[t.key] = a[0]
            else:
                kind, fmt, block, shape = t.qmeta
                out[t.key] = quant.QuantizedTensor(q=a[0], scale=a[1], kind=kind, fmt=fmt, block=block, shape=shape)
        return out

    def _verify(self, version: int, a_rows: dict, arrived: dict) -> None:
        """Checksums of both sides compared on the rollout processes (`parallel.push.verify`; the actor's rows travel
        through the HostChannel, ROW_TERMS uint32 per tensor); the verdict travels back so every process of both
        roles raises the same MpmdPushVerificationError."""
        lay, ch = self.layout, self.channel
        if lay.is_actor:
            rows = {k: _host_row(r) for k, r in a_rows.items()}
            if lay.process == lay.writer:
                ch.publish(f"verify/{version}/actor", rows)
        if lay.is_rollout:
            r_rows = {}
            for t in self.tensors:  # one program at a time: concurrent collectives deadlock on CPU (gloo)
                with jax.set_mesh(self.plan.rollout):
                    row = stored_row(arrived[t.key], tuple(
                        slab_loop(w.shape, w.rollout_sharding, max(self.chunk_bytes // 16, 1024)) for w in t.wires))
                r_rows[t.key] = _host_row(row)
            rows = rows if lay.is_actor else ch.receive(f"verify/{version}/actor", ACTOR,
                                                        f"the actor's checksums of weight version {version}")
            failures = []
            for t in self.tensors:
                failures += [(t.key, why) for why in row_failures(rows[t.key], r_rows[t.key], t.dense_dtype)]
            if lay.process == min(lay.rollout_processes) and not lay.is_actor:
                ch.publish(f"verify/{version}/verdict", failures)
        else:
            failures = ch.receive(f"verify/{version}/verdict", ROLLOUT,
                                  f"the rollout's verdict on weight version {version}")
        if failures:
            raise MpmdPushVerificationError(version, failures)


def _host_row(row) -> np.ndarray:
    """A verification row (uint32[ROW_TERMS], replicated on its mesh, possibly spanning processes) on the host."""
    if not row.sharding.is_fully_replicated:
        row = jax.jit(lambda r: r, out_shardings=NamedSharding(row.sharding.mesh, PartitionSpec()))(row)
    return np.asarray(row.addressable_data(0))
