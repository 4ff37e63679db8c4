"""Actor -> rollout weight push: one new weight version per call of `push_weights` (house rule 9).

    pusher = WeightPusher(plan, sampler, nnx.state(nnx.eval_shape(make_model)))   # plans, compiles, warms up
    stats = push_weights(pusher, learner.params_for_push(), sampler, version=step)
    log({"perf/weight_push_s": stats.seconds, "perf/weight_push_gbps": stats.gbps})

What a push does, chunk by chunk (`chunk_bytes` of wire bytes; a tensor larger than that travels alone); keys are
nnx paths joined by "/", e.g. "layers/1/ffn/experts/w1" [E, I, D], "layers/0/ffn/gate/tid2eid":

1. Stage (actor mesh, `_stage_chunk`): one jit per tensor reads the fp32 master weight and writes its *wire
   arrays* in a *transfer layout*. Dense tensors travel in the dtype the sampler stores them in (bf16; f32 for
   mHC, sinks, ape and the router selection bias, which decides routing and must not be rounded; int32
   `tid2eid`). Quantised tensors (the sampler stores a `dsv4.quant.QuantizedTensor`), with `quantize_on="actor"`
   (the default): quantised right here by `dsv4.quant.quantize_rollout_fp8` (the one path from learner weights to
   rollout FP8 weights: bf16 rounding, e4m3 128x128 blocks, f32 scales, exact fnuz conversion) and sent as
   (q fp8, scale f32): 1 B per parameter + 4 B per 16,384, about half of bf16. With `quantize_on="rollout"` they
   travel as bf16 and step 3 quantises them. Only one replica works: a tensor the actor replicates over some axes
   (e.g. `data=3`) is viewed, without a copy, on the sub-mesh at index 0 of those axes. Dense tensors whose dtype
   and layout need no change skip the jit.
2. Transfer (`_transfer_chunk`): one `jax.device_put` of the chunk's wire arrays onto the rollout mesh,
   `block_until_ready`, then the actor-side copies are deleted explicitly (cross-mesh donation does not free the
   source on CPU, docs/jax-stack.md §2.3). Colocated plans (rollout mesh = actor mesh): step 1 writes the final
   rollout layout and nothing crosses meshes (quantisation then always runs in step 1).
3. Land (rollout mesh, `_land_chunk`): where needed, one jit per tensor finishes a reshard (below) or, with
   `quantize_on="rollout"`, quantises the bf16 arrival with the same `quantize_rollout_fp8`; the arrivals it
   replaced are deleted before the next chunk. The outputs are the next weight version's own buffers.
4. Optional verification (below); then `sampler.set_weights(new_state, version)`: the swap happens only after
   every tensor arrived and passed, so a failed push leaves the previous version live.

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

Peak memory (`WeightPusher.memory()`, per device, from the array layouts and XLA's `memory_analysis()` of every
compiled push program): rollout = 2 quantised states (the live one and the one being built) + the largest chunk
extra (arrivals that a land jit replaces + the largest temp of that chunk's rollout programs); a verified push
adds the largest per-tensor verification temp instead when that is larger. The rollout-side digests loop over
slabs of at most 1/32 of the largest chunk's wire bytes per device (in elements; XLA:CPU materialises the u32 input
of every integer reduction, ~12-14 B per element of a slab, and each slab is cut inside a `lax.cond` so that no
whole-tensor f32 / f16 copy of a bf16 / fp8 array is made, `push_verify._digest_terms`), so a verified push also
stays within 2 states + one chunk (tests/sharding/test_push.py). Never a bf16 copy of the model. Actor = one chunk
of staged wire arrays + the largest stage temp, on top of the learner's own state.

Why a transfer layout. In jax 0.10.2 a single-process `device_put` between meshes takes one of two paths
(`jax/_src/array.py::_array_shard_arg`): if every destination shard's index range exists as a source shard, the
buffers are copied device to device; otherwise it materialises the *whole array on the host* (`x._value`) and
uploads it (seen on CPU: `transfer_guard_host_to_device("disallow_explicit")` trips; the plain "disallow" level
and the device-to-host guard do not, so this round trip is easy to miss). So step 1 reshards on the actor mesh
to a spec that cuts every dim into the same number of pieces as the rollout spec (same index ranges, any device
order); if the actor mesh cannot express that split (e.g. actor axes 3 x 2, rollout tensor=4), it uses the
largest split both meshes can express that divides the rollout's, and step 3 finishes the reshard. The scales of
an actor-quantised tensor get their own transfer layout (the sampler replicates them today).

Verification (`verify=True`, or every `verify_every`-th push): per tensor a row of 10 uint32 terms is computed on
the actor side (in the stage jit, from exactly the wire arrays it sends) and on the rollout side (for tensors
quantised on arrival: in the land jit, from the bf16 that arrived; for everything else: one program over the
stored new state), see `_row`. They must agree on the position-weighted 32-bit checksum pair of every wire array
(fp8 q and f32 scales bitwise; int hash tables and f32/bf16 tensors bitwise); nothing may be NaN/inf (the actor
weight, the rollout copy, FP8 after dequantisation); integer tables must not be all zero (an all-zero `tid2eid`
routes every token to expert 0: the failure of stacks that forget buffers); and every FP8 element must satisfy
the e4m3 rounding bound
    |q * s - w| <= (eps/2 + 2^-20) |w| + (1 + 2^-20) * (smallest_subnormal/2) * s + tiny_f32
where w is the bf16 weight that was quantised, s its block's scale, eps/smallest_subnormal from `jnp.finfo` of the
fp8 dtype (e4m3fn: eps = 2^-3, subnormal step 2^-9; e4m3fnuz: 2^-3, 2^-10). Derivation: y = fl(w / s) has
relative error 2^-24; clipping at +-fmax moves y by at most 2^-22 fmax because s >= amax/fmax up to rounding;
round-to-nearest-even to e4m3 errs by at most half a spacing, i.e. eps/2 |y| for normals and
smallest_subnormal/2 below the normal range; q * s adds another 2^-24 relative; tiny_f32 covers the FTZ of
f32-subnormal inputs on XLA:CPU. Failure raises `PushVerificationError` naming every bad tensor and the reason;
the new state is deleted and the old version stays live. The verdicts come to the host as one small
`device_get` (10 uint32 per tensor and side), the only device-to-host traffic of a push.

Compilation: stage, land and reshard jits are keyed by shapes, dtypes and shardings, so repeated layer shapes
share programs; the stored-state verification program is compiled ahead of time. `WeightPusher.__init__` runs two
dry pushes of zeros (verified and not; chunk by chunk, built per shard with `jax.make_array_from_callback`, never
a whole-model host copy) through every stage and drops them, so the first real push is steady state and later
pushes compile nothing (tests/sharding/test_push.py counts backend compiles).

Ideas from Tunix (`rl/reshard.py::reshard_pytree`: device_put fallback, PRNG keys unwrapped;
`generate/utils.py::_reshard_in_chunks`: key groups with `block_until_ready` between them; `rl_cluster.py::
sync_weights`: transfer guards around the sync) and the jax docs on `jax.device_put` / transfer guards; written
here from scratch. Tests: `.venv/bin/python -m pytest -q tests/sharding/test_push.py`;
benchmark: `.venv/bin/python benchmarks/weight_push.py`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from dsv4 import quant
from parallel.push_verify import (ROW_TERMS, _dense_row, _land_quantize, _row, _slab, _stage, _stored_row,
                                  row_failures)
from parallel.transfer import (FP8_SOURCE_DTYPE, _as_sharding, _buffers, _cast_reshard, _check_keys, _flat,
                               _one_copy, _quantize_as, _transfer_layout, _view)
from sharding.mesh import auto_axes

DEFAULT_CHUNK_BYTES = 256 * 2**20
QUANTIZE_ON = ("actor", "rollout")
DEFAULT_QUANTIZE_ON = "actor"  # chosen by measurement: module docstring, benchmarks/README.md


class PushVerificationError(RuntimeError):
    """A push whose rollout copy is not faithful. `failures`: [(tensor key, reason)]; the old version stays live."""

    def __init__(self, version: int, failures: list[tuple[str, str]]):
        self.version, self.failures = version, failures
        lines = "\n".join(f"  {k}: {r}" for k, r in failures[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        super().__init__(f"weight push of version {version} failed verification for {len(failures)} tensor(s); "
                         f"the sampler keeps version in use:\n{lines}{more}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PushStats:
    """One push. bytes: wire bytes (global sizes x itemsize of what crossed: fp8 q + f32 scales for tensors
    quantised on the actor, bf16 for those quantised on arrival, the stored dtype for dense tensors); gbps =
    bytes / seconds / 1e9 with seconds the wall time of the whole push (incl. quantisation, and verification when
    `verified`); n_params: parameters pushed (so `wire_bytes_per_param` = bytes / n_params). Stage times: cast_s
    (actor jits: casts, actor-side quantisation), transfer_s (device_put), quantize_s (rollout jits: reshards,
    quantisation on arrival), verify_s. colocated: no cross-mesh transfer happened."""

    version: int
    seconds: float
    bytes: int
    gbps: float
    n_chunks: int
    n_tensors: int
    verified: bool
    colocated: bool
    cast_s: float = 0.0
    transfer_s: float = 0.0
    quantize_s: float = 0.0
    verify_s: float = 0.0
    n_params: int = 0
    quantize_on: str = DEFAULT_QUANTIZE_ON

    @property
    def wire_bytes_per_param(self) -> float:
        return self.bytes / max(self.n_params, 1)

    def metrics(self) -> dict[str, float]:
        return {"perf/weight_push_s": self.seconds, "perf/weight_push_gbps": self.gbps}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PushMemory:
    """Per-device bytes of a push (`WeightPusher.memory()`), from array layouts and XLA's `memory_analysis()` of the
    compiled push programs (worst device).

    state: one quantised rollout weight state. chunk: the most one chunk adds on a rollout device on top of the
    live and the new state (arrivals that a land jit replaces + the largest temp among that chunk's rollout
    programs). check: the largest temp of the rollout-side verification programs (one per tensor, run after its
    chunk landed; slab loops of <= 1/32 of chunk_wire in elements, ~12-14 B of temp per slab element on XLA:CPU,
    so check < chunk_wire). peak = 2 * state + chunk (a push without verification);
    peak_verified = 2 * state + max(chunk, check). chunk_wire: the most wire bytes one chunk lands on a rollout
    device (the "one chunk" of the bound peak <= 2 * state + chunk_wire). actor_chunk: the most one chunk holds on
    an actor device (staged wire arrays + the largest stage temp, verification included)."""

    state: int
    chunk: int
    check: int
    peak: int
    peak_verified: int
    chunk_wire: int
    actor_chunk: int


@dataclasses.dataclass(frozen=True)
class _Wire:
    """One array on the wire: global shape, dtype, layout on the actor mesh (transfer), where it lands on the
    rollout mesh (same pieces as transfer), and its final rollout layout."""

    shape: tuple[int, ...]
    dtype: Any
    transfer_sharding: NamedSharding
    landing_sharding: NamedSharding
    rollout_sharding: NamedSharding

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """Static plan of one tensor. dense_dtype: what the actor checks and sends dense (the stored dtype; bf16 for
    quantised tensors). qmeta: (kind, fmt, block, shape) of the stored QuantizedTensor, None = dense (metadata only:
    a plan never holds a weight). quantize_on: "actor" | "rollout" for quantised tensors, None for dense. wires: what
    crosses, (dense,) or (q, scale). out_shardings: the stored arrays' shardings, (array,) or (q, scale)."""

    key: str
    shape: tuple[int, ...]
    actor_dtype: Any
    dense_dtype: Any
    actor_sharding: NamedSharding
    source_sharding: NamedSharding  # one copy of the actor array (a sub-mesh view when the actor replicates it)
    qmeta: tuple | None
    quantize_on: str | None
    wires: tuple[_Wire, ...]
    out_shardings: tuple[NamedSharding, ...]
    actor_jit: bool  # a cast, quantisation or actor-side reshard is needed (else the actor array itself is sent)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.wires)

    @property
    def quantized(self) -> bool:
        return self.qmeta is not None

    @property
    def land_quantize(self) -> bool:
        return self.quantize_on == "rollout"

    @property
    def land_jit(self) -> bool:
        """A rollout-side jit replaces the arrivals (quantisation on arrival, or a reshard to finish)."""
        return self.land_quantize or any(w.landing_sharding != w.rollout_sharding for w in self.wires)


# ------------------------------------------------------------------------------------------ layouts


class WeightPusher:
    """Plans, compiles and warms up the actor -> rollout push for one sampler; call `push_weights` to push.

    Args:
      plan_or_meshes: a `sharding.mesh.MeshPlan` or an (actor_mesh, rollout_mesh) pair (the same Mesh twice, or a
        colocated plan, = colocated). The rollout mesh must be `sampler.mesh`.
      sampler: an `rl.sampler.Sampler` built on a mesh, holding a weight state (version 0 at the latest): its
        `rollout_shardings()`, `weight_state()` (dtypes, quantisation format and shardings of what it stores) and
        `set_weights` are used.
      abstract_actor_state: nnx.State / Module / {key: ShapeDtypeStruct or array} of every tensor the learner
        pushes (fp32 master Params + Buffers), e.g. `nnx.state(nnx.eval_shape(make_model))`.
      actor_shardings: {key: NamedSharding} of the actor arrays; default: each leaf's own `.sharding` when it has
        one, else `plan.param_shardings("actor", abstract_actor_state)` (needs a MeshPlan).
      chunk_bytes: wire bytes per device_put group (a tensor larger than that travels alone).
      verify_every: verify every k-th push when `push_weights(verify=None)` (1 = always, 0 = never).
      quantize_on: "actor" (default: quantised tensors cross as fp8 blocks + scales) or "rollout" (they cross as
        bf16 and are quantised chunk by chunk on arrival); colocated plans always quantise in the one jit.
      warmup: run the dry pushes now (default True).
    Raises:
      ValueError: a key-set mismatch with the sampler (lists missing and unexpected keys), a shape mismatch, a
        sampler without a mesh, weights or on another mesh, missing actor shardings, an unknown quantize_on.
    """

    def __init__(self, plan_or_meshes, sampler, abstract_actor_state, *, actor_shardings=None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify_every: int = 1,
                 quantize_on: str = DEFAULT_QUANTIZE_ON, warmup: bool = True):
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
        abstract = _flat(abstract_actor_state)
        rollout_sh = sampler.rollout_shardings()
        _check_keys(abstract, rollout_sh, "WeightPusher")
        if actor_shardings is None:
            actor_shardings = {k: getattr(v, "sharding", None) for k, v in abstract.items()}
            if any(not isinstance(s, NamedSharding) for s in actor_shardings.values()):
                if plan is None:
                    raise ValueError("WeightPusher: pass actor_shardings= or a MeshPlan, or leaves with shardings")
                actor_shardings = _flat(plan.param_shardings("actor", abstract_actor_state))
        else:
            actor_shardings = _flat(actor_shardings)
        self.tensors = self._plan(abstract, actor_shardings, rollout_sh)
        self.chunks = self._group(self.tensors)
        self.wire_bytes = sum(t.nbytes for t in self.tensors)
        self._slab_elems = max(self._chunk_wire() // 32, 256)  # verification digests: `_slabs`
        self.n_params = sum(math.prod(t.shape) for t in self.tensors)
        if warmup:
            self.warmup()

    def _plan(self, abstract, actor_sh, rollout_sh) -> list[_Tensor]:
        """Stored dtypes / formats / shardings from what the sampler holds now (`weight_state()`: metadata only,
        they do not depend on the input dtypes), transfer layouts per wire array."""
        stored = self.sampler.weight_state()
        tensors = []
        for k, r_sh in rollout_sh.items():
            a, out = abstract[k], stored[k]
            ndim = len(a.shape)
            if isinstance(out, quant.QuantizedTensor):
                if out.kind not in ("fp8", "fp4"):
                    raise ValueError(f"WeightPusher: {k}: unknown stored kind {out.kind!r}")
                qmeta = (out.kind, out.fmt, tuple(out.block), tuple(out.shape))
                outs = (r_sh, out.scale.sharding)  # q as the dense tensor; scales as the sampler keeps them
                dense = np.dtype(FP8_SOURCE_DTYPE)
                if self.quantize_on == "actor":
                    arrays = [(out.q.shape, out.q.dtype, outs[0]), (out.scale.shape, out.scale.dtype, outs[1])]
                else:
                    arrays = [(tuple(a.shape), dense, r_sh)]
                where = self.quantize_on
            else:
                if tuple(out.shape) != tuple(a.shape):
                    raise ValueError(f"WeightPusher: {k}: sampler stores shape {out.shape}, actor has {a.shape}")
                qmeta, where, dense, outs = None, None, np.dtype(out.dtype), (r_sh,)
                arrays = [(tuple(a.shape), dense, r_sh)]
            if self.colocated:  # the rollout layout is written by the actor-side jit itself, on the whole mesh
                source = actor_sh[k]
                wires = tuple(_Wire(tuple(s), np.dtype(d), sh, sh, sh) for s, d, sh in arrays)
            else:
                source = _one_copy(actor_sh[k])
                wires = []
                for s, d, sh in arrays:
                    transfer, landing = _transfer_layout(source, sh, ndim)
                    if qmeta is None and transfer.is_equivalent_to(source, ndim):
                        transfer = source
                    wires.append(_Wire(tuple(s), np.dtype(d), transfer, landing, sh))
                wires = tuple(wires)
            actor_jit = (qmeta is not None or dense != np.dtype(a.dtype)
                         or not wires[0].transfer_sharding.is_equivalent_to(source, ndim))
            tensors.append(_Tensor(key=k, shape=tuple(a.shape), actor_dtype=np.dtype(a.dtype), dense_dtype=dense,
                                   actor_sharding=actor_sh[k], source_sharding=source, qmeta=qmeta,
                                   quantize_on=where, wires=wires, out_shardings=tuple(outs), actor_jit=actor_jit))
        return tensors

    def _group(self, tensors) -> list[list[_Tensor]]:
        chunks, cur, size = [], [], 0
        for t in tensors:
            if cur and size + t.nbytes > self.chunk_bytes:
                chunks.append(cur)
                cur, size = [], 0
            cur.append(t)
            size += t.nbytes
        return chunks + ([cur] if cur else [])

    # -------------------------------------------------------------- the three steps of a chunk

    def _stage_args(self, t: _Tensor, verify: bool):
        qmeta = t.qmeta if t.quantize_on == "actor" else None
        return (t.dense_dtype, qmeta, tuple(w.transfer_sharding for w in t.wires), verify)

    def _stage_chunk(self, chunk: list[_Tensor], src: dict, verify: bool) -> tuple[dict, dict]:
        """Step 1, actor mesh: {key: tuple of wire arrays in their transfer layouts}, {key: row} (verify).
        Wire arrays made by a jit are owned by the push (deleted after the transfer); the others are views."""
        staged, rows = {}, {}
        for t in chunk:
            x = _view(src[t.key], t.source_sharding)
            if not t.actor_jit:
                staged[t.key] = (x,)
                if verify:
                    with jax.set_mesh(t.source_sharding.mesh):
                        rows[t.key] = _dense_row(x)
                continue
            with jax.set_mesh(t.source_sharding.mesh):
                staged[t.key], row = _stage(x, *self._stage_args(t, verify))
            if verify:
                rows[t.key] = row
            if self._one_at_a_time:
                jax.block_until_ready(staged[t.key])
        jax.block_until_ready(list(staged.values()))
        return staged, rows

    def _transfer_chunk(self, chunk: list[_Tensor], staged: dict) -> dict:
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

    def _land_chunk(self, chunk: list[_Tensor], landed: dict, verify: bool) -> tuple[dict, dict]:
        """Step 3, rollout mesh: quantisation on arrival / reshards to the stored layouts; the replaced arrivals are
        deleted. Returns ({key: tuple of stored arrays}, {key: row of the arrival} for tensors quantised here)."""
        out, rows = dict(landed), {}
        todo = [t for t in chunk if t.land_jit]
        with jax.set_mesh(self.rollout_mesh):
            for t in todo:
                arrived = landed[t.key]
                if t.land_quantize:
                    out[t.key], row = _land_quantize(arrived[0], t.qmeta, t.out_shardings, verify)
                    if verify:
                        rows[t.key] = row
                else:
                    out[t.key] = tuple(x if w.landing_sharding == w.rollout_sharding
                                       else _cast_reshard(x, w.dtype, w.rollout_sharding)
                                       for x, w in zip(arrived, t.wires))
                if self._one_at_a_time:
                    jax.block_until_ready(out[t.key])
        jax.block_until_ready([out[t.key] for t in todo])
        for t in todo:
            kept = set().union(*(_buffers(y) for y in out[t.key]))
            for x in landed[t.key]:
                if not x.is_deleted() and not (_buffers(x) & kept):
                    x.delete()
        for t in chunk:
            out[t.key] = tuple(_as_sharding(y, sh) for y, sh in zip(out[t.key], t.out_shardings))
            if verify and not t.land_quantize:  # the checksums of what the sampler will store
                with jax.set_mesh(self.rollout_mesh):
                    rows[t.key] = _stored_row(out[t.key], self._slabs(t))
                if self._one_at_a_time:
                    rows[t.key].block_until_ready()
        return out, rows

    def _slabs(self, t: _Tensor) -> tuple:
        """Per stored array, the slab loop of its rollout-side digest: one slab <= `_slab_elems` elements per
        device (1/32 of the largest chunk's wire bytes on a device; the digest's temporaries take about 12-14 B per
        element of a slab), so verification adds less than one chunk on a rollout device."""
        return tuple(_slab(w.shape, w.rollout_sharding, self._slab_elems) for w in t.wires)

    def _chunk_wire(self) -> int:
        """The most wire bytes one chunk lands on a rollout device (`PushMemory.chunk_wire`)."""
        return max((sum(_dev_bytes(w.shape, w.dtype, w.landing_sharding) for t in chunk for w in t.wires)
                    for chunk in self.chunks), default=0)

    def _move_chunk(self, chunk: list[_Tensor], src: dict, times: dict, verify: bool = False):
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

    def _run(self, src: dict, version: int, verify: bool) -> PushStats:
        """The push proper (see push_weights)."""
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
        self.sampler.set_weights(wstate, version)
        if verify and self.sampler.weight_version != version:
            raise PushVerificationError(version, [("<version>", f"sampler reports {self.sampler.weight_version}")])
        seconds = time.perf_counter() - start
        return PushStats(version=version, seconds=seconds, bytes=self.wire_bytes,
                         gbps=self.wire_bytes / seconds / 1e9, n_chunks=len(self.chunks), n_tensors=len(self.tensors),
                         verified=verify, colocated=self.colocated, n_params=self.n_params,
                         quantize_on=self.quantize_on, **times)

    def _zeros(self, chunk: list[_Tensor]) -> dict:
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
        """Whether the next `push_weights(verify=None)` verifies (every `verify_every`-th push, the first included)."""
        return self.verify_every > 0 and self.n_pushes % self.verify_every == 0

    # -------------------------------------------------------------- memory

    def memory(self) -> PushMemory:
        """Per-device peak bytes of a push (`PushMemory`), from the array layouts and XLA's
        `memory_analysis()` of the compiled stage, land and check programs (compiled here from shapes and
        shardings; the jit caches make this free after the warm-up's compiles except for the lowering)."""

        dev_bytes = _dev_bytes

        def temp(jitted, *args) -> int:
            mem = jitted.lower(*args).compile().memory_analysis()
            return int(getattr(mem, "temp_size_in_bytes", 0) or 0)

        state = sum(dev_bytes(w.shape, w.dtype, w.rollout_sharding) if not t.land_quantize else 0
                    for t in self.tensors for w in t.wires)
        for t in self.tensors:  # tensors quantised on arrival: their stored (q, scale)
            if t.land_quantize:
                q, s = jax.eval_shape(lambda x, m=t.qmeta: _quantize_as(x, m),
                                      jax.ShapeDtypeStruct(t.shape, t.dense_dtype))
                state += dev_bytes(q.shape, q.dtype, t.out_shardings[0]) + dev_bytes(s.shape, s.dtype,
                                                                                     t.out_shardings[1])
        chunk_extra = chunk_wire = actor_chunk = 0
        for chunk in self.chunks:
            wire = sum(dev_bytes(w.shape, w.dtype, w.landing_sharding) for t in chunk for w in t.wires)
            replaced = sum(dev_bytes(w.shape, w.dtype, w.landing_sharding) for t in chunk if t.land_jit
                           for w in t.wires)
            temps, a_temps, staged = [0], [0], 0
            for t in chunk:
                if t.land_quantize:
                    arg = jax.ShapeDtypeStruct(t.shape, t.dense_dtype, sharding=t.wires[0].landing_sharding)
                    with jax.set_mesh(self.rollout_mesh):
                        temps.append(temp(_land_quantize, arg, t.qmeta, t.out_shardings, True))
                elif t.land_jit:
                    for w in t.wires:
                        if w.landing_sharding != w.rollout_sharding:
                            arg = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.landing_sharding)
                            with jax.set_mesh(self.rollout_mesh):
                                temps.append(temp(_cast_reshard, arg, w.dtype, w.rollout_sharding))
                if t.actor_jit:
                    staged += sum(dev_bytes(w.shape, w.dtype, w.transfer_sharding) for w in t.wires)
                    arg = jax.ShapeDtypeStruct(t.shape, t.actor_dtype, sharding=t.source_sharding)
                    with jax.set_mesh(t.source_sharding.mesh):
                        a_temps.append(temp(_stage, arg, *self._stage_args(t, True)))
            chunk_extra = max(chunk_extra, replaced + max(temps))
            chunk_wire = max(chunk_wire, wire)
            actor_chunk = max(actor_chunk, staged + max(a_temps))
        check = 0
        with jax.set_mesh(self.rollout_mesh):
            for t in self.tensors:
                if not t.land_quantize:
                    args = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.rollout_sharding) for w in t.wires)
                    check = max(check, temp(_stored_row, args, self._slabs(t)))
        return PushMemory(state=state, chunk=chunk_extra, check=check, peak=2 * state + chunk_extra,
                          peak_verified=2 * state + max(chunk_extra, check), chunk_wire=chunk_wire,
                          actor_chunk=actor_chunk)


def _dev_bytes(shape, dtype, sharding) -> int:
    """Bytes of one device's piece of an array of `shape` / `dtype` laid out as `sharding`."""
    return math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def _delete(tree) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def push_weights(pusher: WeightPusher, actor_params, sampler, version: int, *, verify: bool | None = None) -> PushStats:
    """Push the actor's weights to the sampler as weight `version` (the one push function of the system).

    Args:
      pusher: the WeightPusher built for `sampler`.
      actor_params: nnx.State / Module / {key: array} of every model tensor (fp32 master Params + Buffers) on the
        actor mesh, in the shardings the pusher was planned with (e.g. `Learner.params_for_push()`).
      sampler: the rollout sampler (must be `pusher.sampler`).
      version: new weight version; must exceed `sampler.weight_version`.
      verify: True / False, or None = the pusher's `verify_every` schedule.
    Returns:
      PushStats (seconds, wire bytes, GB/s, chunks, stage times); `stats.metrics()` gives the loop's
      `perf/weight_push_s` and `perf/weight_push_gbps`.
    Raises:
      ValueError: wrong sampler, a non-increasing version, a key-set mismatch (lists missing and unexpected keys),
        a tensor of another shape/dtype/sharding than planned (named; it would otherwise recompile).
      PushVerificationError: the rollout copy failed verification (tensors named); the old version stays live.
    """
    if sampler is not pusher.sampler:
        raise ValueError("push_weights: this pusher was built for another sampler")
    if version <= sampler.weight_version:
        raise ValueError(f"push_weights: version {version} must exceed the live version {sampler.weight_version}")
    flat = _flat(actor_params)
    _check_keys(flat, {t.key: t for t in pusher.tensors}, "push_weights")
    for t in pusher.tensors:
        x = flat[t.key]
        if tuple(x.shape) != t.shape or np.dtype(x.dtype) != t.actor_dtype:
            raise ValueError(f"push_weights: {t.key} is {x.dtype}{list(x.shape)}, "
                             f"planned {t.actor_dtype}{list(t.shape)}")
        if not x.sharding.is_equivalent_to(t.actor_sharding, len(t.shape)):
            raise ValueError(f"push_weights: {t.key} has sharding {x.sharding}, planned {t.actor_sharding}")
    do_verify = pusher.wants_verify() if verify is None else bool(verify)
    stats = pusher._run(flat, int(version), do_verify)
    pusher.n_pushes += 1
    return stats
