"""Actor -> rollout weight push in one process: one new weight version per call of `WeightPusher.push` (house
rule 9; the `protocol.Pusher` of the in-process layouts).

    pusher = WeightPusher(plan, sampler, nnx.state(nnx.eval_shape(make_model)))   # plans, compiles, warms up
    stats = pusher.push(learner.params_for_push(), version=step)
    log(stats.metrics())   # {"perf/weight_push_s": stats.seconds, "perf/weight_push_gbps": stats.gbps}

What a push does, chunk by chunk (`chunk_bytes` of wire bytes; a tensor larger than that travels alone); keys are
nnx paths joined by "/", e.g. "layers/1/ffn/experts/w1" [E, I, D], "layers/0/ffn/gate/tid2eid":

1. Stage (actor mesh, `_stage_chunk`): one jit per tensor (`verify.stage_wires`) reads the fp32 master weight and
   writes its *wire arrays* in a *transfer layout*. Dense tensors travel in the dtype the sampler stores them in
   (bf16; f32 for mHC, sinks, ape and the router selection bias, which decides routing and must not be rounded; int32
   `tid2eid`). Quantised tensors (the sampler stores a `dsv4.quant.QuantizedTensor`), with `quantize_on="actor"` (the
   default): quantised right here by `dsv4.quant.quantize_rollout_fp8` (the one path from learner weights to rollout
   FP8 weights: bf16 rounding, e4m3 128x128 blocks, f32 scales, exact fnuz conversion) and sent as (q fp8, scale
   f32): 1 B per parameter + 4 B per 16,384, about half of bf16. With `quantize_on="rollout"` they travel as bf16 and
   step 3 quantises them. Only one replica works: a tensor the actor replicates over some axes (e.g. `data=3`) is
   viewed, without a copy, on the sub-mesh at index 0 of those axes. Dense tensors whose dtype and layout need no
   change skip the jit. Why a transfer layout: `transfer.py`.
2. Transfer (`_transfer_chunk`): one `jax.device_put` of the chunk's wire arrays onto the rollout mesh,
   `block_until_ready`, then the actor-side copies are deleted explicitly (cross-mesh donation does not free the
   source on CPU, docs/jax-stack.md §2.3). Colocated plans (rollout mesh = actor mesh): step 1 writes the final
   rollout layout and nothing crosses meshes (quantisation then always runs in step 1).
3. Land (rollout mesh, `_land_chunk`): where needed, one jit per tensor finishes a reshard (below) or, with
   `quantize_on="rollout"`, quantises the bf16 arrival with the same `quantize_rollout_fp8`; the arrivals it
   replaced are deleted before the next chunk. The outputs are the next weight version's own buffers.
4. Optional verification (`verify.py`: the checks and the e4m3 bound); then `sampler.set_weights(new_state,
   version)`: the swap happens only after every tensor arrived and passed, so a failed push leaves the previous
   version live.

Where to quantise (measured: benchmarks/weight_push.py, benchmarks/README.md "Weight push"): on the actor.
- Wire bytes: 1 B + 4 B per 16,384 instead of 2 B per FP8-stored parameter (small config, whole model: 1.10
  instead of 2.01 B per parameter; embedding and head stay bf16).
- Rollout memory: the arrivals of an actor-quantised tensor already are the stored (q, scale), so a push adds
  nothing on a rollout device beyond the new state, except arrivals that need a rollout-side reshard (small config
  6/2: peak = exactly 2 states); quantising on arrival keeps a bf16 chunk plus the quantise jit's temporaries live
  (+131 MiB there, with the whole small model in one 256 MiB chunk).
- Work: the same arithmetic either way; on the seed layout 16 actor devices share the quantisation that 8 rollout
  devices would do, and the rollout mesh is free for generation meanwhile. On 8 CPU host devices sharing 2 loaded
  cores the two take about the same time (best of 3: 0.86 vs 0.78 s), so CPU time did not decide it.
`quantize_on="rollout"` stays available (benchmark comparisons; meshes where the actor is the bottleneck).

Peak memory (`WeightPusher.memory()`, `memory.py`): rollout = 2 quantised states + the largest chunk extra
(verification included), never a bf16 copy of the model; actor = one chunk of staged wire arrays + the largest
stage temp, on top of the learner's own state.

Compilation: stage, land and reshard jits are keyed by shapes, dtypes and shardings, so repeated layer shapes
share programs; the stored-state verification program is compiled ahead of time. `WeightPusher.__init__` runs two
dry pushes of zeros (verified and not; chunk by chunk, built per shard with `jax.make_array_from_callback`, never
a whole-model host copy) through every stage and drops them, so the first real push is steady state and later
pushes compile nothing (tests/parallel/test_push.py counts backend compiles).

Ideas from Tunix (`rl/reshard.py::reshard_pytree`: device_put fallback, PRNG keys unwrapped;
`generate/utils.py::_reshard_in_chunks`: key groups with `block_until_ready` between them; `rl_cluster.py::
sync_weights`: transfer guards around the sync) and the jax docs on `jax.device_put` / transfer guards; written
here from scratch. Tests: `.venv/bin/python -m pytest -q tests/parallel/test_push.py`;
benchmark: `.venv/bin/python benchmarks/weight_push.py`.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from dsv4 import quant
from parallel.push.memory import PushMemory, push_memory
from parallel.push.protocol import PushStats, PushVerificationError
from parallel.push.tensors import TensorPlan, dev_bytes, plan_tensors
from parallel.push.transfer import (as_sharding, buffer_ids, cast_reshard, check_keys, chunked, flat_state,
                                    view_on)
from parallel.push.verify import dense_row, land_quantize, row_failures, stage_wires, stored_row
from sharding.mesh import auto_axes

DEFAULT_CHUNK_BYTES = 256 * 2**20
QUANTIZE_ON = ("actor", "rollout")
DEFAULT_QUANTIZE_ON = "actor"  # chosen by measurement: module docstring, benchmarks/README.md


class WeightPusher:
    """Plans, compiles and warms up the actor -> rollout push for one sampler; call `push` to push.

    Args:
      plan_or_meshes: a `sharding.mesh.MeshPlan` or an (actor_mesh, rollout_mesh) pair (the same Mesh twice, or a
        colocated plan, = colocated). The rollout mesh must be `sampler.mesh`.
      sampler: an `rl.rollout.engine.Sampler` built on a mesh, holding a weight state (version 0 at the latest): its
        `rollout_shardings()`, `weight_state()` (dtypes, quantisation format and shardings of what it stores) and
        `set_weights` are used.
      abstract_actor_state: nnx.State / Module / {key: ShapeDtypeStruct or array} of every tensor the learner
        pushes (fp32 master Params + Buffers), e.g. `nnx.state(nnx.eval_shape(make_model))`.
      actor_shardings: {key: NamedSharding} of the actor arrays; default: each leaf's own `.sharding` when it has
        one, else `plan.param_shardings("actor", abstract_actor_state)` (needs a MeshPlan).
      chunk_bytes: wire bytes per device_put group (a tensor larger than that travels alone).
      verify_every: verify every k-th push when `push(verify=None)` (1 = always, 0 = never).
      quantize_on: "actor" (default: quantised tensors cross as fp8 blocks + scales) or "rollout" (they cross as
        bf16 and are quantised chunk by chunk on arrival); colocated plans always quantise in the one jit.
      warmup: run the dry pushes now (default True).
      only: None (default: every tensor of the sampler), or a predicate on tensor keys: the push moves those
        tensors alone and the sampler keeps its others as stored (e.g. `dsv4.lora.is_adapter_key`: a LoRA push moves
        the adapters, the rollout applies them unmerged over its base); `abstract_actor_state` and `push`'s params
        may hold more keys (they are filtered). Verified as any push (per tensor pushed).
    Raises:
      ValueError: a key-set mismatch with the sampler (lists missing and unexpected keys), a shape mismatch, a
        sampler without a mesh, weights or on another mesh, missing actor shardings, an unknown quantize_on.
    """

    def __init__(self, plan_or_meshes, sampler, abstract_actor_state, *, actor_shardings=None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify_every: int = 1,
                 quantize_on: str = DEFAULT_QUANTIZE_ON, warmup: bool = True, only=None):
        if isinstance(plan_or_meshes, tuple):
            actor_mesh, rollout_mesh = plan_or_meshes
            plan = None
        else:
            plan, actor_mesh, rollout_mesh = plan_or_meshes, plan_or_meshes.actor, plan_or_meshes.rollout
        actor_mesh, rollout_mesh = auto_axes(actor_mesh), auto_axes(rollout_mesh)  # sharding.mesh.auto_axes
        if sampler.mesh is None or sampler.mesh != rollout_mesh:
            raise ValueError("WeightPusher: the sampler must be built on the plan's rollout mesh "
                             f"(sampler.mesh={sampler.mesh}, rollout mesh={rollout_mesh})")
        if chunk_bytes < 1 or verify_every < 0:
            raise ValueError(f"WeightPusher: chunk_bytes must be >= 1 and verify_every >= 0, got {chunk_bytes}, "
                             f"{verify_every}")
        if quantize_on not in QUANTIZE_ON:
            raise ValueError(f"WeightPusher: quantize_on={quantize_on!r}; expected one of {', '.join(QUANTIZE_ON)}")
        if sampler.weight_state() is None:
            raise ValueError("WeightPusher: the sampler holds no weights yet (set_weights first): the push copies "
                             "the stored dtypes, quantisation format and shardings from its weight state")
        self.sampler, self.actor_mesh, self.rollout_mesh = sampler, actor_mesh, rollout_mesh
        self.colocated = actor_mesh == rollout_mesh
        self.quantize_on = "actor" if self.colocated else quantize_on
        self.chunk_bytes, self.verify_every = int(chunk_bytes), int(verify_every)
        self.n_pushes = 0
        # XLA:CPU runs the per-device parts of every multi-device program on one shared thread pool; with hundreds
        # of small collective programs in flight on few cores their rendezvous starve each other (seen: a 40 s
        # all-gather rendezvous abort with a 6-device actor on 2 cores). On CPU each reshard program is therefore
        # waited for before the next is dispatched; GPUs order collectives per stream and keep the async dispatch.
        self._one_at_a_time = actor_mesh.devices.flat[0].platform == "cpu"
        self.only = only
        abstract = self._selected(flat_state(abstract_actor_state))
        rollout_sh = self._selected(sampler.rollout_shardings())
        check_keys(abstract, rollout_sh, "WeightPusher")
        if actor_shardings is None:
            actor_shardings = {k: getattr(v, "sharding", None) for k, v in abstract.items()}
            if any(not isinstance(s, NamedSharding) for s in actor_shardings.values()):
                if plan is None:
                    raise ValueError("WeightPusher: pass actor_shardings= or a MeshPlan, or leaves with shardings")
                actor_shardings = self._selected(flat_state(plan.param_shardings("actor", abstract_actor_state)))
        else:
            actor_shardings = self._selected(flat_state(actor_shardings))
        self.tensors = plan_tensors(abstract, actor_shardings, rollout_sh, sampler.weight_state(),
                                    colocated=self.colocated, quantize_on=self.quantize_on)
        self.chunks = chunked(self.tensors, self.chunk_bytes)
        self.wire_bytes = sum(t.nbytes for t in self.tensors)
        self.slab_elems = max(self._chunk_wire() // 32, 256)  # verification digests: `TensorPlan.slabs`
        self.n_params = sum(math.prod(t.shape) for t in self.tensors)
        if warmup:
            self.warmup()

    def _selected(self, flat: dict) -> dict:
        """{key: ...} restricted to the keys this pusher moves (`only`)."""
        return flat if self.only is None else {k: v for k, v in flat.items() if self.only(k)}

    # -------------------------------------------------------------- the three steps of a chunk

    def _stage_chunk(self, chunk: list[TensorPlan], src: dict, verify: bool) -> tuple[dict, dict]:
        """Step 1, actor mesh: {key: tuple of wire arrays in their transfer layouts}, {key: row} (verify).
        Wire arrays made by a jit are owned by the push (deleted after the transfer); the others are views."""
        staged, rows = {}, {}
        for t in chunk:
            x = view_on(src[t.key], t.source_sharding)
            if not t.actor_jit:
                staged[t.key] = (x,)
                if verify:
                    with jax.set_mesh(t.source_sharding.mesh):
                        rows[t.key] = dense_row(x)
                continue
            with jax.set_mesh(t.source_sharding.mesh):
                staged[t.key], row = stage_wires(x, *t.stage_args(verify))
            if verify:
                rows[t.key] = row
            if self._one_at_a_time:
                jax.block_until_ready(staged[t.key])
        jax.block_until_ready(list(staged.values()))
        return staged, rows

    def _transfer_chunk(self, chunk: list[TensorPlan], staged: dict) -> dict:
        """Step 2: the chunk's wire arrays onto their landing layouts (one device_put, device to device), then the
        actor-side copies the push owns are deleted. Colocated: jit outputs already are the rollout copy; views of
        the actor's arrays are copied (never aliased: the learner may donate its params)."""
        landed = dict(staged)
        put = [(t, i) for t in chunk if not (self.colocated and t.actor_jit) for i in range(len(t.wires))]
        if put:
            arrays = jax.device_put([staged[t.key][i] for t, i in put],
                                    [t.wires[i].landing_sharding for t, i in put], may_alias=False)
            got: dict = {}
            for (t, i), y in zip(put, arrays):
                got.setdefault(t.key, [None] * len(t.wires))[i] = y
            landed.update({k: tuple(v) for k, v in got.items()})
        jax.block_until_ready(list(landed.values()))
        for t in chunk:
            if t.actor_jit and not self.colocated:
                for x in staged[t.key]:
                    x.delete()
        return landed

    def _land_chunk(self, chunk: list[TensorPlan], landed: dict, verify: bool) -> tuple[dict, dict]:
        """Step 3, rollout mesh: quantisation on arrival / reshards to the stored layouts; the replaced arrivals are
        deleted. Returns ({key: tuple of stored arrays}, {key: row of the arrival} for tensors quantised here)."""
        out, rows = dict(landed), {}
        todo = [t for t in chunk if t.land_jit]
        with jax.set_mesh(self.rollout_mesh):
            for t in todo:
                arrived = landed[t.key]
                if t.land_quantize:
                    out[t.key], row = land_quantize(arrived[0], t.qmeta, t.out_shardings, verify)
                    if verify:
                        rows[t.key] = row
                else:
                    out[t.key] = tuple(x if w.landing_sharding == w.rollout_sharding
                                       else cast_reshard(x, w.dtype, w.rollout_sharding)
                                       for x, w in zip(arrived, t.wires))
                if self._one_at_a_time:
                    jax.block_until_ready(out[t.key])
        jax.block_until_ready([out[t.key] for t in todo])
        for t in todo:
            kept = set().union(*(buffer_ids(y) for y in out[t.key]))
            for x in landed[t.key]:
                if not x.is_deleted() and not (buffer_ids(x) & kept):
                    x.delete()
        for t in chunk:
            out[t.key] = tuple(as_sharding(y, sh) for y, sh in zip(out[t.key], t.out_shardings))
            if verify and not t.land_quantize:  # the checksums of what the sampler will store
                with jax.set_mesh(self.rollout_mesh):
                    rows[t.key] = stored_row(out[t.key], t.slabs(self.slab_elems))
                if self._one_at_a_time:
                    rows[t.key].block_until_ready()
        return out, rows

    def _chunk_wire(self) -> int:
        """The most wire bytes one chunk lands on a rollout device (`PushMemory.chunk_wire`)."""
        return max((sum(dev_bytes(w.shape, w.dtype, w.landing_sharding) for t in chunk for w in t.wires)
                    for chunk in self.chunks), default=0)

    def _move_chunk(self, chunk: list[TensorPlan], src: dict, times: dict, verify: bool = False):
        """One chunk through steps 1-3 -> ({key: tuple of stored arrays}, actor rows, rollout rows)."""
        t0 = time.perf_counter()
        staged, actor_rows = self._stage_chunk(chunk, src, verify)
        t1 = time.perf_counter()
        landed = self._transfer_chunk(chunk, staged)
        t2 = time.perf_counter()
        stored, rollout_rows = self._land_chunk(chunk, landed, verify)
        times["cast_s"] += t1 - t0
        times["transfer_s"] += t2 - t1
        times["quantize_s"] += time.perf_counter() - t2
        return stored, actor_rows, rollout_rows

    # -------------------------------------------------------------- the new state and its checks

    def _assemble(self, arrays: dict) -> dict:
        """{key: tuple of stored arrays} -> the sampler's weight state {key: QuantizedTensor | array}."""
        out = {}
        for t in self.tensors:
            a = arrays[t.key]
            if t.quantized:
                kind, fmt, block, shape = t.qmeta
                out[t.key] = quant.QuantizedTensor(q=a[0], scale=a[1], kind=kind, fmt=fmt, block=block, shape=shape)
            else:
                out[t.key] = a[0]
        return out

    def _verdict(self, actor_rows: dict, rollout_rows: dict) -> list[tuple[str, str]]:
        # one small explicit transfer: ROW_TERMS uint32 per tensor and side
        a_vals, r_vals = jax.device_get((list(actor_rows.values()), list(rollout_rows.values())))
        arows, rows = dict(zip(actor_rows, a_vals)), dict(zip(rollout_rows, r_vals))
        failures = []
        for t in self.tensors:
            reasons = row_failures(arows[t.key], rows[t.key], t.dense_dtype)
            failures += [(t.key, why) for why in reasons]
        return failures

    # -------------------------------------------------------------- a push

    def push(self, params, version: int, *, verify: bool | None = None) -> PushStats:
        """Push the actor's weights to the sampler as weight `version` (`protocol.Pusher`).

        Args:
          params: nnx.State / Module / {key: array} of every model tensor (fp32 master Params + Buffers) on the
            actor mesh, in the shardings the pusher was planned with (e.g. `Learner.params_for_push()`).
          version: new weight version; must exceed `sampler.weight_version`.
          verify: True / False, or None = the `verify_every` schedule (`wants_verify`).
        Returns:
          PushStats (seconds, wire bytes, GB/s, chunks, stage times); `stats.metrics()` gives the loop's
          `perf/weight_push_s` and `perf/weight_push_gbps`.
        Raises:
          ValueError: a non-increasing version, a key-set mismatch (lists missing and unexpected keys), a tensor of
            another shape/dtype/sharding than planned (named; it would otherwise recompile).
          PushVerificationError: the rollout copy failed verification (tensors named); the old version stays live.
        """
        if version <= self.sampler.weight_version:
            raise ValueError(f"push: version {version} must exceed the live version {self.sampler.weight_version}")
        flat = self._selected(flat_state(params))
        check_keys(flat, {t.key: t for t in self.tensors}, "push")
        for t in self.tensors:
            x = flat[t.key]
            if tuple(x.shape) != t.shape or np.dtype(x.dtype) != t.actor_dtype:
                raise ValueError(f"push: {t.key} is {x.dtype}{list(x.shape)}, planned {t.actor_dtype}{list(t.shape)}")
            if not x.sharding.is_equivalent_to(t.actor_sharding, len(t.shape)):
                raise ValueError(f"push: {t.key} has sharding {x.sharding}, planned {t.actor_sharding}")
        stats = self._push(flat, int(version), self.wants_verify() if verify is None else bool(verify))
        self.n_pushes += 1
        return stats

    def _push(self, src: dict, version: int, verify: bool) -> PushStats:
        """The push proper, on checked inputs (`push`)."""
        start = time.perf_counter()
        times = dict(cast_s=0.0, transfer_s=0.0, quantize_s=0.0, verify_s=0.0)
        arrays, actor_rows, rollout_rows = {}, {}, {}
        try:
            for chunk in self.chunks:
                stored, ra, rr = self._move_chunk(chunk, src, times, verify)
                arrays.update(stored)
                actor_rows.update(ra)
                rollout_rows.update(rr)
        except BaseException:
            _delete(arrays)
            raise
        wstate = self._assemble(arrays)
        t1 = time.perf_counter()
        failures = self._verdict(actor_rows, rollout_rows) if verify else []
        times["verify_s"] = time.perf_counter() - t1
        if failures:
            _delete(wstate)
            raise PushVerificationError(version, failures)
        if self.only is not None:  # the tensors not pushed stay as stored
            wstate = {**self.sampler.weight_state(), **wstate}
        self.sampler.set_weights(wstate, version)
        if verify and self.sampler.weight_version != version:
            raise PushVerificationError(version, [("<version>", f"sampler reports {self.sampler.weight_version}")])
        seconds = time.perf_counter() - start
        return PushStats(version=version, seconds=seconds, bytes=self.wire_bytes, n_chunks=len(self.chunks),
                         n_tensors=len(self.tensors), verified=verify, colocated=self.colocated, n_params=self.n_params,
                         quantize_on=self.quantize_on, **times)

    def _zeros(self, chunk: list[TensorPlan]) -> dict:
        """Actor-side zeros of a chunk, made shard by shard (never a whole-model host copy)."""
        out = {}
        for t in chunk:
            sh = t.actor_sharding
            out[t.key] = jax.make_array_from_callback(
                t.shape, sh, lambda idx, t=t, sh=sh: np.zeros(sh.shard_shape(t.shape), t.actor_dtype),
                dtype=t.actor_dtype)
        return out

    def warmup(self) -> float:
        """Two dry pushes of zeros (verified, then not) through every step, then dropped; returns their seconds.

        Zeros are made one chunk at a time, shard by shard, so the actor side holds at most one chunk of extra
        arrays, as in a real push; every program of a real push is compiled here."""
        start = time.perf_counter()
        for verify in (True, False):
            times = dict(cast_s=0.0, transfer_s=0.0, quantize_s=0.0)
            arrays, rows = {}, []
            for chunk in self.chunks:
                zeros = self._zeros(chunk)
                stored, ra, rr = self._move_chunk(chunk, zeros, times, verify)
                arrays.update(stored)
                rows += [*ra.values(), *rr.values()]
                _delete(zeros)
            wstate = self._assemble(arrays)
            jax.block_until_ready(rows)
            _delete(wstate)
        return time.perf_counter() - start

    def wants_verify(self) -> bool:
        """Whether the next `push(verify=None)` verifies (every `verify_every`-th push, the first included)."""
        return self.verify_every > 0 and self.n_pushes % self.verify_every == 0

    # -------------------------------------------------------------- memory

    def memory(self) -> PushMemory:
        """Per-device peak bytes of a push (`memory.push_memory`: array layouts and XLA's `memory_analysis()` of
        the compiled stage, land and check programs)."""
        return push_memory(self)


def _delete(tree) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()



class SamplerPusher:
    """The push without a mesh plan (`protocol.Pusher`): `sampler.update_weights` casts / quantises the learner's
    params itself (tests, single-device runs). `push` returns PushStats with bytes = 2 B per parameter (bf16) and
    quantize_on "rollout"; raises what `update_weights` raises."""

    def __init__(self, sampler):
        self.sampler = sampler

    def push(self, params, version: int) -> PushStats:
        t0 = time.perf_counter()
        leaves = jax.tree.leaves(params)
        self.sampler.update_weights(params, version)
        jax.block_until_ready(jax.tree.leaves(self.sampler.weight_state()))
        return PushStats(version=int(version), seconds=time.perf_counter() - t0,
                         bytes=sum(int(np.prod(x.shape)) * 2 for x in leaves), n_tensors=len(leaves),
                         n_params=sum(int(np.prod(x.shape)) for x in leaves), quantize_on="rollout")
