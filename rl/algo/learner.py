"""The learner: one jitted GRPO/PPO update step on the actor mesh (fp32 master weights, AdamW, micro-batches,
inputs at their real size, optional host offload of the optimizer state). This module holds the state, the jits and
the host side of a batch; the traced math (forward, loss, gradients, update) is `rl.algo.learner_step.LearnerStep`.

Data: a `TrainBatch` holds N rows of S = P + T columns laid out by the rollout as `[prompt | response | pad]`
(rl/algo/batch.py: left-aligned). The per-token arrays are aligned at each token's own position
(`rl.algo.logprobs`), so `response_mask` selects the same tokens in the learner's logprobs, the rollout's logprobs
and the loss.
The loss's token axis is therefore S = P + T: Dr.GRPO (`seq-mean-token-sum-norm`) should set
`LossConfig.norm_length` (e.g. the sampler's max_new_tokens), or it divides by S.

State: `TrainState(step, params, opt_state, buffers, ref_params)`. `params` are the trainable `nnx.Param`s in
`LearnerConfig.param_dtype` ("auto" by default: float32 on CPU, bfloat16 on accelerators; float32: they are their
own masters and `opt_state` is the optax state; bfloat16: bf16 params, and `opt_state` is `rl.algo.optim.MasterState`
holding fp32 masters of the trained bf16 params plus the optax state; leaves the model keeps in fp32 stay fp32),
`opt_state` float32 Adam moments, `buffers` the `dsv4.layers.Buffer`s (hash tables `tid2eid`, router selection
`bias`: model tensors that no optimizer touches), `ref_params` the frozen reference policy, a copy of the initial
params with matrices in `ref_dtype` (bf16 by default) and vectors in float32 (only when `loss.kl_coef > 0`, else
None: no copy is kept). `step` counts *applied* updates and drives the LR schedule (it equals optax's count).

Choices (and why):
- Precision (mixed precision as Micikevicius et al., arXiv 1710.03740, minus loss scaling, which bf16 does
  not need): the model is rebuilt for the learner with `param_dtype=float32, dtype=compute_dtype`
  (`nnx.eval_shape`, so only the graph is built; the values are the given model's, cast to float32). Matmuls
  cast the fp32 masters to bf16 at use, gradients arrive in fp32, Adam runs in fp32. A bf16-only optimizer
  silently drops updates below bf16 resolution (docs/jax-stack.md §10); the fp32 masters keep them.
- Input size (rl/algo/batching.py): before the jit, columns are cut to the bucketed longest real row (`trim`, exact);
  the rollout's rows start at column 0 and the forward runs the model's left-aligned path (no per-row roll); rows
  an outside caller left-pads are rolled to column 0 on the host first (`batching.trim`'s shift, `trim` off too)
  and a compute_logprobs result is put back at the caller's columns. With `max_tokens_per_micro_batch` B the
  micro-batches hold floor(B / W) rows per device at width W (floor(B C / W) under context parallelism over C
  devices: the budget counts tokens per context shard; padding rows neutral); a longest row above B is a
  ValueError naming --max-tokens-per-micro-batch.
- Optimizer offload: `offload_optimizer` F puts the optimizer state (masters + moments) of the params
  `sharding.offload.select_offloaded` picks into `pinned_host` memory; the step moves it to the device, updates
  it and writes it back (out_shardings carry the memory kind; rules: rl/algo/learner_state.py; parallel/plan.py
  counts the same bytes).
- Micro-batches: `lax.scan` over M = N / micro_batch_size micro-batches inside the one jitted step. Micro-batch m
  takes rows m, m + M, m + 2M, ... (strided: with the batch sharded in blocks over the data axes every device holds
  an equal share of each). Every micro-batch loss is divided by the *full batch's* token/sequence counts
  (`rl.algo.losses.loss_normalizers`) and summed: loss, gradient and metrics equal the full batch's (fp rounding).
- FP8-aware forward (`fp8_forward`, `--learner.fp8_forward`): every forward (policy, `compute_logprobs`, the
  reference) runs on `dsv4.rollout_format.fp8_aware_params(params)`: the weights the FP8 rollout holds, built from
  the masters by the rollout's own rule (`RolloutFormat`, shared with `Sampler.quantize_weights`) and dequantised
  as its layers do, and the rollout's activation quantisation at the same linears, all straight-through to the
  masters; one quantised copy per micro-batch forward, up front (benchmarks/README.md "Train/rollout mismatch").
- On-policy old logprobs: with `TrainBatch.old_logprobs=None`, pi_old = stop_gradient(pi_theta) from the same
  forward (PPO ratio 1 at one update per batch); for several updates, put `compute_logprobs`' result in the batch.
- Routing replay (R3, Ma et al., arXiv 2510.11370): with `routing_replay=True` the batch's recorded experts
  are forced in every MoE layer of the learner's forward (and of the reference's). Missing, mis-shaped or
  invalid routing (`rl.algo.replay.validate_routing`: dtype, range, distinct experts, hash layers = tid2eid) raises
  ValueError in `train_step` before anything runs; there is no silent fallback. With replay on, the step's
  metrics add `train/replay_unknown_frac` and `train/replay_layers`.
- Freezing: `optax.multi_transform` gives frozen params `optax.set_to_zero()` (no Adam state; values carried over):
  the router with `freeze_router`, the MTP module unless `train_mtp`. Buffers are outside the optimizer; weight
  decay applies to matrices.
- LoRA (`lora.rank > 0`, `--learner.lora.*`, dsv4/lora.py): the model must carry the adapters
  (`DSV4ForCausalLM(..., lora=cfg.lora)` or `dsv4.lora.attach`); they alone are TRAIN, every base weight (the
  router, the MTP module, norms, embeddings included) is FROZEN, and the gradient is taken with respect to the
  adapters only (`LearnerStep.loss_and_grads`: the base enters the loss under stop_gradient, no base gradient is
  formed or accumulated). The adapters are float32 `nnx.LoRAParam`s whatever `param_dtype` (no masters); the
  frozen base stays in `param_dtype` (bf16 on accelerators). Not built: a base held in the release's FP8 / FP4
  blocks on the learner (the FP8-aware forward, `fp8_forward`, does run the rollout's FP8 products on the base
  and the adapters' low-rank path beside them; checked by hand, 2 steps: only the adapters move). With
  `kl_coef > 0` the reference is the base itself (every adapter zero inside the step; no copy is kept).
  `state_dict()` holds the adapters alone (the base is the run's --init); `params_for_push()` the whole model,
  `adapters_for_push()` the adapters alone.
- Non-finite guard (own, not `optax.apply_if_finite`): a non-finite loss or gradient norm discards the new
  step/params/opt_state (`jnp.where`): the state stays bitwise the old one and `train/skipped_nonfinite` is 1.
- Donation: `train_step` donates the old state: never reuse it, nor arrays taken from it (`params_for_push()`
  returns live arrays: push them before the next step).
- Scanned layers (`scan_layers`, the default): the state (params, buffers, fp32 masters, Adam moments, reference)
  holds the decoder layers stacked per group of identical layers (`dsv4.scan.stack_params`, built inside the init
  jit, so there is no per-step re-stacking), and the forward runs `dsv4.scan.merge_stacked`'s shell with
  `layer_stack=` (one `lax.scan` per group, `remat` per sub-layer): compile time flat in depth. Labels (frozen /
  trained), the weight-decay mask and the reference's matrix dtype are decided per layer, then stacked; the
  expert dispatch and routing validation read the per-layer shardings / hash tables; `params_for_push()` unstacks
  (official per-layer paths). Optimizer offload then selects whole stacked leaves (all layers of a group's
  tensor at once), coarser than the planner's per-parameter count. `state_dict` is stacked (loads only into a
  learner with the same setting: the checkpoint fingerprint records it).
- Pipeline parallelism (`pipeline_stages` P > 1, `--learner.pipeline_stages`; `parallel/pipeline.py`): the largest
  scanned layer group is split into P contiguous stages over the mesh's `stage` axis (its stacked leaves, and their
  masters, moments and reference copies, split over `stage`: `parallel.pipeline.stage_shardings`; the stacked
  state and its checkpoints are otherwise unchanged). `train_step` and `compute_logprobs` then run the step's M
  micro-batches (the rows of `rl.algo.batching.split`) through one pipelined forward (GPipe, parallel/pipeline.py)
  instead of the `lax.scan` over micro-batches, or `train_step` in passes of `pipeline_micro_batches` (a `lax.scan`
  over the passes, a shorter last pass for the rest, gradients accumulated); embedding, head and loss
  run on the whole pass, outside the pipeline. Equal to the unpipelined step (tests/rl/test_learner_pipeline.py).
  `next_logits` is not pipelined (it runs the stack as is on the stage-split weights).
- Mesh: with `mesh`, the state is placed by `sharding.rules.param_shardings` (actor rules by default), the
  batch is split along N over the rules' `act_batch` mesh axes (a `context` axis splits every row's activations
  along S inside the model: context parallelism, `dsv4/context.py`; the batch enters replicated over it), and the
  jits run inside `jax.set_mesh(mesh)` and `sharding.rules.use_rules` with explicit in/out shardings
  (docs/jax-stack.md §2.2: a jit on a sub-mesh must run inside set_mesh).

Sources: PPO (Schulman et al. 2017, arXiv 1707.06347); GRPO (Shao et al. 2024, arXiv 2402.03300 §4); the optax
docs for `adamw`, `clip_by_global_norm`, `multi_transform`, `set_to_zero`, `tree.norm`.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_learner.py`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4 import scan
from dsv4.layers import Buffer
from dsv4.lora import is_adapter_key
from dsv4.model import ShapeKeys
from dsv4.names import tree_key
from parallel import expert as expert_lib
from parallel import pipeline
from rl.algo import batching, optim
from rl.config.algo import LearnerConfig
from rl.algo.batch import TrainBatch, check_train_batch
from rl.config.tree import default
from rl.algo.learner_state import (LogprobResult, TrainState, check_lora, fp8_forward_format, master_like_params,
                              offload_shardings, place, resolve_param_dtype, state_shardings, streamable)
from rl.algo.learner_step import FROZEN, TRAIN, LearnerStep, Metrics
from rl.algo.replay import check_replay_routing
from rl.config.rollout import RolloutConfig
from sharding import axes as ax
from sharding import offload as so
from sharding import rules as sr
from sharding.mesh import auto_axes

_HASH_TABLE = re.compile(r"layers/(\d+)/ffn/gate/tid2eid")


class Learner:
    """Holds the train state and the jitted update; see the module docstring for every choice.

    Args:
        model: a `dsv4.DSV4ForCausalLM` (any param dtype) or a `(graphdef, state)` pair from `nnx.split`. Its
            values are copied into the learner's own float32 state; the object itself is not used afterwards.
        cfg: LearnerConfig.
        mesh: the actor mesh (e.g. `sharding.mesh.build_mesh_plan(...).actor`) or None (default device).
        rules: rule table for `mesh` (default `sharding.rules.ACTOR_RULES`).
        dispatch_fn: routed-expert implementation passed to the model, e.g. the expert-parallel
            `parallel.expert.make_ep_dispatch(mesh)`; None = `parallel.expert.default_dispatch`: the tiled/dense CPU
            implementation `moe.routed_experts_cpu` on CPU with unsharded experts, else the model's single-program
            ragged_dot path (on a mesh XLA then partitions it on its own); experts split over a mesh's `expert`
            axis get the all-to-all `parallel.expert.make_ep_dispatch` (`parallel.expert.default_dispatch` decides,
            with `cfg.ep_backend` / `cfg.ep_capacity_factor`).
        rollout_dtype: the rollout's `--rollout-dtype` (default the run's), read only with `cfg.fp8_forward`: the
            weights the FP8-aware forward reproduces. rollout_devices: the rollout's devices, which decide "auto"
            (`dsv4.quant.select_fp8_format`; default the learner's). fp8_block: the rollout's FP8 scale block.
        exact_layout: (rows R, width W) of exact mode (`rl.rollout.exact`, `--exact-rollout`): every forward runs in
            micro-batches of R rows x W columns (`rl.algo.batching.fixed_layout`), so a row's logprobs do not depend
            on its batch; None (default): the layout of "Input size".
        abstract: build only the state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s; `model` may be
            an `nnx.eval_shape` model): for `lower` / AOT memory analysis of models larger than this machine
            (python -m launch.plan --compile). Such a learner cannot `update`.
    Attributes:
        state: the current TrainState (replaced by `update`). graphdef: the learner's model graph (compute
        dtype, per layer); `nnx.merge(graphdef, params_for_push())` is the current policy (without scan_layers
        also `nnx.merge(graphdef, state.params, state.buffers)`). sdef: the `dsv4.scan.StackDef` with
        scan_layers, else None.
    Raises:
        ValueError: a model holding variables other than Params and Buffers, params that do not fit the
            mesh (from `sharding.rules.param_shardings`), or `cfg.fp8_forward` with a dense `rollout_dtype`.
    """

    def __init__(self, model: Any, cfg: LearnerConfig, *, mesh: Mesh | None = None, rules: sr.Rules | None = None,
                 dispatch_fn: Any = None, abstract: bool = False, rollout_dtype: str = default(RolloutConfig, "dtype"),
                 rollout_devices=None, fp8_block: tuple[int, int] = (128, 128),
                 exact_layout: tuple[int, int] | None = None):
        mesh = auto_axes(mesh)  # a jax.make_mesh mesh (Explicit axes) works too: see sharding.mesh.auto_axes
        module = model if isinstance(model, nnx.Module) else nnx.merge(*model)
        cfg = resolve_param_dtype(cfg, [jax.devices()[0]] if mesh is None else list(mesh.devices.flat))
        self.cfg, self.dispatch_fn, self.exact_layout = cfg, dispatch_fn, exact_layout
        self.model_config = module.config
        compute = jnp.dtype(cfg.compute_dtype)
        devs = rollout_devices or ([jax.devices()[0]] if mesh is None else list(mesh.devices.flat))
        self.rformat = fp8_forward_format(cfg, rollout_dtype, devs, fp8_block, compute)  # None without fp8_forward
        check_lora(module, cfg)
        opts = module.build_options(remat=cfg.remat) if hasattr(module, "build_options") else {}
        abs_model = nnx.eval_shape(lambda: type(module)(module.config, rngs=ShapeKeys(),
                                                       param_dtype=jnp.dtype(cfg.param_dtype), dtype=compute, **opts))
        self.graphdef, abs_params, _ = nnx.split(abs_model, nnx.Param, Buffer)
        _, params, buffers, rest = nnx.split(module, nnx.Param, Buffer, ...)
        if jax.tree.leaves(rest):
            raise ValueError(f"the model holds variables that are neither nnx.Param nor Buffer: "
                             f"{[tree_key(p) for p, _ in jax.tree_util.tree_leaves_with_path(rest)]}")
        if jax.tree.structure(params) != jax.tree.structure(abs_params):
            raise ValueError("the model's parameters do not match the structure of its config's model")
        # scan_layers: the state holds `layers` stacked per group (dsv4/scan.py); labels and the matrix mask
        # (weight decay, reference dtype) are decided per layer, then stacked (a stacked leaf has one more dim)
        self.sdef = scan.stack_def(abs_model) if cfg.scan_layers else None
        self.pipeline = None  # --learner.pipeline_stages: the stages' group (micro-batches: per step's layout)
        pipeline.check_stage_axis(cfg.pipeline_stages, 1 if mesh is None else mesh.shape.get(sr.STAGE, 1))
        if cfg.pipeline_stages > 1:
            self.pipeline = pipeline.pipeline_plan(self.sdef.groups, cfg.pipeline_stages, 1)
        self._per_layer_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abs_params)
        labels = jax.tree_util.tree_map_with_path(self._label, params)
        matrix = jax.tree.map(lambda x: x.ndim >= 2, params)
        if self.sdef is not None:
            labels, matrix = (scan.stack_params(t, self.sdef.groups) for t in (labels, matrix))
            abs_params = scan.stack_params(abs_params, self.sdef.groups)
        self.labels = labels
        self._matrix = {tree_key(p): m for p, m in jax.tree_util.tree_leaves_with_path(matrix)}
        self.tx = optax.multi_transform({TRAIN: optim.train_tx(cfg, self._matrix), FROZEN: optax.set_to_zero()},
                                        self.labels)
        self.mesh, self.rules = mesh, (sr.ACTOR_RULES if rules is None else rules)
        trained = {tree_key(p): lab == TRAIN for p, lab in jax.tree_util.tree_leaves_with_path(self.labels)}
        is_matrix = lambda path, x: self._matrix[tree_key(path)]  # noqa: E731  (per-layer ndim >= 2)

        def init(params, buffers):
            if self.sdef is not None:  # traced: the stacked copy is the jit's (placed) output, no eager copy
                params, buffers = (scan.stack_params(t, self.sdef.groups) for t in (params, buffers))
            # each param in the learner's param dtype (the model keeps some leaves fp32 whatever it is)
            params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, abs_params)
            ref = None
            if cfg.loss.kl_coef > 0 and not cfg.lora.enabled:  # LoRA: the reference is the base (LearnerStep)
                ref_dtype = jnp.dtype(cfg.ref_dtype)
                ref = jax.tree_util.tree_map_with_path(
                    lambda p, x: x.astype(ref_dtype) if is_matrix(p, x) else x, params)
            return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=optim.init(self.tx, params, trained), buffers=buffers, ref_params=ref)

        self._state_shardings = self._batch_sharding = None
        if mesh is None:
            if abstract:
                raise ValueError("Learner(abstract=True) needs a mesh")
            self.state = jax.jit(init)(params, buffers)  # jit outputs are fresh buffers: the learner owns them
            self._state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
        else:
            abstract_state = jax.eval_shape(init, params, buffers)
            self._state_shardings = state_shardings(abstract_state, mesh, self.rules)
            if self.pipeline is not None:  # the pipelined group's layers split over `stage`
                self._state_shardings = pipeline.stage_shardings(self._state_shardings, self.pipeline, self.rules)
            batch_axes = sr.activation_spec(ax.ACT_BATCH, rules=self.rules, mesh=mesh)
            self._batch_sharding = NamedSharding(mesh, batch_axes)
            self._replicated = NamedSharding(mesh, PartitionSpec())
            self._state_shardings = master_like_params(self._state_shardings)
            if abstract:
                self.state = place(abstract_state, self._state_shardings, abstract=True)
            else:
                with self._context():
                    self.state = jax.jit(init, out_shardings=self._state_shardings)(params, buffers)
        dev = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
        self.offloaded, self._state_shardings = offload_shardings(cfg, self.state.params, self._state_shardings,
                                                                  trained, dev)
        if self.offloaded:  # their optimizer state to host memory
            self.state = place(self.state, self._state_shardings, abstract=abstract)
        self.streamed = streamable(self.state.params, self.offloaded) if cfg.stream_optimizer else {}
        if dispatch_fn is None:
            devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
            shardings = {tree_key(p): sh for p, sh in jax.tree_util.tree_leaves_with_path(self._param_shardings())}
            self.dispatch_fn = expert_lib.default_dispatch(  # --ep-backend / --ep-capacity-factor: expert meshes
                devices, shardings, ep_backend=None if cfg.ep_backend == "auto" else cfg.ep_backend,
                ep_capacity_factor=cfg.ep_capacity_factor, check_vma=self.pipeline is None)
        self._jits: dict[Any, Any] = {}
        self._hash_buffers = {int(m.group(1)): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(buffers)
                              if (m := _HASH_TABLE.fullmatch(tree_key(p)))}
        self._replay_metrics: dict[str, Any] = {}
        self.math = LearnerStep(cfg=cfg, graphdef=self.graphdef, sdef=self.sdef, rformat=self.rformat,
                                dispatch_fn=self.dispatch_fn, labels=self.labels, tx=self.tx, matrix=self._matrix,
                                offloaded=self.offloaded, streamed=self.streamed,
                                opt_shardings=self._state_shardings.opt_state)

    def _param_shardings(self) -> Any:
        """The params' shardings in the per-layer layout (official paths, e.g. for `expert_lib.default_dispatch`)."""
        sh = self._state_shardings.params
        if self.sdef is None:
            return sh
        if self.mesh is None:  # one device: every per-layer leaf has that leaf's (single-device) sharding
            one = jax.tree.leaves(sh)[0]
            return jax.tree.map(lambda _: one, self._per_layer_params)
        return scan.unstack_params(sh, self.sdef.groups)

    # ------------------------------------------------------------------ optimizer
    def _label(self, path, _leaf) -> str:
        """TRAIN or FROZEN: `sharding.offload.is_trained` (the planner counts optimizer state by the same rule)."""
        if self.cfg.lora.enabled:  # LoRA: the adapters alone train, every base weight is frozen
            return TRAIN if is_adapter_key(tree_key(path)) else FROZEN
        trained = so.is_trained(tree_key(path), train_mtp=self.cfg.train_mtp, freeze_router=self.cfg.freeze_router)
        return TRAIN if trained else FROZEN

    # ------------------------------------------------------------------ public API
    def train_step(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]:
        """One optimizer update on `batch` (validated first). Donates `state`: use the returned one.

        Returns:
            (new TrainState, metrics): float32 scalars named in `METRIC_NAMES` plus those of `policy_loss`.
        Raises:
            ValueError: mis-shaped batch arrays, N not a multiple of micro_batch_size (or of the mesh's batch
                axes), or routing missing / mis-shaped while `routing_replay` is on. Nothing has run then.
        """
        batch, lay, _ = self.fit_batch(batch)
        fn = self._jit(("step", lay), functools.partial(self.math.step, lay=lay), donate=True)
        with self._context():
            new_state, metrics = fn(state, self._place(batch))
        return new_state, {**metrics, **self._replay_metrics}

    def lower(self, batch: TrainBatch, state: TrainState | None = None) -> jax.stages.Lowered:
        """The train step exactly as `train_step` / `update` runs it (same jit, shardings, donation, layout),
        lowered for `batch`, whose fields may be `jax.ShapeDtypeStruct`s (then no trimming: the batch is taken
        to be as long as its real rows, and the token budget is checked against S). state: default the learner's
        (its arrays are not touched; `jax.ShapeDtypeStruct`s with shardings work too).
        `.compile().memory_analysis()` gives XLA's per-device figures (python -m launch.plan --compile).
        Raises ValueError as `train_step` (mis-shaped batch, token budget below the longest row)."""
        batch = self._check_batch(batch, self.cfg.routing_replay)
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch))
        if abstract:
            n, s = batch.input_ids.shape
            lay = self.layout(n, s, s)
        else:
            batch, lay, _ = self._fit(batch)
        fn = self._jit(("step", lay), functools.partial(self.math.step, lay=lay), donate=True)
        state = self.state if state is None else state
        if abstract and self._batch_sharding is not None:
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._batch_sharding),
                                 batch)
        with self._context():
            return fn.lower(state, batch if abstract else self._place(batch))

    def update(self, batch: TrainBatch) -> Metrics:
        """`self.state, metrics = self.train_step(self.state, batch)`; returns metrics."""
        self.state, metrics = self.train_step(self.state, batch)
        return metrics

    def loss_and_grads(self, state: TrainState, batch: TrainBatch) -> tuple[jax.Array, Any, Metrics]:
        """The step's (loss, grads, metrics) without updating (no donation); for tests and diagnostics."""
        batch, lay, _ = self.fit_batch(batch)
        fn = self._jit(("grads", lay), functools.partial(self.math.loss_and_grads, lay=lay), donate=False,
                       out_batch=False)
        with self._context():
            return fn(state, self._place(batch))

    def compute_logprobs(self, state: TrainState, batch: TrainBatch, *, routing_replay: bool | None = None
                         ) -> tuple[LogprobResult, Metrics]:
        """Current-policy logprobs/entropy/routing of the batch (no gradient), micro-batched like the step.

        Use the logprobs as `TrainBatch.old_logprobs` for several updates on one batch. routing_replay: override
        of `cfg.routing_replay` for this call (None = the config's).
        Returns:
            (LogprobResult [N, S] / [N, S, L, k], metrics {train/train_rollout_logprob_abs_diff,
            train/train_rollout_kl (k3 estimate of KL(rollout || learner)), train/entropy}: masked token means).
        """
        replay = self.cfg.routing_replay if routing_replay is None else routing_replay
        batch, lay, shift = self.fit_batch(batch, replay)
        fn = self._jit(("logprobs", replay, lay), lambda s, b: self.math.forward(s, b, replay, lay), donate=False,
                       out_batch=True)
        with self._context():
            res, metrics = fn(state, self._place(batch))
            if lay.width != lay.seq_len or np.any(shift):
                s_pad = max(lay.seq_len, lay.width)  # exact_layout: padded columns cut again
                res = LogprobResult(*(batching.untrim(x, shift, s_pad, fill)[:, :lay.seq_len]
                                      for x, fill in zip((res.logprobs, res.entropy, res.routing), (0.0, 0.0, -1))))
            return res, metrics

    def next_logits(self, state: TrainState, batch: TrainBatch) -> jax.Array:
        """[N, V] float32: the tempered logits (logits / T, as the loss scores them) from which the learner predicts
        the token after the one `batch.response_mask` marks in each row (exactly one 1 per row), with the model,
        weights and micro-batch layout of `compute_logprobs` (no routing replay). Exact mode draws its tokens from
        these (rl/rollout/exact.py). Needs rows that start at column 0 (no re-alignment: ValueError otherwise)."""
        batch, lay, shift = self.fit_batch(batch, False)
        if np.any(shift):
            raise ValueError("Learner.next_logits: rows must start at column 0 (right-padded)")
        fn = self._jit(("next", lay), lambda s, b: (self.math.next_logits(s, b, lay), None), donate=False,
                       out_batch=True)
        with self._context():
            return fn(state, self._place(batch))[0]

    def params_for_push(self) -> Any:
        """Every tensor that defines the current model: nnx.State of the float32 master Params and the Buffers,
        per layer (official paths; with `scan_layers` the stacked layers are sliced back, i.e. copied).
        Live arrays of the state: push (copy) them before the next `train_step` donates them."""
        merged = nnx.merge_state(self.state.params, self.state.buffers)
        return merged if self.sdef is None else scan.unstack_params(merged, self.sdef.groups)

    def adapters_for_push(self) -> Any:
        """LoRA: nnx.State of the adapters alone (`nnx.LoRAParam`s, per layer, official paths; sliced back, i.e.
        copied, with `scan_layers`): what an adapter push moves (`parallel.push.local.WeightPusher(only=...)`)."""
        ad = nnx.filter_state(self.state.params, nnx.LoRAParam)
        return ad if self.sdef is None else scan.unstack_params(ad, self.sdef.groups)

    def state_dict(self) -> dict[str, Any]:
        """{"step", "params", "opt_state", "buffers"} (+ "ref_params" when kl_coef > 0): a pytree of arrays
        (with `scan_layers`, in the stacked layout: it only loads into a learner with the same setting). LoRA:
        "params" holds the adapters alone (the frozen base is the run's --init, recorded by the checkpoint's
        fingerprint: rl/run/wiring.py), and there is no "ref_params" (the reference is the base)."""
        s = self.state
        params = nnx.filter_state(s.params, nnx.LoRAParam) if self.cfg.lora.enabled else s.params
        d = {"step": s.step, "params": params, "opt_state": s.opt_state, "buffers": s.buffers}
        if s.ref_params is not None:
            d["ref_params"] = s.ref_params
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace the state by `d` (as from `state_dict`), placed like the current state.
        Raises ValueError when its structure, shapes or dtypes differ from the learner's."""
        params = d["params"]
        if self.cfg.lora.enabled:  # the checkpoint holds the adapters; the frozen base is this learner's own
            params = nnx.merge_state(nnx.filter_state(self.state.params, nnx.Not(nnx.LoRAParam)), params)
        new = TrainState(step=d["step"], params=params, opt_state=d["opt_state"], buffers=d["buffers"],
                         ref_params=d.get("ref_params"))
        if jax.tree.structure(new) != jax.tree.structure(self.state):
            raise ValueError("state_dict structure differs from the learner's state (other model or config?)")
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(self.state)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"state_dict leaf {a.shape} {a.dtype} does not match {b.shape} {b.dtype}")
        # device_put may return the caller's own arrays (same placement): copy, since train_step donates them.
        self.state = jax.tree.map(lambda x: jnp.array(x, copy=True), jax.device_put(new, self._state_shardings))

    # ------------------------------------------------------------------ plumbing
    @contextlib.contextmanager
    def _context(self):
        """`jax.set_mesh` + `use_rules` on the actor mesh (nothing without a mesh); jits are traced inside."""
        if self.mesh is None:
            yield
            return
        with jax.set_mesh(self.mesh), sr.use_rules(self.rules, self.mesh):
            yield

    def _jit(self, key, fn, *, donate: bool, out_batch: bool = False):
        if key not in self._jits:
            kw = {"donate_argnums": 0} if donate else {}
            if self.mesh is not None:
                state_sh, batch_sh, rep = self._state_shardings, self._batch_sharding, self._replicated
                outs = {"step": (state_sh, rep), "grads": (rep, state_sh.params, rep)}
                kw.update(in_shardings=(state_sh, batch_sh),
                          out_shardings=(batch_sh, rep) if out_batch else outs[key[0]])
            elif self.offloaded and key[0] == "step":  # host-memory outputs need explicit shardings
                rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                kw.update(out_shardings=(self._state_shardings, rep))
            self._jits[key] = jax.jit(fn, **kw)
        return self._jits[key]

    def batch_devices(self) -> int:
        """Devices the batch's rows are split over (the rules' `act_batch` axes), 1 without a mesh."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in sr.mesh_axes_for(ax.ACT_BATCH, self.rules) if a in self.mesh.shape)

    def context_devices(self) -> int:
        """Devices one row's tokens are split over (the rules' `act_seq` axes: context parallelism), 1 without."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in sr.mesh_axes_for(ax.ACT_SEQ, self.rules) if a in self.mesh.shape)

    def layout(self, n: int, s: int, longest: int) -> batching.Layout:
        """The micro-batch layout (`rl.algo.batching.Layout`) of a step batch of `n` rows x `s` columns whose longest
        row has `longest` tokens: exact mode's fixed layout, else `rl.algo.batching.layout` with the learner's knobs."""
        c = self.cfg
        if self.exact_layout is not None:
            return batching.fixed_layout(n, s, longest, rows=self.exact_layout[0], width=self.exact_layout[1])
        return batching.layout(n, s, longest, trim=c.trim, micro_batch_size=c.micro_batch_size,
                               max_tokens=c.max_tokens_per_micro_batch, batch_devices=self.batch_devices(),
                               context=self.context_devices())

    def fit_batch(self, batch: TrainBatch, replay: bool | None = None
                  ) -> tuple[TrainBatch, batching.Layout, np.ndarray]:
        """The host side of `train_step` / `compute_logprobs`: the batch checked (routing dropped unless `replay`,
        default `cfg.routing_replay`) and trimmed -> (the batch as the step's jit takes it, its micro-batch layout,
        the per-row column shift). Raises ValueError as `train_step`."""
        replay = self.cfg.routing_replay if replay is None else replay
        return self._fit(self._check_batch(batch, replay))

    def _fit(self, batch: TrainBatch) -> tuple[TrainBatch, batching.Layout, np.ndarray]:
        """Host side: trim to the longest real row (rl/algo/batching.py) -> (batch, rows at column 0, layout, per-row
        shift: 0 for the rollout's rows). Raises ValueError when the token budget is below the longest row."""
        n, s = batch.input_ids.shape
        shift, longest = batching.real_extent(batch.attention_mask)
        lay = self.layout(n, s, longest)
        if not self.cfg.trim and self.exact_layout is None:  # full width; left-padded rows still start at column 0
            return batching.trim(batch, shift, s), lay, shift
        batch = batching.pad_columns(batch, lay.width)  # exact_layout: a batch narrower than its width
        return batching.trim(batch, shift, lay.width), lay, shift

    def _place(self, batch: TrainBatch) -> TrainBatch:
        return batch if self.mesh is None else jax.device_put(batch, self._batch_sharding)

    def _check_batch(self, batch: TrainBatch, replay: bool) -> TrainBatch:
        """Static shape checks (ValueError; `rl.algo.batch.check_train_batch`); drops routing when replay is off (not
        sent to the device)."""
        check_train_batch(batch, micro_batch_size=self.cfg.micro_batch_size,
                          token_budget=self.cfg.max_tokens_per_micro_batch, batch_devices=self.batch_devices())
        n, s = batch.input_ids.shape
        self._replay_metrics = {}
        if not replay:
            return batch.replace(routing=None)
        metrics = check_replay_routing(
            batch.routing, batch.input_ids, batch.attention_mask,
            (n, s, self.model_config.num_hidden_layers, self.model_config.num_experts_per_tok),
            self.model_config.n_routed_experts, {i: np.asarray(t) for i, t in self._hash_buffers.items()})
        self._replay_metrics = {k: np.float32(v) for k, v in metrics.items()}
        return batch
