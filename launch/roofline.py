"""Roofline time of a compiled program from its HLO counts (launch/hlo_stats.py) and a target's peaks
(launch/gpu_target.py), and the per-role summary lines of `python -m launch.plan --compile --target`.

    step time = max(flops / peak flop/s, bytes / HBM bytes/s) + intra-node collective bytes / link bytes/s
                + inter-node collective bytes / NIC bytes/s
per device (SPMD: every device runs the same program on its shard, so the slowest device is any device).
Collectives are added, not overlapped (an upper bound on what XLA's async collectives cost). Peaks are the
target's (`Target.source`, `Target.assumed`; NIC 50 GB/s per GPU assumed for every target).

Actor: model flops per device = `parallel.flops.train_flops_per_token` x rows x seq / actor devices; the remat
flops ratio = HLO dot flops / model flops (> 1: the remat policy's recompute, the loss's log-prob chunks and the
gathered-expert padding). Rollout: the generate program's decode loop (the costliest while loop without a known
trip count: it runs until every sequence is done) counted once = one decode step of every sequence in flight;
tokens/s of the rollout mesh = sequences in flight / that step's roofline time.
"""

from __future__ import annotations

import dataclasses

from launch.gpu_target import NET_BW, Target
from launch.hlo_stats import HloStats, collectives_by_axis

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Seconds per program run (per device): compute, memory, collectives and the step (module docstring)."""

    compute_s: float
    memory_s: float
    collective_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.collective_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "HBM bandwidth"


def roofline(st: HloStats, target: Target) -> Roofline:
    return Roofline(compute_s=st.flops / target.peak_flops, memory_s=st.bytes / target.hbm_bw,
                    collective_s=st.intra / target.link_bw + st.inter / NET_BW)


def _coll(st: HloStats) -> str:
    kinds = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(st.collectives.items()))
    return f"{st.collective_bytes / GiB:.2f} GiB ({kinds or 'none'}; {st.inter / GiB:.2f} GiB across nodes)"


def kernel_lines(st: HloStats, axes: dict[str, int] | None = None, n: int = 10, indent: str = "    ") -> list[str]:
    """Where the bytes and flops of `st` go: the `n` costliest kernels by HBM bytes and by dot flops (each with its
    runs per program run, what it is and its share), and the collectives by kind and by the mesh `axes` their
    replica groups run over (launch/hlo_stats.py `collectives_by_axis`; without `axes`, by kind)."""
    lines = []
    for by, total, unit, scale in (("bytes", st.bytes, "GiB", GiB), ("flops", st.flops, "TFLOP", 1e12)):
        top = st.top_kernels(by, n)
        if not top or total <= 0:
            continue
        lines.append(f"{indent}the {len(top)} costliest kernels by {'HBM bytes' if by == 'bytes' else 'dot flops'} "
                     f"({sum(getattr(k, by) for _, k in top) / total:.0%} of {total / scale:,.2f} {unit}):")
        lines += [f"{indent}  {getattr(k, by) / scale:10,.3f} {unit} {getattr(k, by) / total:4.0%}  x{k.runs:<5,.0f} "
                  f"{name}: {k.what}" for name, k in top]
    if st.groups:
        by_axis = collectives_by_axis(st, axes) if axes else {(kind, "?"): b for (kind, _), b in st.groups.items()}
        parts = [f"{kind} over {ax} {b / GiB:,.3f} GiB" for (kind, ax), b in sorted(by_axis.items(), key=lambda kv: -kv[1])]
        lines.append(f"{indent}collectives by kind and mesh axes: " + "; ".join(parts))
    return lines


def actor_summary(st: HloStats, target: Target, *, model_flops: float, label: str,
                  axes: dict[str, int] | None = None) -> tuple[list[str], dict]:
    """Lines and {"step_s", "remat_flops_ratio"} of the actor train step's counts `st` (per device), with its
    kernel breakdown (`kernel_lines`, collectives named with the actor mesh's `axes`)."""
    r = roofline(st, target)
    ratio = st.flops / model_flops if model_flops else float("nan")
    lines = [f"  roofline of the train step on {label} (per device; counted from the optimized HLO, "
             f"launch/hlo_stats.py):",
             f"    HLO dot flops {st.flops / 1e12:.1f} TFLOP; model flops (6 x active params x tokens + attention) "
             f"{model_flops / 1e12:.1f} TFLOP; remat flops ratio {ratio:.2f}",
             f"    HBM bytes {st.bytes / GiB:.1f} GiB; collective bytes sent {_coll(st)}",
             f"    compute {r.compute_s:.3f} s, HBM {r.memory_s:.3f} s, collectives {r.collective_s:.3f} s -> step "
             f"{r.step_s:.3f} s ({r.bound}-bound; peaks {target.peak_flops / 1e12:.0f} TFLOP/s, "
             f"{target.hbm_bw / 1e12:.2f} TB/s HBM, {target.link_bw / 1e9:.0f} GB/s link, {NET_BW / 1e9:.0f} GB/s "
             f"NIC{'; ' + target.assumed if target.assumed else ''})"]
    return lines + kernel_lines(st, axes), {"step_s": r.step_s, "remat_flops_ratio": ratio}


def rollout_summary(st: HloStats, decode: HloStats | None, target: Target, *, seqs: int, weight_bytes: int,
                    label: str, axes: dict[str, int] | None = None, kv_bytes: int = 0, token_flops: float = 0.0,
                    routed_flops: float = 0.0) -> tuple[list[str], dict]:
    """Lines and figures of the generate program: `decode` = one decode step's counts (None: not found), `seqs`
    sequences in flight on the rollout mesh, `weight_bytes` the resident (quantised) weights per device; the decode
    step's kernel breakdown (`kernel_lines`, collectives named with the rollout mesh's `axes`).

    The decode step against its physical limit (issue 37): `kv_bytes` the KV caches per device (all of them read:
    every slot full, an upper bound on the KV in use), `token_flops` the model's forward flops of one decode step
    per device, `routed_flops` the routed experts' share of them (k of E experts per token). Figures: tok_s,
    decode_step_ms_roofline, decode_step_ms_limit (max of (weights + KV) / HBM bandwidth and token_flops / peak),
    decode_bytes_x_weights, fp8_gemm_byte_share (8-bit float operand bytes / all GEMM operand bytes),
    expert_flops_x_routed (the routed experts' HLO dot flops / routed_flops)."""
    nan = float("nan")
    lines = [f"  roofline of the rollout on {label} (per device; optimized HLO): program {st.flops / 1e12:.2f} TFLOP, "
             f"{st.bytes / GiB:.1f} GiB HBM, collectives {_coll(st)}; dots with an FP8 operand: {st.fp8_dots} of "
             f"{st.dots}" + (" (the FP8 weights are dequantised to bf16 before every GEMM)" if not st.fp8_dots else "")]
    if decode is None:
        lines.append("    no token loop found (no while loop in the program)")
        return lines, {"tok_s": nan, "decode_step_ms_roofline": nan, "decode_step_ms_limit": nan,
                       "decode_bytes_x_weights": nan, "fp8_gemm_byte_share": nan, "expert_flops_x_routed": nan}
    r = roofline(decode, target)
    tok_s = seqs / r.step_s if r.step_s > 0 else nan
    limit_s = max((weight_bytes + kv_bytes) / target.hbm_bw, token_flops / target.peak_flops)
    fig = {"tok_s": tok_s, "decode_step_ms_roofline": r.step_s * 1e3, "decode_step_ms_limit": limit_s * 1e3,
           "decode_bytes_x_weights": decode.bytes / weight_bytes if weight_bytes else nan,
           "fp8_gemm_byte_share": decode.fp8_gemm_bytes / decode.gemm_bytes if decode.gemm_bytes else nan,
           "expert_flops_x_routed": decode.expert_flops / routed_flops if routed_flops else nan}
    lines += [f"    one decode step ({seqs} sequences): {decode.flops / 1e9:.1f} GFLOP, {decode.bytes / GiB:.2f} GiB "
              f"read+written ({fig['decode_bytes_x_weights']:.2f}x the {weight_bytes / GiB:.2f} GiB of resident "
              f"weights), collectives {decode.collective_bytes / GiB:.3f} GiB",
              f"    compute {r.compute_s * 1e3:.2f} ms, HBM {r.memory_s * 1e3:.2f} ms, collectives "
              f"{r.collective_s * 1e3:.2f} ms -> {r.step_s * 1e3:.2f} ms per step ({r.bound}-bound) = {tok_s:,.0f} "
              f"tokens/s on the rollout mesh",
              f"    physical limit {limit_s * 1e3:.2f} ms (weights + {kv_bytes / GiB:.2f} GiB of KV caches at "
              f"{target.hbm_bw / 1e12:.2f} TB/s: {(weight_bytes + kv_bytes) / target.hbm_bw * 1e3:.2f} ms; "
              f"{token_flops / 1e9:.1f} GFLOP of model flops at peak: {token_flops / target.peak_flops * 1e3:.2f} ms)"
              f": the roofline is {r.step_s / limit_s if limit_s else nan:.1f}x it; FP8 share of GEMM operand bytes "
              f"{fig['fp8_gemm_byte_share']:.2f}; routed-expert dot flops {decode.expert_flops / 1e9:.1f} GFLOP = "
              f"{fig['expert_flops_x_routed']:.2f}x the routed {routed_flops / 1e9:.1f} GFLOP"]
    return lines + non_fp8_gemm_lines(decode) + kernel_lines(decode, axes), fig


def non_fp8_gemm_lines(st: HloStats, n: int = 5, indent: str = "    ") -> list[str]:
    """What keeps `fp8_gemm_byte_share` below 1: the GEMM operand bytes of `st` not in 8-bit floats, and the `n`
    kernels with the most of them (a dot reading FP8 bytes through a fused convert computes in the wider type and
    counts here, at that type's size)."""
    ks = sorted(((name, k) for name, k in st.kernels.items() if k.runs > 0.5 and k.gemm_bytes > k.fp8_gemm_bytes),
                key=lambda nk: nk[1].fp8_gemm_bytes - nk[1].gemm_bytes)[:n]
    if not ks:
        return []
    return ([f"{indent}GEMM operand bytes not in FP8: {(st.gemm_bytes - st.fp8_gemm_bytes) / GiB:,.2f} of "
             f"{st.gemm_bytes / GiB:,.2f} GiB; the {len(ks)} largest:"]
            + [f"{indent}  {(k.gemm_bytes - k.fp8_gemm_bytes) / GiB:10,.3f} GiB  x{k.runs:<5,.0f} {name}: {k.what}"
               for name, k in ks])
