"""Jitted rollout sampler: FP8 (or BF16/FP32) weights, prefill + `lax.while_loop` decode over donated caches,
per-token logprobs and recorded routing.

Usage:
    sampler = Sampler(model, mesh=plan.rollout, weights="fp8")
    batch = sampler.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(eos,)),
                             seed=0)
    sampler.update_weights(actor_params, version=1)

Design (docs/jax-stack.md §5; Tunix `sampler.py`, MaxText `maxengine` read for ideas):
- Static batching by default (`slots=0`); `slots=N` (`--rollout-slots`) runs continuous batching instead
  (rl/rollout/slots.py: N decode slots refilled as samples finish, cache sized to prompt + max_new_tokens rounded to the
  compression ratios; same per-sample results). Static: prompt lengths, the batch size and max_new_tokens are
  bucketed to powers of two, so steady state never recompiles; temperature, top-p, top-k, max_new_tokens (per
  row) and stop ids are traced values.
- Prompts are laid out right-padded internally (each row has its own positions), so a row's result does not
  depend on the other rows: the output is the same for any batch composition, padding included.
- Weights: `fp8` = weight-only FP8 e4m3fn 128x128 blocks (f32 scales) for the released FP8 set (attention
  projections, indexer wq_b, shared experts, MTP projections) and the routed experts, always built by
  `quantize_weights` -> `dsv4.quant.quantize_rollout_fp8` (version 0, pushes, rebuilt samplers alike);
  `fp8_e4m3fnuz` for MI300/MI308 (gfx942) is the exact byte conversion of the e4m3fn result; `auto` picks by
  device kind; `fp8+fp4experts` keeps the routed experts FP4 e2m1 (1x32 ue8m0 scales); `bf16` / `fp32` dense. Each
  layer's weights are dequantised right before it runs, in the prefill and in every decode step
  (`dequant="per_layer"`, default: rl/rollout/layerwise.py), or, as references, the whole model once per call
  (`"per_call"`) / per decode step (`"per_step"`). FP8 GEMMs where the backend has them (`matmul="auto"`, logged).
- KV cache (`kv_cache_dtype`, `--kv-cache-dtype`): "fp8" stores the window ring, the compressed entries and the
  indexer keys in FP8 with ue8m0 scales (the release's layout, `dsv4.cache` docstring; e4m3fnuz when the weights
  are fnuz), dequantised on read in each decode step; "bf16" keeps today's unquantised layout (entries in the
  compute dtype, f32 indexer keys); "auto" = fp8 for FP8 weights. The prefill attends to its own unquantised
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
- Routed experts: `parallel.expert.default_dispatch` (an expert mesh: the EP dispatch of --rollout.ep_backend, padded
  on GPUs; unsharded experts: `routed_experts_cpu` on CPU, else the model's `ragged_dot`); prefill and decode ops
  sit under the `prefill` / `decode_step` name scopes (profiles, compiled HLO; benchmarks/sampler.py counts the
  decode step's bytes from them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from dsv4 import quant
from dsv4.cache import cache_shapes, decode_step, resolve_kv_cache_dtype
from dsv4.chunked import check_chunk, prefill_chunked
from dsv4.model import DSV4ForCausalLM
from dsv4.names import param_key
from parallel import expert as expert_lib
from sharding.mesh import auto_axes
from rl.rollout import slots as _slots
from rl.rollout import speculative as _spec
from rl.batch import RolloutBatch
from rl.config import DataConfig, RolloutConfig
from rl.config_tree import default
from dsv4.rollout_format import RolloutFormat, check_fp4_experts, layer_value, parse_rollout_dtype
from rl.rollout.layerwise import DEQUANT_MODES, LayerwiseWeights, default_tie, select_fp8_matmul
from rl.rollout.sampling import row_keys, sample_tokens
from sharding import axes as ax
from sharding.rules import (ROLLOUT_RULES, activation_spec, batch_shards, cache_shardings, param_shardings,
                            use_rules)

log = logging.getLogger(__name__)

MAX_STOP_IDS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """temperature (0 = greedy), top_p in (0, 1], top_k (0 = off), max_new_tokens >= 1, stop_token_ids (<= 16).

    Defaults: the run's `--temperature`, `--top-p`, `--top-k`, `--max-new-tokens` (`rl.config.RolloutConfig`).
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


def _next_pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class Sampler:
    """Rollout engine over the rollout mesh.

    Args:
      model: a DSV4ForCausalLM (its weights become version 0; any param dtype), or an abstract one
        (`nnx.eval_shape`): no weights until `set_weights` (e.g. `rl.rollout.init.checkpoint_rollout_weights`).
      mesh: rollout `jax.sharding.Mesh` (None = default device). rules: logical-axis rules (default
        `sharding.rules.ROLLOUT_RULES`).
      weights: "fp8" | "fp8_e4m3fn" | "fp8_e4m3fnuz" | "auto" | "fp8+fp4experts" | "bf16" | "fp32"
        (`dsv4.rollout_format.parse_rollout_dtype`).
      max_prompt_len: largest prompt bucket (longer prompts raise ValueError); prompt buckets are powers of two
        from 16. Default: the run's `--max-prompt-len` default (`rl.config.DataConfig.max_prompt_len`); likewise
        `weights`, `slots` and `prefill_chunk` default to the run's `--rollout-dtype`, `--rollout-slots` and
        `--prefill-chunk` (`rl.config.RolloutConfig`). fp8_block: block of the FP8 scales. dequant: "per_layer"
        (default: each layer's weights are dequantised right before it runs, `rl.rollout.layerwise.LayerwiseWeights`)
        | "per_call" | "per_step" (the whole model at once, per call / per decode step; kept as references).
      matmul: "auto" (FP8 GEMMs where the backend has them, logged) | "dequant" | "fp8" (forced; per_layer only).
      compute_dtype: matmul dtype (default bf16, fp32 for `weights="fp32"`); FP8 weights are dequantised to it
        (float32 suits CPUs, where bf16 matmuls are emulated). dispatch_fn: routed-expert implementation for
        prefill and decode (`dsv4.moe` contract); None: experts split over an `expert` mesh axis get the
        expert-parallel dispatch of `ep_backend` / `ep_capacity_factor` (`--rollout.ep_backend`,
        `--rollout.ep_capacity_factor`; "auto" = `parallel.expert.rollout_backend`: capacity on CPU, padded on
        GPUs, dropless without a factor), else `moe.routed_experts_cpu` on CPU with unsharded experts and the
        model's stock `ragged_dot` elsewhere.
      slots: 0 = static batching; N >= 1 = continuous batching over N decode slots (rl/rollout/slots.py).
      kv_budget_bytes: KV-cache bytes per rollout device the memory plan allows (None = unchecked); `generate`
        raises ValueError naming --rollout-slots when N slots of its cache length need more.
      kv_cache_dtype: "bf16" (default here: the unquantised cache) | "fp8" | "auto" (fp8 for FP8 weights; the run's
        `--kv-cache-dtype` default), `dsv4.cache.resolve_kv_cache_dtype`.
      prefill_chunk: prompts longer than this prefill in chunks of this many tokens against the cache built so
        far (`dsv4.chunked.prefill_chunked`: temporaries bounded by one chunk); 0 = whole prompt at once. A
        multiple of the compression ratios' lcm (`--prefill-chunk`).
      speculative, draft_tokens: "off" | "mtp" and k in 1..3 (`--rollout.speculative`, `--rollout.draft_tokens`):
        speculative decoding with the MTP block as the draft (rl/rollout/speculative.py; static or continuous batching).
    Raises:
      ValueError: unknown `weights` / `dequant` / `matmul` / `kv_cache_dtype`, slots < 0, prefill_chunk not a
        multiple of the compression ratios.
    """

    def __init__(self, model: DSV4ForCausalLM, *, mesh=None, weights: str = default(RolloutConfig, "dtype"),
                 rules=None, max_prompt_len: int = default(DataConfig, "max_prompt_len"), fp8_block=(128, 128),
                 dequant: str = "per_layer", dispatch_fn=None, compute_dtype=None,
                 slots: int = default(RolloutConfig, "slots"), kv_budget_bytes: float | None = None,
                 matmul: str = "auto", kv_cache_dtype: str = "bf16",
                 prefill_chunk: int = default(RolloutConfig, "prefill_chunk"),
                 speculative: str = default(RolloutConfig, "speculative"),
                 draft_tokens: int = default(RolloutConfig, "draft_tokens"),
                 ep_backend: str = default(RolloutConfig, "ep_backend"),
                 ep_capacity_factor: float | None = default(RolloutConfig, "ep_capacity_factor")):
        rdt = parse_rollout_dtype(weights)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, rdt.fp8)
        if dequant not in DEQUANT_MODES:
            raise ValueError(f"Sampler dequant={dequant!r}: expected {' | '.join(DEQUANT_MODES)}")
        self.config = model.config
        self.prefill_chunk = check_chunk(self.config, prefill_chunk)
        self.mesh = mesh = auto_axes(mesh)  # Explicit or Auto axes (sharding.mesh.auto_axes)
        if rules is None and mesh is not None:
            rules = ROLLOUT_RULES
        self.rules = rules
        self.fp8 = rdt.fp8
        self.fp4_experts = rdt.fp4_experts
        self.fmt = None
        devs = None if mesh is None else list(mesh.devices.flat)
        if self.fp8:
            self.fmt = quant.select_fp8_format(rdt.fp8_name, devs)
        # FP8 cache format: the weights' (e4m3fnuz on gfx942), else the device's
        self.kv_fp8 = None if self.kv_cache_dtype == "bf16" else (self.fmt or quant.select_fp8_format("auto", devs))
        self.fp8_gemm = select_fp8_matmul(matmul, self.fp8, devs) and dequant == "per_layer"
        self.weights = weights
        if compute_dtype is None:
            compute_dtype = jnp.float32 if weights == "fp32" else jnp.bfloat16
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.fp8_block = tuple(fp8_block)
        # the one rule from learner weights to rollout weights (also the FP8-aware learner's, dsv4/rollout_format.py)
        self.rformat = RolloutFormat(rdt=rdt, fmt=self.fmt, block=self.fp8_block, compute_dtype=self.compute_dtype)
        self.dequant = dequant
        self.max_prompt_len = max_prompt_len
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 0:
            raise ValueError(f"Sampler slots={slots!r} (--rollout-slots): expected an int >= 0 (0 = static batching)")
        self.slots, self.kv_budget_bytes = int(slots), kv_budget_bytes
        self.speculative, self.draft_tokens = _spec.check_speculative(speculative, draft_tokens, model.config)
        self.last_stats: dict = {}
        cfg = self.config
        abstract = nnx.eval_shape(lambda: DSV4ForCausalLM(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32,
                                                          dtype=self.compute_dtype))
        self._layerwise = LayerwiseWeights(abstract, self.compute_dtype, fp8_gemm=self.fp8_gemm, tie=default_tie(devs))
        self.graphdef, abs_state = nnx.split(abstract)
        self._abs_flat = list(nnx.to_flat_state(abs_state))
        self._raw_shardings = self._shardings_for(abs_state)
        if dispatch_fn is None:  # an expert mesh: the EP dispatch; CPU + unsharded experts: moe.routed_experts_cpu
            devs = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
            backend = (expert_lib.rollout_backend(all(d.platform == "cpu" for d in devs)) if ep_backend == "auto"
                       else ep_backend)
            dispatch_fn = expert_lib.default_dispatch(devs, self._raw_shardings, ep_backend=backend,
                                                      ep_capacity_factor=ep_capacity_factor)
        self.ep_backend, self.ep_capacity_factor = ep_backend, ep_capacity_factor
        self.dispatch_fn = dispatch_fn
        self._quantize_jit = jax.jit(self._quantize_fn, out_shardings=self._wstate_shardings())
        # Outputs are replicated on the rollout mesh (readable on every host); the donated caches keep their
        # batch-sharded placement (`_cache_shardings`), so the next call's inputs have the same signature.
        self._cache_shapes: dict = {}
        out_sh = rep = None
        if mesh is not None:
            rep = NamedSharding(mesh, PartitionSpec())
            out_sh = (rep,) * 6 + (self._cache_shardings(self._abstract_caches(1, 1)),)
        self._generate_jit = jax.jit(self._generate_fn, static_argnums=(0,), donate_argnums=(2,),
                                     out_shardings=out_sh)
        if self.speculative == "mtp":  # the same signature, one more (replicated) output: the stats
            self._generate_jit = jax.jit(lambda *a: _spec.spec_program(self, *a[:-1]), static_argnums=(0,),
                                         donate_argnums=(2,), out_shardings=None if out_sh is None else
                                         out_sh[:6] + (rep,) + out_sh[6:])
        # continuous batching (rl/rollout/slots.py): slot caches split like the batch
        slot_out = None  # per-request outputs split over the batch axes like the slots (at 1,024 x 32K the routing
        if mesh is not None:  # alone is ~0.8 GB per layer: replicated, it would not fit), stats replicated
            rows = self._input_shardings()[0]
            slot_out = (rows,) * 6 + (rep, self._cache_shardings(self._abstract_caches(1, 1)))
        # the last input is the rows' token offsets (partial rollouts); speculative decoding takes none
        slots_fn = ((lambda *a: _spec.spec_slots_program(*a[:-1])) if self.speculative == "mtp"
                    else _slots.slots_program)
        self._slots_jit = jax.jit(lambda *a: slots_fn(self, *a), static_argnums=(0,), donate_argnums=(2,),
                                  out_shardings=slot_out)
        self.last_cache_bytes: tuple[int, int] = (0, 0)  # (global, largest per device) bytes of the last caches
        self.weight_version = -1
        self._w = None
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model))):
            self.update_weights(nnx.state(model), version=0)  # an abstract model: set_weights comes later

    # ------------------------------------------------------------------ weights
    def _shardings_for(self, abs_state):
        if self.mesh is None:
            return None
        sh = param_shardings(abs_state, self.mesh, self.rules)
        return {param_key(p): v.get_value() if isinstance(v, nnx.Variable) else v for p, v in nnx.to_flat_state(sh)}

    def _is_fp8(self, key: str, leaf) -> bool:
        """Quantised on the rollout side (FP8 blocks, or FP4 for the routed experts under `fp8+fp4experts`)."""
        return self.rformat.kind(key, leaf.ndim) is not None

    def _is_fp4(self, key: str) -> bool:
        return self.fp4_experts and bool(quant.ROUTED_EXPERT_RE.search(key))

    def _wstate_shardings(self):
        if self.mesh is None:
            return None
        rep = NamedSharding(self.mesh, PartitionSpec())
        out = {}
        for p, v in self._abs_flat:
            k = param_key(p)
            sh = self._raw_shardings[k]
            if self._is_fp8(k, v.get_value()) and self._is_fp4(k):  # scales [E, out, in/32]: split like q
                out[k] = quant.QuantizedTensor(q=sh, scale=sh, kind="fp4", fmt="e2m1", block=(1, quant.FP4_BLOCK),
                                               shape=v.get_value().shape)
            elif self._is_fp8(k, v.get_value()):
                block = self.fp8_block
                out[k] = quant.QuantizedTensor(q=sh, scale=rep, kind="fp8", fmt=self.fmt, block=block,
                                               shape=v.get_value().shape)
            else:
                out[k] = sh
        return out

    def _quantize_fn(self, raw: dict):
        """{key: array} (any float dtype) -> {key: QuantizedTensor | array in the rollout dtype}."""
        return {param_key(p): self.rformat.value(param_key(p), raw[param_key(p)], v.get_value().dtype)
                for p, v in self._abs_flat}

    def rollout_shardings(self) -> dict | None:
        """{path key: NamedSharding} of the dense rollout-side weights (what the push device_puts onto)."""
        return self._raw_shardings

    def quantize_weights(self, raw: dict) -> dict:
        """Jitted quantisation on the rollout mesh: {key: array on the rollout mesh} -> rollout weight state.

        The single function that builds rollout weights: version 0 (`Sampler(model)`), `update_weights` (a
        rebuilt sampler, a resumed run without a pusher) and every push (parallel/push/) all call it; FP8
        tensors go through `dsv4.quant.quantize_rollout_fp8` (bf16 rounding, e4m3fn blocks, exact fnuz
        conversion), so the result does not depend on how the weights arrived (fp32 master or bf16 wire copy).
        """
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx:
            return self._quantize_jit(raw)

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
        if isinstance(params, nnx.Module):
            params = nnx.state(params)
        if isinstance(params, dict) and all(isinstance(k, str) for k in params):
            flat = params
        else:
            flat = {param_key(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
                    for p, v in nnx.to_flat_state(params)}
        missing = [param_key(p) for p, _ in self._abs_flat if param_key(p) not in flat]
        if missing:
            raise ValueError(f"update_weights: {len(missing)} tensors missing, e.g. {missing[:5]}")
        return flat

    def update_weights(self, params, version: int) -> None:
        """Swap in new weights: actor params (nnx.State of Params + Buffers, any mesh) -> rollout dtype / FP8."""
        flat = self.flat_params(params)
        if self.mesh is not None:
            flat = {k: jax.device_put(flat[k], self._raw_shardings[k]) for k in flat}
        self.set_weights(self.quantize_weights(flat), version)

    def _model(self, wstate):
        vals = {k: layer_value(k, v, self.compute_dtype, fp8_gemm=self.fp8_gemm) for k, v in wstate.items()}
        flat = [(p, var.replace(vals[param_key(p)])) for p, var in self._abs_flat]
        return nnx.merge(self.graphdef, nnx.from_flat_state(flat))

    # ------------------------------------------------------------------ generation
    def _generate_fn(self, shape, wstate, caches, ids, lens, key_data, temperature, top_p, top_k, max_new, stop_ids,
                     token_offset):
        b, p, t_cap = shape
        keys = jax.random.wrap_key_data(key_data)
        cache_len = p + t_cap
        layerwise = self.dequant == "per_layer"
        # per_layer: the model outside the layers as stored, each layer built (dequantised) right before it runs
        model = self._layerwise.shell(wstate) if layerwise else self._model(wstate)
        layer_fn = self._layerwise.layer_fn(wstate) if layerwise else None
        with jax.named_scope("prefill"):  # names the ops in profiles and compiled HLO (benchmarks/sampler.py)
            logits, prompt_routing, caches = prefill_chunked(model, ids, lens, cache_len, self.prefill_chunk,
                                                             dispatch_fn=self.dispatch_fn, layer_fn=layer_fn,
                                                             kv_fp8=self.kv_fp8)

        def is_stop(tok):
            return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

        def keys_at(i):  # token g = token_offset + i of each row (a continued partial rollout keeps counting)
            return jax.vmap(lambda kk, o: jax.random.fold_in(kk, o + i))(keys, token_offset)

        tok0, lp0 = sample_tokens(logits, keys_at(0), temperature, top_p, top_k)
        n_l, k = self.config.num_hidden_layers, self.config.num_experts_per_tok
        out_tok = jnp.zeros((b, t_cap + 1), jnp.int32).at[:, 0].set(tok0)
        out_lp = jnp.zeros((b, t_cap + 1), jnp.float32).at[:, 0].set(lp0)
        resp_routing = jnp.full((b, t_cap + 1, n_l, k), -1, jnp.int32)
        stop0 = is_stop(tok0)
        done = stop0 | (max_new <= 1)
        length = jnp.ones((b,), jnp.int32)
        carry = (jnp.int32(1), tok0, done, length, out_tok, out_lp, resp_routing, caches, stop0)
        per_step = self.dequant == "per_step"

        def cond(c):
            i, _, _, length = c[:4]
            return jnp.any((i <= max_new) & (i - 1 < length))  # max_new: per row

        def body(c):
            i, cur, done, length, out_tok, out_lp, resp_routing, caches, stopped = c
            m = self._model(jax.lax.optimization_barrier(wstate)) if per_step else model
            pos = lens + i - 1
            with jax.named_scope("decode_step"):
                logits, r, caches = decode_step(m, cur, pos, caches, dispatch_fn=self.dispatch_fn, layer_fn=layer_fn)
            fed_real = (i - 1) < length
            resp_routing = resp_routing.at[:, i - 1].set(jnp.where(fed_real[:, None, None], r, -1))
            active = (~done) & (i < max_new)
            tok, lp = sample_tokens(logits, keys_at(i), temperature, top_p, top_k)
            tok = jnp.where(active, tok, 0)
            out_tok = out_tok.at[:, i].set(tok)
            out_lp = out_lp.at[:, i].set(jnp.where(active, lp, 0.0))
            length = length + active.astype(jnp.int32)
            stop = active & is_stop(tok)
            done = done | stop | (active & (i + 1 >= max_new))
            return (i + 1, tok, done, length, out_tok, out_lp, resp_routing, caches, stopped | stop)

        if per_step:
            del model
        out = jax.lax.while_loop(cond, body, carry)
        _, _, _, length, out_tok, out_lp, resp_routing, caches, stopped = out
        return (out_tok[:, :t_cap], out_lp[:, :t_cap], prompt_routing, resp_routing[:, :t_cap], length, stopped,
                caches)

    def _cache_pad(self) -> int:
        """Cache positions beyond prompt + response a speculative verify reaches (0 without speculation)."""
        return _spec.cache_pad(self.config, self.draft_tokens) if self.speculative == "mtp" else 0

    def _abstract_caches(self, b, cache_len):
        """ShapeDtypeStructs of the decode caches for (batch, cache_len) (list over layers of dicts)."""
        key = (b, cache_len)
        if key not in self._cache_shapes:
            model_abs = nnx.merge(self.graphdef, nnx.from_flat_state(self._abs_flat))
            self._cache_shapes[key] = jax.eval_shape(
                lambda: [cache_shapes(l.attn, b, cache_len, self.compute_dtype, self.kv_fp8) for l in model_abs.layers])
        return self._cache_shapes[key]

    def _cache_shardings(self, caches):
        """Placement of the caches from the rule table (`sharding.rules.cache_shardings`: batch over the
        `ACT_BATCH` mesh axes, never replicated over them); None without a mesh."""
        if self.mesh is None:
            return None
        return cache_shardings(caches, self.mesh, self.rules)

    def _empty_caches(self, b, cache_len):
        """Zeroed decode caches for (batch or slots, cache_len), placed like every call's (batch-sharded on the
        rollout mesh, so the jit's input signature never changes); donated to the generate jit."""
        shapes = self._abstract_caches(b, cache_len)
        sh = self._cache_shardings(shapes)
        if sh is None:
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        return jax.tree.map(lambda x, d: jnp.zeros(x.shape, x.dtype, device=d), shapes, sh)

    def batch_shards(self) -> int:
        """Shards of the rollout batch (and of its caches / slots) on the mesh: data x expert under the rollout
        rules (`sharding.rules.batch_shards`), 1 without a mesh."""
        if self.mesh is None:
            return 1
        return batch_shards(self.rules, self.mesh)

    def slot_count(self, slots: int | None = None) -> int:
        """Decode slots the continuous-batching program runs for `slots` (default `self.slots`): rounded up to a
        multiple of `batch_shards()`, so every device holds the same number of slot caches."""
        s, k = self.slots if slots is None else int(slots), self.batch_shards()
        return -(-s // k) * k

    def _slot_inputs(self, b: int, t_cap: int):
        """(slots, prompt width, cache_len) of the continuous-batching program for a `b`-request bucket."""
        return self.slot_count(), self.max_prompt_len, _slots.cache_len_for(self.config, self.max_prompt_len,
                                                                            t_cap + self._cache_pad())

    def _buckets(self, n: int, prompt_len: int, max_new_tokens: int) -> tuple[int, int, int]:
        """(batch, prompt, response) buckets of a call: powers of two (prompts from 16, capped by max_prompt_len's
        bucket; responses from 16); the batch also a multiple of the rollout mesh's batch shards."""
        p_bucket = min(_next_pow2(prompt_len, 16), _next_pow2(self.max_prompt_len, 16))
        b = _next_pow2(n)
        if self.mesh is not None:
            k = batch_shards(self.rules, self.mesh)
            b = -(-b // k) * k
        return b, p_bucket, _next_pow2(max_new_tokens, 16)

    def _input_shardings(self):
        """Shardings of (ids, lens, key_data, temperature, top_p, top_k, max_new [B], stop, token_offset [B]):
        per-row inputs split like the batch (`ACT_BATCH`), scalars and stop ids replicated; None without a mesh."""
        if self.mesh is None:
            return None
        rep = NamedSharding(self.mesh, PartitionSpec())
        rows = NamedSharding(self.mesh, activation_spec(ax.ACT_BATCH, rules=self.rules, mesh=self.mesh))
        return (rows, rows, rows, rep, rep, rep, rows, rep, rows)

    def _abstract_wstate(self):
        """ShapeDtypeStructs (with shardings) of the weight state: the live one's, or the quantised layout of
        an abstract model's (no weights needed)."""
        if self._w is not None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self._w)
        raw = {param_key(p): jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype) for p, v in self._abs_flat}
        w_abs = jax.eval_shape(self._quantize_fn, raw)
        sh = self._wstate_shardings()
        if sh is None:
            return w_abs
        return jax.tree.map(lambda a, d: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=d), w_abs, sh)

    def lower(self, batch_size: int, prompt_len: int, max_new_tokens: int) -> jax.stages.Lowered:
        """The generate program for `batch_size` prompts of up to `prompt_len` tokens and `max_new_tokens` new
        tokens, lowered with abstract inputs (no weights or caches are allocated; works on a sampler built from
        an abstract model). Shapes are bucketed as `generate` buckets them, so `.compile().memory_analysis()`
        gives XLA's per-device figures of exactly the program a `generate` call of that size runs: arguments =
        weight state + caches + inputs, temporaries = activations and dequantised weights. With `slots` >= 1 it
        is the continuous-batching program (rl/rollout/slots.py: `slot_count()` slot caches of `max_prompt_len` +
        `max_new_tokens`, split over the batch shards; per-request chunked prefill), else the static one.

        Raises ValueError when prompt_len > max_prompt_len or any size is < 1.
        """
        if min(batch_size, prompt_len, max_new_tokens) < 1:
            raise ValueError(f"Sampler.lower: sizes must be >= 1, got batch_size={batch_size} "
                             f"prompt_len={prompt_len} max_new_tokens={max_new_tokens}")
        if prompt_len > self.max_prompt_len:
            raise ValueError(f"Sampler.lower: prompt_len {prompt_len} > max_prompt_len {self.max_prompt_len}")
        b, p, t_cap = self._buckets(batch_size, prompt_len, max_new_tokens)
        sds = jax.ShapeDtypeStruct
        if self.slots:
            return self._lower_slots(b, max_new_tokens)
        caches = self._abstract_caches(b, p + t_cap + self._cache_pad())
        c_sh = self._cache_shardings(caches)
        if c_sh is not None:
            caches = jax.tree.map(lambda x, d: sds(x.shape, x.dtype, sharding=d), caches, c_sh)
        key_shape = jax.random.key_data(jax.random.key(0)).shape
        inputs = (sds((b, p), jnp.int32), sds((b,), jnp.int32), sds((b, *key_shape), jnp.uint32),
                  sds((), jnp.float32), sds((), jnp.float32), sds((), jnp.int32), sds((b,), jnp.int32),
                  sds((MAX_STOP_IDS,), jnp.int32), sds((b,), jnp.int32))
        in_sh = self._input_shardings()
        if in_sh is not None:
            inputs = tuple(sds(x.shape, x.dtype, sharding=d) for x, d in zip(inputs, in_sh))
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx, _rules_ctx(self.rules, self.mesh):
            return self._generate_jit.lower((b, p, t_cap), self._abstract_wstate(), caches, *inputs)

    def _lower_slots(self, b: int, t_cap: int) -> jax.stages.Lowered:
        """`lower` of the continuous-batching program for a `b`-request bucket (inputs as `generate` passes them)."""
        sds = jax.ShapeDtypeStruct
        s_n, p_max, cache_len = self._slot_inputs(b, t_cap)
        caches = self._abstract_caches(s_n, cache_len)
        c_sh = self._cache_shardings(caches)
        if c_sh is not None:
            caches = jax.tree.map(lambda x, d: sds(x.shape, x.dtype, sharding=d), caches, c_sh)
        key_shape = jax.random.key_data(jax.random.key(0)).shape
        inputs = (sds((b, p_max), jnp.int32), sds((b,), jnp.int32), sds((b, *key_shape), jnp.uint32),
                  sds((), jnp.int32), sds((), jnp.float32), sds((), jnp.float32), sds((), jnp.int32),
                  sds((b,), jnp.int32), sds((MAX_STOP_IDS,), jnp.int32), sds((b,), jnp.int32))
        if self.mesh is not None:
            rep = NamedSharding(self.mesh, PartitionSpec())
            inputs = tuple(sds(x.shape, x.dtype, sharding=rep) for x in inputs)
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx, _rules_ctx(self.rules, self.mesh):
            return self._slots_jit.lower((b, p_max, t_cap, s_n), self._abstract_wstate(), caches, *inputs)

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
            from prompt + its first g tokens (rl/partial.py) draws with the keys of an uninterrupted sample;
            default 0. Not with speculative decoding.
        Returns:
          RolloutBatch (see its docstring).
        Raises:
          ValueError: empty prompt, prompt longer than `max_prompt_len`, token id out of range (names the row).
        """
        n = len(prompts)
        if n == 0:
            raise ValueError("generate: no prompts")
        lens_np = np.array([len(p) for p in prompts], np.int32)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty (at least one token is needed)")
            if len(p) > self.max_prompt_len and self.slots:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens; the rollout KV cache holds prompts of "
                                 f"at most {self.max_prompt_len} (+ max_new_tokens) tokens (--max-prompt-len)")
            if len(p) > self.max_prompt_len:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens; the largest prompt bucket is "
                                 f"{self.max_prompt_len} (Sampler(max_prompt_len=...))")
            if min(p) < 0 or max(p) >= self.config.vocab_size:
                raise ValueError(f"generate: prompt {i} has token ids outside [0, {self.config.vocab_size})")
        b, p_bucket, t_cap = self._buckets(n, int(lens_np.max()), params.max_new_tokens)
        if self.slots:
            t_cap = params.max_new_tokens
        ids = np.zeros((b, p_bucket), np.int32)
        lens = np.ones((b,), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        lens[:n] = lens_np
        mx = np.full((b,), params.max_new_tokens, np.int32)
        if max_new_tokens_per_row is not None:
            mx[:n] = np.asarray(max_new_tokens_per_row, np.int64)
            if len(max_new_tokens_per_row) != n or mx.min() < 1 or mx.max() > params.max_new_tokens:
                raise ValueError(f"generate: max_new_tokens_per_row must be {n} ints in [1, "
                                 f"{params.max_new_tokens}] (SamplingParams.max_new_tokens)")
        off = np.zeros((b,), np.int32)
        if token_offset is not None:
            off[:n] = np.asarray(token_offset, np.int64)
            if len(token_offset) != n or off.min() < 0:
                raise ValueError(f"generate: token_offset must be {n} ints >= 0")
            if off.any() and self.speculative == "mtp":
                raise ValueError("generate: token_offset (partial rollouts) is not supported with speculative "
                                 "decoding")
        pi = np.arange(n) if prompt_index is None else np.asarray(prompt_index)
        si = np.zeros(n, np.int64) if sample_index is None else np.asarray(sample_index)
        keys = row_keys(seed, step, pi, si)
        keys = jax.device_get(jnp.concatenate([keys, jnp.repeat(keys[:1], b - n)]))
        stop = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop[: len(params.stop_token_ids)] = params.stop_token_ids
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        rep = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        if self.slots:
            # one prefill width per sampler (a row's result does not depend on the call's longest prompt); slots
            # rounded up to a multiple of the batch shards, each device holding slots / shards of them
            s_n, p_max, cache_len = self._slot_inputs(b, t_cap)
            _slots.plan_slots(s_n, per_slot_bytes=_slots.cache_bytes_per_slot(self, cache_len),
                              budget_bytes=self.kv_budget_bytes, seq_len=cache_len, shards=self.batch_shards())
            caches = self._empty_caches(s_n, cache_len)
            ids = np.pad(ids, ((0, 0), (0, max(0, p_max - p_bucket))))[:, :p_max]
            inputs = jax.device_put((ids, lens, jax.random.key_data(keys), np.int32(n), np.float32(params.temperature),
                                     np.float32(params.top_p), np.int32(params.top_k), mx, stop, off), rep)
            with ctx, _rules_ctx(self.rules, self.mesh):
                out = self._slots_jit((b, p_max, t_cap, s_n), self._w, caches, *inputs)
            tok, lp, prompt_routing, resp_routing, length, stopped, stats, caches = out
            stats = jax.device_get(stats)
            self.last_stats = _slots.slot_stats(stats[:3], s_n)
            if len(stats) > 3:  # speculative (rl/rollout/speculative.py)
                self.last_stats.update(_spec.spec_stats(stats[3:], self.draft_tokens))
        else:
            caches = self._empty_caches(b, p_bucket + t_cap + self._cache_pad())
            inputs = (ids, lens, jax.random.key_data(keys), np.float32(params.temperature), np.float32(params.top_p),
                      np.int32(params.top_k), mx, stop, off)
            # identical host values on every process -> one global array each (rows split like the batch)
            inputs = jax.device_put(inputs, self._input_shardings())
            with ctx, _rules_ctx(self.rules, self.mesh):
                out = self._generate_jit((b, p_bucket, t_cap), self._w, caches, *inputs)
            self.last_stats = _spec.spec_stats(jax.device_get(out[6]), self.draft_tokens) if len(out) == 8 else {}
            tok, lp, prompt_routing, resp_routing, length, stopped, caches = out[:6] + out[-1:]
        self.last_cache_bytes = _cache_bytes(caches)
        del caches
        tok, lp, pr, rr, length, stopped = _to_host((tok, lp, prompt_routing, resp_routing, length, stopped))
        if pr.shape[1] != p_bucket:  # slots: right-padded rows of max_prompt_len -> the static width p_bucket (exact)
            pr = np.pad(pr, ((0, 0), (0, max(0, p_bucket - pr.shape[1])), (0, 0), (0, 0)),
                        constant_values=-1)[:, :p_bucket]
        t = params.max_new_tokens
        tok, lp, rr, length, stopped = tok[:n, :t], lp[:n, :t], rr[:n, :t], length[:n], stopped[:n]
        # prompt routing: right-padded rows -> left-padded layout
        shift = p_bucket - lens_np
        idx = (np.arange(p_bucket)[None] - shift[:, None]) % p_bucket
        pr = np.take_along_axis(pr[:n], idx[:, :, None, None], axis=1)
        pr = np.where((np.arange(p_bucket)[None] >= shift[:, None])[:, :, None, None], pr, -1)
        prompt_tokens = np.zeros((n, p_bucket), np.int32)
        for i, p in enumerate(prompts):
            prompt_tokens[i, p_bucket - len(p):] = p
        return RolloutBatch(tokens=tok.astype(np.int32), logprobs=lp.astype(np.float32),
                            routing=np.concatenate([pr, rr], axis=1).astype(np.int32), lengths=length.astype(np.int32),
                            finish_reasons=["stop" if s else "length" for s in stopped], prompt_tokens=prompt_tokens,
                            prompt_lengths=lens_np, weight_version=self.weight_version)

    def compile_count(self) -> int:
        """Number of compiled variants of the generate function (for recompilation tests)."""
        return self._generate_jit._cache_size() + self._slots_jit._cache_size()


def _to_host(tree):
    """numpy copies of (possibly batch-sharded) arrays; arrays spread over other processes' devices are
    all-gathered first (multi-host rollout meshes)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


def _cache_bytes(caches) -> tuple[int, int]:
    """(global bytes, largest per-device bytes) of cache arrays, from their addressable shards."""
    per_dev: dict = {}
    for x in jax.tree.leaves(caches):
        for sh in x.addressable_shards:
            per_dev[sh.device] = per_dev.get(sh.device, 0) + sh.data.nbytes
    return sum(x.nbytes for x in jax.tree.leaves(caches)), max(per_dev.values(), default=0)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _rules_ctx(rules, mesh):
    if rules is None or mesh is None:
        return _null()
    return use_rules(rules, mesh)
