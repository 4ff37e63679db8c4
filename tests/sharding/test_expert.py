"""Tests for parallel/expert.py and parallel/padded.py on the 8 forced CPU devices: the EP dispatch equals the
single-device reference `dsv4.moe.routed_experts_ragged` (fp32, <= 1e-5) for every backend (ragged through the
all_gather reference of ragged_all_to_all, since XLA:CPU lacks the op), including when every token picks the same
experts, with padding and skipped pairs, with a bounded capacity (drops predicted by hand and counted), on actor
and rollout layouts; "sized" runs the capacity its loads need (balanced: the routed rows); gradients w.r.t. x, the
routing weights and w1/w3/w2 equal the unsharded ones; the native ragged op lowers (CPU) / runs (GPU).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv4 import moe
from parallel.expert import default_dispatch, make_ep_dispatch, ragged_all_to_all_reference, rollout_backend
from parallel.padded import capacity_buckets, merge_repeated_picks, padded_capacity
from sharding.mesh import build_mesh_plan
from sharding.rules import ACTOR_RULES, ROLLOUT_RULES, param_shardings

T, D, E, I, K = 48, 16, 8, 8, 2
LIMIT = 10.0
TOL = dict(rtol=1e-5, atol=1e-5)
# LLVM -O0 for XLA:CPU: compiles ~2.5x faster on the shared cores; the HLO (and so every sharding) is unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _call(jitted, *args):
    """Lower, compile with FAST_COMPILE and run `jitted(*args)` (under the caller's mesh context)."""
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def routed_experts_ragged(*args, limit, dtype):
    """The single-device reference `dsv4.moe.routed_experts_ragged`, jitted (eager dispatch is slower here)."""
    return _call(jax.jit(functools.partial(moe.routed_experts_ragged, limit=limit, dtype=dtype)), *args)


@pytest.fixture(scope="module")
def actor_mesh():
    return build_mesh_plan("actor:fsdp=2,expert=2,tensor=2").actor


def _inputs(seed=0, t=T, same=False):
    """x [t, D], ids [t, K] (distinct experts per token, or all tokens -> experts (3, 5)), weights, w1, w3, w2."""

    def make():
        ks = jax.random.split(jax.random.key(seed), 6)
        x = jax.random.normal(ks[0], (t, D))
        if same:
            ids = jnp.tile(jnp.array([[3, 5]], jnp.int32), (t, 1))
        else:  # a random permutation prefix per token
            ids = jnp.argsort(jax.random.uniform(ks[1], (t, E)), axis=1)[:, :K].astype(jnp.int32)
        w = jax.random.uniform(ks[2], (t, K), minval=0.1, maxval=1.0)
        w1 = jax.random.normal(ks[3], (E, I, D)) / 3
        w3 = jax.random.normal(ks[4], (E, I, D)) / 3
        w2 = jax.random.normal(ks[5], (E, D, I)) / 3
        return x, ids, w, w1, w3, w2

    return _call(jax.jit(make))


def _backend(name):
    """(backend, hook): the ragged backend on CPU goes through the all_gather reference of ragged_all_to_all."""
    return ("ragged", ragged_all_to_all_reference) if name == "ragged" else (name, None)


def _run(mesh, fn, x, ids, w, w1, w3, w2, rules=ACTOR_RULES):
    """jit on `mesh` with the weights placed by `rules` (as the model's parameters would be)."""
    wsh = [NamedSharding(mesh, s) for s in _weight_specs(mesh, rules)]
    w1, w3, w2 = (jax.device_put(a, s) for a, s in zip((w1, w3, w2), wsh))
    with jax.set_mesh(mesh):
        return _call(jax.jit(lambda *a: fn(*a, limit=LIMIT, dtype=jnp.float32)), x, ids, w, w1, w3, w2)


def _weight_specs(mesh, rules):
    from flax import nnx

    from sharding import axes as ax

    tree = {"w1": nnx.Param(jax.ShapeDtypeStruct((E, I, D), jnp.float32), logical_axes=(ax.EXPERT, ax.MLP, ax.EMBED)),
            "w2": nnx.Param(jax.ShapeDtypeStruct((E, D, I), jnp.float32), logical_axes=(ax.EXPERT, ax.EMBED, ax.MLP))}
    sh = param_shardings(tree, mesh, rules)
    return sh["w1"].get_value().spec, sh["w1"].get_value().spec, sh["w2"].get_value().spec


@pytest.mark.parametrize("backend", ["capacity", "ragged", "padded"])
@pytest.mark.parametrize("same", [False, True], ids=["random", "all_same_expert"])
def test_matches_reference(actor_mesh, backend, same):
    args = _inputs(same=same)
    ref = routed_experts_ragged(*args, limit=LIMIT, dtype=jnp.float32)
    name, hook = _backend(backend)
    out = _run(actor_mesh, make_ep_dispatch(actor_mesh, backend=name, _ragged_all_to_all=hook), *args)
    assert out.shape == (T, D) and out.dtype == jnp.float32
    assert out.sharding.is_equivalent_to(NamedSharding(actor_mesh, P(("fsdp", "expert"), None)), 2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)


@pytest.mark.parametrize("spec, rules, backends", [
    ("actor:expert=8", ACTOR_RULES, ("capacity",)),  # EP over all 8 devices, one expert each
    ("actor:data=2,expert=4", ACTOR_RULES, ("capacity", "ragged")),  # two EP groups of 4 (offsets per group)
    ("actor:fsdp=4/rollout:expert=2,tensor=2", ROLLOUT_RULES, ("capacity", "padded")),  # rollout layout: TP, no FSDP
])
def test_other_layouts(spec, rules, backends):
    plan = build_mesh_plan(spec)
    mesh = plan.rollout if rules is ROLLOUT_RULES else plan.actor
    args = _inputs(seed=1)
    ref = routed_experts_ragged(*args, limit=LIMIT, dtype=jnp.float32)
    for name in backends:
        backend, hook = _backend(name)
        fn = make_ep_dispatch(mesh, backend=backend, rules=rules, _ragged_all_to_all=hook)
        np.testing.assert_allclose(np.asarray(_run(mesh, fn, *args, rules=rules)), np.asarray(ref), **TOL)


@pytest.mark.parametrize("spec, exact", [("actor:fsdp=4,expert=2", True), ("actor:fsdp=2,expert=2,tensor=2", False)])
def test_bf16_matches_reference(spec, exact):
    """bf16 compute: bitwise equal to the reference without tensor parallelism (same dots, outputs travel in
    bf16 losslessly); with TP the w2 partial sums stay f32 through the psum while the reference rounds each of
    the k picks' outputs to bf16, so results differ by rounding only (<= k half-ulps, half-ulp <= 2^-8 |y|)."""
    mesh = build_mesh_plan(spec).actor
    x, ids, w, w1, w3, w2 = _inputs(seed=6)
    args = (x.astype(jnp.bfloat16), ids, w, *(a.astype(jnp.bfloat16) for a in (w1, w3, w2)))
    ref = np.asarray(routed_experts_ragged(*args, limit=LIMIT, dtype=jnp.bfloat16))
    fn = make_ep_dispatch(mesh)
    with jax.set_mesh(mesh):
        out = np.asarray(_call(jax.jit(lambda *a: fn(*a, limit=LIMIT, dtype=jnp.bfloat16)), *args))
    if exact:
        np.testing.assert_array_equal(out, ref)
    else:
        assert np.abs(out - ref).max() <= K * 2.0**-8 * np.abs(ref).max()


@pytest.mark.parametrize("backend", ["capacity", "ragged", "padded", "sized"])
def test_gradients_match(actor_mesh, backend):
    x, ids, w, w1, w3, w2 = _inputs(seed=2)
    name, hook = _backend(backend)
    fn = make_ep_dispatch(actor_mesh, backend=name, _ragged_all_to_all=hook)
    probe = jax.random.normal(jax.random.key(9), (T, D))

    def loss(f, x, w, w1, w3, w2):
        return jnp.sum(probe * f(x, ids, w, w1, w3, w2, limit=LIMIT, dtype=jnp.float32))

    ref = _call(jax.jit(jax.grad(lambda *a: loss(moe.routed_experts_ragged, *a), argnums=range(5))), x, w, w1, w3,
                w2)
    specs = _weight_specs(actor_mesh, ACTOR_RULES)
    w1s, w3s, w2s = (jax.device_put(a, NamedSharding(actor_mesh, s)) for a, s in zip((w1, w3, w2), specs))
    with jax.set_mesh(actor_mesh):
        got = _call(jax.jit(jax.grad(lambda *a: loss(fn, *a), argnums=range(5))), x, w, w1s, w3s, w2s)
    for name_, g, r in zip(("x", "weights", "w1", "w3", "w2"), got, ref):
        assert g.shape == r.shape, name_
        # sums over the k picks / tokens happen in another order: scale the tolerance by the gradient's size
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()),
                                   err_msg=name_)
    # the weight gradients keep the weights' layout (reduce-scattered over fsdp, split over expert / tensor)
    assert got[2].sharding.is_equivalent_to(NamedSharding(actor_mesh, specs[0]), 3)


def test_padding_and_skipped_pairs(actor_mesh):
    """T not divisible by the 4 token shards, and ids < 0 (skipped pairs) -> same as the reference without them."""
    x, ids, w, w1, w3, w2 = _inputs(seed=3, t=T - 3)
    ids = ids.at[::5, 1].set(-1)
    keep = ids >= 0
    ref = routed_experts_ragged(x, jnp.where(keep, ids, 0), jnp.where(keep, w, 0.0), w1, w3, w2, limit=LIMIT,
                                dtype=jnp.float32)
    for name in ("capacity", "ragged", "padded"):
        backend, hook = _backend(name)
        out = _run(actor_mesh, make_ep_dispatch(actor_mesh, backend=backend, _ragged_all_to_all=hook),
                   x, ids, w, w1, w3, w2)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)


def _kept_pairs(ids, n_shards, ep, n_local, backend, cf):
    """Which (token, k) pairs survive a bounded buffer, computed by hand. Token shard s = rows [s Tl, (s+1) Tl);
    its EP rank is s % ep (expert is the minor token axis), its EP group s // ep."""
    ids = np.asarray(ids)
    t, k = ids.shape
    tl = t // n_shards
    n = tl * k
    keep = np.zeros(ids.shape, bool)
    if backend == "capacity":  # per source shard, per destination rank: the first C pairs in (token, k) order
        cap = min(n, max(1, math.ceil(cf * n / ep)))
        for s in range(n_shards):
            used = np.zeros(ep, int)
            for row in range(s * tl, (s + 1) * tl):
                for j in range(k):
                    dst = ids[row, j] // n_local
                    keep[row, j] = used[dst] < cap
                    used[dst] += 1
        return keep
    if backend == "padded":  # per source shard, per global expert: the first C pairs in (token, k) order
        cap = padded_capacity(tl, k, ep * n_local, cf)
        for s in range(n_shards):
            used = np.zeros(ep * n_local, int)
            for row in range(s * tl, (s + 1) * tl):
                for j in range(k):
                    keep[row, j] = used[ids[row, j]] < cap
                    used[ids[row, j]] += 1
        return keep
    rows = max(1, math.ceil(cf * n))  # ragged: receivers fill from source rank 0 upward, pairs sorted by expert
    for g in range(n_shards // ep):
        filled = np.zeros(ep, int)
        for r in range(ep):
            s = g * ep + r
            block = ids[s * tl:(s + 1) * tl].reshape(-1)
            for p in np.argsort(block, kind="stable"):
                dst = block[p] // n_local
                keep[s * tl + p // k, p % k] = filled[dst] < rows
                filled[dst] += 1
    return keep


@pytest.mark.parametrize("backend", ["capacity", "ragged", "padded"])
def test_bounded_capacity_drops_predictably(actor_mesh, backend):
    x, ids, w, w1, w3, w2 = _inputs(seed=4)
    ids = ids.at[: T // 2].set(jnp.array([0, 1], jnp.int32))  # half the tokens crowd rank 0's experts
    cf = 0.75
    keep = jnp.asarray(_kept_pairs(ids, 4, 2, E // 2, backend, cf))
    assert 0 < int(keep.sum()) < ids.size  # some pairs are dropped, some kept
    ref = routed_experts_ragged(x, ids, jnp.where(keep, w, 0.0), w1, w3, w2, limit=LIMIT, dtype=jnp.float32)
    name, hook = _backend(backend)
    fn = make_ep_dispatch(actor_mesh, backend=name, capacity_factor=cf, _ragged_all_to_all=hook)
    np.testing.assert_allclose(np.asarray(_run(actor_mesh, fn, x, ids, w, w1, w3, w2)), np.asarray(ref), **TOL)


def test_merge_repeated_picks_by_hand():
    """A repeated expert adds its weight to the token's first pick of it; skipped picks (< 0) are left as they are."""
    ids = jnp.array([[3, 3, 5], [1, -1, 1], [-1, 2, -1]], jnp.int32)
    w = jnp.array([[0.5, 0.25, 0.125], [1.0, 2.0, 4.0], [8.0, 0.5, 16.0]], jnp.float32)
    got_ids, got_w = merge_repeated_picks(ids, w)
    np.testing.assert_array_equal(np.asarray(got_ids), [[3, -1, 5], [1, -1, -1], [-1, 2, -1]])
    np.testing.assert_array_equal(np.asarray(got_w), [[0.75, 0.0, 0.125], [5.0, 2.0, 0.0], [8.0, 0.5, 16.0]])


def test_padded_dropless_is_t_local_and_exact_with_repeated_picks(actor_mesh):
    """Dropless padded holds T_local rows per (source rank, expert) (DeepEP's low-latency bound), k times less than
    every local pair; with repeated picks of one expert (hash routing) and every token on the same experts it
    still equals the reference, which sums the repeated picks' outputs."""
    assert padded_capacity(12, 6, 256, None) == 12 and padded_capacity(12, 6, 256, 1.25) == 1
    assert padded_capacity(12, 6, 4, 4.0) == 12  # a factor never asks for more than the dropless bound
    assert rollout_backend(cpu=True) == "capacity" and rollout_backend(cpu=False) == "sized"
    x, ids, w, w1, w3, w2 = _inputs(seed=6, same=True)
    ids = ids.at[::3, 1].set(ids[::3, 0])  # every third token picks expert 3 twice
    ref = routed_experts_ragged(x, ids, w, w1, w3, w2, limit=LIMIT, dtype=jnp.float32)
    out = _run(actor_mesh, make_ep_dispatch(actor_mesh, backend="padded"), x, ids, w, w1, w3, w2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)


def _dispatch_stats(mesh, fn, *args):
    """(output, DispatchStats as ints, compiled HLO text) of `fn.with_stats(*args)` on `mesh` (weights as `_run`)."""
    wsh = [NamedSharding(mesh, s) for s in _weight_specs(mesh, ACTOR_RULES)]
    args = (*args[:3], *(jax.device_put(a, s) for a, s in zip(args[3:], wsh)))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda *a: fn.with_stats(*a, limit=LIMIT, dtype=jnp.float32)).lower(*args).compile(
            compiler_options=FAST_COMPILE)
        out, st = compiled(*args)
    return out, tuple(int(v) for v in st), compiled.as_text()


@pytest.mark.parametrize("same", [False, True], ids=["balanced", "all_same_expert"])
def test_sized_is_exact_at_the_routed_cost(actor_mesh, same):
    """The "sized" backend, dropless (4 token shards of T_local = 12, k = 2, E = 8: capacities (3, 6, 12) under
    one lax.switch), equals the reference. Balanced routing (token t -> experts 2t, 2t + 1 mod 8: every shard sends
    every expert T_local k / E = 3 rows) runs the bottom capacity 3: expert rows per call = shards x E x C = 96 =
    the routed rows (fixed dropless padded: 384, E / k = 4x). Every token on experts (3, 5) runs the top one, C =
    T_local.
    The compiled program holds each capacity's batched expert dots, [n_local, ep * C, D]."""
    x, ids, w, w1, w3, w2 = _inputs(seed=7, same=same)
    if not same:
        t = jnp.arange(T)
        ids = jnp.stack([2 * t % E, (2 * t + 1) % E], axis=1).astype(jnp.int32)
    ref = routed_experts_ragged(x, ids, w, w1, w3, w2, limit=LIMIT, dtype=jnp.float32)
    out, (bucket, cap, dropped, routed, rows), hlo = _dispatch_stats(actor_mesh, make_ep_dispatch(
        actor_mesh, backend="sized"), x, ids, w, w1, w3, w2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    assert capacity_buckets(T // 4, K, E) == (3, 6, 12)
    assert (bucket, cap, dropped, routed, rows) == ((2, 12) if same else (0, 3)) + (0, T * K, 2 * cap)
    assert 4 * E * cap == (T * K * E // K if same else T * K)  # expert matmul rows of the call vs routed
    assert "conditional(" in hlo
    assert {int(r) for r in re.findall(r"f32\[4,(\d+),16\][^ ]* dot\(", hlo)} == {6, 12, 24}  # ep x (3, 6, 12)


@pytest.mark.parametrize("backend", ["padded", "sized"])
def test_drops_are_counted(actor_mesh, backend):
    """With a capacity factor (f_max for "sized": capacities (3, 6)) the pairs past an expert's capacity 6 are
    dropped as predicted by hand and counted: `DispatchStats.dropped` / `.routed` (train/expert_drop_frac)."""
    x, ids, w, w1, w3, w2 = _inputs(seed=4)
    ids = ids.at[: T // 2].set(jnp.array([0, 1], jnp.int32))  # shards 0 and 1 send experts 0 and 1 12 rows each
    keep = _kept_pairs(ids, 4, 2, E // 2, "padded", 2.0)
    ref = routed_experts_ragged(x, ids, jnp.where(keep, w, 0.0), w1, w3, w2, limit=LIMIT, dtype=jnp.float32)
    fn = make_ep_dispatch(actor_mesh, backend=backend, capacity_factor=2.0)
    out, (bucket, cap, dropped, routed, _), _ = _dispatch_stats(actor_mesh, fn, x, ids, w, w1, w3, w2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    assert fn.can_drop and (bucket, cap, dropped, routed) == (int(backend == "sized"), 6, int((~keep).sum()), T * K)
    assert dropped == 2 * 2 * (12 - 6)


def test_sized_compact_runs_each_experts_rows(actor_mesh):
    """`compact=True`: each (source shard, expert) load is 6 or 0 (in each EP pair of shards the even one sends
    experts 0, 1, 4, 5 six rows each, the odd one 2, 3, 6, 7), so C = 6 and the all_to_all brings each expert
    2 x 6 rows of which 6 are real; compacted, the FFN runs 6 rows per local expert (= the routed rows; 12
    without compaction). Equal to the reference, values and gradients (x, routing weights, w1)."""
    x, _, w, w1, w3, w2 = _inputs(seed=8)
    i, p = np.arange(T) % 12, (np.arange(T) // 12) % 2
    ids = jnp.asarray(np.stack([2 * p + i % 2, 4 + 2 * p + i % 2], axis=1), jnp.int32)
    ref = routed_experts_ragged(x, ids, w, w1, w3, w2, limit=LIMIT, dtype=jnp.float32)
    # built as the sampler builds it (--rollout.ep_backend sized --rollout.ep_compact true)
    shardings = {f"layers/1/ffn/experts/{n}": NamedSharding(actor_mesh, s)
                 for n, s in zip(("w1", "w3", "w2"), _weight_specs(actor_mesh, ACTOR_RULES))}
    fn = default_dispatch(list(actor_mesh.devices.flat), shardings, ep_backend="sized", compact=True)
    assert fn.dispatch_name.endswith("; dropless; rows compacted per local expert"), fn.dispatch_name
    out, (bucket, cap, _, _, rows), _ = _dispatch_stats(actor_mesh, fn, x, ids, w, w1, w3, w2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    assert (bucket, cap, rows) == (1, 6, 6)
    probe = jax.random.normal(jax.random.key(9), (T, D))
    grad = lambda f: jax.grad(lambda *a: jnp.sum(probe * f(a[0], ids, a[1], a[2], w3, w2, limit=LIMIT,  # noqa: E731
                                                            dtype=jnp.float32)), argnums=(0, 1, 2))
    want = _call(jax.jit(grad(moe.routed_experts_ragged)), x, w, w1)
    with jax.set_mesh(actor_mesh):
        got = _call(jax.jit(grad(fn)), x, w, w1)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))


def test_native_ragged_all_to_all_lowers(actor_mesh):
    """The real jax.lax.ragged_all_to_all path traces, differentiates and lowers on any backend."""
    x, ids, w, w1, w3, w2 = _inputs()
    fn = make_ep_dispatch(actor_mesh, backend="ragged")
    g = jax.jit(jax.grad(lambda x, w1: jnp.sum(fn(x, ids, w, w1, w3, w2, limit=LIMIT, dtype=jnp.float32)),
                         argnums=(0, 1)))
    with jax.set_mesh(actor_mesh):
        text = g.lower(x, w1).as_text()
    assert "ragged_all_to_all" in text


@pytest.mark.skipif(jax.default_backend() == "cpu",
                    reason="XLA:CPU does not implement ragged-all-to-all (UNIMPLEMENTED: HLO opcode "
                           "ragged-all-to-all is not supported by XLA:CPU ThunkEmitter)")
def test_native_ragged_all_to_all_matches_reference():
    n = jax.device_count()
    ep = 1 << (n.bit_length() - 1)
    mesh = build_mesh_plan(f"actor:expert={ep}").actor
    args = _inputs(seed=5)
    ref = routed_experts_ragged(*args, limit=LIMIT, dtype=jnp.float32)
    out = _run(mesh, make_ep_dispatch(mesh, backend="ragged"), *args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)


def test_errors(actor_mesh):
    with pytest.raises(ValueError, match="unknown EP backend 'dense'"):
        make_ep_dispatch(actor_mesh, backend="dense")
    with pytest.raises(ValueError, match="capacity_factor must be None"):
        make_ep_dispatch(actor_mesh, capacity_factor=0.0)
    with pytest.raises(ValueError, match="expert_axis 'ep' is not an axis"):
        make_ep_dispatch(actor_mesh, expert_axis="ep")
    with pytest.raises(ValueError, match="overlap the tensor-parallel axes"):
        make_ep_dispatch(actor_mesh, token_axes=("fsdp", "expert", "tensor"))
    with pytest.raises(ValueError, match="embed dim is split over"):
        make_ep_dispatch(actor_mesh, token_axes=("expert",))
    with pytest.raises(ValueError, match="must be one of token_axes"):
        make_ep_dispatch(actor_mesh, token_axes=("fsdp",))
    x, ids, w, w1, w3, w2 = _inputs()
    fn = make_ep_dispatch(actor_mesh)
    with pytest.raises(ValueError, match="n_routed_experts=7 is not divisible"):
        fn(x, ids, w, w1[:7], w3[:7], w2[:7], limit=LIMIT, dtype=jnp.float32)


def test_model_forward_counts_expert_drops():
    """The model returns its EP dispatch's drop counts summed over the main MoE layers (`DSV4Output.expert_drops`,
    the path of the routing records; the learner logs train/expert_drop_frac from it): with a capacity factor
    (padded, C = 2 rows per (source shard, expert), 4 shards of one 16-token row each) they equal the count from
    the returned routing by hand, the same through the scanned layer stack; dropless, constant zeros."""
    import dsv4
    from dsv4 import scan as sc
    from dsv4.layers import Buffer
    from flax import nnx

    cfg = dsv4.DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
    plan = build_mesh_plan("actor:fsdp=2,expert=2,tensor=2", config=cfg)
    model = dsv4.DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params, buffers = nnx.split(model, nnx.Param, Buffer)
    sdef = sc.stack_def(model)
    sp, sb = sc.stack_params(params, sdef.groups), sc.stack_params(buffers, sdef.groups)
    ids = jax.random.randint(jax.random.key(3), (4, 16), 0, cfg.vocab_size)
    capped = make_ep_dispatch(plan.actor, backend="padded", capacity_factor=0.5)
    assert padded_capacity(16, cfg.num_experts_per_tok, cfg.n_routed_experts, 0.5) == 2

    def loop(fn):
        out = nnx.merge(graphdef, params, buffers)(ids, dispatch_fn=fn)
        return out.routing, out.expert_drops

    def scanned(fn):
        shell, stack = sc.merge_stacked(sdef, sp, sb)
        return shell(ids, dispatch_fn=fn, layer_stack=stack).expert_drops

    with plan.activate("actor"):
        routing, drops = jax.jit(lambda: loop(capped))()
        drops_scan = jax.jit(lambda: scanned(capped))()
        zero = jax.jit(lambda: loop(make_ep_dispatch(plan.actor, backend="padded"))[1])()
    dropped = routed = 0
    for layer in range(cfg.num_hidden_layers):
        merged, _ = merge_repeated_picks(routing[:, :, layer].reshape(64, -1), jnp.ones((64, cfg.num_experts_per_tok)))
        for row in np.asarray(merged).reshape(4, 16, -1):  # one token shard per row
            counts = np.bincount(row[row >= 0], minlength=cfg.n_routed_experts)
            dropped, routed = dropped + int(np.maximum(counts - 2, 0).sum()), routed + int(counts.sum())
    assert dropped > 0 and [int(v) for v in drops] == [int(v) for v in drops_scan] == [dropped, routed]
    assert [int(v) for v in zero] == [0, 0]
