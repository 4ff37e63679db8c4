"""parallel/routing_load.py: the busiest (rank, expert) cell a routing model gives, and the sized dispatch's
capacity it picks; launch/hlo_stats.py counting that branch of the dispatch's switch."""

from __future__ import annotations

import pytest

from launch import hlo_stats
from parallel.padded import capacity_buckets
from parallel.routing_load import bucket_index, drop_line, drop_stats, peak_cell_load, peak_expert_load

# a conditional of 3 branches in the routed experts' scope (the sized switch) and one outside it
HLO = """HloModule m

%small (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %d = f32[4,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%mid (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %d = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%big (p: f32[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  ROOT %d = f32[16,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main (i: s32[], x: f32[16,8]) -> f32[16,8] {
  %i = s32[] parameter(0)
  %x = f32[16,8]{1,0} parameter(1)
  ROOT %c = f32[16,8]{1,0} conditional(%i, %x, %x, %x), branch_computations={%small, %mid, %big}, metadata={op_name="jit(f)/routed_experts/shard_map/switch"}
}
"""


def test_peak_cell_load_and_bucket():
    buckets = capacity_buckets(128, 6, 256)  # Flash decode: 128 tokens per rank, k = 6 of 256
    assert buckets == (3, 6, 12, 24, 48, 96, 128)
    picks = {r: bucket_index(buckets, peak_cell_load(128, 6, 256, 8, r))
             for r in ("balanced", "uniform", "zipf", "worst")}
    # the capacities benchmarks/ep_dispatch.py measured: uniform C = 12 (4x the routed rows), Zipf 0.6 C = 48 (16x)
    assert picks == {"balanced": 0, "uniform": 2, "zipf": 4, "worst": 6}
    assert bucket_index(buckets, 500) == 6 and bucket_index(buckets, 1) == 0
    with pytest.raises(ValueError, match="--routing-load must be one of worst|uniform|zipf|balanced"):
        peak_cell_load(128, 6, 256, 8, "pareto")
    # `compact`'s second switch at C = 12: rows per local expert (ep x C = 96 at most) from all 8 sources, the mean
    # 24; uniform routing's busiest expert needs 48 (2x the routed rows, benchmarks/ep_dispatch.py's compact_uniform_x)
    inner = tuple(c for c in capacity_buckets(8 * 128, 6, 256) if c < 96) + (96,)
    assert inner == (24, 48, 96)
    rows = {r: bucket_index(inner, peak_expert_load(128, 6, 256, 8, 12, r)) for r in ("balanced", "uniform", "worst")}
    assert rows == {"balanced": 0, "uniform": 1, "worst": 2}
    with pytest.raises(ValueError, match="--routing-load"):
        peak_expert_load(128, 6, 256, 8, 12, "pareto")


def test_hlo_counts_the_branch_the_routing_picks():
    flops = {n: 2 * (n * 8) * 8 for n in (4, 8, 16)}  # 2 x output elements x contracted
    assert hlo_stats.count(HLO).flops == flops[16]  # conservative: the costliest branch
    assert hlo_stats.count(HLO, expert_branch=(1, 3)).flops == flops[8]
    assert hlo_stats.count(HLO, expert_branch=(1, 4)).flops == flops[16]  # not the sized switch's branch count
    assert hlo_stats.count(HLO.replace("routed_experts", "attention"), expert_branch=(0, 3)).flops == flops[16]
    # several switches (the sized dispatch's and, with compact, the one inside its branches): matched by branch count
    assert hlo_stats.count(HLO, expert_branch=[(6, 7), (0, 3)]).flops == flops[4]


def test_drop_fraction_of_a_capacity():
    """The padded backend's capacity factor 1.25 at 2,304 tokens per rank (k 6 of 256, ep 8; the seed learner has 9,216):
    random routing drops about 1% of the pairs, a Zipf-skewed router about a quarter (the silent drops of issue
    38); a capacity of T_local drops nothing under any routing."""
    from parallel.padded import padded_capacity
    from parallel.routing_load import drop_fraction

    c = padded_capacity(2304, 6, 256, 1.25)
    uniform, zipf = (drop_fraction(2304, 6, 256, 8, c, r, trials=2) for r in ("uniform", "zipf"))
    assert 0 < uniform < 0.05 < 0.1 < zipf < 0.5, (uniform, zipf)
    assert drop_fraction(2304, 6, 256, 8, c, "balanced") == 0 and drop_fraction(128, 6, 256, 8, 28, "worst") == 100 / 128
    assert all(drop_fraction(128, 6, 256, 8, 128, r, trials=2) == 0 for r in ("uniform", "zipf", "worst", "balanced"))
    # the drop probability: every Zipf dispatch of 8 x 2,304 tokens overflows some cell; none at C = T_local
    assert drop_stats(2304, 6, 256, 8, c, "zipf", trials=2) == (1.0, zipf)
    assert drop_stats(128, 6, 256, 8, 128, "uniform", trials=2) == (0.0, 0.0)
    assert drop_stats(128, 6, 256, 8, 28, "worst") == (1.0, 100 / 128)
    line = drop_line(128, 6, 256, 8, 28, 1.25, "worst", trials=2)
    assert "f_max 1.25 = 28 rows" in line and "worst: P(drop) 1.00, expected drop fraction 0.7812" in line
