"""Peak memory of the in-process push (`local.WeightPusher.memory()`), per device, from the array layouts and XLA's
`memory_analysis()` of every compiled push program.

Rollout = 2 quantised states (the live one and the one being built) + the largest chunk extra (arrivals that a land
jit replaces + the largest temp of that chunk's rollout programs); a verified push adds the largest per-tensor
verification temp instead when that is larger. The rollout-side digests loop over slabs of at most 1/32 of the
largest chunk's wire bytes per device (in elements; XLA:CPU materialises the u32 input of every integer reduction,
~12-14 B per element of a slab, and each slab is cut inside a `lax.cond` so that no whole-tensor f32 / f16 copy of a
bf16 / fp8 array is made, `verify._digest_terms`), so a verified push also stays within 2 states + one chunk
(tests/parallel/test_push.py). Never a bf16 copy of the model. Actor = one chunk of staged wire arrays + the largest
stage temp, on top of the learner's own state.
"""

from __future__ import annotations

import dataclasses

import jax

from parallel.push.tensors import dev_bytes
from parallel.push.transfer import cast_reshard, quantize_as
from parallel.push.verify import land_quantize, stage_wires, stored_row


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


def push_memory(pusher) -> PushMemory:
    """Per-device peak bytes of `pusher`'s pushes (a `local.WeightPusher`: its `tensors`, `chunks`, `rollout_mesh`,
    `slab_elems`) as a `PushMemory`, from the array layouts and XLA's `memory_analysis()` of the compiled stage,
    land and check programs (compiled here from shapes and shardings; the jit caches make this free after the
    warm-up's compiles except for the lowering)."""

    def temp(jitted, *args) -> int:
        mem = jitted.lower(*args).compile().memory_analysis()
        return int(getattr(mem, "temp_size_in_bytes", 0) or 0)

    state = sum(dev_bytes(w.shape, w.dtype, w.rollout_sharding) if not t.land_quantize else 0
                for t in pusher.tensors for w in t.wires)
    for t in pusher.tensors:  # tensors quantised on arrival: their stored (q, scale)
        if t.land_quantize:
            q, s = jax.eval_shape(lambda x, m=t.qmeta: quantize_as(x, m),
                                  jax.ShapeDtypeStruct(t.shape, t.dense_dtype))
            state += dev_bytes(q.shape, q.dtype, t.out_shardings[0]) + dev_bytes(s.shape, s.dtype, t.out_shardings[1])
    chunk_extra = chunk_wire = actor_chunk = 0
    for chunk in pusher.chunks:
        wire = sum(dev_bytes(w.shape, w.dtype, w.landing_sharding) for t in chunk for w in t.wires)
        replaced = sum(dev_bytes(w.shape, w.dtype, w.landing_sharding) for t in chunk if t.land_jit
                       for w in t.wires)
        temps, a_temps, staged = [0], [0], 0
        for t in chunk:
            if t.land_quantize:
                arg = jax.ShapeDtypeStruct(t.shape, t.dense_dtype, sharding=t.wires[0].landing_sharding)
                with jax.set_mesh(pusher.rollout_mesh):
                    temps.append(temp(land_quantize, arg, t.qmeta, t.out_shardings, True))
            elif t.land_jit:
                for w in t.wires:
                    if w.landing_sharding != w.rollout_sharding:
                        arg = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.landing_sharding)
                        with jax.set_mesh(pusher.rollout_mesh):
                            temps.append(temp(cast_reshard, arg, w.dtype, w.rollout_sharding))
            if t.actor_jit:
                staged += sum(dev_bytes(w.shape, w.dtype, w.transfer_sharding) for w in t.wires)
                arg = jax.ShapeDtypeStruct(t.shape, t.actor_dtype, sharding=t.source_sharding)
                with jax.set_mesh(t.source_sharding.mesh):
                    a_temps.append(temp(stage_wires, arg, *t.stage_args(True)))
        chunk_extra = max(chunk_extra, replaced + max(temps))
        chunk_wire = max(chunk_wire, wire)
        actor_chunk = max(actor_chunk, staged + max(a_temps))
    check = 0
    with jax.set_mesh(pusher.rollout_mesh):
        for t in pusher.tensors:
            if not t.land_quantize:
                args = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.rollout_sharding) for w in t.wires)
                check = max(check, temp(stored_row, args, t.slabs(pusher.slab_elems)))
    return PushMemory(state=state, chunk=chunk_extra, check=check, peak=2 * state + chunk_extra,
                      peak_verified=2 * state + max(chunk_extra, check), chunk_wire=chunk_wire,
                      actor_chunk=actor_chunk)
