"""Transfer layouts of the actor -> rollout push: how a tensor is cut on each side, the layout it crosses in,
and the small helpers every push shares (`local.py` in one process, `mpmd.py` across processes, `job.py` between
jobs).

A transfer layout (`transfer_layout`) splits every dimension exactly as the rollout's sharding does, realised on
the actor mesh (whose devices then hold the slices the rollout devices need), so the cross-mesh `device_put` is a
one-to-one copy. `cast_reshard` casts and moves a tensor onto it in one jit; `quantize_as` quantises a bf16 tensor
into the rollout's stored FP8 / FP4 format (`dsv4.quant`), bitwise as the sampler does.

Why a transfer layout. In jax 0.10.2 a single-process `device_put` between meshes takes one of two paths
(`jax/_src/array.py::_array_shard_arg`): if every destination shard's index range exists as a source shard, the
buffers are copied device to device; otherwise it materialises the *whole array on the host* (`x._value`) and
uploads it (seen on CPU: `transfer_guard_host_to_device("disallow_explicit")` trips; the plain "disallow" level
and the device-to-host guard do not, so this round trip is easy to miss). So the push's first step reshards on
the actor mesh to a spec that cuts every dim into the same number of pieces as the rollout spec (same index
ranges, any device order); if the actor mesh cannot express that split (e.g. actor axes 3 x 2, rollout
tensor=4), it uses the largest split both meshes can express that divides the rollout's, and the rollout side
finishes the reshard. The scales of an actor-quantised tensor get their own transfer layout (the sampler
replicates them today).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4 import quant
from dsv4.names import param_key

FP8_SOURCE_DTYPE = quant.ROLLOUT_FP8_SOURCE_DTYPE  # the bf16 value quantised tensors are quantised from


def _entry_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def dim_splits(sharding: NamedSharding, ndim: int) -> tuple[int, ...]:
    """Pieces per dim of a NamedSharding, e.g. P("expert", None) on expert=2 -> (2, 1)."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(math.prod(sharding.mesh.shape[a] for a in _entry_axes(e)) for e in spec)


@functools.lru_cache(maxsize=None)
def realize_spec(mesh: Mesh, splits: tuple[int, ...], prefer: PartitionSpec | None) -> PartitionSpec | None:
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


def one_copy(sharding: NamedSharding) -> NamedSharding:
    """The same layout restricted to one replica: e.g. P(None, "fsdp") on data=3 x fsdp=2 -> the 2 devices of data
    index 0. Casting and resharding one replica instead of all of them saves (replicas - 1) x the work and memory."""
    used = tuple(a for e in sharding.spec for a in _entry_axes(e))
    sub = _sub_mesh(sharding.mesh, used)
    return sharding if sub.devices.size == sharding.mesh.devices.size else NamedSharding(sub, sharding.spec)


def view_on(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """x's buffers on `sharding`'s devices wrapped as an array of that sharding (no copy; never delete it)."""
    if sharding == x.sharding:
        return x
    by_device = {shard.device: shard.data for shard in x.addressable_shards}
    here = jax.process_index()  # multi-process: this process holds (and passes) only its own devices' buffers
    shards = [by_device[d] for d in sharding.mesh.devices.flat if d.process_index == here]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def as_sharding(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """x rewrapped, without a copy, with `sharding` when that is an equivalent spelling of x's own (e.g. jit outputs
    come back as P("tensor",) for a requested P("tensor", None)): the sampler's programs see the exact shardings of
    the state they were compiled for, so a pushed state never recompiles them."""
    if x.sharding == sharding or not x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return view_on(x, sharding)


def _divisor_vectors(splits: tuple[int, ...]):
    """Every vector s with s[d] dividing splits[d], most pieces first."""
    divs = [[k for k in range(n, 0, -1) if n % k == 0] for n in splits]
    return sorted(itertools.product(*divs), key=lambda s: -math.prod(s))


def transfer_layout(actor_sh: NamedSharding, rollout_sh: NamedSharding, ndim: int):
    """(transfer sharding on the actor mesh, landing sharding on the rollout mesh) such that every landing shard's
    index range is a shard of the transfer layout (so device_put copies device to device, never via the host)."""
    target = dim_splits(rollout_sh, ndim)
    for s in _divisor_vectors(target):
        a_spec = realize_spec(actor_sh.mesh, s, actor_sh.spec)
        r_spec = rollout_sh.spec if s == target else realize_spec(rollout_sh.mesh, s, rollout_sh.spec)
        if a_spec is not None and r_spec is not None:
            landing = rollout_sh if s == target else NamedSharding(rollout_sh.mesh, r_spec)
            return NamedSharding(actor_sh.mesh, a_spec), landing
    raise AssertionError("unreachable: the all-ones split is always realisable")



# ------------------------------------------------------------------------------------------ jitted steps


@functools.partial(jax.jit, static_argnums=(1, 2))
def cast_reshard(x, dtype, sharding):
    """x (any sharding) -> x.astype(dtype) laid out as `sharding` (same mesh). A fresh buffer."""
    return jax.lax.with_sharding_constraint(x.astype(dtype), sharding)


def quantize_as(w, qmeta):
    """w [..., out, in] (bf16) -> (q, scale) exactly as the sampler stores the tensor (`Sampler.quantize_weights`):
    fp8 via `quant.quantize_rollout_fp8`; fp4 via `quant.QuantizedTensor.from_fp4` of the bf16 values."""
    kind, fmt, block, _ = qmeta
    if kind == "fp8":
        qt = quant.quantize_rollout_fp8(w, fmt=fmt, block=block)
    else:
        qt = quant.QuantizedTensor.from_fp4(w.astype(FP8_SOURCE_DTYPE).astype(jnp.float32), block=block[1])
    return qt.q, qt.scale


def chunked(items: list, chunk_bytes: int) -> list[list]:
    """`items` (each with `.nbytes`, the wire bytes of one tensor) in order, cut into groups of at most
    `chunk_bytes` wire bytes; an item larger than that is a group of its own."""
    chunks, cur, size = [], [], 0
    for t in items:
        if cur and size + t.nbytes > chunk_bytes:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    return chunks + ([cur] if cur else [])


def buffer_ids(x) -> set[int]:
    """The device buffer addresses of x's addressable shards (to tell whether a jit output aliases an input)."""
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _is_rng(value, var) -> bool:
    return isinstance(var, nnx.RngState) or jax.dtypes.issubdtype(getattr(value, "dtype", np.float32),
                                                                    jax.dtypes.prng_key)


def flat_state(state) -> dict[str, Any]:
    """nnx.State / Module / {key: array or Variable} -> {key: array or ShapeDtypeStruct}; PRNG keys dropped (the
    sampler seeds its own randomness; RNG state is not a weight)."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    if isinstance(state, Mapping) and not isinstance(state, nnx.State) and all(isinstance(k, str) for k in state):
        items = state.items()
    else:
        items = ((param_key(p), v) for p, v in nnx.to_flat_state(state))
    out = {}
    for k, var in items:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if not _is_rng(value, var):
            out[k] = value
    return out


def check_keys(got, expected, what: str) -> None:
    """ValueError (prefixed `what`) listing the missing and unexpected keys when `got`'s keys differ from
    `expected`'s (both {tensor key: ...})."""
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    if missing or extra:
        raise ValueError(f"{what}: the actor state does not match the sampler's tensors: "
                         f"{len(missing)} missing {missing}, {len(extra)} unexpected {extra}")
