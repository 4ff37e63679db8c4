"""Deviceless XLA:GPU targets for `python -m launch.plan --compile --target NAME`: abstract GPU devices of a
topology this machine does not have, so that `jit(...).lower(...).compile()` runs XLA:GPU's SPMD partitioner,
fusions and memory-aware scheduler (MaxText's `train_compile.py` idea) and `memory_analysis()` answers.

How: the CUDA PJRT plugin (`pip install -e '.[gpu-aot]'`, i.e. `jax[cuda13]` at the project's jax version) gives
`jax.experimental.topologies.get_topology_desc(name, "cuda", target_config=<GpuTargetConfigProto text>,
topology="1xNODESxGPUS")`: no GPU and no CUDA driver is needed (the plugin's version check is skipped by
initialising JAX with JAX_PLATFORMS=cpu; launch/plan.py re-runs itself so). The target config is one of XLA's
specs, carried as data in launch/targets/ (source: openxla/xla `xla/backends/gpu/target_config/specs/`,
Apache-2.0; see launch/targets/README.md). Fields the installed plugin's proto does not know yet (the specs are
newer than jaxlib 0.10.2's XLA, e.g. `collective_memory_granularity`) are dropped before parsing.

AMD targets: the ROCm plugin needs the ROCm runtime (not on pip; without it the topology call raises "topology not
implemented for rocm"), so `mi300x` / `mi308x` / `mi355x` compile for the H200 spec (B200 for MI355X) with the
AMD device's memory size written into `device_memory_size` (XLA's scheduler takes it as its limit): buffer
assignment and partitioning are XLA:GPU's, kernels and fusion choices are NVIDIA's. Every line printed for such a
target says "proxy".

Compiler options (`COMPILE_OPTIONS`, every deviceless compile): XLA:GPU's CUB radix sort is off. Its sort rewriter
needs CUB's scratch size for the target; deviceless, it has none for H100 / H200 ("Missing deviceless CUB scratch size
data for sort. Using fallback sort algorithm") and keeps XLA's own sort, but for the B200 spec (sm_100) it asks the
CUDA runtime, which has no device: the compile fails with "CUDA Runtime error: cudaErrorInvalidDevice: invalid
device ordinal" (any sort of >= ~100K keys, e.g. Flash's indexer top-k; 4 x 8 MI355X, issue 24). With
`xla_gpu_enable_cub_radix_sort=False` every target compiles XLA's sort, as the H200 spec already did.

Peaks (`Target.peak_flops`, `hbm_bw`, `link_bw`, `net_bw`) feed the roofline (launch/hlo_stats.py); they are the
vendors' published dense BF16 / HBM / scale-up-link figures, per direction, except where `assumed` says otherwise.
Units: bytes, bytes/s, flop/s. Tests: tests/launch/test_gpu_aot.py.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
from pathlib import Path

from jax.experimental import topologies

from dsv4.quant import canonical_fp8_format, fp8_format_for_device_kind
from dsv4.rollout_format import parse_rollout_dtype

GiB = 2**30
TARGET_DIR = Path(__file__).with_name("targets")
NET_BW = 50e9  # bytes/s per GPU between nodes: one 400 Gb/s NIC per GPU (assumed for every target)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A compile target. `spec`: the XLA spec file in launch/targets/; `hbm_bytes`: the device memory written
    into the spec (None = the spec's own); `proxy`: the AMD device this NVIDIA target stands in for (None for a
    real target); `peak_flops` (dense BF16 flop/s), `hbm_bw` (bytes/s), `link_bw` (bytes/s per direction per GPU
    inside a node); `assumed`: what in these peaks is not a published figure."""

    name: str
    device: str
    spec: str
    hbm_bytes: int | None
    proxy: str | None
    peak_flops: float
    hbm_bw: float
    link_bw: float
    source: str
    assumed: str = ""

    @property
    def label(self) -> str:
        """How every printed line names the target: 'mi308x (proxy: H200 spec, 192 GiB)' or 'h200'."""
        if self.proxy is None:
            return self.name
        return f"{self.name} (proxy: {self.spec.split('.')[0].upper()} spec with {self.memory_bytes() / GiB:.0f} GiB)"

    def memory_bytes(self) -> int:
        """The device memory XLA:GPU compiles for (bytes)."""
        if self.hbm_bytes is not None:
            return self.hbm_bytes
        m = re.search(r"device_memory_size:\s*(\d+)", (TARGET_DIR / self.spec).read_text())
        return int(m.group(1))


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target(name="h100", device="NVIDIA H100 SXM 80 GB", spec="h100_sxm.txtpb", hbm_bytes=None, proxy=None,
           peak_flops=989e12, hbm_bw=3.35e12, link_bw=450e9, source="NVIDIA H100 datasheet (SXM), NVLink 4"),
    Target(name="h200", device="NVIDIA H200 SXM 141 GB", spec="h200.txtpb", hbm_bytes=None, proxy=None,
           peak_flops=989e12, hbm_bw=4.8e12, link_bw=450e9, source="NVIDIA H200 datasheet (SXM), NVLink 4"),
    Target(name="b200", device="NVIDIA B200 180 GB", spec="b200.txtpb", hbm_bytes=None, proxy=None,
           peak_flops=2.25e15, hbm_bw=7.7e12, link_bw=900e9, source="NVIDIA HGX B200 datasheet, NVLink 5"),
    Target(name="mi300x", device="AMD Instinct MI300X 192 GB", spec="h200.txtpb", hbm_bytes=192 * GiB,
           proxy="AMD Instinct MI300X", peak_flops=1307e12, hbm_bw=5.3e12, link_bw=448e9,
           source="AMD MI300X datasheet: 1307 TFLOPS BF16 dense, 5.3 TB/s, 7 x 64 GB/s Infinity Fabric"),
    Target(name="mi308x", device="AMD Instinct MI308X 192 GB", spec="h200.txtpb", hbm_bytes=192 * GiB,
           proxy="AMD Instinct MI308X", peak_flops=1307e12, hbm_bw=5.3e12, link_bw=448e9,
           source="192 GB HBM3 (AMD); compute, HBM and link peaks: MI300X's",
           assumed="MI308X compute peak unpublished: MI300X's 1307 TFLOPS taken (an upper bound)"),
    Target(name="mi355x", device="AMD Instinct MI355X 288 GB", spec="b200.txtpb", hbm_bytes=288 * GiB,
           proxy="AMD Instinct MI355X", peak_flops=2.5e15, hbm_bw=8.0e12, link_bw=537.6e9,
           source="AMD MI355X datasheet: 2.5 PFLOPS BF16 dense, 8 TB/s, 7 x 76.8 GB/s Infinity Fabric"),
)}
TARGET_NAMES = ("cpu", *TARGETS)


def rollout_fp8_stand_in(target: Target, rollout_dtype: str) -> tuple[str, str | None]:
    """The `--rollout-dtype` a deviceless compile for `target` uses, and a line saying why when it is not the
    configured one. The rollout's FP8 format follows the device (`dsv4.quant.fp8_format_for_device_kind`:
    e4m3fnuz on gfx942, MI300X / MI308X; e4m3fn elsewhere); XLA:CUDA has no e4m3fnuz GEMM (it converts fnuz
    operands before an f32 / bf16 dot), so a proxy target whose AMD device runs e4m3fnuz compiles e4m3fn in its
    place: the same bytes per weight and per activation, the same FP8 GEMMs the AMD device runs on fnuz operands
    (fnuz differs only in its exponent bias and NaN / -0 codes). Raises ValueError for an unknown rollout dtype."""
    rdt = parse_rollout_dtype(rollout_dtype)
    if not rdt.fp8 or target.proxy is None:
        return rollout_dtype, None
    device_fmt = fp8_format_for_device_kind("rocm", target.proxy)
    fmt = device_fmt if rdt.fp8_name == "auto" else canonical_fp8_format(rdt.fp8_name)
    if fmt != "e4m3fnuz":
        note = (None if fmt == device_fmt else f"--rollout-dtype {rollout_dtype}: {fmt} on the {target.proxy}, whose "
                f"FP8 GEMMs take {device_fmt} (use {'fp8_e4m3fnuz' if device_fmt == 'e4m3fnuz' else 'fp8'} or auto)")
        return rollout_dtype, note
    stand_in = "fp8_e4m3fn"
    return stand_in, (f"--rollout-dtype {rollout_dtype}: the {target.proxy} runs e4m3fnuz FP8 GEMMs (gfx942); "
                      f"XLA:CUDA has none, so this proxy compiles e4m3fn in its place (--rollout-dtype {stand_in}: "
                      f"the same bytes, the same FP8 GEMMs on fn operands)")


# XLA options of every deviceless compile (module docstring: the B200 spec's CUB sort asks a device that is not there)
COMPILE_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def compile_options(extra: dict | None = None) -> dict:
    """`COMPILE_OPTIONS` with `extra` on top (e.g. the GPU test's cheaper ptxas): for `Lowered.compile`."""
    return {**COMPILE_OPTIONS, **(extra or {})}


# fields of XLA's current specs that jaxlib 0.10.2's GpuDeviceInfoProto does not have: dropped when a spec does
# not parse (the plugin names the field only in its C++ log)
NEWER_FIELDS = ("collective_memory_granularity",)


def _drop_field(text: str, field: str) -> str:
    """`text` without every occurrence of `field` (a scalar line or a `field { ... }` block)."""
    out, depth, skipping = [], 0, False
    for line in text.splitlines(keepends=True):
        s = line.strip()
        if not skipping and (s.startswith(field + ":") or s.startswith(field + " {")):
            if s.endswith("{"):
                skipping, depth = True, 1
            continue
        if skipping:
            depth += s.count("{") - s.count("}")
            skipping = depth > 0
            continue
        out.append(line)
    return "".join(out)


def target_config(target: Target) -> str:
    """The GpuTargetConfigProto text of `target`: its spec with the proxy's memory size, comments removed."""
    text = "".join(ln for ln in (TARGET_DIR / target.spec).read_text().splitlines(keepends=True)
                   if not ln.lstrip().startswith("#"))
    if target.hbm_bytes is not None:
        text = re.sub(r"device_memory_size:\s*\d+", f"device_memory_size: {target.hbm_bytes}", text)
    return text


def plugin_error() -> str | None:
    """None when the CUDA plugin can make deviceless topologies here, else why not (one line)."""
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
        return "the CUDA PJRT plugin (jax_plugins.xla_cuda13) is not installed: pip install -e '.[gpu-aot]'"
    try:
        topology_devices(TARGETS["h200"], 1)
    except Exception as e:  # noqa: BLE001  (any failure means: no deviceless GPU compile here)
        return f"the CUDA plugin cannot make a deviceless topology: {type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=None)
def topology_devices(target: Target, n_devices: int, gpus_per_node: int = 8) -> tuple:
    """`n_devices` abstract GPU devices of `target` (1 x nodes x gpus_per_node; fewer than a node: 1 x 1 x n).
    Raises RuntimeError naming the target when the plugin rejects it."""
    nodes, per = (1, n_devices) if n_devices <= gpus_per_node else (-(-n_devices // gpus_per_node), gpus_per_node)
    text = target_config(target)
    try:
        topo = topologies.get_topology_desc(target.name, "cuda", target_config=text, topology=f"1x{nodes}x{per}")
    except Exception as e:  # noqa: BLE001  (JaxRuntimeError; the plugin logs the unknown field on stderr only)
        if "Failed to parse" not in str(e):
            raise RuntimeError(f"--target {target.name}: {e}") from e
        for field in NEWER_FIELDS:
            text = _drop_field(text, field)
        try:
            topo = topologies.get_topology_desc(target.name, "cuda", target_config=text,
                                                topology=f"1x{nodes}x{per}")
        except Exception as e2:  # noqa: BLE001
            raise RuntimeError(f"--target {target.name}: {e2}") from e2
    return tuple(topo.devices[:n_devices])
