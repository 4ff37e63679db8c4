"""Expert FFN rows per EP dispatch call vs the routed rows, at Flash decode's routing shape (issues 37 and 38).

The shape of one Flash decode step on the rollout node: ep = 8 ranks (one `expert` mesh axis of 8 devices: CPU host
devices here), T_local = 128 tokens per rank, k = 6 picks of E = 256 experts (hidden sizes small: the counts do not
depend on them). For each routing and backend (`parallel.expert.make_ep_dispatch`), one call of
`dispatch_fn.with_stats` gives `DispatchStats`: the capacity that ran and the expert FFN's rows per local expert;
rows x E / routed pairs is the expert work relative to the routed work (1.0 = only the routed rows). Routings:
- balanced: token t picks experts 6t .. 6t + 5 mod E (every (rank, expert) cell holds the mean, 3 rows);
- uniform: a random set of 6 distinct experts per token;
- zipf: 6 distinct experts per token drawn with probability ~ 1 / rank^0.6 (a skew like real routers');
- skewed: every token picks experts 0..5 (the worst case; the top bucket, T_local rows).
Backends: "padded" dropless (C = T_local: E / k = 42.7x whatever the routing), "sized" (C chosen per call from the
loads), "sized" with `compact=True` (each local expert's rows compacted after the all_to_all). Every output is
compared with the single-device reference `dsv4.moe.routed_experts_ragged` (max abs error over all calls; nothing
may be dropped: all dropless).

Run:   .venv/bin/python benchmarks/ep_dispatch.py         (XLA:CPU, 8 host devices; ~1-2 min on 2 cores)
Last line: `RESULT padded_x=.. sized_balanced_x=.. sized_uniform_x=.. sized_zipf_x=.. sized_skewed_x=..
compact_uniform_x=.. compact_zipf_x=.. dropped=.. max_abs_err=..`.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from dsv4.moe import routed_experts_ragged  # noqa: E402
from parallel.expert import make_ep_dispatch  # noqa: E402
from sharding.mesh import build_mesh_plan  # noqa: E402

EP, T_LOCAL, K, E, D, I = 8, 128, 6, 256, 64, 32
T = EP * T_LOCAL
LIMIT = 10.0


def routing(name: str, key) -> jax.Array:
    """ids [T, K] int32, distinct experts per token."""
    if name == "balanced":
        return ((K * jnp.arange(T)[:, None] + jnp.arange(K)[None, :]) % E).astype(jnp.int32)
    if name == "skewed":
        return jnp.tile(jnp.arange(K, dtype=jnp.int32)[None, :], (T, 1))
    logits = jnp.zeros((E,)) if name == "uniform" else -0.6 * jnp.log(jnp.arange(1, E + 1, dtype=jnp.float32))
    gumbel = jax.random.gumbel(key, (T, E))  # Gumbel top-k: K distinct draws with probabilities softmax(logits)
    return jax.lax.top_k(logits[None, :] + gumbel, K)[1].astype(jnp.int32)


def main() -> int:
    mesh = build_mesh_plan(f"actor:expert={EP}").actor
    ks = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(ks[0], (T, D))
    w = jax.random.uniform(ks[1], (T, K), minval=0.1, maxval=1.0)
    w1, w3 = (jax.random.normal(k, (E, I, D)) * D ** -0.5 for k in ks[2:4])
    w2 = jax.random.normal(ks[4], (E, D, I)) * I ** -0.5
    placed = [jax.device_put(a, NamedSharding(mesh, PartitionSpec("expert", None, None))) for a in (w1, w3, w2)]
    fns = {"padded": make_ep_dispatch(mesh, backend="padded"), "sized": make_ep_dispatch(mesh, backend="sized"),
           "compact": make_ep_dispatch(mesh, backend="sized", compact=True)}
    result, err, dropped = {}, 0.0, 0
    for name in ("balanced", "uniform", "zipf", "skewed"):
        ids = routing(name, ks[5])
        ref = np.asarray(routed_experts_ragged(x, ids, w, w1, w3, w2, limit=LIMIT, dtype=jnp.float32))
        for backend, fn in fns.items():
            with jax.set_mesh(mesh):
                out, st = jax.jit(lambda *a, f=fn: f.with_stats(*a, limit=LIMIT, dtype=jnp.float32))(x, ids, w, *placed)
            err = max(err, float(np.max(np.abs(np.asarray(out) - ref))))
            dropped += int(st.dropped)
            ratio = int(st.rows) * E / int(st.routed)
            result[f"{backend}_{name}_x"] = ratio
            print(f"{name:9s} {backend:8s} capacity {int(st.capacity):4d} rows/expert {int(st.rows):5d} "
                  f"routed {int(st.routed):5d} dropped {int(st.dropped)}  expert rows / routed = {ratio:.2f}x",
                  flush=True)
    print(f"RESULT padded_x={result['padded_uniform_x']:.2f} sized_balanced_x={result['sized_balanced_x']:.2f} "
          f"sized_uniform_x={result['sized_uniform_x']:.2f} sized_zipf_x={result['sized_zipf_x']:.2f} "
          f"sized_skewed_x={result['sized_skewed_x']:.2f} compact_uniform_x={result['compact_uniform_x']:.2f} "
          f"compact_zipf_x={result['compact_zipf_x']:.2f} dropped={dropped} max_abs_err={err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
