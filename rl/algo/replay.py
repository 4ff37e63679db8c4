"""Routing-replay input validation (R3, Ma et al., arXiv 2510.11370): refuse garbage before any update.

The learner forces the recorded experts `routing [N, S, L, k]` in every MoE layer (dsv4/moe.py `route`:
ids >= 0 are forced, < 0 route normally). Replaying a wrong route silently trains a different model than the
one that sampled, which is worse than not replaying, so `validate_routing` checks, on the host, before anything
runs:
- dtype: an integer array (a float array could carry 3.7 or NaN that the int cast would quietly fix);
- range: every id of a real token (attention_mask > 0) lies in [0, n_routed_experts) or is the documented
  unknown marker `UNKNOWN_EXPERT = -1` (the sampler's marker for a position it did not route); the k ids of a
  token are either all known or all unknown (a half-recorded route is refused);
- distinct experts: the k known ids of a token are pairwise different (top-k never repeats an expert);
- hash layers: the recorded ids equal `tid2eid[token]` (as a set: the order of the k picks does not change the
  layer's output), since hash routing is a fixed function of the token.
Padding positions (attention_mask == 0) are not checked: nothing there reaches the loss.
Unknown tokens are counted per layer: `train/replay_unknown_frac` = unknown (real token, layer) pairs / all of
them, `train/replay_layers` = the number of layers in which at least one real token is replayed.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_replay.py`.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

UNKNOWN_EXPERT = -1


def _where(bad: np.ndarray) -> tuple[int, int, int]:
    """First (row, position, layer) where the [N, S, L] bool `bad` is True."""
    n, s, layer = np.argwhere(bad)[0]
    return int(n), int(s), int(layer)


def validate_routing(routing, input_ids, attention_mask, n_routed_experts: int,
                     hash_tables: Mapping[int, np.ndarray] | None = None) -> dict[str, float]:
    """Check recorded routes before replaying them; returns the replay metrics.

    Args:
        routing: [N, S, L, k] integer expert ids (see the module docstring for the accepted values).
        input_ids: [N, S] int token ids (the hash layers' lookup key); attention_mask: [N, S], > 0 on real tokens.
        n_routed_experts: E, the number of routed experts.
        hash_tables: {layer index: tid2eid [vocab, k] int} of the hash-routed layers (None: not checked).
    Returns:
        {"train/replay_unknown_frac": float in [0, 1], "train/replay_layers": float (a count of layers)}.
    Raises:
        ValueError: naming the row, position and layer of the first bad route and what was expected.
    """
    r = np.asarray(routing)
    if not np.issubdtype(r.dtype, np.integer):
        raise ValueError(f"TrainBatch.routing has dtype {r.dtype}; routing replay needs integer expert ids")
    n, s, n_layers, k = r.shape
    real = np.asarray(attention_mask) > 0  # [N, S]
    real_l = np.broadcast_to(real[:, :, None], (n, s, n_layers))
    unknown = r == UNKNOWN_EXPERT  # [N, S, L, k]
    in_range = (r >= 0) & (r < n_routed_experts)
    bad = real_l & ~np.all(in_range | unknown, axis=-1)
    if bad.any():
        i, t, layer = _where(bad)
        raise ValueError(f"TrainBatch.routing row {i}, position {t}, layer {layer}: expert ids "
                         f"{r[i, t, layer].tolist()} outside [0, {n_routed_experts}) and not the unknown marker "
                         f"{UNKNOWN_EXPERT}")
    all_unknown = np.all(unknown, axis=-1)  # [N, S, L]
    bad = real_l & np.any(unknown, axis=-1) & ~all_unknown
    if bad.any():
        i, t, layer = _where(bad)
        raise ValueError(f"TrainBatch.routing row {i}, position {t}, layer {layer}: {r[i, t, layer].tolist()} mixes "
                         f"recorded experts with the unknown marker {UNKNOWN_EXPERT}; a route is all known or all "
                         "unknown")
    srt = np.sort(r, axis=-1)
    bad = real_l & ~all_unknown & np.any(srt[..., 1:] == srt[..., :-1], axis=-1)
    if bad.any():
        i, t, layer = _where(bad)
        raise ValueError(f"TrainBatch.routing row {i}, position {t}, layer {layer}: {r[i, t, layer].tolist()} "
                         f"repeats an expert; the top-{k} experts of a token must be distinct")
    ids = np.asarray(input_ids)
    for layer, table in sorted((hash_tables or {}).items()):
        expected = np.sort(np.asarray(table)[np.clip(ids, 0, len(table) - 1)], axis=-1)  # [N, S, k]
        bad = real & ~all_unknown[:, :, layer] & np.any(srt[:, :, layer] != expected, axis=-1)
        if bad.any():
            i, t = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(f"TrainBatch.routing row {i}, position {t}, layer {layer} (hash-routed): "
                             f"{r[i, t, layer].tolist()} differs from tid2eid[{int(ids[i, t])}] = "
                             f"{np.asarray(table)[ids[i, t]].tolist()}")
    n_real = int(real.sum()) * n_layers
    n_unknown = int((all_unknown & real_l).sum())
    replayed_layers = int(np.any(~all_unknown & real_l, axis=(0, 1)).sum())
    return {"train/replay_unknown_frac": n_unknown / n_real if n_real else 0.0,
            "train/replay_layers": float(replayed_layers)}


def check_replay_routing(routing, input_ids, attention_mask, expected: tuple[int, int, int, int],
                         n_routed_experts: int, hash_tables: Mapping[int, np.ndarray] | None = None
                         ) -> dict[str, float]:
    """The learner's checks of a batch's recorded routing before a replayed step: present, of shape `expected`
    ([N, S, L, k]), integer; with values (not a `jax.ShapeDtypeStruct` of an abstract batch), `validate_routing`'s
    checks -> its metrics ({} for an abstract batch). Raises ValueError naming TrainBatch.routing."""
    if routing is None:
        raise ValueError("routing_replay is on but TrainBatch.routing is None: the sampler must record the "
                         f"routing [N, S, L, k] = {expected}, or turn LearnerConfig.routing_replay off")
    if tuple(routing.shape) != tuple(expected):
        raise ValueError(f"TrainBatch.routing has shape {tuple(routing.shape)}; routing replay needs "
                         f"[N, S, L, k] = {tuple(expected)}")
    if isinstance(routing, jax.ShapeDtypeStruct):  # an abstract batch (`Learner.lower`): no values to check
        if not np.issubdtype(routing.dtype, np.integer):
            raise ValueError(f"TrainBatch.routing has dtype {routing.dtype}; routing replay needs integer expert "
                             "ids")
        return {}
    return validate_routing(routing, input_ids, attention_mask, n_routed_experts, hash_tables)
