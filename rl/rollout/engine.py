"""Jitted rollout sampler: FP8 (or BF16/FP32) weights, prefill + `lax.while_loop` decode over donated caches,
per-token logprobs and recorded routing.

Usage:
    sampler = Sampler(model, mesh=plan.rollout, weights="fp8")
    batch = sampler.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(eos,)),
                             seed=0)
    sampler.update_weights(actor_params, version=1)

Design (docs/jax-stack.md §5; Tunix `sampler.py`, MaxText `maxengine` read for ideas):
- Settings resolved once (`rl.rollout.settings.EngineSettings`: `Sampler(model, settings=...)`, or its fields as
  keywords). Static batching by default (`slots=0`, rl/rollout/static.py); `slots=N` (`--rollout-slots`) runs
  continuous batching instead (rl/rollout/slots.py: N decode slots refilled as samples finish, cache sized to
  prompt + max_new_tokens rounded to the compression ratios; same per-sample results). Static: prompt lengths, the batch size and max_new_tokens are
  bucketed to powers of two, so steady state never recompiles; temperature, top-p, top-k, max_new_tokens (per
  row) and stop ids are traced values.
- Prompts are laid out right-padded (left-aligned: each row has its own positions 0..), so a row's result does not
  depend on the other rows: the output is the same for any batch composition, padding included. The RolloutBatch
  keeps that layout (rl/batch.py: [prompt | response | pad] rows, `to_batch`).
- Weights: `fp8` = weight-only FP8 e4m3fn 128x128 blocks (f32 scales) for the released FP8 set (attention
  projections, indexer wq_b, shared experts, MTP projections) and the routed experts, always built by
  `quantize_weights` -> `dsv4.quant.quantize_rollout_fp8` (version 0, pushes, rebuilt samplers alike);
  `fp8_e4m3fnuz` for MI300/MI308 (gfx942) is the exact byte conversion of the e4m3fn result; `auto` picks by
  device kind; `fp8+fp4experts` keeps the routed experts FP4 e2m1 (1x32 ue8m0 scales); `bf16` / `fp32` dense. Each
  layer's weights are dequantised right before it runs, in the prefill and in every decode step
  (`dequant="per_layer"`, default: rl/rollout/layerwise.py), or, as references, the whole model once per call
  (`"per_call"`) / per decode step (`"per_step"`). FP8 GEMMs where the backend has them (`matmul="auto"`, logged).
- KV cache (`EngineSettings.kv_layout`): "fp8" stores the window ring, the compressed entries and the
  indexer keys in FP8 with ue8m0 scales (the release's layout, `dsv4.cache` docstring; e4m3fnuz when the weights
  are fnuz), dequantised on read in each decode step; "bf16" keeps today's unquantised layout (entries in the
  compute dtype, f32 indexer keys). The prefill attends to its own unquantised
  keys; the decode steps read the cache. Static and continuous batching share the layout.
- Placement: the batch, its inputs and the KV caches are split over the rule table's `ACT_BATCH` mesh axes (rollout:
  data x fsdp x expert, "EP as DP"; `sharding.rules.cache_shardings`), never replicated; outputs are replicated.
- Logprobs: `log_softmax(logits / T)` over the full vocabulary at the sampled token, i.e. after temperature and
  before top-k/top-p truncation: the distribution the learner recomputes (training logits / T). Temperature 0
  means greedy; its logprobs are then those of T = 1.
- Randomness per sample from (seed, step, prompt index, sample index) and the token index: a sample does not
  change when the batch around it changes.
- Routing: expert ids of every main MoE layer for every prompt and response token; the last response token is
  fed once more after sampling stops so that its routing is recorded too.
- Routed experts: `parallel.expert.default_dispatch` (an expert mesh: the EP dispatch of --rollout.ep_backend, sized
  on GPUs; unsharded experts: `routed_experts_cpu` on CPU, else the model's `ragged_dot`); prefill and decode ops
  sit under the `prefill` / `decode_step` name scopes (profiles, compiled HLO; benchmarks/sampler.py counts the
  decode step's bytes from them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dsv4 import quant
from dsv4.chunked import check_chunk
from dsv4.model import DSV4ForCausalLM
from dsv4.rollout_format import RolloutFormat, check_fp4_experts
from parallel import expert as expert_lib
from sharding.mesh import auto_axes
from rl.algo.batch import RolloutBatch, join_rows
from rl.config.rollout import RolloutConfig
from rl.config.tree import default
from rl.rollout import slots as slots_lib
from rl.rollout import speculative as spec_lib
from rl.rollout.shapes import MAX_STOP_IDS, EngineShapes, ProgramShape, to_host
from rl.rollout.layerwise import default_tie, select_fp8_matmul
from rl.rollout.sampling import row_keys
from rl.rollout.settings import EngineSettings
from rl.rollout.static import static_program
from rl.rollout.weights import EngineWeights
from sharding.rules import ROLLOUT_RULES, use_rules

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """temperature (0 = greedy), top_p in (0, 1], top_k (0 = off), max_new_tokens >= 1, stop_token_ids (<= 16).

    Defaults: the run's `--temperature`, `--top-p`, `--top-k`, `--max-new-tokens` (`rl.config.rollout.RolloutConfig`).
    Raises ValueError naming the field for out-of-range values.
    """

    temperature: float = default(RolloutConfig, "temperature")
    top_p: float = default(RolloutConfig, "top_p")
    top_k: int = default(RolloutConfig, "top_k")
    max_new_tokens: int = default(RolloutConfig, "max_new_tokens")
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in self.stop_token_ids))
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids: at most {MAX_STOP_IDS}, got {len(self.stop_token_ids)}")


class Sampler(EngineShapes):
    """Rollout engine over the rollout mesh.

    Args:
      model: a DSV4ForCausalLM (its weights become version 0; any param dtype), or an abstract one
        (`nnx.eval_shape`): no weights until `set_weights` (e.g. `rl.rollout.init.checkpoint_rollout_weights`).
      settings: the engine's knobs (`rl.rollout.settings.EngineSettings`, e.g. `EngineSettings.for_run(cfg.rollout,
        ...)`); or pass its fields as keywords (`weights=`, `max_prompt_len=`, `slots=`, ...).
      mesh: rollout `jax.sharding.Mesh` (None = default device). rules: logical-axis rules (default
        `sharding.rules.ROLLOUT_RULES`). dispatch_fn: routed-expert implementation for prefill and decode
        (`dsv4.moe` contract); None: `parallel.expert.default_dispatch` for `ep_backend` / `ep_capacity_factor`
        ("auto" = `parallel.expert.rollout_backend`: capacity on CPU, sized on GPUs).
    Public state: `settings`, `config`, `mesh`, `rules`, `weights` (`rl.rollout.weights.EngineWeights`),
    `layerwise`, `dispatch_fn` / `dispatch_name`, `kv_fp8` (the cache's FP8 format or None), `last_stats`,
    `last_cache_bytes`, `weight_version`; `static_jit` / `slots_jit` the two programs.
    Raises:
      ValueError: an unknown setting (`EngineSettings`), slots < 0, prefill_chunk not a
        multiple of the compression ratios, speculative decoding the model cannot do.
    """

    def __init__(self, model: DSV4ForCausalLM, settings: EngineSettings | None = None, *, mesh=None, rules=None,
                 dispatch_fn=None, **knobs):
        self.settings = st = settings if settings is not None else EngineSettings(**knobs)
        if settings is not None and knobs:
            raise TypeError(f"Sampler: pass settings or its fields, not both ({sorted(knobs)})")
        rdt = st.rdt
        self.config = cfg = model.config
        self.prefill_chunk = check_chunk(cfg, st.prefill_chunk)
        self.mesh = mesh = auto_axes(mesh)  # Explicit or Auto axes (sharding.mesh.auto_axes)
        self.rules = ROLLOUT_RULES if rules is None and mesh is not None else rules
        self.fp8, self.fp4_experts = rdt.fp8, rdt.fp4_experts
        devs = None if mesh is None else list(mesh.devices.flat)
        self.fmt = quant.select_fp8_format(rdt.fp8_name, devs) if self.fp8 else None
        # FP8 cache format: the weights' (e4m3fnuz on gfx942), else the device's
        self.kv_fp8 = None if st.kv_layout == "bf16" else (self.fmt or quant.select_fp8_format("auto", devs))
        self.fp8_matmul = select_fp8_matmul(st.matmul, self.fp8, devs) if st.dequant == "per_layer" else "dequant"
        self.fp8_gemm = self.fp8_matmul != "dequant"  # FP8 GEMMs (XLA's dots or the kernel)
        self.compute_dtype, self.fp8_block, self.dequant = st.compute_dtype, st.fp8_block, st.dequant
        self.max_prompt_len, self.slots, self.kv_budget_bytes = st.max_prompt_len, st.slots, st.kv_budget_bytes
        self.speculative, self.draft_tokens = spec_lib.check_speculative(st.speculative, st.draft_tokens, cfg)
        # the one rule from learner weights to rollout weights (also the FP8-aware learner's, dsv4/rollout_format.py)
        self.rformat = RolloutFormat(rdt=rdt, fmt=self.fmt, block=self.fp8_block, compute_dtype=self.compute_dtype)
        self.weights = EngineWeights(cfg, self.rformat, mesh=mesh, rules=self.rules, fp8_matmul=self.fp8_matmul,
                                     tie=default_tie(devs), lora=getattr(model, "lora", None))
        self.layerwise, self.dense_model = self.weights.layerwise, self.weights.dense_model
        if dispatch_fn is None:  # an expert mesh: the EP dispatch; CPU + unsharded experts: moe.routed_experts_cpu
            ddevs = [jax.devices()[0]] if mesh is None else devs
            backend = (expert_lib.rollout_backend(all(d.platform == "cpu" for d in ddevs))
                       if st.ep_backend == "auto" else st.ep_backend)
            dispatch_fn = expert_lib.default_dispatch(ddevs, self.weights.dense_shardings, ep_backend=backend,
                                                      ep_capacity_factor=st.ep_capacity_factor,
                                                      compact=st.ep_compact)
        self.dispatch_fn, self.dispatch_name = dispatch_fn, expert_lib.dispatch_name(dispatch_fn)
        self.last_stats: dict = {}
        self._init_caches()
        self._build_programs()
        self.last_cache_bytes: tuple[int, int] = (0, 0)  # (global, largest per device) bytes of the last caches
        self.weight_version = -1
        self._w = None
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model))):
            self.update_weights(nnx.state(model), version=0)  # an abstract model: set_weights comes later

    def _build_programs(self):
        """The static and the continuous-batching jits. Outputs are replicated on the rollout mesh (readable on
        every host), except the slots program's per-request rows (split like the slots: at 1,024 x 32K the
        routing alone is ~0.8 GB per layer); the donated caches keep their batch-sharded placement."""
        out_sh = slot_out = rep = None
        if self.mesh is not None:
            rep = NamedSharding(self.mesh, PartitionSpec())
            c_sh = self.cache_shardings(self.cache_shapes(1, 1))
            out_sh = (rep,) * 6 + (c_sh,)
            slot_out = (self.input_shardings()[0],) * 6 + (rep, c_sh)
        if self.speculative == "mtp":  # the same signature, one more (replicated) output: the stats
            static_fn = lambda *a: spec_lib.spec_program(self, *a[:-1])  # noqa: E731
            out_sh = None if out_sh is None else out_sh[:6] + (rep,) + out_sh[6:]
            # the last input is the rows' token offsets (partial rollouts); speculative decoding takes none
            slots_fn = lambda *a: spec_lib.spec_slots_program(self, *a[:-1])  # noqa: E731
        else:
            static_fn = lambda *a: static_program(self, *a)  # noqa: E731
            slots_fn = lambda *a: slots_lib.slots_program(self, *a)  # noqa: E731
        self.static_jit = jax.jit(static_fn, static_argnums=(0,), donate_argnums=(2,), out_shardings=out_sh)
        self.slots_jit = jax.jit(slots_fn, static_argnums=(0,), donate_argnums=(2,), out_shardings=slot_out)

    # ------------------------------------------------------------------ weights
    def rollout_shardings(self) -> dict | None:
        """{path key: NamedSharding} of the dense rollout-side weights (what the push device_puts onto)."""
        return self.weights.dense_shardings

    def abstract_weights(self) -> dict:
        """ShapeDtypeStructs (with shardings) of the weight state the engine stores (the live one's, or the
        quantised layout of the abstract model's: no weights needed)."""
        return self.weights.abstract_state(self._w)

    def quantize_weights(self, raw: dict) -> dict:
        """Jitted quantisation on the rollout mesh: {key: array on the rollout mesh} -> rollout weight state.

        The single function that builds rollout weights: version 0 (`Sampler(model)`), `update_weights` (a
        rebuilt sampler, a resumed run without a pusher) and every push (parallel/push/) all call it; FP8
        tensors go through `dsv4.quant.quantize_rollout_fp8` (bf16 rounding, e4m3fn blocks, exact fnuz
        conversion), so the result does not depend on how the weights arrived (fp32 master or bf16 wire copy).
        """
        with self.mesh_ctx():
            return self.weights.quantize(raw)

    def set_weights(self, wstate: dict, version: int) -> None:
        """Swap in an already quantised weight state (from `quantize_weights`) as weight `version`.

        Raises ValueError under `fp8+fp4experts` when the routed experts are not FP4 (`check_fp4_experts`)."""
        if self.fp4_experts:
            check_fp4_experts(wstate)
        self._w = wstate
        self.weight_version = int(version)

    def weight_state(self) -> dict:
        return self._w

    def flat_params(self, params) -> dict:
        """nnx.State / Module / {key: array} -> {path key: array} covering every tensor of the model."""
        return self.weights.flat_params(params)

    def update_weights(self, params, version: int) -> None:
        """Swap in new weights: actor params (nnx.State of Params + Buffers, any mesh) -> rollout dtype / FP8."""
        flat = self.flat_params(params)
        if self.mesh is not None:
            flat = {k: jax.device_put(flat[k], self.weights.dense_shardings[k]) for k in flat}
        self.set_weights(self.quantize_weights(flat), version)

    # ------------------------------------------------------------------ generation
    def lower(self, batch_size: int, prompt_len: int, max_new_tokens: int) -> jax.stages.Lowered:
        """The generate program for `batch_size` prompts of up to `prompt_len` tokens and `max_new_tokens` new
        tokens, lowered with abstract inputs (no weights or caches are allocated; works on a sampler built from
        an abstract model). Shapes are bucketed as `generate` buckets them (`program_shape`), so
        `.compile().memory_analysis()` gives XLA's per-device figures of exactly the program a `generate` call of
        that size runs: arguments = weight state + caches + inputs, temporaries = activations and dequantised
        weights. With `slots` >= 1 it is the continuous-batching program (rl/rollout/slots.py), else the static one.

        Raises ValueError when prompt_len > max_prompt_len or any size is < 1.
        """
        if min(batch_size, prompt_len, max_new_tokens) < 1:
            raise ValueError(f"Sampler.lower: sizes must be >= 1, got batch_size={batch_size} "
                             f"prompt_len={prompt_len} max_new_tokens={max_new_tokens}")
        if prompt_len > self.max_prompt_len:
            raise ValueError(f"Sampler.lower: prompt_len {prompt_len} > max_prompt_len {self.max_prompt_len}")
        shape = self.program_shape(batch_size, prompt_len, max_new_tokens)
        caches = self.cache_shapes(shape.cache_rows, shape.cache_len, placed=True)
        with self.mesh_ctx(), _rules_ctx(self.rules, self.mesh):
            return self._jit(shape).lower(shape.static_args, self.abstract_weights(), caches,
                                          *self.input_shapes(shape))

    def _jit(self, shape: ProgramShape):
        return self.slots_jit if shape.slots else self.static_jit

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int, step: int = 0,
                 prompt_index: Sequence[int] | None = None, sample_index: Sequence[int] | None = None,
                 max_new_tokens_per_row: Sequence[int] | None = None,
                 token_offset: Sequence[int] | None = None) -> RolloutBatch:
        """Sample one continuation per prompt.

        Args:
          prompts: N token-id lists (1 <= len <= max_prompt_len, ids < vocab_size).
          params: SamplingParams. seed, step: randomness; prompt_index / sample_index [N]: the (prompt, sample)
            identity of each row for per-sample randomness (default: row index, 0).
          max_new_tokens_per_row: optional [N] length limits (1 <= each <= params.max_new_tokens; a length
            schedule, e.g. benchmarks/rollout_lengths.py); default params.max_new_tokens for every row.
          token_offset: optional [N] ints >= 0: row i's first new token is drawn as token `token_offset[i]` of its
            sample (key fold_in(key_i, token_offset[i] + j) for its j-th new token), so a partial rollout continued
            from prompt + its first g tokens (rl/run/partial.py) draws with the keys of an uninterrupted sample;
            default 0. Not with speculative decoding.
        Returns:
          RolloutBatch (see its docstring).
        Raises:
          ValueError: empty prompt, prompt longer than `max_prompt_len`, token id out of range (names the row).
        """
        n = len(prompts)
        lens_np = self.check_prompts(prompts)
        shape = self.program_shape(n, int(lens_np.max()), params.max_new_tokens)
        host = self.host_inputs(shape, prompts, params, max_new_tokens_per_row, token_offset)
        if token_offset is not None and host[-1].any() and self.speculative == "mtp":
            raise ValueError("generate: token_offset (partial rollouts) is not supported with speculative decoding")
        pi = np.arange(n) if prompt_index is None else np.asarray(prompt_index)
        si = np.zeros(n, np.int64) if sample_index is None else np.asarray(sample_index)
        keys = row_keys(seed, step, pi, si)
        keys = jax.random.key_data(jax.device_get(jnp.concatenate([keys, jnp.repeat(keys[:1], shape.batch - n)])))
        ids, lens, mx, stop, off = host
        if shape.slots:  # one prefill width per sampler (a row's result does not depend on the call's longest prompt)
            slots_lib.plan_slots(shape.slots, per_slot_bytes=self.cache_bytes(shape.cache_len),
                                 budget_bytes=self.kv_budget_bytes, seq_len=shape.cache_len, shards=self.batch_shards())
            inputs = (ids, lens, keys, np.int32(n), np.float32(params.temperature), np.float32(params.top_p),
                      np.int32(params.top_k), mx, stop, off)
        else:
            inputs = (ids, lens, keys, np.float32(params.temperature), np.float32(params.top_p),
                      np.int32(params.top_k), mx, stop, off)
        # identical host values on every process -> one global array each (rows split like the batch)
        inputs = jax.device_put(inputs, self.input_shardings(shape))
        caches = self.empty_caches(shape.cache_rows, shape.cache_len)
        with self.mesh_ctx(), _rules_ctx(self.rules, self.mesh):
            out = self._jit(shape)(shape.static_args, self._w, caches, *inputs)
        self.last_stats = self._stats(shape, out)
        self.last_cache_bytes = _cache_bytes(out[-1])
        del caches
        tok, lp, pr, rr, length, stopped = to_host(tuple(out[:6]))
        del out
        return self.to_batch(shape, prompts, params, lens_np, tok, lp, pr, rr, length, stopped)

    def _stats(self, shape: ProgramShape, out) -> dict:
        """The call's counters: continuous batching's (`rl.rollout.slots.slot_stats`), speculative decoding's."""
        if shape.slots:
            stats = jax.device_get(out[6])
            st = slots_lib.slot_stats(stats[:3], shape.slots)
            if len(stats) > 3:  # speculative (rl/rollout/speculative.py)
                st.update(spec_lib.spec_stats(stats[3:], self.draft_tokens))
            return st
        return spec_lib.spec_stats(jax.device_get(out[6]), self.draft_tokens) if len(out) == 8 else {}

    def to_batch(self, shape, prompts, params, lens_np, tok, lp, pr, rr, length, stopped) -> RolloutBatch:
        """Host outputs of a program -> the RolloutBatch (rl/batch.py: left-aligned prompts of the static width
        P, responses of width T, the routing joined into [prompt | response | pad] rows; N rows). The programs run
        the prompts right-padded (each row at positions 0..), so the prompt half is taken as it is; joining the
        routing is the one move (the response's routes placed right after each prompt's)."""
        n, p_bucket = len(prompts), shape.prompt_bucket
        if pr.shape[1] != p_bucket:  # slots: right-padded rows of max_prompt_len -> the static width p_bucket (exact)
            pr = np.pad(pr, ((0, 0), (0, max(0, p_bucket - pr.shape[1])), (0, 0), (0, 0)),
                        constant_values=-1)[:, :p_bucket]
        t = params.max_new_tokens
        tok, lp, rr, length, stopped = tok[:n, :t], lp[:n, :t], rr[:n, :t], length[:n], stopped[:n]
        routing = join_rows(pr[:n], lens_np, rr, -1)
        prompt_tokens = np.zeros((n, p_bucket), np.int32)
        for i, p in enumerate(prompts):
            prompt_tokens[i, : len(p)] = p
        return RolloutBatch(tokens=tok.astype(np.int32), logprobs=lp.astype(np.float32),
                            routing=routing.astype(np.int32), lengths=length.astype(np.int32),
                            finish_reasons=["stop" if s else "length" for s in stopped], prompt_tokens=prompt_tokens,
                            prompt_lengths=lens_np, weight_version=self.weight_version)

    def compile_count(self) -> int:
        """Number of compiled variants of the generate function (for recompilation tests)."""
        return self.static_jit._cache_size() + self.slots_jit._cache_size()


def _cache_bytes(caches) -> tuple[int, int]:
    """(global bytes, largest per-device bytes) of cache arrays, from their addressable shards."""
    per_dev: dict = {}
    for x in jax.tree.leaves(caches):
        for sh in x.addressable_shards:
            per_dev[sh.device] = per_dev.get(sh.device, 0) + sh.data.nbytes
    return sum(x.nbytes for x in jax.tree.leaves(caches)), max(per_dev.values(), default=0)


def _rules_ctx(rules, mesh):
    if rules is None or mesh is None:
        return contextlib.nullcontext()
    return use_rules(rules, mesh)
