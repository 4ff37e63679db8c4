"""The static plan of the in-process push (`local.py`): per tensor, the wire arrays that cross and their layouts on
both meshes (`TensorPlan`, `Wire`, `plan_tensors`) and the per-device bytes of a layout (`dev_bytes`). A plan holds
metadata only, never a weight.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from dsv4 import quant
from parallel.push.transfer import FP8_SOURCE_DTYPE, one_copy, transfer_layout
from parallel.push.verify import slab_loop


def dev_bytes(shape, dtype, sharding) -> int:
    """Bytes of one device's piece of an array of `shape` / `dtype` laid out as `sharding`."""
    return math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Wire:
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
class TensorPlan:
    """Static plan of one tensor of the in-process push. dense_dtype: what the actor checks and sends dense (the
    stored dtype; bf16 for quantised tensors). qmeta: (kind, fmt, block, shape) of the stored QuantizedTensor, None =
    dense (metadata only: a plan never holds a weight). quantize_on: "actor" | "rollout" for quantised tensors, None
    for dense. wires: what crosses, (dense,) or (q, scale). out_shardings: the stored arrays' shardings, (array,) or
    (q, scale)."""

    key: str
    shape: tuple[int, ...]
    actor_dtype: Any
    dense_dtype: Any
    actor_sharding: NamedSharding
    source_sharding: NamedSharding  # one copy of the actor array (a sub-mesh view when the actor replicates it)
    qmeta: tuple | None
    quantize_on: str | None
    wires: tuple[Wire, ...]
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

    def stage_args(self, verify: bool) -> tuple:
        """The static arguments of this tensor's actor-side jit (`verify.stage_wires` after the array)."""
        qmeta = self.qmeta if self.quantize_on == "actor" else None
        return (self.dense_dtype, qmeta, tuple(w.transfer_sharding for w in self.wires), verify)

    def slabs(self, max_elems: int) -> tuple:
        """Per stored array, the slab loop of its rollout-side digest (`verify.slab_loop`): one slab holds at most
        `max_elems` elements per device."""
        return tuple(slab_loop(w.shape, w.rollout_sharding, max_elems) for w in self.wires)


def plan_tensors(abstract: dict, actor_sh: dict, rollout_sh: dict, stored: dict, *, colocated: bool,
                 quantize_on: str) -> list[TensorPlan]:
    """The in-process push's plan of every tensor, in `rollout_sh`'s order.

    abstract: {key: ShapeDtypeStruct or array} of the actor's tensors (fp32 master weights, int tables);
    actor_sh / rollout_sh: {key: NamedSharding} on the actor / rollout mesh; stored: the sampler's weight state
    ({key: QuantizedTensor | array}, metadata only: stored dtypes, formats and shardings do not depend on the input
    dtypes); colocated: one mesh for both roles; quantize_on: "actor" | "rollout" for quantised tensors.
    Raises ValueError naming a tensor the sampler stores in another shape or an unknown quantised kind."""
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
            if quantize_on == "actor":
                arrays = [(out.q.shape, out.q.dtype, outs[0]), (out.scale.shape, out.scale.dtype, outs[1])]
            else:
                arrays = [(tuple(a.shape), dense, r_sh)]
            where = quantize_on
        else:
            if tuple(out.shape) != tuple(a.shape):
                raise ValueError(f"WeightPusher: {k}: sampler stores shape {out.shape}, actor has {a.shape}")
            qmeta, where, dense, outs = None, None, np.dtype(out.dtype), (r_sh,)
            arrays = [(tuple(a.shape), dense, r_sh)]
        if colocated:  # the rollout layout is written by the actor-side jit itself, on the whole mesh
            source = actor_sh[k]
            wires = tuple(Wire(tuple(s), np.dtype(d), sh, sh, sh) for s, d, sh in arrays)
        else:
            source = one_copy(actor_sh[k])
            wires = []
            for s, d, sh in arrays:
                transfer, landing = transfer_layout(source, sh, ndim)
                if qmeta is None and transfer.is_equivalent_to(source, ndim):
                    transfer = source
                wires.append(Wire(tuple(s), np.dtype(d), transfer, landing, sh))
            wires = tuple(wires)
        actor_jit = (qmeta is not None or dense != np.dtype(a.dtype)
                     or not wires[0].transfer_sharding.is_equivalent_to(source, ndim))
        tensors.append(TensorPlan(key=k, shape=tuple(a.shape), actor_dtype=np.dtype(a.dtype), dense_dtype=dense,
                                  actor_sharding=actor_sh[k], source_sharding=source, qmeta=qmeta,
                                  quantize_on=where, wires=wires, out_shardings=tuple(outs), actor_jit=actor_jit))
    return tensors
