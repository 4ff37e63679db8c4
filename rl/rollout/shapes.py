"""The shapes of the rollout engine's programs, its decode caches and their placement: what the engine runs and
what the planner (`launch.aot.compile_rollout`) reports, public so that neither re-derives the other's arithmetic.

    shape = sampler.program_shape(n, prompt_len, max_new_tokens)   # ProgramShape: the buckets of one call
    caches = sampler.cache_shapes(shape.cache_rows, shape.cache_len, placed=True)   # ShapeDtypeStructs + shardings
    sampler.cache_shardings(caches), sampler.input_shardings(shape), sampler.input_shapes(shape)

Buckets (static batching): prompt lengths, the batch size and max_new_tokens are powers of two (prompts from 16,
capped by max_prompt_len's bucket; responses from 16), the batch also a multiple of the rollout mesh's batch shards,
so steady state never recompiles. Continuous batching: `slot_count()` slot caches of `max_prompt_len` +
`max_new_tokens` positions rounded to the compression ratios (`rl.rollout.slots.cache_len_for`). Placement: the
batch, its inputs and the KV caches are split over the rule table's `ACT_BATCH` mesh axes (rollout: data x fsdp x
expert, "EP as DP"; `sharding.rules.cache_shardings`), never replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from dsv4.cache import cache_shapes
from parallel.model_bytes import kv_cache_bytes
from rl.rollout import slots as slots_lib
from rl.rollout import speculative as spec_lib
from sharding import axes as ax
from sharding.rules import activation_spec, batch_shards, cache_shardings

MAX_STOP_IDS = 16


def next_pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """The static shape of one generate program: batch (request rows, bucketed), prompt (the program's prompt width:
    the bucket, or max_prompt_len with slots), new (response positions: the bucket, or max_new_tokens with slots),
    slots (0 = the static program), cache_len (positions of one cache row), prompt_bucket (the RolloutBatch's
    prompt width)."""

    batch: int
    prompt: int
    new: int
    slots: int
    cache_len: int
    prompt_bucket: int

    @property
    def cache_rows(self) -> int:
        """Rows of the decode caches: the slots, or the batch."""
        return self.slots or self.batch

    @property
    def static_args(self) -> tuple:
        """The jit's static shape argument: (B, P, T) static, (B, P, T, S) continuous."""
        return (self.batch, self.prompt, self.new, self.slots) if self.slots else (self.batch, self.prompt, self.new)


class EngineShapes:
    """Shapes, caches and input placement of `rl.rollout.engine.Sampler` (its base; reads `config`, `mesh`,
    `rules`, `compute_dtype`, `kv_fp8`, `max_prompt_len`, `slots`, `speculative`, `draft_tokens`, `weights`)."""

    def _init_caches(self):
        self._cache_shapes: dict = {}

    def mesh_ctx(self):
        """`jax.set_mesh(self.mesh)`, or nothing without a mesh."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def batch_shards(self) -> int:
        """Shards of the rollout batch (and of its caches / slots) on the mesh: data x expert under the rollout
        rules (`sharding.rules.batch_shards`), 1 without a mesh."""
        return 1 if self.mesh is None else batch_shards(self.rules, self.mesh)

    def slot_count(self, slots: int | None = None) -> int:
        """Decode slots the continuous-batching program runs for `slots` (default `self.slots`): rounded up to a
        multiple of `batch_shards()`, so every device holds the same number of slot caches."""
        s, k = self.slots if slots is None else int(slots), self.batch_shards()
        return -(-s // k) * k

    def cache_pad(self) -> int:
        """Cache positions beyond prompt + response a speculative verify reaches (0 without speculation)."""
        return spec_lib.cache_pad(self.config, self.draft_tokens) if self.speculative == "mtp" else 0

    def program_shape(self, n: int, prompt_len: int, max_new_tokens: int) -> ProgramShape:
        """The program a call of `n` prompts of up to `prompt_len` tokens and `max_new_tokens` new tokens runs."""
        p_bucket = min(next_pow2(prompt_len, 16), next_pow2(self.max_prompt_len, 16))
        b = next_pow2(n)
        if self.mesh is not None:
            k = batch_shards(self.rules, self.mesh)
            b = -(-b // k) * k
        if self.slots:
            cache_len = slots_lib.cache_len_for(self.config, self.max_prompt_len, max_new_tokens + self.cache_pad())
            return ProgramShape(b, self.max_prompt_len, max_new_tokens, self.slot_count(), cache_len, p_bucket)
        t_cap = next_pow2(max_new_tokens, 16)
        return ProgramShape(b, p_bucket, t_cap, 0, p_bucket + t_cap + self.cache_pad(), p_bucket)

    def cache_shapes(self, rows: int, cache_len: int, placed: bool = False):
        """ShapeDtypeStructs of the decode caches for (rows, cache_len) (list over layers of dicts); `placed`:
        with their shardings (`cache_shardings`)."""
        key = (rows, cache_len)
        if key not in self._cache_shapes:
            model_abs = self.weights.abstract_model()
            self._cache_shapes[key] = jax.eval_shape(
                lambda: [cache_shapes(l.attn, rows, cache_len, self.compute_dtype, self.kv_fp8)
                         for l in model_abs.layers])
        caches = self._cache_shapes[key]
        sh = self.cache_shardings(caches) if placed else None
        if sh is None:
            return caches
        return jax.tree.map(lambda x, d: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=d), caches, sh)

    def cache_shardings(self, caches):
        """Placement of the caches from the rule table (`sharding.rules.cache_shardings`: batch over the
        `ACT_BATCH` mesh axes, never replicated over them); None without a mesh."""
        return None if self.mesh is None else cache_shardings(caches, self.mesh, self.rules)

    def empty_caches(self, rows: int, cache_len: int):
        """Zeroed decode caches for (batch or slots, cache_len), placed like every call's (batch-sharded on the
        rollout mesh, so the jit's input signature never changes); donated to the generate jit."""
        shapes = self.cache_shapes(rows, cache_len)
        sh = self.cache_shardings(shapes)
        if sh is None:
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        return jax.tree.map(lambda x, d: jnp.zeros(x.shape, x.dtype, device=d), shapes, sh)

    def cache_bytes(self, cache_len: int) -> int:
        """Bytes of one row's decode cache at `cache_len` positions in this engine's layout
        (`parallel.model_bytes.kv_cache_bytes`)."""
        return kv_cache_bytes(self.config, cache_len, self.compute_dtype, self.kv_fp8)

    def input_shardings(self, shape: ProgramShape | None = None):
        """Shardings of the program's inputs: static (ids, lens, key_data, temperature, top_p, top_k, max_new [B],
        stop, token_offset [B]): per-row inputs split like the batch (`ACT_BATCH`), scalars and stop ids
        replicated; continuous batching (one more scalar, n_real, after the keys): every input replicated. None
        without a mesh."""
        if self.mesh is None:
            return None
        rep = NamedSharding(self.mesh, PartitionSpec())
        if shape is not None and shape.slots:
            return (rep,) * 10
        rows = NamedSharding(self.mesh, activation_spec(ax.ACT_BATCH, rules=self.rules, mesh=self.mesh))
        return (rows, rows, rows, rep, rep, rep, rows, rep, rows)

    def input_shapes(self, shape: ProgramShape) -> tuple:
        """ShapeDtypeStructs (with shardings) of the program's inputs, as `generate` passes them."""
        sds, b = jax.ShapeDtypeStruct, shape.batch
        key_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape  # traced: nothing runs
        scalars = (sds((), jnp.float32), sds((), jnp.float32), sds((), jnp.int32))
        head = (sds((b, shape.prompt), jnp.int32), sds((b,), jnp.int32), sds((b, *key_shape), jnp.uint32))
        if shape.slots:
            head = head + (sds((), jnp.int32),)
        inputs = head + scalars + (sds((b,), jnp.int32), sds((MAX_STOP_IDS,), jnp.int32), sds((b,), jnp.int32))
        sh = self.input_shardings(shape)
        if sh is None:
            return inputs
        return tuple(sds(x.shape, x.dtype, sharding=d) for x, d in zip(inputs, sh))

    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Prompt lengths [N] int32; ValueError naming the row for an empty prompt, one longer than
        `max_prompt_len`, or a token id outside the vocabulary."""
        if len(prompts) == 0:
            raise ValueError("generate: no prompts")
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
        return np.array([len(p) for p in prompts], np.int32)

    def host_inputs(self, shape: ProgramShape, prompts, params, max_new_tokens_per_row, token_offset) -> tuple:
        """(ids [B, P] right-padded, lens [B], max_new [B], stop ids [16], token_offset [B]) host arrays; padding
        rows are length-1 prompts of token 0. ValueError for bad per-row limits or offsets."""
        n, b = len(prompts), shape.batch
        ids = np.zeros((b, shape.prompt), np.int32)
        lens = np.ones((b,), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
            lens[i] = len(p)
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
        stop = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop[: len(params.stop_token_ids)] = params.stop_token_ids
        return ids, lens, mx, stop, off


def to_host(tree):
    """numpy copies of (possibly batch-sharded) arrays; arrays spread over other processes' devices are
    all-gathered first (multi-host rollout meshes)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)
