"""What benchmarks/sampler.py measures besides time: the weight modes and the timed sampler call it shares, the bytes a
decode step reads, the memory bandwidth of the roofline, the sampler's resident weight bytes and XLA's compiled memory
of the generate program. Imported by benchmarks/sampler.py (not a script); its docstring has the timing and RESULT.

- model bytes (`step_bytes`) = every dense weight (attention, compressors, indexer, shared experts, gates, norms,
  mHC, lm head) in the dtype the step reads (the compute dtype: fp8 modes read their dequantised copy), the B
  embedding rows, min(E, B * k) routed experts per layer, and every cache leaf of `dsv4.cache.cache_shapes` at
  cache_len = P + 64 (the decode step reads the whole window ring, compressed entries and indexer keys); fp8 and
  fp8_step are counted at their FP8 bytes (q + f32 scales), what a fused dequantising matmul would read.
- bandwidth (`memcpy_bandwidth`) = the best over the run (measured at the start, before every (config, B) block
  and at the end) of a numpy 512 MB copy and a jitted, donated jnp 512 MB read+write, as bytes copied / time (the
  DRAM traffic is twice that); the higher of the two is used.
- HLO bytes: the bytes the compiled decode step really reads through its matmuls: the sampler's generate program
  is compiled for the exact call signature and the operand sizes of every `dot` under the `decode_step` name
  scope are summed (weights in the dtype XLA feeds the dot: XLA:CPU upcasts some bf16 weights to f32 once per
  call, outside the loop, so the loop reads f32 copies; plus the cache tensors attention contracts with). At
  B = 1 XLA rewrites the matrix-vector dots as multiply + reduce and there is nothing to count (nan).
- compiled memory (`--memory-only` runs just this): XLA's `memory_analysis()` of the generate program from
  `Sampler.lower(8, 32, 64)` on small with abstract weights, f32 compute, per weight mode (fp32 = unquantised,
  bf16, fp8 per_layer, fp8+fp4experts, and the old whole-model fp8 per_call / per_step), plus bf16 weights at
  bf16 compute. Reported as fractions of the fp32 program's argument bytes (its weights):
  `<mode>_temp_excess` = (temp - fp32 temp) / fp32 args and `<mode>_args_frac` = args / fp32 args.
"""

from __future__ import annotations

import gc
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import DSV4Config, abstract_model, quant
from dsv4.cache import cache_shapes
from dsv4.moe import routed_experts_ragged
from rl.rollout.engine import Sampler, SamplingParams

CONFIGS = {"tiny": DSV4Config.tiny, "small": DSV4Config.small}
MODES = {  # name -> (Sampler weights, dequant, compute dtype, stock ragged_dot routed experts)
    "bf16": ("bf16", "per_call", "bfloat16", False),
    "fp8": ("fp8", "per_layer", "bfloat16", False),
    "fp8_call": ("fp8", "per_call", "bfloat16", False),
    "fp8_step": ("fp8", "per_step", "bfloat16", False),
    "fp8_f32": ("fp8", "per_call", "float32", False),
    "fp32": ("fp32", "per_call", "float32", False),
    "bf16_ragged": ("bf16", "per_call", "bfloat16", True),
    "fp8_ragged": ("fp8", "per_call", "bfloat16", True),
}
PROMPT_LEN = 32
T_CAP = 64  # ours' response bucket: N_hi and N_lo must both be in (32, 64]


def make_sampler(model, mode: str) -> Sampler:
    weights, dequant, compute, ragged = MODES[mode]
    return Sampler(model, weights=weights, max_prompt_len=PROMPT_LEN, dequant=dequant, compute_dtype=compute,
                   kv_cache_dtype="bf16", dispatch_fn=routed_experts_ragged if ragged else None)


def ours_fn(sampler: Sampler, prompts, n: int):
    sp = SamplingParams(temperature=0.0, max_new_tokens=n)

    def run():
        out = sampler.generate(prompts, sp, seed=0)
        if not (out.lengths == n).all():
            raise RuntimeError(f"ours: rows stopped early: lengths {out.lengths.tolist()} != {n}")
        return out

    return run


# ------------------------------------------------------------------------------------------ compiled memory
MEMORY_MODES = {  # name -> (Sampler weights, dequant): compiled at f32 compute (XLA:CPU upcasts bf16 dots)
    "fp32": ("fp32", "per_layer"),
    "bf16": ("bf16", "per_layer"),
    "fp8": ("fp8", "per_layer"),
    "fp8+fp4experts": ("fp8+fp4experts", "per_layer"),
    "fp8_per_call": ("fp8", "per_call"),
    "fp8_per_step": ("fp8", "per_step"),
}


def compiled_memory(name: str = "small", batch: int = 8, new_tokens: int = T_CAP) -> dict:
    """XLA's `memory_analysis()` of the generate program (`Sampler.lower(batch, PROMPT_LEN, new_tokens)`) per
    memory mode, abstract weights (nothing is allocated), f32 compute; bf16 also at bf16 compute ("bf16@bf16":
    bf16 weights stored; XLA:CPU then upcasts its dots, so its temp holds f32 copies)."""
    cfg = CONFIGS[name]()
    model = _abstract_model(cfg)
    out = {}
    for mode, (weights, dequant) in list(MEMORY_MODES.items()) + [("bf16@bf16", ("bf16", "per_layer"))]:
        compute = "bfloat16" if mode == "bf16@bf16" else "float32"
        s = Sampler(model, weights=weights, dequant=dequant, compute_dtype=compute, max_prompt_len=PROMPT_LEN,
                    kv_cache_dtype="bf16")
        ma = s.lower(batch, PROMPT_LEN, new_tokens).compile().memory_analysis()
        out[mode] = {"args": ma.argument_size_in_bytes, "temp": ma.temp_size_in_bytes}
        print(f"  {mode:<16s} arguments {ma.argument_size_in_bytes / 2**20:8.1f} MiB  temp "
              f"{ma.temp_size_in_bytes / 2**20:8.1f} MiB", flush=True)
    return out


def memory_result(mem: dict) -> str:
    """The memory targets against the unquantised (fp32) program: temp excess and argument bytes as fractions
    of the fp32 program's argument bytes (= its weight bytes plus the small inputs and caches)."""
    ref = mem["fp32"]
    parts = []
    for mode, key in (("fp8", "fp8"), ("fp8+fp4experts", "fp4"), ("bf16@bf16", "bf16"), ("fp8_per_call", "fp8_call")):
        m = mem[mode]
        parts.append(f"{key}_temp_excess={(m['temp'] - ref['temp']) / ref['args']:.3f} "
                     f"{key}_args_frac={m['args'] / ref['args']:.3f}")
    return " ".join(parts)


# ------------------------------------------------------------------------------------------ bytes
def _leaf_bytes(v) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(v))


def resident_weight_bytes(sampler: Sampler) -> int:
    """Sum of nbytes over the sampler's weight-state leaves (QuantizedTensor: q and scale)."""
    return _leaf_bytes(sampler.weight_state())


def step_bytes(sampler: Sampler, mode: str, batch: int, cache_len: int) -> dict:
    """Bytes a decode step of `batch` rows touches: dense weights, embedding rows, min(E, B k) experts per layer,
    caches (benchmarks/sampler.py's docstring, "roofline")."""
    cfg = sampler.config
    _, dequant, compute, _ = MODES[mode]
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    exp_frac = min(e, batch * k) / e
    compute_item = jnp.dtype(compute).itemsize
    out = {"dense": 0, "experts": 0, "embed": 0, "cache": 0}
    for key, v in sampler.weight_state().items():
        if isinstance(v, quant.QuantizedTensor):
            n = math.prod(v.shape)
            b = _leaf_bytes(v) if dequant in ("per_step", "per_layer") else n * compute_item
            shape = v.shape
        else:
            b, shape = int(v.nbytes), v.shape
        if key.startswith("mtp/"):
            continue  # not run by the decode step
        if key == "embed/weight" or key.endswith("gate/tid2eid"):
            out["embed"] += b * batch // shape[0]  # B rows gathered
        elif "/ffn/experts/" in key:
            out["experts"] += int(b * exp_frac)
        else:
            out["dense"] += b
    caches = jax.eval_shape(lambda: [cache_shapes(layer.attn, batch, cache_len, sampler.compute_dtype)
                                     for layer in _abstract_model(cfg).layers])
    out["cache"] = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(caches))
    out["total"] = sum(out.values())
    return out


_HLO_ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                 "s8": 1, "u8": 1, "pred": 1}
_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z0-9]+)\[([\d,]*)\]")
_HLO_DOT = re.compile(r"\bdot\(([^)]*)\)")


def hlo_dot_operand_bytes(hlo: str, scope: str) -> dict:
    """{dtype: bytes} summed over the operands of every `dot` in compiled HLO text whose op_name metadata contains
    `scope` (operand types are looked up among the definitions of the same computation)."""
    out, local = {}, {}
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
            local = {}  # a new computation
            continue
        m = _HLO_DEF.match(line)
        if not m:
            continue
        local[m.group(1)] = (m.group(2), m.group(3))
        d = _HLO_DOT.search(line)
        if d is None or scope not in line:
            continue
        for op in d.group(1).split(","):
            dt, dims = local.get(op.strip().lstrip("%"), (None, None))
            if dt is None:
                raise RuntimeError(f"hlo_dot_operand_bytes: operand {op!r} of {m.group(1)} not found")
            n = math.prod(int(x) for x in dims.split(",") if x)
            out[dt] = out.get(dt, 0) + n * _HLO_ITEMSIZE.get(dt, 1)
    return out


def decode_step_hlo_bytes(sampler: Sampler, prompts, n: int) -> dict:
    """Bytes the compiled decode step reads through its matmuls: `hlo_dot_operand_bytes` of the sampler's compiled
    generate program (the exact signature of a `generate(prompts, max_new_tokens=n)` call) over the ops named
    `decode_step` (weights as the dots really read them, plus the cache tensors attention contracts with)."""
    jitted, seen = sampler.static_jit, {}

    def spy(*a):
        seen["args"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "dtype") else x, a)
        return jitted(*a)

    sampler.static_jit = spy
    try:
        ours_fn(sampler, prompts, n)()
    finally:
        sampler.static_jit = jitted
    # An executable loaded from the persistent compilation cache prints without op metadata; a compile option
    # that only affects profiling makes a distinct cache key, so this compiles afresh.
    lowered = jitted.lower(*seen["args"])
    text = lowered.compile(compiler_options={"xla_cpu_enable_xprof_traceme": True}).as_text()
    out = hlo_dot_operand_bytes(text, "decode_step/")
    out["total"] = sum(out.values())
    return out


def _abstract_model(cfg: DSV4Config):
    return abstract_model(cfg)


def memcpy_bandwidth(mb: int = 512, reps: int = 3) -> dict:
    """Copy bandwidth (bytes copied / time, best of `reps`) of numpy and of a jitted jnp copy of `mb` MB."""
    n = mb * (1 << 20) // 4
    src = np.random.RandomState(0).rand(n).astype(np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    numpy_bw = src.nbytes / best
    del dst
    x = jnp.asarray(src)
    del src
    # one read and one write of every element, like a copy; donated, so it runs in place in one buffer (a fresh
    # 512 MB output per call would time page faults, not bandwidth)
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = f(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x = f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    jax_bw = x.nbytes / best
    del x
    gc.collect()
    return {"numpy": numpy_bw, "jax": jax_bw, "best": max(numpy_bw, jax_bw)}
