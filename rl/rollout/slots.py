"""Continuous batching for the rollout sampler: a fixed number of decode slots, refilled as samples finish.

`Sampler(..., slots=N)` (`--rollout-slots N`) routes `Sampler.generate` here; `slots=0` keeps the static batch
(every row decodes until the longest one ends). One jitted program per (request bucket, prompt bucket,
max_new_tokens, slots) runs the whole rollout on device:

    while some request is unfinished:
        while a slot is free and a request is pending:      # refill
            prefill the next request alone ([1, P] prompt, in chunks of --prefill-chunk tokens against the cache
            built so far: dsv4/chunked.py; only as many chunks as its length needs)
            write its decode cache into the free slot's row; sample its first token
        one decode step over all N slots (free slots compute on a dead row; nothing of theirs is kept)
        a slot whose sample has ended (stop token or max_new_tokens, and its last token fed once more so its
        routing is recorded) writes its result row and becomes free

Per-sample randomness is the static path's: request r's key is fold_in(fold_in(fold_in(key(seed), step), prompt),
sample), and its token g is drawn with fold_in(key_r, g); every row's math reads only its own cache row, so a
sample's tokens, logprobs and routing do not depend on the slot, the slot count or the order it ran in (bitwise
on CPU, tests/rl/test_slots.py, also against the static path).

The KV cache holds N rows of `cache_len_for(P + max_new_tokens)` positions: rounded up to the least common
multiple of the compression ratios (every compressed entry a row can complete fits), not to powers of two. The
slots (their caches and per-slot state) are split like the static path's batch, over the rule table's `ACT_BATCH`
axes (data x expert on the rollout mesh: "EP as DP"); N is rounded up to a multiple of those shards
(`Sampler.slot_count`), so a device holds N / shards slot caches. A refill's prefill is one request's, so the
program's peak is the slot caches + one chunk's temporaries, whatever the prompt length.
`plan_slots` turns the memory plan's KV budget into a slot count (`--rollout-slots auto`) and checks an explicit
count against it. Counters per call (`Sampler.last_stats`): rollout/slots_refilled (admissions into a slot that
had already served a request), rollout/slot_utilisation (slot-steps holding a live request / all slot-steps),
rollout/decode_steps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dsv4.cache import decode_step
from dsv4.chunked import prefill_chunked
from parallel.plan import GPUS, plan
from rl.config.algo import LearnerConfig
from rl.config.rollout import RolloutConfig
from rl.config.tree import default
from rl.rollout.host_memory import cpu_kv_budget, host_memory_bytes
from rl.rollout.sampling import sample_tokens
from sharding import axes as ax
from sharding.rules import activation_spec, cache_shardings


def cache_len_for(config, prompt_len: int, max_new_tokens: int) -> int:
    """Cache positions of one slot: prompt_len + max_new_tokens rounded up to the lcm of the (non-zero)
    compression ratios of `config` (so floor(cache_len / m) entries hold every entry a row completes)."""
    step = math.lcm(*(int(r) for r in config.compress_ratios if r)) if any(config.compress_ratios) else 1
    n = int(prompt_len) + int(max_new_tokens)
    return -(-n // step) * step


def plan_slots(requested, *, per_slot_bytes: float, budget_bytes: float | None, seq_len: int,
               flag: str = "--rollout-slots", shards: int = 1) -> int:
    """The slot count for `requested` (int >= 0 or "auto") against a KV-cache budget.

    Args:
      requested: 0 = static batching (returned as is), N >= 1 slots, or "auto" (as many slots as the budget holds).
      per_slot_bytes: one slot's decode cache (`parallel.model_bytes.kv_cache_bytes`). budget_bytes: bytes the memory plan
        leaves for the KV cache on one rollout device (`parallel.plan` rollout margin), None = unknown (no check; "auto"
        then means 0, static batching). seq_len: max prompt + max new tokens (for the message). shards: the
        batch shards the slots are split over (data x expert, `Sampler.batch_shards`): a device holds
        ceil(N / shards) slots.
    Raises:
      ValueError (one line naming `flag`): N slots need more than the budget, or "auto" finds room for none.
    """
    if requested == 0:
        return 0
    if budget_bytes is None:
        return 0 if requested == "auto" else int(requested)
    shards = max(1, int(shards))
    fit = int(budget_bytes // per_slot_bytes) * shards if per_slot_bytes > 0 else 1 << 30
    if requested == "auto":
        if fit < 1:
            raise ValueError(f"{flag} auto: the memory plan leaves {budget_bytes / 2**30:.2f} GiB per rollout device "
                             f"for the KV cache, less than one slot of {seq_len} tokens "
                             f"({per_slot_bytes / 2**20:.1f} MiB)")
        return fit
    if int(requested) > fit:
        split = f", {fit // shards} per device over {shards} batch shards" if shards > 1 else ""
        raise ValueError(f"{flag} {requested}: the memory plan leaves {budget_bytes / 2**30:.2f} GiB per rollout "
                         f"device for the KV cache, room for {fit} slots of {seq_len} tokens "
                         f"({per_slot_bytes / 2**20:.1f} MiB each{split}); use {flag} <= {fit} or auto")
    return int(requested)


_SLOT_STATE = ("req", "fed", "len", "done", "stop", "cur", "used")
_OUTPUTS = ("out_tok", "out_lp", "out_pr", "out_rr", "out_len", "out_stop")  # [nb, ...] rows split the same way


def _pinner(sampler):
    """st -> st with the slot caches and the per-slot state [S] placed like the static path's batch (the rule
    table's `ACT_BATCH` axes: data x expert on the rollout mesh), never replicated; identity without a mesh."""
    if sampler.mesh is None:
        return lambda st: st
    mesh, rules = sampler.mesh, sampler.rules
    rows = NamedSharding(mesh, activation_spec(ax.ACT_BATCH, rules=rules, mesh=mesh))

    def pin(st):
        st = dict(st)
        st["caches"] = jax.lax.with_sharding_constraint(st["caches"], cache_shardings(st["caches"], mesh, rules))
        for name in _SLOT_STATE + _OUTPUTS:
            st[name] = jax.lax.with_sharding_constraint(st[name], rows)
        return st

    return pin


def _put_row(big, small, j):
    """big [S, ...], small [1, ...]: row j of big <- small[0]."""
    return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), j, 0)


def slots_program(sampler, shape, wstate, caches, ids, lens, key_data, n_real, temperature, top_p, top_k,
                  max_new, stop_ids, token_offset):
    """The continuous-batching rollout (traced by `Sampler.slots_jit`; see the module docstring).

    shape = (nb, P, T, S) static: request rows (padded), prompt bucket, max_new_tokens, slots.
    caches: S-row decode caches (donated). ids [nb, P] right-padded prompts, lens [nb], key_data [nb, ...] per
    request keys, n_real: requests to run (rows >= n_real are padding), max_new [nb] per-request length limits
    (<= T), token_offset [nb]: index of each request's first new token in its sample (the keys; partial rollouts).
    Returns (tokens [nb, T], logprobs [nb, T],
    prompt routing [nb, P, L, k], response routing [nb, T, L, k], lengths [nb], stopped [nb], stats [3] int32 =
    (refills, busy slot-steps, decode steps), caches).
    """
    nb, p, t_cap, s = shape
    cfg = sampler.config
    n_l, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    cache_len = cache_len_for(cfg, p, t_cap)
    keys = jax.random.wrap_key_data(key_data)
    per_step = sampler.dequant == "per_step"
    layerwise = sampler.dequant == "per_layer"  # each layer dequantised right before it runs (rl/rollout/layerwise.py)
    layer_fn = sampler.layerwise.layer_fn(wstate) if layerwise else None
    model = None if per_step else sampler.layerwise.shell(wstate) if layerwise else sampler.dense_model(wstate)

    pin = _pinner(sampler)

    def model_now():
        return sampler.dense_model(jax.lax.optimization_barrier(wstate)) if per_step else model

    def is_stop(tok):
        return jnp.any(tok[..., None] == stop_ids, axis=-1)

    def admit(st):
        """Prefill the next pending request into the first free slot."""
        m = model_now()
        j = jnp.argmax(st["req"] < 0).astype(jnp.int32)
        r = st["next"]
        row_ids = jax.lax.dynamic_slice_in_dim(ids, r, 1, 0)
        row_len = jax.lax.dynamic_slice_in_dim(lens, r, 1, 0)
        with jax.named_scope("prefill"):
            logits, pr, c1 = prefill_chunked(m, row_ids, row_len, cache_len, sampler.prefill_chunk,
                                             dispatch_fn=sampler.dispatch_fn, layer_fn=layer_fn,
                                             kv_fp8=sampler.kv_fp8)
        st = dict(st)
        st["caches"] = jax.tree.map(lambda big, sm: _put_row(big, sm, j), st["caches"], c1)
        key0 = jax.random.fold_in(keys[r], token_offset[r])[None]
        tok0, lp0 = sample_tokens(logits, key0, temperature, top_p, top_k)
        stop0 = is_stop(tok0)[0]
        st["out_tok"] = st["out_tok"].at[r, 0].set(tok0[0])
        st["out_lp"] = st["out_lp"].at[r, 0].set(lp0[0])
        st["out_pr"] = st["out_pr"].at[r].set(pr[0])
        st["refills"] = st["refills"] + st["used"][j].astype(jnp.int32)
        for name, val in (("req", r), ("fed", 0), ("len", 1), ("done", stop0 | (max_new[r] <= 1)), ("stop", stop0),
                          ("cur", tok0[0]), ("used", True)):
            st[name] = st[name].at[j].set(val)
        st["next"] = r + 1
        return pin(st)

    def refill(st):
        return jax.lax.while_loop(lambda c: jnp.any(c["req"] < 0) & (c["next"] < n_real), admit, st)

    def step(st):
        st = refill(st)
        m = model_now()
        live = st["req"] >= 0
        req = jnp.where(live, st["req"], 0)
        pos = jnp.where(live, lens[req] + st["fed"], 0)
        cur = jnp.where(live, st["cur"], 0)
        with jax.named_scope("decode_step"):
            logits, rt, caches = decode_step(m, cur, pos, st["caches"], dispatch_fn=sampler.dispatch_fn,
                                             layer_fn=layer_fn)
        st = dict(st, caches=caches)
        drop = jnp.where(live, st["req"], nb)  # out-of-range rows are dropped by the scatters
        st["out_rr"] = st["out_rr"].at[drop, st["fed"]].set(rt, mode="drop")
        want = live & ~st["done"]
        g = st["len"]  # index of the token drawn now
        step_keys = jax.vmap(jax.random.fold_in)(keys[req], g + token_offset[req])
        tok, lp = sample_tokens(logits, step_keys, temperature, top_p, top_k)
        wdrop = jnp.where(want, st["req"], nb)
        gi = jnp.minimum(g, t_cap - 1)
        st["out_tok"] = st["out_tok"].at[wdrop, gi].set(tok, mode="drop")
        st["out_lp"] = st["out_lp"].at[wdrop, gi].set(lp, mode="drop")
        stop = want & is_stop(tok)
        st["len"] = st["len"] + want.astype(jnp.int32)
        st["done"] = st["done"] | stop | (want & (g + 1 >= max_new[req]))
        st["stop"] = st["stop"] | stop
        st["cur"] = jnp.where(want, tok, st["cur"])
        st["fed"] = st["fed"] + live.astype(jnp.int32)
        fin = live & st["done"] & (st["fed"] >= st["len"])
        fdrop = jnp.where(fin, st["req"], nb)
        st["out_len"] = st["out_len"].at[fdrop].set(st["len"], mode="drop")
        st["out_stop"] = st["out_stop"].at[fdrop].set(st["stop"], mode="drop")
        st["finished"] = st["finished"] + jnp.sum(fin).astype(jnp.int32)
        st["req"] = jnp.where(fin, -1, st["req"])
        st["busy"] = st["busy"] + jnp.sum(live).astype(jnp.int32)
        st["steps"] = st["steps"] + 1
        return pin(st)

    z = lambda dt: jnp.zeros((s,), dt)  # noqa: E731
    st = {"caches": caches, "req": jnp.full((s,), -1, jnp.int32), "fed": z(jnp.int32), "len": z(jnp.int32),
          "done": z(bool), "stop": z(bool), "cur": z(jnp.int32), "used": z(bool), "next": jnp.int32(0),
          "finished": jnp.int32(0), "refills": jnp.int32(0), "busy": jnp.int32(0), "steps": jnp.int32(0),
          "out_tok": jnp.zeros((nb, t_cap), jnp.int32), "out_lp": jnp.zeros((nb, t_cap), jnp.float32),
          "out_pr": jnp.full((nb, p, n_l, k), -1, jnp.int32), "out_rr": jnp.full((nb, t_cap, n_l, k), -1, jnp.int32),
          "out_len": jnp.zeros((nb,), jnp.int32), "out_stop": jnp.zeros((nb,), bool)}
    st = jax.lax.while_loop(lambda c: c["finished"] < n_real, step, pin(st))
    stats = jnp.stack([st["refills"], st["busy"], st["steps"]])
    return (st["out_tok"], st["out_lp"], st["out_pr"], st["out_rr"], st["out_len"], st["out_stop"], stats,
            st["caches"])


def slot_stats(stats, slots: int) -> dict:
    """Host metrics from the program's stats [refills, busy slot-steps, decode steps]."""
    refills, busy, steps = (int(x) for x in np.asarray(stats))
    return {"rollout/slots_refilled": float(refills), "rollout/decode_steps": float(steps),
            "rollout/slot_utilisation": busy / max(1, steps * slots)}


def kv_budget_from_plan(model_cfg, mesh_spec: str, seq_len: int, *,
                        rollout_dtype: str = default(RolloutConfig, "dtype"),
                        **plan_kwargs) -> tuple[float | None, str]:
    """KV-cache bytes the memory plan (parallel/plan.py) leaves on one rollout device after weights and reserve,
    for the detected GPU (else MI308X for fp8_e4m3fnuz, else H200: the planner's GPUs; on XLA:CPU the host's
    memory shared by its devices, `rl.rollout.host_memory.cpu_kv_budget`), and a note saying which.
    (The rollout's side of the plan does not depend on the learner's knobs: planned with `LearnerConfig()`.)

    Returns (None, reason) when the plan cannot be made (then slot counts are not checked).
    """
    kind = jax.devices()[0].device_kind.lower().replace(" ", "")
    gpu = next((g for g in GPUS if g in kind), None)
    note = "detected" if gpu else "assumed"
    gpu = gpu or ("mi308x" if rollout_dtype == "fp8_e4m3fnuz" else "h200")
    try:
        report = plan(model_cfg, mesh_spec, gpu, learner=LearnerConfig(), rollout_seq_len=seq_len, **plan_kwargs)
    except Exception as e:  # noqa: BLE001 - the plan is advice; an unplannable mesh leaves slots unchecked
        return None, f"memory plan unavailable for {mesh_spec} on {gpu} ({type(e).__name__}: {e})"
    if jax.devices()[0].platform == "cpu":  # XLA:CPU: every device in the host's RAM (rl/rollout/host_memory.py)
        host = host_memory_bytes()
        return cpu_kv_budget(report, host), f"memory plan on this host's {host / 2**30:.1f} GiB of RAM, XLA:CPU"
    return float(report.rollout.margin), f"memory plan on {gpu} ({note})"
