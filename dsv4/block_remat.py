"""The scanned layer loop under remat "block", with hand-written backwards: each sub-layer recomputed from its saved
input (uint16 bits) and differentiated, the stacked weights read in place (`take`). `scan_block_remat` is
`dsv4.scan.run_group`'s loop; `run_period`, `period_backward` and `weight_cotangents` are its pieces, shared with
the pipeline's backward (parallel/pipeline.py). Tests: tests/dsv4/test_scan.py, tests/dsv4/test_scan_memory.py.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def take(tree: Any, i: jax.Array, axis: int = 0) -> Any:
    """Row i of every stacked leaf of `tree` (along `axis`, the leading one by default; None subtrees stay None),
    read inside a loop body whose step index is i.

    The stack is first tied to i by an optimization barrier, so XLA cannot hoist work on the whole stack out of
    the loop. Without it XLA:CPU, which runs no bf16 dynamic-slice, turns `dynamic-slice(bf16 stack)` into
    `dynamic-slice(convert(stack, f32))` and hoists the loop-invariant convert: an f32 copy of every stacked bf16
    weight (2x the weights) alive for the whole step. With the barrier the convert stays inside the loop and
    fuses into the slice (one layer at a time). On a GPU the barrier is free (no copy, no kernel); it depends on
    the step index only, not on the layer's input, so the next layer's slice (and its FSDP gather) can still be
    issued ahead of the current layer's compute."""
    tree, _ = jax.lax.optimization_barrier((tree, i))
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis, keepdims=False), tree)


def to_bits(a: jax.Array) -> jax.Array:
    """A 16-bit float activation as uint16 bits (saved stacks of integers are never float-normalised)."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype.itemsize == 2 and jnp.issubdtype(
        a.dtype, jnp.floating) else a


def from_bits(a: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype != dtype else a


def run_period(steps: Sequence[Callable], st: Sequence[Any], fo: Any, x: jax.Array, positions: jax.Array,
                ids: jax.Array, saved: list | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One scan step: sub-layers `steps[j](st[j], x, fo[j], positions, ids)` in order -> (x, (routes [period, B, S,
    k] int32, drops [period, 2] int32)). `fo`: [period, B, S, k] forced ids or None. With a `saved` list, each
    sub-layer's input is appended to it (`to_bits`)."""
    rs = []
    for j, step in enumerate(steps):
        if saved is not None:
            saved.append(to_bits(x))
        x, r = step(st[j], x, None if fo is None else fo[j], positions, ids)
        rs.append(r)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *rs)


def differentiable(states: Sequence[Any]) -> list[list[bool]]:
    """Per sub-layer state (a pytree), per leaf: whether it is a float (gets a cotangent)."""
    return [[jnp.issubdtype(a.dtype, jnp.inexact) for a in jax.tree.leaves(st)] for st in states]


def period_backward(steps: Sequence[Callable], diff: Sequence[Sequence[bool]], st: Sequence[Any], saved: Sequence[Any],
                    fo: Any, positions: jax.Array, ids: jax.Array, ct_x: jax.Array) -> tuple[jax.Array, tuple]:
    """The backward of one `run_period` step under remat "block": each sub-layer recomputed from its `saved` input
    (`to_bits`) and differentiated, last first. st: the period's layer states (one repetition's); diff:
    `differentiable(st)`. Returns (ct_x of the period's input (ct_x's dtype), per sub-layer the cotangents of its
    float leaves, in leaf order)."""
    xdtype = ct_x.dtype  # the carry's dtype (a scan carry keeps its dtype)
    cts_j = [None] * len(steps)
    for j in reversed(range(len(steps))):
        lv, tdef = jax.tree.flatten(st[j])
        dj = diff[j]

        def g(wd, xin, j=j, lv=lv, tdef=tdef, dj=dj):
            it = iter(wd)
            full = [next(it) if d else a for a, d in zip(lv, dj)]
            return steps[j](jax.tree.unflatten(tdef, full), xin, None if fo is None else fo[j], positions, ids)[0]

        _, vjp = jax.vjp(g, [a for a, d in zip(lv, dj) if d], from_bits(saved[j], xdtype))
        cts_j[j], ct_x = vjp(ct_x)
    return ct_x, tuple(cts_j)


def weight_cotangents(states: Sequence[Any], diff: Sequence[Sequence[bool]], cts: Sequence[Sequence[Any]]) -> tuple:
    """`period_backward`'s per-leaf cotangents (stacked or accumulated) as the `states` pytrees, None for the
    leaves that are not floats (a custom_vjp's zero)."""
    out = []
    for st, dj, ct in zip(states, diff, cts):
        it = iter(ct)
        out.append(jax.tree.unflatten(jax.tree.structure(st), [next(it) if d else None for d in dj]))
    return tuple(out)


def scan_block_remat(steps: Sequence[Callable], n: int):
    """`lax.scan` over `n` repetitions of the sub-layer `steps`, with a hand-written backward that recomputes
    each sub-layer from its saved input (what `jax.checkpoint(step, policy=nothing_saveable)` under `lax.scan`
    computes, with the same ops), returned as `f(states, x, forced, positions, ids) -> (x, routes)`.

    Why not `jax.checkpoint` + `lax.scan`: JAX scans the stacked weights and the saved inputs as the loop's `xs`,
    slicing them with a bf16 dynamic-slice that XLA:CPU float-normalises into f32 copies of whole stacks (83 + 20
    GiB per device for DeepSeek-V4-Flash on 2 x 8 devices, more than the weights themselves). Here the weights
    are read with `take` (no copy), the saved inputs are stacked as uint16 bits (bitwise), and the per-layer
    weight gradients leave the backward loop as its stacked outputs. Gradients equal the checkpointed scan's
    (tests/dsv4/test_scan.py).

    steps[j](state_j, x, forced_j, positions, ids) -> (x', (routes_j [B, S, k] int32, drops_j [2] int32)), state_j a
    pytree of one layer's arrays. Arguments of f: states (tuple over j of stacked pytrees, leading axis n), x [B, S,
    n_hc, D], forced ([n, period, B, S, k] int32 or None), positions and ids [B, S] int32. Returns (x, (routes
    [n, period, B, S, k] int32, drops [n, period, 2] int32)).
    """

    def forward(states, x, forced, positions, ids, save):
        def body(x, i):
            saved = [] if save else None
            x, r = run_period(steps, *take((states, forced), i), x, positions, ids, saved)
            return x, (None if saved is None else tuple(saved), r)
        return jax.lax.scan(body, x, jnp.arange(n))

    @jax.custom_vjp
    def f(states, x, forced, positions, ids):
        x, (_, r) = forward(states, x, forced, positions, ids, save=False)
        return x, r

    def f_fwd(states, x, forced, positions, ids):
        out, (saved, r) = forward(states, x, forced, positions, ids, save=True)
        return (out, r), (states, saved, forced, positions, ids)

    def f_bwd(res, cts):
        states, saved, forced, positions, ids = res
        diff = differentiable(states)

        def body(ct_x, i):
            st, sv, fo = take((states, saved, forced), i)
            return period_backward(steps, diff, st, sv, fo, positions, ids, ct_x)

        ct_x, ct_w = jax.lax.scan(body, cts[0], jnp.arange(n), reverse=True)
        return weight_cotangents(states, diff, ct_w), ct_x, None, None, None

    f.defvjp(f_fwd, f_bwd)
    return f
