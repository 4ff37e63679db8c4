"""The planner on the GPU compiler (issue 24): `python -m launch.plan --compile --target GPU` compiles the real
actor train step and the rollout generate program with XLA:GPU on a deviceless topology (launch/gpu_target.py),
counts flops / bytes / collectives from the optimized HLO (launch/hlo_stats.py), and plans the run of a
`--config-file`. The deviceless compile needs the CUDA plugin (`pip install -e '.[gpu-aot]'`): that test skips,
with the reason, only where the plugin cannot make a topology. Tiny config at 1 layer, ptxas without
optimisations and cuBLAS instead of Triton gemms (`FAST`: the figures asserted do not depend on them): the two
XLA:GPU compiles take ~30 s of CPU (347 ptxas runs for the 2-layer actor with the defaults).
Run: `.venv/bin/python -m pytest -q tests/launch/test_gpu_aot.py`.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4
from launch import gpu_target as gt
from launch import hlo_stats
from launch.aot import compile_actor, compile_rollout, reduced_depth
from launch import plan as plan_mod
from launch.compile_child import CompileFailed, child_env
from launch.plan import main as plan_main
from launch.roofline import kernel_lines
from rl.config.run import DEFAULT_LEARNER
from rl.config.rollout import RolloutConfig

SEED = pathlib.Path(__file__).resolve().parents[2] / "launch" / "configs" / "dapo_seed_mi308x.yaml"
MESH = "actor:fsdp=2,expert=2/rollout:expert=2"
REMAT = "Involuntary full rematerialization"
FAST = gt.compile_options({"xla_gpu_disable_gpuasm_optimizations": True, "xla_gpu_enable_triton_gemm": False})

# one scanned layer body (trip count 4) with a Triton gemm fusion, an FSDP all-gather over the inner mesh axis,
# and a fusion that reads one layer of a stacked [4, 8, 16] weight through dynamic-slice
HLO = """HloModule m

%gemm (p0: bf16[8,16], p1: bf16[16,32]) -> f32[8,32] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%slice (q0: bf16[4,8,16], q1: s32[]) -> bf16[8,16] {
  %q0 = bf16[4,8,16]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%q0, %q1, %c, %c), dynamic_slice_sizes={1,8,16}
  ROOT %b = bf16[8,16]{1,0} bitcast(%ds)
}

%body (t: (s32[], bf16[4,8,16], bf16[16,32])) -> (s32[], bf16[4,8,16], bf16[16,32]) {
  %t = (s32[], bf16[4,8,16]{2,1,0}, bf16[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = bf16[4,8,16]{2,1,0} get-tuple-element(%t), index=1
  %x = bf16[16,32]{1,0} get-tuple-element(%t), index=2
  %ag-start = (bf16[16,16]{1,0}, bf16[16,32]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=mesh['a'=2,'b'=8] {'b'}, dimensions={1}
  %ag-done = bf16[16,32]{1,0} all-gather-done(%ag-start)
  %s = bf16[8,16]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice
  %g = f32[8,32]{1,0} fusion(%s, %ag-done), kind=kCustom, calls=%gemm
  ROOT %r = (s32[], bf16[4,8,16]{2,1,0}, bf16[16,32]{1,0}) tuple(%i, %w, %x)
}

%cond (u: (s32[], bf16[4,8,16], bf16[16,32])) -> pred[] {
  %u = (s32[], bf16[4,8,16]{2,1,0}, bf16[16,32]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (a: bf16[4,8,16], x: bf16[16,32]) -> bf16[16,32] {
  %a = bf16[4,8,16]{2,1,0} parameter(0)
  %x = bf16[16,32]{1,0} parameter(1)
  %z = s32[] constant(0)
  %tup = (s32[], bf16[4,8,16]{2,1,0}, bf16[16,32]{1,0}) tuple(%z, %a, %x)
  %wh = (s32[], bf16[4,8,16]{2,1,0}, bf16[16,32]{1,0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %ar = f32[8] all-reduce(%x), channel_id=2, replica_groups=[2,8]<=[16], to_apply=%cond
  ROOT %out = bf16[16,32]{1,0} get-tuple-element(%wh), index=2
}
"""


def test_hlo_counts_scan_trips_fusions_slices_and_collectives():
    st = hlo_stats.count(HLO)
    assert st.flops == 4 * 2 * 8 * 32 * 16  # the gemm fusion's dot, 4 trips
    # per trip: the slice fusion reads one [8,16] layer (not the [4,8,16] stack) and its s32 index, writes [8,16];
    # the gemm reads
    # [8,16] + [16,32] and writes f32 [8,32]; the all-gather's buffer [16,32] (its operand [16,16] and result)
    trip = (2 * 8 * 16 * 2 + 4) + (8 * 16 * 2 + 16 * 32 * 2 + 8 * 32 * 4) + (16 * 16 * 2 + 16 * 32 * 2 + 16 * 32 * 2)
    assert st.bytes == 4 * trip + (16 * 32 * 2 + 8 * 4)  # + the all-reduce's operand and result
    # all-gather over the inner 8-device axis: 7/8 of the result sent, inside a node; the all-reduce's groups of 8
    # consecutive ids also stay in a node: 2 x 7/8 x its operand
    assert st.collectives["all-gather"] == 4 * 7 / 8 * 16 * 32 * 2
    assert st.collectives["all-reduce"] == 2 * 7 / 8 * 16 * 32 * 2
    assert st.inter == 0 and st.intra == st.collective_bytes > 0
    assert st.dots == 1 and st.fp8_dots == 0 and st.loops == [(st.decode_step, 4)]  # the outermost loop
    # the kernel breakdown: each kernel's bytes and flops over its 4 runs, costliest first, what it is; they sum to
    # the program's; the collectives named by the mesh axis their groups run over
    assert sum(k.bytes for k in st.kernels.values()) == st.bytes and sum(k.flops for k in st.kernels.values()) == st.flops
    (name, gemm), = st.top_kernels("flops")
    assert name == "g" and gemm.runs == 4 and gemm.flops == st.flops and gemm.what == "fusion(dot) -> f32[8,32]"
    assert [n for n, _ in st.top_kernels("bytes", 2)] == ["ag-start", "g"] and st.kernels["s"].what.startswith(
        "fusion(dynamic-slice)")
    assert hlo_stats.collectives_by_axis(st, {"a": 2, "b": 8}) == {("all-gather", "b"): st.collectives["all-gather"],
                                                                   ("all-reduce", "b"): st.collectives["all-reduce"]}
    lines = kernel_lines(st, {"a": 2, "b": 8})
    assert "the 1 costliest kernels by dot flops (100% of" in "\n".join(lines) and "all-gather over b" in lines[-1]


def test_decode_step_of_the_slots_loop_leaves_out_its_refill():
    """Continuous batching: the token loop (no trip count) holds the refill loop (no trip count: admissions run
    only when a slot frees); one decode step is the token loop's body without it."""
    text = """HloModule m

%refill (r: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %r = (s32[], f32[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%r), index=0
  %a = f32[64,64]{1,0} get-tuple-element(%r), index=1
  %pre = f32[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[64,64]{1,0}) tuple(%i, %pre)
}

%cond (c: (s32[], f32[64,64])) -> pred[] {
  %c = (s32[], f32[64,64]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%step (u: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %u = (s32[], f32[64,64]{1,0}) parameter(0)
  %w = (s32[], f32[64,64]{1,0}) while(%u), condition=%cond, body=%refill
  %j = s32[] get-tuple-element(%w), index=0
  %b = f32[64,64]{1,0} get-tuple-element(%w), index=1
  %x = f32[8,64]{1,0} slice(%b), slice={[0:8], [0:64]}
  %dec = f32[8,64]{1,0} dot(%x, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %v = (s32[], f32[64,64]{1,0}) tuple(%j, %b)
}

ENTRY %main (p: f32[64,64]) -> f32[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[64,64]{1,0}) tuple(%z, %p)
  %loop = (s32[], f32[64,64]{1,0}) while(%t0), condition=%cond, body=%step
  ROOT %out = f32[64,64]{1,0} get-tuple-element(%loop), index=1
}
"""
    st = hlo_stats.count(text)
    step = st.decode_step
    assert st.flops == 2 * 64 * 64 * 64 + 2 * 8 * 64 * 64  # the program: one refill dot + one decode dot
    assert step.flops == 2 * 8 * 64 * 64 and step.dots == 1  # the decode step alone
    assert step.bytes == st.bytes - st.loops[0][0].loops[0][0].bytes


def test_hlo_counts_cublas_gemms():
    """A cuBLASLt gemm custom call (what XLA:GPU emits without Triton gemms) counts its dot flops, its operands and
    result as bytes (its s8 workspace is scratch), its operands' FP8 share, and its flops as the routed experts'
    when its op_name is in their scope (`dsv4.moe.ROUTED_EXPERTS_SCOPE`)."""
    text = """ENTRY %main (a: f8e4m3fn[32,8], b: bf16[24,8]) -> f32[32,24] {
  %a = f8e4m3fn[32,8]{1,0} parameter(0)
  %b = bf16[24,8]{1,0} parameter(1)
  %cc = (f32[32,24]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}, metadata={op_name="jit(f)/routed_experts/shard_map/dot_general"}
  ROOT %r = f32[32,24]{1,0} get-tuple-element(%cc), index=0
}
"""
    st = hlo_stats.count(text)
    assert st.flops == 2 * 32 * 24 * 8 and st.dots == 1 and st.fp8_dots == 1 and st.expert_flops == st.flops
    assert st.bytes == 32 * 8 + 24 * 8 * 2 + 32 * 24 * 4  # its operands and result, not its 4 MiB workspace
    assert (st.gemm_bytes, st.fp8_gemm_bytes) == (32 * 8 + 24 * 8 * 2, 32 * 8)
    assert hlo_stats.count(text.replace("routed_experts", "attention")).expert_flops == 0


def test_hlo_counts_a_gather_by_its_rows():
    """An embedding lookup (a gather fusion) reads the rows it gathers, not the whole table."""
    text = """%g (t: bf16[1000,64], i: s32[8,1]) -> bf16[8,64] {
  %t = bf16[1000,64]{1,0} parameter(0)
  %i = s32[8,1]{1,0} parameter(1)
  ROOT %r = bf16[8,64]{1,0} gather(%t, %i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
}

ENTRY %main (t: bf16[1000,64], i: s32[8,1]) -> bf16[8,64] {
  %t = bf16[1000,64]{1,0} parameter(0)
  %i = s32[8,1]{1,0} parameter(1)
  ROOT %f = bf16[8,64]{1,0} fusion(%t, %i), kind=kLoop, calls=%g
}
"""
    assert hlo_stats.count(text).bytes == 8 * 64 * 2 + 8 * 4 + 8 * 64 * 2  # rows read, indices, rows written


def test_hlo_counts_slices_and_in_place_updates_through_bitcasts():
    """A scan's saved stack read or written one step at a time through a bitcast of the stack (XLA:GPU bitcasts a
    stack to the layout its slices want) counts the step's slice, not the whole stack (before: 9,309 vs 14,914 GiB
    of a pipelined Flash step)."""
    text = """%w (s: f32[72,8,16], u: f32[8,16], i: s32[]) -> f32[72,8,16] {
  %s = f32[72,8,16]{2,1,0} parameter(0)
  %b = f32[72,16,8]{1,2,0} bitcast(%s)
  %c = f32[72,8,16]{2,1,0} bitcast(%b)
  %u = f32[8,16]{1,0} parameter(1)
  %u1 = f32[1,8,16]{2,1,0} bitcast(%u)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[72,8,16]{2,1,0} dynamic-update-slice(%c, %u1, %i, %z, %z)
}

%r (s: f32[72,8,16], i: s32[]) -> f32[1,8,16] {
  %s = f32[72,8,16]{2,1,0} parameter(0)
  %b = f32[72,16,8]{1,2,0} bitcast(%s)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %d = f32[1,16,8]{1,2,0} dynamic-slice(%b, %i, %z, %z), dynamic_slice_sizes={1,16,8}
}

ENTRY %main (s: f32[72,8,16], u: f32[8,16], i: s32[]) -> f32[1,8,16] {
  %s = f32[72,8,16]{2,1,0} parameter(0)
  %u = f32[8,16]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %f = f32[72,8,16]{2,1,0} fusion(%s, %u, %i), kind=kLoop, calls=%w
  ROOT %g = f32[1,16,8]{1,2,0} fusion(%f, %i), kind=kLoop, calls=%r
}
"""
    step = 8 * 16 * 4
    assert hlo_stats.count(text).bytes == (step + step + 4) + (step + 4 + step)  # update in + out; slice in + out


def test_replica_group_forms():
    assert hlo_stats._groups("replica_groups={{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert hlo_stats._groups("replica_groups=[2,2]<=[4]") == [[0, 1], [2, 3]]
    assert hlo_stats._groups("replica_groups=[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    assert hlo_stats._groups("replica_groups=mesh['x'=2,'y'=8] {'x'}")[:2] == [[0, 8], [1, 9]]
    # the mesh form with the devices at its positions (XLA:GPU's SPMD output for a mesh whose axes it reordered):
    # axis a (8) of mesh [a=8, b=2] placed by an iota [2, 8] transposed: groups of one node's 8 devices
    assert hlo_stats._groups("replica_groups=mesh['a'=8,'b'=2], device_ids=([2,8]T(1,0)) {'a'}") == [
        list(range(8)), list(range(8, 16))]


def test_targets_specs_and_proxies():
    """Every target's spec is carried; an AMD proxy writes its memory into the NVIDIA spec and says so."""
    for t in gt.TARGETS.values():
        assert (gt.TARGET_DIR / t.spec).is_file() and t.peak_flops > 0 and t.hbm_bw > 0
    mi = gt.TARGETS["mi308x"]
    assert f"device_memory_size: {192 * 2**30}" in gt.target_config(mi) and "proxy" in mi.label
    assert gt.TARGETS["h200"].memory_bytes() == 151397597184 and "proxy" not in gt.TARGETS["h200"].label
    text = "a {\n  b: 1\n  c {\n    d: 2\n  }\n  e: 3\n}\n"
    assert gt._drop_field(gt._drop_field(text, "c"), "b") == "a {\n  e: 3\n}\n"


def test_config_file_plans_the_run(capsys):
    """--config-file: the seed run's mesh, row length and EP dispatch; a flag on top wins."""
    assert plan_main(["--config-file", str(SEED), "--gpu", "mi308x", "--num-layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh actor:stage=2,expert=8/rollout:expert=8" in out and "seq 9216" in out and "EP padded" in out
    assert "pipeline: 2 stages" in out and "M=6 micro-batches" in out
    assert plan_main(["--config-file", str(SEED), "--gpu", "mi308x", "--num-layers", "4", "--ep-backend",
                      "ragged"]) == 0
    assert "EP ragged" in capsys.readouterr().out
    assert plan_main(["--config-file", "/no/such.yaml", "--gpu", "mi308x"]) == 2
    assert "--config-file /no/such.yaml" in capsys.readouterr().err


def test_config_file_compile_gets_the_runs_device_count(monkeypatch, capsys):
    """--config-file --compile on XLA:CPU compiles each program in a child process with as many host devices as the
    file's mesh (24 for the seed layout), not --mesh's (absent here)."""
    calls = []

    def fake(job, *, role, target, hint, n_devices, gpu):
        calls.append((role, n_devices, child_env(n_devices, gpu)["XLA_FLAGS"]))
        raise CompileFailed(f"the {role} compile: not run here")

    monkeypatch.setattr(plan_mod, "compile_in_child", fake)
    assert plan_main(["--config-file", str(SEED), "--compile", "--target", "cpu", "--gpu", "mi308x", "--num-layers",
                      "4"]) == 1
    assert [c[:2] for c in calls] == [("actor", 24), ("rollout", 24)]
    assert all("--xla_force_host_platform_device_count=24" in c[2] for c in calls)
    assert capsys.readouterr().err.count("error: the ") == 2


def test_compiled_tokens_per_device_split_over_context():
    """--compile plans what it compiles: a row's tokens over the context axis, the budget per context shard (the
    learner's layout, rl/algo/batching.py): 32K rows at context 4 are 8K tokens per device (issue 25)."""
    seed_cp = "actor:fsdp=2,context=4,expert=2/rollout:expert=8"
    assert plan_mod.compiled_tokens_per_device(seed_cp, 32768, 9216) == 8192  # one row per micro-batch
    assert plan_mod.compiled_tokens_per_device(seed_cp, 32768, 16384) == 16384  # two rows of 8K per shard
    assert plan_mod.compiled_tokens_per_device(seed_cp, 32768, None) == 8192
    assert plan_mod.compiled_tokens_per_device("actor:fsdp=2,expert=8", 9216, 9216) == 9216


_PLUGIN = gt.plugin_error()


@pytest.mark.skipif(_PLUGIN is not None, reason=f"no deviceless XLA:GPU compile here: {_PLUGIN}")
def test_deviceless_gpu_compile_actor_and_rollout(capfd):
    """XLA:GPU (H200 spec) compiles both tiny programs on 8 abstract GPUs: memory figures, dot flops and the FSDP
    collectives from the optimized HLO, and no involuntary full rematerialization in either program."""
    cfg = reduced_depth(dsv4.DSV4Config.tiny(), 1)
    devices = gt.topology_devices(gt.TARGETS["h200"], 8)
    assert devices[0].platform == "gpu" and not devices[0].addressable_memories()
    learner = dataclasses.replace(DEFAULT_LEARNER, max_tokens_per_micro_batch=32, offload_optimizer=1.0)
    a = compile_actor(cfg, MESH, seq_len=16, learner=learner, devices=devices, backend="XLA:GPU h200",
                      compiler_options=FAST)
    assert a.argument > 0 and a.temp > 0 and a.host_from_shardings and 0 < a.host < a.argument
    assert a.hlo.flops > 0 and a.hlo.dots > 0 and a.hlo.collectives.get("all-gather", 0) > 0 and a.hlo.bytes > 0
    assert "on XLA:GPU h200" in a.lines()[0]
    r = compile_rollout(cfg, MESH, batch=8, context=48, prompt_len=16, rollout=RolloutConfig(slots=4),
                        devices=devices, backend="XLA:GPU h200", compiler_options=FAST)
    assert r.argument > 0 and r.weights > 0 and r.hlo.flops > 0 and r.hlo.decode_step is not None
    # the run's rollout on a GPU: continuous batching, the dropless load-sized padded expert dispatch (no ragged_dot)
    assert r.slots == 4 and "(sized)" in r.ep_dispatch and r.ep_dispatch.endswith("dropless")
    # the routed experts' dots carry their name scope into the optimized HLO (issue 37's expert_flops_x_routed)
    assert 0 < r.hlo.decode_step.expert_flops < r.hlo.decode_step.flops and a.hlo.expert_flops > 0
    assert REMAT not in capfd.readouterr().err


@pytest.mark.skipif(_PLUGIN is not None, reason=f"no deviceless XLA:GPU compile here: {_PLUGIN}")
def test_deviceless_gpu_compile_with_a_context_axis(capfd):
    """Context parallelism on XLA:GPU (issue 25): the tiny actor with one HCA layer (window 8, m = 8) compiles on
    `actor:context=2,expert=2` (4 abstract H200s): each row of 64 tokens split over 2 devices, the sliding
    window's halo a collective-permute in the optimized HLO, no involuntary full rematerialization."""
    cfg = dsv4.DSV4Config.tiny(num_hidden_layers=1, compress_ratios=(8, 0))
    devices = gt.topology_devices(gt.TARGETS["h200"], 4)
    learner = dataclasses.replace(DEFAULT_LEARNER, max_tokens_per_micro_batch=32)  # per context shard: one row
    a = compile_actor(cfg, "actor:context=2,expert=2", seq_len=64, learner=learner, devices=devices,
                      backend="XLA:GPU h200", compiler_options=FAST)
    assert (a.rows, a.seq_len, a.micro_batches) == (2, 64, 1)  # one row per expert-axis device, 32 tokens each
    assert a.hlo.collectives.get("collective-permute", 0) > 0 and a.temp > 0
    assert REMAT not in capfd.readouterr().err


@pytest.mark.skipif(_PLUGIN is not None, reason=f"no deviceless XLA:GPU compile here: {_PLUGIN}")
def test_b200_spec_compiles_a_large_sort():
    """The MI355X proxy (B200 spec): a sort of 64 x 2^17 keys (CUB territory) compiles deviceless with the
    planner's options; XLA:GPU's CUB sort would ask the CUDA runtime for a device (launch/gpu_target.py)."""
    devices = gt.topology_devices(gt.TARGETS["mi355x"], 1)
    rep = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), jax.sharding.PartitionSpec())
    keys = jax.ShapeDtypeStruct((64, 1 << 17), jnp.float32, sharding=rep)
    compiled = jax.jit(lambda a: jnp.argsort(a, axis=-1)).lower(keys).compile(gt.compile_options())
    assert compiled.memory_analysis().output_size_in_bytes == 64 * (1 << 17) * 4
