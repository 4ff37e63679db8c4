"""Actor -> rollout weight push: one new weight version per call of `push_weights` (house rule 9).

    pusher = WeightPusher(plan, sampler, nnx.state(nnx.eval_shape(make_model)))   # plans, compiles, warms up
    stats = push_weights(pusher, learner.params_for_push(), sampler, version=step)
    log({"perf/weight_push_s": stats.seconds, "perf/weight_push_gbps": stats.gbps})

What a push does, per tensor (shapes are the model's, e.g. experts w1 [E, I, D]; keys are nnx paths joined by
"/", e.g. "layers/1/ffn/experts/w1", "layers/0/ffn/gate/tid2eid"):

1. Actor mesh (`jax.set_mesh`): one jit casts the fp32 master weight to its *wire dtype* and reshards it to a
   *transfer layout*. Wire dtype = the dtype the sampler stores the tensor in (bf16; f32 for the tensors the
   sampler keeps in f32: mHC, sinks, ape, router selection bias, which decides routing and must not be rounded;
   int32 for `tid2eid`), except FP8-stored tensors, which travel as bf16 and are quantised on arrival. Tensors
   whose dtype and layout need no change skip the jit (no copy on the actor side). The jit runs on one replica
   only: a tensor the actor replicates over some mesh axes (e.g. `data=3`) is viewed, without a copy, as an
   array on the sub-mesh at index 0 of those axes, so replicas are not cast (and do not hold copies) 3 times.
2. `jax.device_put` onto the sampler's `rollout_shardings()` (disjoint rollout mesh), a chunk of tensors at a
   time (`chunk_bytes` of wire bytes), `block_until_ready`, then the chunk's actor-side bf16 copies are deleted
   explicitly (cross-mesh donation does not free the source on CPU, docs/jax-stack.md §2.3). Colocated plans
   (rollout mesh = actor mesh): step 1 writes the rollout layout directly and nothing crosses meshes.
3. Rollout mesh: `sampler.quantize_weights` (one jit: FP8 e4m3 128x128 blocks, f32 scales).
4. Optional verification (below); then `sampler.set_weights(wstate, version)`: the swap happens only after
   every tensor arrived and passed, so a failed push leaves the previous version live.

Why a transfer layout. In jax 0.10.2 a single-process `device_put` between meshes takes one of two paths
(`jax/_src/array.py::_array_shard_arg`): if every destination shard's index range exists as a source shard, the
buffers are copied device to device; otherwise it materialises the *whole array on the host* (`x._value`) and
uploads it (seen on CPU: `transfer_guard_host_to_device("disallow_explicit")` trips; the plain "disallow" level
and the device-to-host guard do not, so this round trip is easy to miss). So step 1 reshards on the actor mesh
to a spec that cuts every dim into the same number of pieces as the rollout spec (same index ranges, any device
order); if the actor mesh cannot express that split (e.g. actor axes 3 x 2, rollout tensor=4), it uses the
largest split both meshes can express that divides the rollout's, and a rollout-side jit finishes the reshard.

Verification (`verify=True`, or every `verify_every`-th push): per tensor a position-weighted 32-bit checksum
pair of the wire bits is computed on the actor mesh and compared with the same checksum of what arrived
(FP8 tensors) or of what the sampler stores (everything else: int hash tables and f32/bf16 tensors must be
bitwise equal); nothing may be NaN/inf (wire copy, and FP8 tensors after dequantisation); integer tables must
not be all zero (an all-zero `tid2eid` routes every token to expert 0: the failure of stacks that forget
buffers); and every FP8 element must satisfy the e4m3 rounding bound
    |q * s - w| <= (eps/2 + 2^-20) |w| + (1 + 2^-20) * (smallest_subnormal/2) * s + tiny_f32
where w is the bf16 weight that arrived, s its block's scale, eps/smallest_subnormal from `jnp.finfo` of the
fp8 dtype (e4m3fn: eps = 2^-3, subnormal step 2^-9; e4m3fnuz: 2^-3, 2^-10). Derivation: y = fl(w / s) has
relative error 2^-24; clipping at +-fmax moves y by at most 2^-22 fmax because s >= amax/fmax up to rounding;
round-to-nearest-even to e4m3 errs by at most half a spacing, i.e. eps/2 |y| for normals and
smallest_subnormal/2 below the normal range; q * s adds another 2^-24 relative; tiny_f32 covers the FTZ of
f32-subnormal inputs on XLA:CPU. Failure raises `PushVerificationError` naming every bad tensor and the reason;
the new state is deleted and the old version stays live. The verdicts come to the host as one small
`device_get` (4-6 uint32 per tensor), the only device-to-host traffic of a push.

Compilation: the cast jit is keyed by (shape, dtype, sharding, wire dtype, transfer sharding), so repeated layer
shapes share programs; the verification programs (one per actor sub-mesh, one on the rollout mesh, for the whole
model) are compiled ahead of time. `WeightPusher.__init__` runs a dry push of zeros (chunk by chunk, built per
shard with `jax.make_array_from_callback`, never a whole-model host copy) through every stage, verification
included, and drops the result, so the first real push is steady state and later pushes compile nothing
(tests/sharding/test_push.py counts backend compiles).

Memory (per push): actor side, at most one chunk of wire copies at a time; rollout side, the bf16 copy of every
tensor (kept until quantisation and verification finish; `Sampler.quantize_weights` takes the full dict) plus
the new and the old weight state until the swap.

Ideas from Tunix (`rl/reshard.py::reshard_pytree`: device_put fallback, PRNG keys unwrapped;
`generate/utils.py::_reshard_in_chunks`: key groups with `block_until_ready` between them; `rl_cluster.py::
sync_weights`: transfer guards around the sync) and the jax docs on `jax.device_put` / transfer guards; written
here from scratch. Tests: `.venv/bin/python -m pytest -q tests/sharding/test_push.py`;
benchmark: `.venv/bin/python benchmarks/weight_push.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4 import quant

DEFAULT_CHUNK_BYTES = 256 * 2**20
FP8_SOURCE_DTYPE = quant.ROLLOUT_FP8_SOURCE_DTYPE  # what FP8-stored tensors travel as (learner compute precision)


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
    """One push. bytes: logical wire bytes (global sizes x wire itemsize; bf16 for FP8/bf16 tensors); gbps =
    bytes / seconds / 1e9 with seconds the wall time of the whole push (incl. quantisation, and verification when
    `verified`). Stage times: cast_s (actor jits), transfer_s (device_put + rollout-side reshards), quantize_s,
    verify_s. colocated: no cross-mesh transfer happened."""

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

    def metrics(self) -> dict[str, float]:
        return {"perf/weight_push_s": self.seconds, "perf/weight_push_gbps": self.gbps}


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """Static plan of one tensor: key, global shape, actor dtype/sharding, wire dtype, actor-side transfer layout,
    rollout landing sharding (= final unless the meshes need a rollout-side reshard), final rollout sharding."""

    key: str
    shape: tuple[int, ...]
    actor_dtype: Any
    wire_dtype: Any
    actor_sharding: NamedSharding
    source_sharding: NamedSharding  # one copy of the actor array (a sub-mesh view when the actor replicates it)
    transfer_sharding: NamedSharding
    landing_sharding: NamedSharding
    rollout_sharding: NamedSharding
    quantized: bool
    actor_jit: bool  # a cast or an actor-side reshard is needed (else the actor array itself is device_put)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.wire_dtype).itemsize


# ------------------------------------------------------------------------------------------ layouts


def _entry_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _splits(sharding: NamedSharding, ndim: int) -> tuple[int, ...]:
    """Pieces per dim of a NamedSharding, e.g. P("expert", None) on expert=2 -> (2, 1)."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(math.prod(sharding.mesh.shape[a] for a in _entry_axes(e)) for e in spec)


@functools.lru_cache(maxsize=None)
def _realize(mesh: Mesh, splits: tuple[int, ...], prefer: PartitionSpec | None) -> PartitionSpec | None:
    """A PartitionSpec on `mesh` that cuts dim d into exactly splits[d] pieces (each mesh axis of size > 1 used at
    most once, axes in mesh order inside an entry), preferring entries equal to `prefer`'s; None if impossible."""
    ndim = len(splits)
    axes = [(n, s) for n, s in mesh.shape.items() if s > 1]
    pref = tuple(prefer or ()) + (None,) * ndim
    best, best_score = None, -1
    for assign in itertools.product(range(-1, ndim), repeat=len(axes)):
        per_dim = [[n for (n, _), d in zip(axes, assign) if d == dim] for dim in range(ndim)]
        if any(math.prod(mesh.shape[n] for n in names) != splits[dim] for dim, names in enumerate(per_dim)):
            continue
        entries = [None if not names else names[0] if len(names) == 1 else tuple(names) for names in per_dim]
        score = sum(_entry_axes(e) == _entry_axes(p) for e, p in zip(entries, pref[:ndim]))
        if score > best_score:
            best, best_score = PartitionSpec(*entries), score
    return best


@functools.lru_cache(maxsize=None)
def _sub_mesh(mesh: Mesh, used: tuple[str, ...]) -> Mesh:
    """The devices of `mesh` at index 0 along every axis not in `used` (same axis names, those axes of size 1)."""
    index = tuple(slice(None) if name in used else slice(0, 1) for name in mesh.axis_names)
    return Mesh(mesh.devices[index], mesh.axis_names, axis_types=mesh.axis_types)


def _one_copy(sharding: NamedSharding) -> NamedSharding:
    """The same layout restricted to one replica: e.g. P(None, "fsdp") on data=3 x fsdp=2 -> the 2 devices of data
    index 0. Casting and resharding one replica instead of all of them saves (replicas - 1) x the work and memory."""
    used = tuple(a for e in sharding.spec for a in _entry_axes(e))
    sub = _sub_mesh(sharding.mesh, used)
    return sharding if sub.devices.size == sharding.mesh.devices.size else NamedSharding(sub, sharding.spec)


def _view(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """x's buffers on `sharding`'s devices wrapped as an array of that sharding (no copy; never delete it)."""
    if sharding == x.sharding:
        return x
    by_device = {shard.device: shard.data for shard in x.addressable_shards}
    shards = [by_device[d] for d in sharding.mesh.devices.flat]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _divisor_vectors(splits: tuple[int, ...]):
    """Every vector s with s[d] dividing splits[d], most pieces first."""
    divs = [[k for k in range(n, 0, -1) if n % k == 0] for n in splits]
    return sorted(itertools.product(*divs), key=lambda s: -math.prod(s))


def _transfer_layout(actor_sh: NamedSharding, rollout_sh: NamedSharding, ndim: int):
    """(transfer sharding on the actor mesh, landing sharding on the rollout mesh) such that every landing shard's
    index range is a shard of the transfer layout (so device_put copies device to device, never via the host)."""
    target = _splits(rollout_sh, ndim)
    for s in _divisor_vectors(target):
        a_spec = _realize(actor_sh.mesh, s, actor_sh.spec)
        r_spec = rollout_sh.spec if s == target else _realize(rollout_sh.mesh, s, rollout_sh.spec)
        if a_spec is not None and r_spec is not None:
            landing = rollout_sh if s == target else NamedSharding(rollout_sh.mesh, r_spec)
            return NamedSharding(actor_sh.mesh, a_spec), landing
    raise AssertionError("unreachable: the all-ones split is always realisable")


# ------------------------------------------------------------------------------------------ jitted steps


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cast_reshard(x, dtype, sharding):
    """x (any sharding) -> x.astype(dtype) laid out as `sharding` (same mesh). A fresh buffer."""
    return jax.lax.with_sharding_constraint(x.astype(dtype), sharding)


def _bits_u32(x):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[np.dtype(x.dtype).itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _digest_terms(x):
    """x [...] -> uint32[4]: (sum of the bit words b_i, sum of b_i * (i + 1) with i the row-major position, any
    non-finite, any nonzero). Sums wrap mod 2^32, so the reduction order (and the sharding) does not matter; the
    position weight catches permuted blocks (swapping elements i, j changes the second sum by (b_i - b_j)(j - i))."""
    bits = _bits_u32(x)
    pos = jnp.ones(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
        stride *= x.shape[d]
    nonfinite = jnp.any(~jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(False)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * pos, dtype=jnp.uint32),
                      nonfinite.astype(jnp.uint32), jnp.any(x != 0).astype(jnp.uint32)])


@functools.partial(jax.jit, static_argnums=(1,))
def _digests(xs, dtypes):
    """Digests of [x.astype(dtype)] (the wire values), computed where the xs live -> uint32[n, 4]. One program for
    the whole model (a compile per tensor shape would dominate start-up)."""
    return jnp.stack([_digest_terms(x.astype(d)) for x, d in zip(xs, dtypes)])


def _fp8_terms(w, q, scale, block):
    """w [..., out, in] (bf16 as arrived), q/scale of its QuantizedTensor -> uint32[6]: digest(w) (4 terms),
    any non-finite after dequantisation, any element over the e4m3 bound (module docstring)."""
    fi = jnp.finfo(q.dtype)
    b0, b1 = block
    *_, rows, cols = q.shape
    s = jnp.repeat(jnp.repeat(scale, b0, axis=-2), b1, axis=-1)[..., :rows, :cols]  # -> [..., out, in]
    wf, deq = w.astype(jnp.float32), q.astype(jnp.float32) * s
    bound = ((float(fi.eps) / 2 + 2**-20) * jnp.abs(wf) + (1 + 2**-20) * (float(fi.smallest_subnormal) / 2) * s
             + float(jnp.finfo(jnp.float32).tiny))
    over = jnp.any(jnp.abs(deq - wf) > bound)
    return jnp.concatenate([_digest_terms(w), jnp.stack([jnp.any(~jnp.isfinite(deq)), over]).astype(jnp.uint32)])


@functools.partial(jax.jit, static_argnums=(2, 3))
def _rollout_checks(plain, fp8, plain_dtypes, blocks):
    """Rollout-side checks in one program: plain [arrays as stored] -> uint32[n_plain, 4] digests; fp8
    [(w, q, scale)] -> uint32[n_fp8, 6] (`_fp8_terms`)."""
    d = jnp.stack([_digest_terms(x.astype(t)) for x, t in zip(plain, plain_dtypes)]) if plain else None
    f = jnp.stack([_fp8_terms(w, q, sc, b) for (w, q, sc), b in zip(fp8, blocks)]) if fp8 else None
    return d, f


# ------------------------------------------------------------------------------------------ the pusher


def _buffers(x) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _key(path) -> str:
    return "/".join(str(p) for p in path)


def _is_rng(value, var) -> bool:
    return isinstance(var, nnx.RngState) or jax.dtypes.issubdtype(getattr(value, "dtype", np.float32),
                                                                    jax.dtypes.prng_key)


def _flat(state) -> dict[str, Any]:
    """nnx.State / Module / {key: array or Variable} -> {key: array or ShapeDtypeStruct}; PRNG keys dropped (the
    sampler seeds its own randomness; RNG state is not a weight)."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    if isinstance(state, Mapping) and not isinstance(state, nnx.State) and all(isinstance(k, str) for k in state):
        items = state.items()
    else:
        items = ((_key(p), v) for p, v in nnx.to_flat_state(state))
    out = {}
    for k, var in items:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if not _is_rng(value, var):
            out[k] = value
    return out


def _check_keys(got, expected, what: str) -> None:
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    if missing or extra:
        raise ValueError(f"{what}: the actor state does not match the sampler's tensors: "
                         f"{len(missing)} missing {missing}, {len(extra)} unexpected {extra}")


class WeightPusher:
    """Plans, compiles and warms up the actor -> rollout push for one sampler; call `push_weights` to push.

    Args:
      plan_or_meshes: a `sharding.mesh.MeshPlan` or an (actor_mesh, rollout_mesh) pair (the same Mesh twice, or a
        colocated plan, = colocated). The rollout mesh must be `sampler.mesh`.
      sampler: an `rl.sampler.Sampler` built on a mesh (its `rollout_shardings()`, `quantize_weights`,
        `set_weights` are used).
      abstract_actor_state: nnx.State / Module / {key: ShapeDtypeStruct or array} of every tensor the learner
        pushes (fp32 master Params + Buffers), e.g. `nnx.state(nnx.eval_shape(make_model))`.
      actor_shardings: {key: NamedSharding} of the actor arrays; default: each leaf's own `.sharding` when it has
        one, else `plan.param_shardings("actor", abstract_actor_state)` (needs a MeshPlan).
      chunk_bytes: wire bytes per device_put group (a tensor larger than that travels alone).
      verify_every: verify every k-th push when `push_weights(verify=None)` (1 = always, 0 = never).
      warmup: run the dry push now (default True).
    Raises:
      ValueError: a key-set mismatch with the sampler (lists missing and unexpected keys), a shape mismatch, a
        sampler without a mesh or on another mesh, missing actor shardings.
    """

    def __init__(self, plan_or_meshes, sampler, abstract_actor_state, *, actor_shardings=None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify_every: int = 1, warmup: bool = True):
        if isinstance(plan_or_meshes, tuple):
            actor_mesh, rollout_mesh = plan_or_meshes
            plan = None
        else:
            plan, actor_mesh, rollout_mesh = plan_or_meshes, plan_or_meshes.actor, plan_or_meshes.rollout
        if sampler.mesh is None or sampler.mesh != rollout_mesh:
            raise ValueError("WeightPusher: the sampler must be built on the plan's rollout mesh "
                             f"(sampler.mesh={sampler.mesh}, rollout mesh={rollout_mesh})")
        if chunk_bytes < 1 or verify_every < 0:
            raise ValueError(f"WeightPusher: chunk_bytes must be >= 1 and verify_every >= 0, got {chunk_bytes}, "
                             f"{verify_every}")
        self.sampler, self.actor_mesh, self.rollout_mesh = sampler, actor_mesh, rollout_mesh
        self.colocated = actor_mesh == rollout_mesh
        self.chunk_bytes, self.verify_every = int(chunk_bytes), int(verify_every)
        self.n_pushes = 0
        self._compiled: dict[Any, Any] = {}
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
        if warmup:
            self.warmup()

    def _plan(self, abstract, actor_sh, rollout_sh) -> list[_Tensor]:
        """Wire dtypes from what the sampler stores now (`weight_state()`, version 0 at the latest: its dtypes do not
        depend on the input dtypes), transfer layouts per tensor."""
        stored = self.sampler.weight_state()
        tensors = []
        for k, r_sh in rollout_sh.items():
            a = abstract[k]
            out = stored[k]
            quantized = isinstance(out, quant.QuantizedTensor)
            wire = np.dtype(FP8_SOURCE_DTYPE if quantized else out.dtype)
            if not quantized and tuple(out.shape) != tuple(a.shape):
                raise ValueError(f"WeightPusher: {k}: sampler stores shape {out.shape}, actor has {a.shape}")
            if self.colocated:  # the rollout layout is written by the actor-side jit itself, on the whole mesh
                source, transfer, landing = actor_sh[k], r_sh, r_sh
            else:
                source = _one_copy(actor_sh[k])
                transfer, landing = _transfer_layout(source, r_sh, len(a.shape))
            same_layout = transfer.is_equivalent_to(source, len(a.shape))
            tensors.append(_Tensor(key=k, shape=tuple(a.shape), actor_dtype=np.dtype(a.dtype), wire_dtype=wire,
                                   actor_sharding=actor_sh[k], source_sharding=source,
                                   transfer_sharding=source if same_layout else transfer,
                                   landing_sharding=landing, rollout_sharding=r_sh, quantized=quantized,
                                   actor_jit=wire != np.dtype(a.dtype) or not same_layout))
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

    # -------------------------------------------------------------- stages

    def _move_chunk(self, chunk: list[_Tensor], src: dict, times: dict) -> dict:
        """Cast + reshard on the actor mesh, device_put to the rollout mesh, finish any rollout-side reshard.
        Returns {key: array in the final rollout sharding}; actor-side intermediates are deleted."""
        t0 = time.perf_counter()
        staged = {}
        for t in chunk:
            x = _view(src[t.key], t.source_sharding)
            if not t.actor_jit:
                staged[t.key] = x
                continue
            with jax.set_mesh(t.source_sharding.mesh):
                staged[t.key] = _cast_reshard(x, t.wire_dtype, t.transfer_sharding)
            if self._one_at_a_time:
                staged[t.key].block_until_ready()
        jax.block_until_ready(list(staged.values()))
        t1 = time.perf_counter()
        owned = {t.key for t in chunk if t.actor_jit}
        # Colocated: a jit output already is the rollout copy; anything else is copied (never aliased to the actor's
        # buffers, which the learner may donate). Disjoint: a device-to-device copy between the meshes.
        put = [t for t in chunk if not (self.colocated and t.key in owned)]
        landed = dict(staged)
        if put:
            arrays = jax.device_put([staged[t.key] for t in put], [t.landing_sharding for t in put], may_alias=False)
            landed.update(zip((t.key for t in put), arrays))
        jax.block_until_ready(list(landed.values()))
        for t in put:
            if t.key in owned:
                staged[t.key].delete()
        finish = [t for t in chunk if t.landing_sharding != t.rollout_sharding]
        if finish:
            done = {}
            with jax.set_mesh(self.rollout_mesh):
                for t in finish:
                    done[t.key] = _cast_reshard(landed[t.key], t.wire_dtype, t.rollout_sharding)
                    if self._one_at_a_time:
                        done[t.key].block_until_ready()
            jax.block_until_ready(list(done.values()))
            for t in finish:
                landed[t.key].delete()
            landed.update(done)
        times["cast_s"] += t1 - t0
        times["transfer_s"] += time.perf_counter() - t1
        return landed

    def _checker(self, name, mesh: Mesh, jitted, dynamic: tuple, static: tuple, run: bool = True):
        """Run a verification program, compiled ahead of time on first use (the warm-up, from shapes and shardings)
        and reused after: a call with other shapes/shardings raises instead of recompiling."""
        with jax.set_mesh(mesh):
            if name not in self._compiled:
                self._compiled[name] = jitted.lower(*dynamic, *static).compile()
            return self._compiled[name](*dynamic) if run else None

    def _actor_digests(self, src: dict | None) -> list:
        """[(tensors, uint32[n, 4])]: one program per sub-mesh of one-copy views (so replicas are not re-read).
        src=None: compile only (from ShapeDtypeStructs)."""
        groups: dict[Mesh, list[_Tensor]] = {}
        for t in self.tensors:
            groups.setdefault(t.source_sharding.mesh, []).append(t)
        out = []
        for i, (mesh, ts) in enumerate(groups.items()):
            if src is None:
                views = [jax.ShapeDtypeStruct(t.shape, t.actor_dtype, sharding=t.source_sharding) for t in ts]
            else:
                views = [_view(src[t.key], t.source_sharding) for t in ts]
            dtypes = (tuple(t.wire_dtype for t in ts),)
            out.append((ts, self._checker(("actor", i), mesh, _digests, (views,), dtypes, run=src is not None)))
        return out

    def _rollout_digests(self, raw: dict, wstate: dict):
        """(plain tensors, fp8 tensors) checks; fp4 is not produced by the sampler today and would be checked as a
        plain tensor on its raw copy."""
        plain, plain_t, fp8, fp8_t = [], [], [], []
        for t in self.tensors:
            w = wstate[t.key]
            if isinstance(w, quant.QuantizedTensor) and w.kind == "fp8":
                fp8.append((raw[t.key], w.q, w.scale))
                fp8_t.append(t)
            else:
                plain.append(raw[t.key] if t.quantized else w)
                plain_t.append(t)
        d, f = self._checker("rollout", self.rollout_mesh, _rollout_checks, (plain, fp8),
                             (tuple(t.wire_dtype for t in plain_t), tuple(wstate[t.key].block for t in fp8_t)))
        return plain_t + fp8_t, d, f

    def _verdict(self, actor_d, rollout) -> list[tuple[str, str]]:
        order, d, f = rollout
        # one small explicit transfer: 4-6 uint32 per tensor
        actor_ts = [ts for ts, _ in actor_d]
        actor_d, d, f = jax.device_get(([r for _, r in actor_d], d, f))
        rows = dict(zip((t.key for t in order), list(d if d is not None else []) + list(f if f is not None else [])))
        arows = {t.key: row for ts, res in zip(actor_ts, actor_d) for t, row in zip(ts, res)}
        failures = []
        for t in self.tensors:
            a, r = arows[t.key], rows[t.key]
            reasons = []
            if a[2] or r[2]:
                reasons.append("NaN/inf in the " + ("actor weight" if a[2] else "rollout copy"))
            if (a[0], a[1]) != (r[0], r[1]):
                reasons.append("rollout copy differs from the actor's wire value (checksum mismatch)")
            if np.issubdtype(t.wire_dtype, np.integer) and not r[3]:
                reasons.append("integer table is all zero (uninitialised hash table?)")
            if len(r) > 4 and r[4]:
                reasons.append("NaN/inf after FP8 dequantisation")
            if len(r) > 4 and r[5]:
                reasons.append("FP8 error above the e4m3 rounding bound")
            failures += [(t.key, why) for why in reasons]
        return failures

    def _quantize(self, raw: dict, times: dict) -> dict:
        t0 = time.perf_counter()
        wstate = self.sampler.quantize_weights(raw)
        jax.block_until_ready(wstate)
        times["quantize_s"] = time.perf_counter() - t0
        return wstate

    def _run(self, src: dict, version: int, verify: bool) -> PushStats:
        """The push proper (see push_weights)."""
        start = time.perf_counter()
        times = dict(cast_s=0.0, transfer_s=0.0, quantize_s=0.0, verify_s=0.0)
        actor_d = self._actor_digests(src) if verify else None
        raw: dict = {}
        for chunk in self.chunks:
            raw.update(self._move_chunk(chunk, src, times))
        wstate = self._quantize(raw, times)
        t1 = time.perf_counter()
        failures = self._verdict(actor_d, self._rollout_digests(raw, wstate)) if verify else []
        times["verify_s"] = time.perf_counter() - t1
        kept = set().union(*(_buffers(leaf) for leaf in jax.tree.leaves(wstate)))
        for x in raw.values():  # a stored tensor may share its buffer with the landed one (jit input forwarding)
            if not x.is_deleted() and not (_buffers(x) & kept):
                x.delete()
        if failures:
            jax.tree.map(lambda x: x.delete(), wstate)
            raise PushVerificationError(version, failures)
        self.sampler.set_weights(wstate, version)
        if verify and self.sampler.weight_version != version:
            raise PushVerificationError(version, [("<version>", f"sampler reports {self.sampler.weight_version}")])
        seconds = time.perf_counter() - start
        return PushStats(version=version, seconds=seconds, bytes=self.wire_bytes,
                         gbps=self.wire_bytes / seconds / 1e9, n_chunks=len(self.chunks), n_tensors=len(self.tensors),
                         verified=verify, colocated=self.colocated, **times)

    def warmup(self) -> float:
        """Dry push of zeros through every stage, verification included, then dropped; returns its seconds.

        Zeros are made one chunk at a time, shard by shard (`jax.make_array_from_callback`; never a whole-model host
        copy), so the actor side holds at most one chunk of extra arrays, as in a real push; the actor-side
        verification program is compiled from shapes and shardings alone."""
        start = time.perf_counter()
        times = dict(cast_s=0.0, transfer_s=0.0, quantize_s=0.0)
        self._actor_digests(None)
        raw: dict = {}
        for chunk in self.chunks:
            zeros = {}
            for t in chunk:
                sh = t.actor_sharding
                zeros[t.key] = jax.make_array_from_callback(
                    t.shape, sh, lambda idx, t=t, sh=sh: np.zeros(sh.shard_shape(t.shape), t.actor_dtype))
            raw.update(self._move_chunk(chunk, zeros, times))
            for x in zeros.values():
                x.delete()
        wstate = self._quantize(raw, times)
        jax.block_until_ready(self._rollout_digests(raw, wstate))
        jax.tree.map(lambda x: x.delete(), wstate)
        for x in raw.values():
            if not x.is_deleted():
                x.delete()
        return time.perf_counter() - start

    def wants_verify(self) -> bool:
        """Whether the next `push_weights(verify=None)` verifies (every `verify_every`-th push, the first included)."""
        return self.verify_every > 0 and self.n_pushes % self.verify_every == 0


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
