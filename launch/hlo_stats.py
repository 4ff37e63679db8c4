"""Flops, bytes and collective bytes of one compiled program, counted from its optimized HLO text
(`compiled.as_text()`, per device, after SPMD partitioning): `compiled.cost_analysis()` returns None for a
deviceless XLA:GPU compile (jax 0.10.2), and XLA's cost analysis would count a while loop's body once anyway.

Counted, per device, per run of the program:
- flops: 2 x (output elements) x (contracted elements) of every `dot` (inside fusions too: XLA:GPU's Triton gemm
  fusions hold a `dot`) and of every cuBLAS / cuBLASLt gemm custom call (`__cublas$gemm`, `__cublas$lt$matmul`:
  its `dot_dimension_numbers`), and of the block-scaled FP8 GEMM kernel (`dsv4.fp8_kernel`, a Triton custom call
  named `KERNEL_NAME`: 2 E R O K from its rows [E, R, K] and weight [E, O, K], its FP8 operands counted as a
  GEMM's), and of the FP8 decode attention kernel (`dsv4.decode_kernel`, `DECODE_KERNEL_NAME`: its two products,
  2 B H N D each, counted as GEMMs in the compute dtype they run in: its FP8 entries are dequantised in registers,
  so they count at the query's width, as a dot reading FP8 bytes through a fused convert does), and of its indexer
  scores kernel (`INDEX_KERNEL_NAME`: 2 B S H W d, FP8 queries times FP8 keys); a while
  loop's body counts `known_trip_count` times (scanned layers), a conditional its costliest branch (the sized
  expert dispatch's switch: the branch a routing load picks, when told: `count(expert_branch=)`). Elementwise
  flops are left out (the roofline is dot-bound).
- bytes: what each kernel (top-level instruction: a fusion, a gemm, a copy, a collective's buffer) reads and writes
  in HBM: its operands + its result (a gemm's: not its s8 workspace), except that a fusion reading a parameter only
  through `dynamic-slice`, `slice` or `gather` (bitcasts in between are free) counts what it reads (the scan's
  per-layer weights; the FP8 expert GEMMs' K blocks; the rows an embedding lookup gathers), and a fusion rooted in `dynamic-update-slice` or in a
  (single-operand) `scatter` counts the update (in place: XLA:GPU's scatter writes into its operand's buffer, a copy
  where it cannot is a kernel of its own) - the scan's per-layer reads and writes of stacked weights and saved
  inputs, the decode step's KV-cache and routing-record writes. An estimate: caches and re-reads are not modelled.
- collective bytes: per kind, the bytes a device sends: all-gather (g-1)/g x result, reduce-scatter (g-1)/g x
  operand, all-reduce 2 (g-1)/g x operand (ring), all-to-all (g-1)/g x operand, collective-permute the operand; g =
  the replica group size. Split into groups inside one node of `gpus_per_node` devices (`intra`) and groups that
  span nodes (`inter`), by the group's device ids (the program's logical ids; a role's devices start on a node).
- fp8 dots: dots / gemms with an 8-bit float operand (whether FP8 weights reach an FP8 GEMM) vs all dots.
- gemm operand bytes, and those of 8-bit float operands (the FP8 share of what the GEMMs read); the flops of the dots
  of the routed experts (their op_name holds `dsv4.moe.ROUTED_EXPERTS_SCOPE`).
- kernels: each top-level kernel's bytes and flops summed over its runs (a loop body's kernels run trip-count
  times), with what it is (op, the ops fused in it, the JAX op it came from): `HloStats.top_kernels` lists the
  costliest; collectives also by replica group, which `collectives_by_axis` names with the mesh's axes.
Tests: tests/launch/test_gpu_aot.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

from dsv4.decode_kernel import INDEX_KERNEL_NAME, KERNEL_NAME as DECODE_KERNEL_NAME
from dsv4.fp8_kernel import KERNEL_NAME
from dsv4.moe import ROUTED_EXPERTS_SCOPE

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_NAME = re.compile(r"%([\w.\-]+)")
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
                "collective-permute")
_DULL = {"broadcast", "reshape", "slice", "concatenate", "pad", "iota", "compare", "select", "add", "multiply",
         "subtract", "maximum", "minimum", "and", "or", "not", "negate", "divide", "copy"}
_TELLING = {"dot": 0, "convolution": 0, "scatter": 1, "gather": 1, "sort": 1, "reduce": 2, "reduce-window": 2,
            "dynamic-update-slice": 3, "dynamic-slice": 3, "convert": 4, "transpose": 5, "exponential": 6}
_FREE = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier"}


def _dtype_bytes(dt: str) -> float:
    if dt.startswith("f8") or dt.startswith("f4") or dt.startswith("f6"):
        return 1 if dt.startswith("f8") else 0.5
    return _DTYPE_BYTES.get(dt, 0)


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string (a tuple sums its elements)."""
    return sum(_dtype_bytes(dt) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _SHAPE.findall(shape))


def _dims(shape: str) -> list[int]:
    m = _SHAPE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    args: str = ""
    root: bool = False


def _split_balanced(s: str, start: int) -> int:
    """Index just past the parenthesis closing the one at `start`."""
    depth = 0
    for i in range(start, len(s)):
        depth += {"(": 1, ")": -1}.get(s[i], 0)
        if depth == 0:
            return i + 1
    return len(s)


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _split_balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    p = rest.find("(")
    if p < 0:
        return None
    op = rest[:p]
    end = _split_balanced(rest, p)
    return _Instr(name=m.group(1), shape=shape, op=op, operands=_NAME.findall(rest[p:end]), attrs=rest[end:],
                  args=rest[p + 1:end - 1], root=line.lstrip().startswith("ROOT "))


def parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], dict[str, dict[str, str]], str]:
    """{computation: instructions}, {computation: {value name: shape}}, the entry computation's name."""
    comps, shapes, entry, cur = {}, {}, "", None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            cur = h.group(1)
            comps[cur], shapes[cur] = [], {}
            if line.startswith("ENTRY"):
                entry = cur
            for pm in re.finditer(r"([\w.\-]+): ((?:\([^)]*\))|[^,()]+(?:\{[^}]*\})?)", h.group(2)):
                shapes[cur][pm.group(1)] = pm.group(2)
            continue
        if cur is None:
            continue
        if line.startswith("}"):
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            comps[cur].append(ins)
            shapes[cur][ins.name] = ins.shape
    return comps, shapes, entry


@dataclasses.dataclass
class Kernel:
    """One top-level kernel, per program run: `what` it is (op, fused ops, the JAX op it came from), `runs` (a loop
    body's kernel runs trip-count times), HBM `bytes` and dot `flops` summed over those runs."""

    what: str
    runs: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    gemm_bytes: float = 0.0  # its GEMMs' operand bytes (`HloStats.gemm_bytes`), and those in 8-bit floats
    fp8_gemm_bytes: float = 0.0


@dataclasses.dataclass
class HloStats:
    """Per device, per program run (module docstring). `collectives`: {kind: bytes sent}; `kernels`: {instruction
    name: Kernel}; `groups`: {(kind, the first replica group's device ids): bytes sent}."""

    flops: float = 0.0
    bytes: float = 0.0
    collectives: dict = dataclasses.field(default_factory=dict)
    intra: float = 0.0
    inter: float = 0.0
    dots: int = 0
    fp8_dots: int = 0
    loops: list = dataclasses.field(default_factory=list)  # (body stats, trip count or None) of outermost loops
    gemm_bytes: float = 0.0
    fp8_gemm_bytes: float = 0.0
    expert_flops: float = 0.0
    kernels: dict = dataclasses.field(default_factory=dict)
    groups: dict = dataclasses.field(default_factory=dict)

    @property
    def decode_step(self) -> "HloStats | None":
        """One step of a generate program's token loop: the body of the outermost while loop without a known trip
        count (the continuous-batching loop runs until every request is done) with the most bytes, less the loops
        in it without a known trip count (its refill: admissions prefill new requests only when a slot frees, not
        every step); else the outermost loop with the most bytes over all its trips (the static program's decode
        loop); None without loops."""
        if not self.loops:
            return None
        body, trips = max(self.loops, key=lambda lt: (lt[1] is None, (lt[1] or 1) * lt[0].bytes))
        if trips is not None or not any(t is None for _, t in body.loops):
            return body
        step = HloStats()
        step.add(body)
        for inner, t in body.loops:
            if t is None:
                dots, fp8 = step.dots - inner.dots, step.fp8_dots - inner.fp8_dots
                step.add(inner, -1.0, loops=False)  # (`add` counts dots once, whatever `times`)
                step.dots, step.fp8_dots = dots, fp8
        return step

    def add(self, other: "HloStats", times: float = 1.0, loops: bool = True) -> None:
        self.flops += times * other.flops
        self.gemm_bytes += times * other.gemm_bytes
        self.fp8_gemm_bytes += times * other.fp8_gemm_bytes
        self.expert_flops += times * other.expert_flops
        self.bytes += times * other.bytes
        self.intra += times * other.intra
        self.inter += times * other.inter
        self.dots += other.dots
        self.fp8_dots += other.fp8_dots
        if loops:
            self.loops += other.loops
        for k, v in other.collectives.items():
            self.collectives[k] = self.collectives.get(k, 0.0) + times * v
        for k, v in other.groups.items():
            self.groups[k] = self.groups.get(k, 0.0) + times * v
        for name, k in other.kernels.items():
            mine = self.kernels.setdefault(name, Kernel(k.what))
            mine.runs += times * k.runs
            mine.bytes += times * k.bytes
            mine.flops += times * k.flops
            mine.gemm_bytes += times * k.gemm_bytes
            mine.fp8_gemm_bytes += times * k.fp8_gemm_bytes

    def top_kernels(self, by: str = "bytes", n: int = 10) -> list[tuple[str, Kernel]]:
        """The `n` kernels with the most `by` ("bytes" or "flops") over their runs, costliest first."""
        ks = [(name, k) for name, k in self.kernels.items() if k.runs > 0.5 and getattr(k, by) > 0]
        return sorted(ks, key=lambda nk: -getattr(nk[1], by))[:n]

    @property
    def collective_bytes(self) -> float:
        return self.intra + self.inter


def _groups(attrs: str) -> list[list[int]] | None:
    """The replica groups of a collective: explicit {{..},{..}}, iota [a,b]<=[n] (with T(...)), or the mesh form
    mesh['x'=2,'y'=8] {'y'} (with device_ids=([a,b]T(...)): the devices at the mesh's positions); None when absent
    or not understood."""
    m = re.search(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        out = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(out[0], -1).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
                  r"\s*\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        ids = np.arange(math.prod(sizes))
        if m.group(2):  # the device at each mesh position: an iota of these dims, transposed
            dims = [int(x) for x in m.group(2).split(",")]
            ids = ids.reshape(dims)
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(sizes)
        rest = [i for i in range(len(sizes)) if i not in grouped]
        g = math.prod(sizes[i] for i in grouped)
        return ids.transpose(rest + grouped).reshape(-1, g).tolist()
    return None


def _dot_flops(out_shape: str, lhs_shape: str, contracting: list[int]) -> float:
    lhs = _dims(lhs_shape)
    k = math.prod(lhs[i] for i in contracting if i < len(lhs))
    return 2.0 * math.prod(_dims(out_shape)) * k


def _is_gemm(attrs: str) -> bool:
    """A cuBLAS / cuBLASLt / hipBLASLt gemm custom call (`__cublas$gemm`, `__cublas$lt$matmul`, ...)."""
    m = re.search(r'custom_call_target="([^"]+)"', attrs)
    return bool(m) and (m.group(1).startswith(("__cublas", "__hipblas")) or "gemm" in m.group(1))


def _is_fp8(shape: str) -> bool:
    return any(dt.startswith("f8") for dt, _ in _SHAPE.findall(shape))


class _Counter:
    def __init__(self, text: str, gpus_per_node: int, expert_branch=None):
        self.comps, self.shapes, self.entry = parse_hlo(text)
        self.per_node = gpus_per_node
        eb = () if expert_branch is None else tuple(expert_branch)
        self.expert_branch = (eb,) if eb and isinstance(eb[0], int) else eb  # ((index, branches), ...)
        self.memo: dict[str, HloStats] = {}

    def comp(self, name: str, top: bool) -> HloStats:
        key = f"{name}:{top}"
        if key in self.memo:
            return self.memo[key]
        st = HloStats()
        sh = self.shapes.get(name, {})
        for ins in self.comps.get(name, []):
            self.instr(ins, sh, st, top)
        self.memo[key] = st
        return st

    def instr(self, ins: _Instr, sh: dict[str, str], st: HloStats, top: bool) -> None:
        op, called = ins.op, re.findall(r"(?:calls|to_apply|body|branch_computations)=\{?%?([\w.\-]+)", ins.attrs)
        flops0, gemm0, fp80 = st.flops, st.gemm_bytes, st.fp8_gemm_bytes
        operand_shapes = [sh.get(o, "") for o in ins.operands]
        if op == "dot":
            m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
            self.gemm(ins, st, _dot_flops(ins.shape, operand_shapes[0], [int(x) for x in m.group(1).split(",") if x]
                                          if m else []), operand_shapes)
        elif op == "custom-call" and _is_gemm(ins.attrs):
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
            out = ins.shape[1:] if ins.shape.startswith("(") else ins.shape
            contracting = [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []
            self.gemm(ins, st, _dot_flops(out.split("{")[0], operand_shapes[0], contracting), operand_shapes)
        elif op == "custom-call" and KERNEL_NAME in ins.attrs and len(operand_shapes) == 4:
            (e, r, k), o = _dims(operand_shapes[0]), _dims(operand_shapes[2])[1]  # rows [E, R, K], weight [E, O, K]
            self.gemm(ins, st, 2.0 * e * r * o * k, [operand_shapes[0], operand_shapes[2]])
        elif op == "custom-call" and DECODE_KERNEL_NAME in ins.attrs and len(operand_shapes) == 6:
            (b, h, d), n = _dims(operand_shapes[0]), _dims(operand_shapes[1])[1]  # q [B, H, D], entries [B, N, .]
            w = _dims(ins.shape)[-1]  # the output dims this call writes (all D, or its share of them)
            dt = _SHAPE.search(operand_shapes[0]).group(1)
            self.gemm(ins, st, 2.0 * b * h * n * d, [operand_shapes[0], f"{dt}[{b},{n},{d}]"])  # q . k, whole
            self.gemm(ins, st, 2.0 * b * h * n * w, [f"{dt}[{b},{h},{n}]", f"{dt}[{b},{n},{w}]"])  # p . v
        elif op == "custom-call" and INDEX_KERNEL_NAME in ins.attrs and len(operand_shapes) == 4:
            (b, s, h, d), n = _dims(operand_shapes[0]), _dims(operand_shapes[2])[1]  # q [B, S, H, d], keys [B, W, d]
            self.gemm(ins, st, 2.0 * b * s * h * n * d, [operand_shapes[0], operand_shapes[2]])  # FP8 x FP8
        if op == "while":
            m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
            body = re.search(r"body=%([\w.\-]+)", ins.attrs)
            if body:
                inner = self.comp(body.group(1), top)
                st.add(inner, int(m.group(1)) if m else 1, loops=False)
                if top:
                    st.loops.append((inner, int(m.group(1)) if m else None))
            return
        if op == "conditional":
            branches = [self.comp(c, top) for c in re.findall(r"%([\w.\-]+)", ins.attrs.split("branch_computations=")
                                                               [-1].split("}")[0])]
            pick = next((p for p in self.expert_branch if p[1] == len(branches)), None)
            if pick is not None and re.search(r'op_name="[^"]*' + ROUTED_EXPERTS_SCOPE, ins.attrs):
                st.add(branches[pick[0]])  # the sized dispatch's switch: the branch the routing load picks
            elif branches:
                st.add(max(branches, key=lambda b: b.flops + b.bytes))
            return
        if op in ("call", "async-start") and called:
            st.add(self.comp(called[0], top))
            return
        if op == "fusion" and called:
            inner = self.comp(called[0], top=False)
            st.flops += inner.flops
            st.dots += inner.dots
            st.fp8_dots += inner.fp8_dots
            st.gemm_bytes += inner.gemm_bytes
            st.fp8_gemm_bytes += inner.fp8_gemm_bytes
            st.expert_flops += inner.expert_flops
        base = op.removesuffix("-start")
        if top and base in _COLLECTIVES and not op.endswith("-done"):
            self.collective(ins, base, operand_shapes, st)
        if not top or op in _FREE or op.endswith("-done") or op in ("while", "call", "conditional"):
            return
        b = self.kernel_bytes(ins, operand_shapes, called)
        st.bytes += b
        flops = self.comp(called[0], top=False).flops if op == "fusion" and called else \
            (st.flops - flops0 if op in ("dot", "custom-call") else 0.0)
        st.kernels[ins.name] = Kernel(self.describe(ins, called), 1.0, b, flops, st.gemm_bytes - gemm0,
                                      st.fp8_gemm_bytes - fp80)

    @staticmethod
    def gemm(ins: _Instr, st: HloStats, flops: float, operand_shapes: list[str]) -> None:
        """Count one dot / gemm: its flops, its two operands' bytes (and theirs if 8-bit floats), the routed
        experts' flops when its op_name is in their scope."""
        st.flops += flops
        st.dots += 1
        st.fp8_dots += any(_is_fp8(s) for s in operand_shapes[:2])
        st.gemm_bytes += sum(shape_bytes(s) for s in operand_shapes[:2])
        st.fp8_gemm_bytes += sum(shape_bytes(s) for s in operand_shapes[:2] if _is_fp8(s))
        if re.search(r'op_name="[^"]*' + ROUTED_EXPERTS_SCOPE, ins.attrs):
            st.expert_flops += flops

    def describe(self, ins: _Instr, called: list[str]) -> str:
        """What a kernel is: its op (a fusion: the ops fused in it, most telling first), output, JAX op name."""
        what = ins.op
        if ins.op == "custom-call":
            m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
            what = m.group(1) if m else what
        elif ins.op == "fusion" and called:
            ops = {i.op for i in self.comps.get(called[0], [])} - _FREE - _DULL
            what = "fusion(" + ",".join(sorted(ops, key=lambda o: (_TELLING.get(o, 9), o))[:4]) + ")"
        out = " ".join(f"{dt}[{d}]" for dt, d in _SHAPE.findall(ins.shape)[:2])
        m = re.search(r'op_name="([^"]*)"', ins.attrs)
        src = "/".join(m.group(1).split("/")[-2:])[-60:] if m else ""
        return f"{what} -> {out}" + (f" ({src})" if src else "")

    def collective(self, ins: _Instr, kind: str, operand_shapes: list[str], st: HloStats) -> None:
        groups = _groups(ins.attrs)
        g = len(groups[0]) if groups else 2
        inb = sum(shape_bytes(s) for s in operand_shapes)
        outs = ins.shape
        if ins.op.endswith("-start") and ins.shape.startswith("("):  # (operands..., results...): the last half
            parts = _SHAPE.findall(ins.shape)
            outs = " ".join(f"{dt}[{d}]" for dt, d in parts[len(parts) // 2:])
        outb = shape_bytes(outs)
        frac = (g - 1) / g if g > 1 else 0.0
        sent = {"all-gather": frac * outb, "reduce-scatter": frac * inb, "all-reduce": 2 * frac * inb,
                "all-to-all": frac * inb, "ragged-all-to-all": frac * inb, "collective-permute": inb}[kind]
        st.collectives[kind] = st.collectives.get(kind, 0.0) + sent
        key = (kind, tuple(groups[0]) if groups else None)
        st.groups[key] = st.groups.get(key, 0.0) + sent
        crosses = groups is None or any(len({d // self.per_node for d in grp}) > 1 for grp in groups)
        if crosses:
            st.inter += sent
        else:
            st.intra += sent

    def kernel_bytes(self, ins: _Instr, operand_shapes: list[str], called: list[str]) -> float:
        out = shape_bytes(ins.shape)
        if ins.op == "custom-call" and _is_gemm(ins.attrs) and ins.shape.startswith("("):
            out = shape_bytes(" ".join(f"{dt}[{d}]" for dt, d in _SHAPE.findall(ins.shape)[:-1]))  # not its workspace
        ins_bytes = [shape_bytes(s) for s in operand_shapes]
        if ins.op == "fusion" and called:
            body = self.comps.get(called[0], [])
            params = {i.name: i for i in body if i.op == "parameter"}
            users: dict[str, list[_Instr]] = {}
            for i in body:
                for o in i.operands:
                    users.setdefault(o, []).append(i)

            def reads(name: str) -> list[tuple[str, _Instr]]:  # (operand name, user), through bitcasts (free)
                out = []
                for u in users.get(name, []):
                    out += reads(u.name) if u.op == "bitcast" else [(name, u)]
                return out

            for pname, pins in params.items():
                idx = int(pins.args) if pins.args.isdigit() else None
                if idx is None or idx >= len(ins_bytes):
                    continue
                us = reads(pname)
                if us and all(u.op in ("dynamic-slice", "slice", "gather") and u.operands[0] == o for o, u in us):
                    ins_bytes[idx] = sum(shape_bytes(u.shape) for _, u in us)  # the slices / rows it reads
                elif us and all(u.op in ("dynamic-update-slice", "scatter") and u.operands[0] == o for o, u in us):
                    ins_bytes[idx] = 0.0  # updated in place
            root = next((i for i in body if i.root), None)
            if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
                out = shape_bytes(self.shapes.get(called[0], {}).get(root.operands[1], ""))
            elif root is not None and root.op == "scatter" and len(root.operands) == 3:  # in place: the updates
                out = shape_bytes(self.shapes.get(called[0], {}).get(root.operands[2], ""))
        elif ins.op == "dynamic-update-slice":
            return 2 * (ins_bytes[1] if len(ins_bytes) > 1 else 0.0)
        elif ins.op in ("dynamic-slice", "gather"):
            return 2 * out + sum(ins_bytes[1:])  # the rows read (and written), the indices
        return out + sum(ins_bytes)


def count(text: str, gpus_per_node: int = 8, expert_branch=None) -> HloStats:
    """The module docstring's counts for the optimized HLO `text` of one device's program. `expert_branch` (index,
    branches), or several such pairs: a conditional of that many branches in the routed experts' scope (the sized
    dispatch's switch, parallel/padded.py; with `compact`, the switch nested in each of its branches) counts branch
    `index` (the load a routing model picks, parallel/routing_load.py) instead of its costliest; the first pair
    whose branch count matches applies."""
    c = _Counter(text, gpus_per_node, expert_branch)
    return c.comp(c.entry, top=True)


def backend_config(attrs: str) -> dict:
    """An instruction's backend_config as a dict ({} when absent)."""
    m = re.search(r"backend_config=(\{.*\})\s*$", attrs)
    try:
        return json.loads(m.group(1)) if m else {}
    except json.JSONDecodeError:
        return {}


def collectives_by_axis(st: HloStats, axes: dict[str, int]) -> dict[tuple[str, str], float]:
    """{(kind, mesh axes): bytes sent} of `st`'s collectives on a mesh of `axes` ({name: size}, in the mesh's
    order): a replica group's device ids are positions in the mesh's device order, so the axes whose coordinate
    varies inside the group are the axes it runs over ("?": no replica groups, or ids beyond the mesh)."""
    names, sizes = list(axes), list(axes.values())
    out: dict[tuple[str, str], float] = {}
    for (kind, group), sent in st.groups.items():
        label = "?"
        if group and max(group) < math.prod(sizes):
            coords = np.array(np.unravel_index(np.array(group), sizes))  # [axes, group]
            label = ",".join(n for n, c in zip(names, coords) if len(set(c.tolist())) > 1) or "none"
        out[(kind, label)] = out.get((kind, label), 0.0) + sent
    return out
