"""The learner's math, traced inside its jits: the forward model of a state's params, per-token logprobs, the
micro-batched loss and gradients, one optimizer update (with the non-finite guard and the streamed offloaded update)
and the no-gradient forward. `rl.algo.learner.Learner` builds one `LearnerStep` from its config, model graph and state
layout, and jits these methods; its module docstring gives the choices (precision, micro-batches, FP8-aware forward,
routing replay, freezing, the non-finite guard, scanned layers). Tests: tests/rl/test_learner.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv4 import scan
from dsv4.names import tree_key
from dsv4.rollout_format import RolloutFormat, fp8_aware_params
from parallel import pipeline
from rl.algo import batching, optim
from rl.config.algo import LearnerConfig
from rl.algo.batch import TrainBatch
from rl.algo.learner_state import LogprobResult, TrainState, opt_state_to
from rl.algo.logprobs import next_token_logits, token_logprobs
from rl.algo.losses import kl_penalty, loss_normalizers, mtp_mask, policy_loss
from rl.algo.metrics import masked_mean

Metrics = dict[str, jax.Array]
TRAIN, FROZEN = "train", "frozen"  # a param's optimizer label: updated, or carried over as-is (no Adam state)
# Names that every train_step reports (0 where they do not apply), besides what policy_loss returns.
METRIC_NAMES = ("train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/kl_loss", "train/entropy",
                "train/grad_norm", "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl",
                "train/tis_clipfrac", "train/skipped_nonfinite", "train/lr")
# + "train/expert_drop_frac" when the expert dispatch can drop (`dispatch_fn.can_drop`: a capacity factor)
_DROPPED, _ROUTED = "_expert_pairs_dropped", "_expert_pairs_routed"  # per micro-batch, summed, then divided


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LearnerStep:
    """What the traced step needs of a `Learner`, and the step's functions (pure in their array arguments).

    cfg: the resolved LearnerConfig. graphdef: the learner's model graph; sdef: the `dsv4.scan.StackDef` with
    scan_layers, else None. rformat: the rollout's weight format for the FP8-aware forward, else None.
    dispatch_fn: the routed-expert implementation. labels: TRAIN / FROZEN per param (the state's layout); tx: the
    optimizer (`optax.multi_transform` over the labels); matrix: {param path: ndim >= 2 per layer} (weight decay).
    offloaded / streamed: the params whose optimizer state lives in host memory / is updated slice by slice
    (with the blocks their leading dim is split into: `rl.algo.learner_state.streamable`);
    opt_shardings: the optimizer state's shardings (`rl.algo.learner_state.opt_state_to`).
    """

    cfg: LearnerConfig
    graphdef: Any
    sdef: Any
    rformat: RolloutFormat | None
    dispatch_fn: Any
    labels: Any
    tx: Any
    matrix: dict[str, bool]
    offloaded: frozenset[str]
    streamed: Mapping[str, int]
    opt_shardings: Any

    def placement(self, params) -> tuple:
        """`rl.algo.learner_state.opt_state_to`'s placement arguments for a state whose params are `params`."""
        return self.offloaded, self.streamed, params, self.opt_shardings

    def model(self, params, buffers, micro_batches: int | None = None):
        """-> (model, layer stack or None): the learner's forward model of `params` (the FP8-aware one with
        `fp8_forward`: the rollout's weights, straight-through to the masters). micro_batches M: the stack
        pipelined over `cfg.pipeline_stages` stages and M micro-batches (`parallel.pipeline.PipelineStack`)."""
        if self.rformat is not None:
            params = fp8_aware_params(params, self.rformat)
        if self.sdef is None:
            return nnx.merge(self.graphdef, params, buffers), None
        # the shell (embedding, head, ...) + the stacked layers under lax.scan, remat per sub-layer
        shell, stack = scan.merge_stacked(self.sdef, params, buffers, remat=self.cfg.remat)
        if micro_batches is not None:
            stack = pipeline.PipelineStack.of(stack, pipeline.pipeline_plan(self.sdef.groups, self.cfg.pipeline_stages,
                                                                            micro_batches))
        return shell, stack

    @property
    def pipelined(self) -> bool:
        return self.cfg.pipeline_stages > 1

    def logprobs(self, params, buffers, mb: TrainBatch, replay: bool, mtp: bool = False, drops: bool = False,
                 micro_batches: int | None = None):
        model, stack = self.model(params, buffers, micro_batches)
        return token_logprobs(model, mb.input_ids, mb.attention_mask, temperature=self.cfg.temperature,
                              routing_replay=mb.routing if replay else None, return_entropy=True,
                              chunk_size=self.cfg.logprob_chunk_size, dispatch_fn=self.dispatch_fn,
                              layer_stack=stack, mtp=mtp, expert_drops=drops, left_aligned=True)

    def next_logits(self, state: TrainState, batch: TrainBatch, lay: batching.Layout) -> jax.Array:
        """`Learner.next_logits`' device side, micro-batched exactly as `forward` (same split, same `lax.map`)."""
        def one(mb):
            model, stack = self.model(state.params, state.buffers)
            return next_token_logits(model, mb.input_ids, mb.attention_mask, jnp.argmax(mb.response_mask, axis=1),
                                     temperature=self.cfg.temperature, chunk_size=self.cfg.logprob_chunk_size,
                                     dispatch_fn=self.dispatch_fn, layer_stack=stack, left_aligned=True)

        if lay.micro_batches == 1 and lay.rows == batch.input_ids.shape[0]:
            return one(batch)
        return batching.merge(jax.lax.map(one, batching.split(batch, lay)), batch.input_ids.shape[0])

    def loss(self, params, buffers, ref_params, mb: TrainBatch, norms: dict[str, jax.Array], loss_cfg=None,
             micro_batches: int | None = None):
        """Loss of one micro-batch with the full batch's normalisers -> (loss, metrics); differentiated in params.
        loss_cfg: the step's LossConfig (cfg.loss with the caller's S as Dr.GRPO's default length). micro_batches:
        `mb` is the whole (padded) batch, run through the pipeline in that many micro-batches."""
        replay = self.cfg.routing_replay
        w_mtp = self.cfg.mtp_loss_weight
        counted = getattr(self.dispatch_fn, "can_drop", False)  # a capacity factor: count the dropped pairs
        lp, ent, _, *lq = self.logprobs(params, buffers, mb, replay, mtp=w_mtp > 0, drops=counted,
                                        micro_batches=micro_batches)
        drops = lq.pop() if counted else None
        old = jax.lax.stop_gradient(lp) if mb.old_logprobs is None else mb.old_logprobs
        ref_lp = None
        if ref_params is not None:
            ref_lp = jax.lax.stop_gradient(self.logprobs(ref_params, buffers, mb, replay,
                                                         micro_batches=micro_batches)[0])
        if self.cfg.loss.entropy_coef == 0:
            ent = jax.lax.stop_gradient(ent)
        norms = dict(norms)
        mtp_norm = norms.pop("mtp_tokens", None)
        loss, metrics = policy_loss(lp, old, mb.advantages, mb.response_mask, loss_cfg or self.cfg.loss,
                                    rollout_logprobs=mb.rollout_logprobs, ref_logprobs=ref_lp, entropy=ent, **norms)
        if w_mtp > 0:  # on-policy MTP loss: cross-entropy over the batch's response tokens (stop-gradient trunk)
            mtp_loss = -jnp.sum(lq[0] * mtp_mask(mb.response_mask)) / mtp_norm
            loss = loss + w_mtp * mtp_loss
            metrics = dict(metrics, **{"train/mtp_loss": mtp_loss})
        if drops is not None:  # raw counts, summed over micro-batches; `step` divides them
            metrics = dict(metrics, **{_DROPPED: drops[0].astype(jnp.float32), _ROUTED: drops[1].astype(jnp.float32)})
        return loss, metrics

    def loss_cfg(self, lay: batching.Layout):
        """cfg.loss; for Dr.GRPO without norm_length, the caller's S (not the trimmed width) as the length."""
        c = self.cfg.loss
        if c.loss_agg_mode == "seq-mean-token-sum-norm" and c.norm_length is None and lay.width != lay.seq_len:
            return dataclasses.replace(c, norm_length=lay.seq_len)
        return c

    def trained_only(self, params):
        """LoRA: (the TRAIN leaves of `params` [list], with_trained: list -> params with those leaves put back and
        every other leaf under stop_gradient, expand: grads of the list -> a grads tree like params, zeros for the
        frozen leaves (dead after the update, which keeps the frozen params as they are))."""
        leaves, tdef = jax.tree.flatten(params)
        idx = [i for i, lab in enumerate(jax.tree.leaves(self.labels)) if lab == TRAIN]
        frozen = [jax.lax.stop_gradient(x) for x in leaves]

        def with_trained(tr):
            out = list(frozen)
            for i, x in zip(idx, tr):
                out[i] = x
            return jax.tree.unflatten(tdef, out)

        def expand(g):
            out = [jnp.zeros_like(x) for x in leaves]
            for i, x in zip(idx, g):
                out[i] = x
            return jax.tree.unflatten(tdef, out)

        return [leaves[i] for i in idx], with_trained, expand

    def loss_and_grads(self, state: TrainState, batch: TrainBatch, lay: batching.Layout):
        """-> (loss, grads (nnx.State like params, param dtype), metrics), accumulated exactly over micro-batches.
        With LoRA the gradient is taken with respect to the adapters alone (`trained_only`)."""
        norms = loss_normalizers(batch.response_mask, self.cfg.loss)
        if self.cfg.mtp_loss_weight > 0:
            norms = dict(norms, mtp_tokens=jnp.maximum(jnp.sum(mtp_mask(batch.response_mask)), 1.0))
        m = lay.micro_batches
        mp = min(self.cfg.pipeline_micro_batches or m, m)  # micro-batches per pipelined pass
        wrt, expand, ref = state.params, lambda g: g, state.ref_params
        if self.cfg.lora.enabled and self.cfg.loss.kl_coef > 0:  # the reference: the base (every adapter zero)
            ref = jax.tree.map(lambda x, lab: jnp.zeros_like(x) if lab == TRAIN else jax.lax.stop_gradient(x),
                               state.params, self.labels)
        with_trained = None
        if self.cfg.lora.enabled:
            wrt, with_trained, expand = self.trained_only(state.params)

        def make_grad_fn(micro_batches):  # micro_batches: a pipelined pass of that many, else None
            loss_fn = functools.partial(self.loss, loss_cfg=self.loss_cfg(lay), micro_batches=micro_batches)
            if with_trained is not None:
                loss_fn = (lambda f: lambda tr, *a: f(with_trained(tr), *a))(loss_fn)
            return jax.value_and_grad(loss_fn, has_aux=True)

        grad_fn = make_grad_fn(mp if self.pipelined else None)
        tail = None  # (grad_fn, pass) of a shorter last pipelined pass
        if self.pipelined:  # pipelined forward + backward passes over the batch: rows in the order batching.split
            # puts them, the pipeline cutting the micro-batches batching.split would, in passes of
            # cfg.pipeline_micro_batches micro-batches (None: one pass of all M), accumulated as micro-batches below;
            # M not a multiple of it: one shorter last pass (its own pipeline), not a pass padded with neutral rows
            full, rem = divmod(m, mp)
            mbs = batching.split(batch, lay)  # [M, R, ...]
            whole = jax.tree.map(lambda x: jax.vmap(pipeline.merge_micro_batches)(
                x[:full * mp].reshape(full, mp, *x.shape[1:])), mbs)  # [full, mp R, ...]: one pipelined pass each
            if rem:
                tail = make_grad_fn(rem), jax.tree.map(lambda x: pipeline.merge_micro_batches(x[full * mp:]), mbs)
            elif full == 1:
                (loss, metrics), grads = grad_fn(wrt, state.buffers, ref, jax.tree.map(lambda x: x[0], whole), norms)
                return loss, expand(grads), metrics
            mbs = whole
        elif m == 1 and lay.rows == batch.input_ids.shape[0]:
            (loss, metrics), grads = grad_fn(wrt, state.buffers, ref, batch, norms)
            return loss, expand(grads), metrics
        else:
            mbs = batching.split(batch, lay)

        def body(acc, mb):
            (loss, metrics), grads = grad_fn(wrt, state.buffers, ref, mb, norms)
            return jax.tree.map(jnp.add, acc, (loss, grads, metrics)), None

        first = jax.tree.map(lambda x: x[0], mbs)
        (_, metric_shapes), _ = jax.eval_shape(grad_fn, wrt, state.buffers, ref, first, norms)
        zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
        init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, wrt), zeros(metric_shapes))
        acc, _ = jax.lax.scan(body, init, mbs)
        if tail is not None:
            (loss, metrics), grads = tail[0](wrt, state.buffers, ref, tail[1], norms)
            acc = jax.tree.map(jnp.add, acc, (loss, grads, metrics))
        loss, grads, metrics = acc
        return loss, expand(grads), metrics

    def step(self, state: TrainState, batch: TrainBatch, lay: batching.Layout) -> tuple[TrainState, Metrics]:
        loss, grads, metrics = self.loss_and_grads(state, batch, lay)
        grad_norm = optax.tree.norm([g.astype(jnp.float32) for g, label in
                                     zip(jax.tree.leaves(grads), jax.tree.leaves(self.labels)) if label == TRAIN])
        old_opt = opt_state_to(state.opt_state, "device", *self.placement(state.params))
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        if self.streamed:  # offloaded stacked state: one slice at a time on the device (rl.algo.optim.update_streamed)
            tx = optax.multi_transform({TRAIN: optim.train_tx(self.cfg, self.matrix, clip=False),
                                        FROZEN: optax.set_to_zero()}, self.labels)
            clip_norm, apart_norm = grad_norm, None
            if self.cfg.mtp_loss_weight > 0:  # the MTP head clipped apart, as train_tx's clip
                trained = [(tree_key(p), g.astype(jnp.float32)) for (p, g), label in
                           zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(self.labels))
                           if label == TRAIN]
                clip_norm = optax.tree.norm([g for k, g in trained if not optim.is_mtp_key(k)])
                apart_norm = optax.tree.norm([g for k, g in trained if optim.is_mtp_key(k)])
            stepped, opt_state = optim.update_streamed(
                tx, grads, old_opt, state.params, self.streamed, finite=finite, g_norm=clip_norm,
                apart_norm=apart_norm, max_norm=self.cfg.max_grad_norm,
                to_device=lambda x: jax.device_put(x, jax.memory.Space.Device),
                to_host=lambda x: jax.device_put(x, jax.memory.Space.Host))
            params = jax.tree.map(lambda new, old, label: new if label == TRAIN else old, stepped, state.params,
                                  self.labels)
        else:
            stepped, opt_state = optim.update(self.tx, grads, old_opt, state.params)
            params = jax.tree.map(lambda new, old, label: new if label == TRAIN else old, stepped, state.params,
                                  self.labels)
            params, opt_state = keep(params, state.params), keep(opt_state, old_opt)
        new_state = state.replace(step=keep(state.step + 1, state.step), params=params,
                                  opt_state=opt_state_to(opt_state, "host", *self.placement(state.params)))
        out = {name: jnp.zeros((), jnp.float32) for name in METRIC_NAMES}
        metrics = dict(metrics)
        if _DROPPED in metrics:  # pairs past the EP dispatch's capacity / pairs routed, main layers, whole batch
            dropped, routed = metrics.pop(_DROPPED), metrics.pop(_ROUTED)
            out["train/expert_drop_frac"] = dropped / jnp.maximum(routed, 1.0)
        out.update(metrics)
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = optim.lr_schedule(self.cfg)(state.step)
        out["train/skipped_nonfinite"] = (~finite).astype(jnp.float32)
        return new_state, out

    def forward(self, state: TrainState, batch: TrainBatch, replay: bool, lay: batching.Layout
                 ) -> tuple[LogprobResult, Metrics]:
        n = batch.input_ids.shape[0]

        def one(mb, micro_batches=None):
            return LogprobResult(*self.logprobs(state.params, state.buffers, mb, replay, micro_batches=micro_batches))

        if self.pipelined:  # the whole (padded) batch through the pipeline, padding rows dropped
            whole = jax.tree.map(pipeline.merge_micro_batches, batching.split(batch, lay))
            res = jax.tree.map(lambda x: x[:n], one(whole, lay.micro_batches))
        elif lay.micro_batches == 1 and lay.rows == n:
            res = one(batch)
        else:  # [M, R, ...] -> back to [N, ...] (inverse of the strided split, padding rows dropped)
            res = jax.tree.map(lambda x: batching.merge(x, n), jax.lax.map(one, batching.split(batch, lay)))
        mask = batch.response_mask > 0
        diff = jnp.where(mask, res.logprobs - jnp.where(mask, batch.rollout_logprobs, 0.0), 0.0)
        kl = kl_penalty(jnp.where(mask, batch.rollout_logprobs, 0.0), res.logprobs, "k3", self.cfg.loss.kl_clamp)
        metrics = {"train/train_rollout_logprob_abs_diff": masked_mean(jnp.abs(diff), mask),
                   "train/train_rollout_kl": masked_mean(jnp.where(mask, kl, 0.0), mask),
                   "train/entropy": masked_mean(res.entropy, mask)}
        return res, metrics
