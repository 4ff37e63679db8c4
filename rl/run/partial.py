"""Partial rollouts (`--partial-rollout`, with `--max-staleness K >= 1`): generations run in segments of decode
steps; a weight update interrupts the unfinished ones between segments and they continue under the new version.

The producer of rl/run/pipeline.py keeps a pool of groups (a prompt and its `group_size` samples) across batches.
For batch m, with the weights the schedule serves then (P(max(0, m - K)), version v):

    start new groups (oldest drawn first; an iterator batch is drawn when none is left) so that
        new = P - finished + unfinished   (the batch's deficit, plus a margin as large as what is in flight),
        at most as many as fit beside the unfinished rows in pow2(P x G) rows (the plain run's row bucket);
    run one segment over the unfinished and the new groups: each unfinished sample generates up to `segment`
        more tokens (in its last allowed version, v - first version >= K: all it has left), from prompt + its
        tokens so far; the request is padded to pow2(P x G) rows (one compiled program per prompt bucket;
        padding rows draw one token, discarded);
    while fewer than P groups are finished: start the deficit and run a segment (same version) over the groups
        started for the deficit so far (not the others: a short deficit ends early; a long one picked there
        stays in flight; every round advances them, so the loop ends within ceil(max_new_tokens / segment)
        rounds);
    batch m = the first P finished groups in pool order (drawn order); the rest stay in the pool.

P = `--prompts-per-step`, G = `--group-size`, segment = `--rollout.partial_segment` (0: ceil(max_new_tokens /
(K + 1)), so a sample never needs more segments than its K + 1 versions allow). The interruption points are
functions of the schedule and of the sampled tokens, never of wall time: the same flags give the same tokens.

Continuing a sample = re-prefill: the rollout is asked for prompt + the sample's tokens so far as a prompt, with
`token_offset` = its length, so its token g is still drawn with fold_in(key_sample, g) (rl/rollout/engine.py): the keys of
an uninterrupted sample. The old version's KV caches are not kept (they would have to go into the checkpoint and
would hold keys of the old weights); this is what abort + resubmit does on SGLang (Miles `--fully-async`, slime's
partial rollout). The pool is host numpy (tokens, logprobs, routing, versions), so it goes into the in-flight
checkpoint (`state_arrays` / `load`) and a resumed run continues bitwise.

Versions. Every response token records the version it was sampled with (`RolloutBatch.token_versions` [N, T]),
its logprob is that version's (the sampler's at the time), so the off-policy correction (TIS / MIS on
old_logprobs - rollout_logprobs, per token: rl/algo/losses.py) weighs every token against the policy that drew it. A
sample spans at most K + 1 versions; its oldest token trained at step s is at most 2K + w versions old (w: steps a
finished group waited in the pool; the oldest finished are taken first). The pipeline reports the share of
response tokens per staleness (`rollout/token_staleness_<j>`, rl/run/pipeline.py). Per batch: `rollout/partial/*`
(segments run, groups started, groups and rows still in flight, rows continued, tokens re-prefilled).

Randomness: sample j of the prompt at position i of the d-th drawn iterator batch uses (seed, step 0, prompt index
d x P + i, sample j): a function of the data order alone.

Layouts: every one, through the rollout service contract (rl/rollout/service.py: a segment is one RolloutRequest
with `max_new_tokens_per_row` and `token_offset`, tagged "train/partial/<m>/<segment>"). The in-process rollout
(`LocalRollout`); MPMD (rl/rollout/mpmd.py): every actor process runs this producer in lock-step on the same
results (one unsharded prompt stream), the writer (process 0) sends the segments, the rollout processes generate
them; the two-job layout (rl/rollout/two_job.py): actor process 0 sends them over the link (a restarted rollout job is
sent the unanswered segments again, with the same ids: the same tokens). Every side sizes its prompt buckets for
the re-prefill (`rl.run.wiring.prompt_bucket`: + max_new_tokens), and the host channel keeps `requests_per_batch` results
per batch (`rl.run.wiring.channel_window`). The pool is saved by the metrics writer and loaded by every actor process.
Continuous batching (`--rollout-slots`, rl/rollout/slots.py) honours both per-row fields (tests/rl/test_partial_rollout.py).
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from rl.algo.batch import RolloutBatch
from rl.algo.metrics import response_stats, reward_stats, to_python
from rl.run.stages import RolloutRecord, generate, global_batch, sampling_params, score


def segment_tokens(max_new_tokens: int, k: int, segment: int = 0) -> int:
    """Decode steps per segment: `segment`, or (0) ceil(max_new_tokens / (K + 1))."""
    return int(segment) or -(-int(max_new_tokens) // (k + 1))


def requests_per_batch(max_new_tokens: int, k: int, segment: int = 0) -> int:
    """The most rollout requests one batch sends: its first segment + at most ceil(max_new_tokens / segment)
    deficit rounds (the groups started in the first deficit round are finished by then). Sizes the MPMD / two-job
    host channel's window of results (rl/run/wiring.py)."""
    return 1 + -(-int(max_new_tokens) // segment_tokens(max_new_tokens, k, segment))


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass
class Group:
    """One prompt and its G samples in the pool (host numpy). draw / pos: the iterator batch it came from and its
    place there; cap: its response length limit (max_new_tokens or `--rollout.length_schedule`'s);
    tokens / logprobs / versions [G, T] (versions -1 = not generated); routing [G, T, L, k] of the response
    tokens, prompt_routing [G, len(prompt), L, k] (from its first segment); lengths [G]; done / stopped [G] bool;
    first_version: the version of its first segment (-1: not started)."""

    draw: int
    pos: int
    data_index: int
    ref: str
    prompt: np.ndarray
    cap: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routing: np.ndarray | None
    prompt_routing: np.ndarray | None
    lengths: np.ndarray
    done: np.ndarray
    stopped: np.ndarray
    first_version: int = -1

    @property
    def started(self) -> bool:
        return self.first_version >= 0

    @property
    def finished(self) -> bool:
        return bool(self.done.all())


_ARRAYS = ("tokens", "logprobs", "versions", "routing", "lengths", "done", "stopped")


class PartialPool:
    """The partial-rollout producer state of one run (module docstring); `produce(m)` is called by the pipeline's
    producer thread in batch order."""

    def __init__(self, job):
        self.job, self.cfg = job, job.cfg
        r = job.cfg.rollout
        self.k = job.cfg.staleness()
        self.p, self.g, self.t = r.prompts_per_step, r.group_size, r.max_new_tokens
        self.segment = segment_tokens(self.t, self.k, r.partial_segment)
        self.row_cap = _pow2(self.p * self.g)
        self.groups: list[Group] = []
        self.draws = 0  # iterator batches drawn so far

    # -------------------------------------------------------------- producer

    def _draw(self) -> None:
        batch = global_batch(self.job, next(self.job.iterator))
        idx = [int(i) for i in batch["index"]]
        caps = self.cfg.rollout.length_caps(idx) or [self.t] * len(idx)
        g, t = self.g, self.t
        for i in range(len(idx)):
            prompt = np.asarray(batch["prompt_ids"][i, : batch["prompt_len"][i]], np.int32)
            self.groups.append(Group(draw=self.draws, pos=i, data_index=idx[i], ref=batch["reference"][i],
                                     prompt=prompt, cap=int(caps[i]), tokens=np.zeros((g, t), np.int32),
                                     logprobs=np.zeros((g, t), np.float32), versions=np.full((g, t), -1, np.int32),
                                     routing=None, prompt_routing=None, lengths=np.zeros((g,), np.int32),
                                     done=np.zeros((g,), bool), stopped=np.zeros((g,), bool)))
        self.draws += 1

    def _finished(self) -> int:
        return sum(gr.finished for gr in self.groups if gr.started)

    def _start(self, n: int, version: int) -> list[Group]:
        """Start the first `n` not-started groups in drawn order (drawing iterator batches as needed)."""
        out: list[Group] = []
        while len(out) < n:
            fresh = [gr for gr in self.groups if not gr.started]
            if not fresh:
                self._draw()
                continue
            fresh[0].first_version = version
            out.append(fresh[0])
        return out

    def _segment(self, m: int, version: int, stats: dict, groups: list[Group]) -> None:
        """One segment of batch `m` over `groups`: each unfinished sample generates up to `segment` more tokens
        (all it has left in its last allowed version), re-prefilled from prompt + its tokens so far. The request's
        tag "train/partial/<m>/<segment of the batch>" is unique within the run (the MPMD and two-job layouts
        key the results by it)."""
        rows, prompts, budget, offset, pidx, sidx = [], [], [], [], [], []
        for gr in groups:
            last = version - gr.first_version >= self.k
            for j in np.flatnonzero(~gr.done):
                n = int(gr.lengths[j])
                left = gr.cap - n
                rows.append((gr, int(j)))
                prompts.append(np.concatenate([gr.prompt, gr.tokens[j, :n]]).tolist())
                budget.append(left if last else min(self.segment, left))
                offset.append(n)
                pidx.append(gr.draw * self.p + gr.pos)
                sidx.append(int(j))
        if not rows:
            return
        n_real = len(rows)
        pad = self.row_cap - n_real  # one row bucket for every segment: steady state never recompiles
        prompts += [prompts[0]] * pad
        budget += [1] * pad
        offset += [0] * pad
        pidx += [pidx[0]] * pad
        sidx += [sidx[0]] * pad
        rb, m = generate(self.job, prompts, sampling_params(self.job), seed=self.cfg.seed, step=0,
                         prompt_index=pidx, sample_index=sidx, tag=f"train/partial/{m}/{stats['segments']}",
                         max_new_tokens_per_row=budget, token_offset=offset)
        stats["segments"] += 1
        stats["rows"] += n_real
        stats["continued_rows"] += sum(o > 0 for o in offset)
        stats["prefill_tokens"] += sum(len(p) for p in prompts[:n_real])
        stats["rollout_s"] += m["perf/rollout_s"]
        stats["tokens"] += int(rb.lengths[:n_real].sum())
        stats["extra"] = {k: v for k, v in m.items() if not k.startswith("perf/")}
        for r, (gr, j) in enumerate(rows):
            n, c, pl = int(gr.lengths[j]), int(rb.lengths[r]), int(rb.prompt_lengths[r])  # pl = prompt + n
            if gr.routing is None:
                lk = rb.routing.shape[2:]
                gr.routing = np.full((self.g, self.t) + lk, -1, np.int32)
                gr.prompt_routing = np.full((self.g, len(gr.prompt)) + lk, -1, np.int32)
            if n == 0:  # the first segment records the prompt's routing (columns 0.. of the joined row)
                gr.prompt_routing[j] = rb.routing[r, : len(gr.prompt)]
            gr.tokens[j, n: n + c] = rb.tokens[r, :c]
            gr.logprobs[j, n: n + c] = rb.logprobs[r, :c]
            gr.versions[j, n: n + c] = rb.weight_version
            gr.routing[j, n: n + c] = rb.routing[r, pl: pl + c]  # the new tokens, right after the request's prompt
            gr.lengths[j] = n + c
            gr.stopped[j] = rb.finish_reasons[r] == "stop"
            gr.done[j] = gr.stopped[j] or n + c >= gr.cap

    def produce(self, m: int) -> RolloutRecord:
        """Batch `m` (module docstring) -> the RolloutRecord the pipeline queues (rewards scored here)."""
        version = self.job.rollout.weight_version
        stats = {"segments": 0, "rows": 0, "continued_rows": 0, "prefill_tokens": 0, "rollout_s": 0.0, "tokens": 0,
                 "started": 0, "fallback": 0, "extra": {}}
        t0 = time.perf_counter()
        unfinished = [gr for gr in self.groups if gr.started and not gr.finished]
        want = self.p - self._finished() + len(unfinished)
        busy = sum(int((~gr.done).sum()) for gr in unfinished)
        new = self._start(max(0, min(want, (self.row_cap - busy) // self.g)), version)
        self._segment(m, version, stats, unfinished + new)
        stats["started"] = len(new)
        extra: list[Group] = []  # groups started for the deficit, continued in each further round
        while self._finished() < self.p:
            new = self._start(min(self.p - self._finished(), self.row_cap // self.g - len(extra)), version)
            extra = [gr for gr in extra if not gr.finished] + new
            self._segment(m, version, stats, extra)
            stats["started"] += len(new)
            stats["fallback"] += 1
        take = [gr for gr in self.groups if gr.started and gr.finished][: self.p]
        ids = {id(gr) for gr in take}
        self.groups = [gr for gr in self.groups if id(gr) not in ids]
        rb = self._batch(take)
        refs = [gr.ref for gr in take for _ in range(self.g)]
        rewards, _, metrics = score(self.job, rb, refs)
        dt = time.perf_counter() - t0
        left = [gr for gr in self.groups if gr.started]
        metrics.update(stats["extra"])
        metrics.update(to_python(reward_stats(jnp.asarray(rewards), self.g)))
        metrics.update(to_python(response_stats(rb.lengths, self.t, rb.finish_reasons)))
        metrics.update({"perf/rollout_s": stats["rollout_s"], "perf/rollout_tok_per_s":
                        stats["tokens"] / max(stats["rollout_s"], 1e-9), "perf/partial_produce_s": dt,
                        "rollout/partial/segments": float(stats["segments"]),
                        "rollout/partial/started_groups": float(stats["started"]),
                        "rollout/partial/deficit_segments": float(stats["fallback"]),
                        "rollout/partial/rows": float(stats["rows"]),
                        "rollout/partial/continued_rows": float(stats["continued_rows"]),
                        "rollout/partial/prefill_tokens": float(stats["prefill_tokens"]),
                        "rollout/partial/inflight_groups": float(len(left)),
                        "rollout/partial/inflight_rows": float(sum(int((~gr.done).sum()) for gr in left))})
        metrics.update(self.job.rollout.stats())
        tv = rb.token_versions
        versions = np.where(tv >= 0, tv, np.iinfo(np.int32).max).min(axis=1).astype(np.int64)  # oldest token
        return RolloutRecord(step=m, rb=rb, rewards=np.asarray(rewards, np.float32), train_rows=None,
                             versions=versions, metrics=metrics)

    def _batch(self, groups: list[Group]) -> RolloutBatch:
        """The finished groups as one RolloutBatch in the rollout's layout (rl/batch.py: prompts left-aligned in the
        plain run's prompt bucket, responses in max_new_tokens columns, the routing in joined rows), with per-token
        versions: each group's rows copied in, nothing re-laid."""
        g, t = self.g, self.t
        lens = np.array([len(gr.prompt) for gr in groups for _ in range(g)], np.int32)
        pw = min(_pow2(int(lens.max()), 16), _pow2(self.job.train_data.max_prompt_len, 16))
        n = len(lens)
        lk = groups[0].routing.shape[2:]
        prompt_tokens = np.zeros((n, pw), np.int32)
        routing = np.full((n, pw + t) + lk, -1, np.int32)
        for a, gr in enumerate(groups):
            lp = len(gr.prompt)
            rows = slice(a * g, (a + 1) * g)
            prompt_tokens[rows, :lp] = gr.prompt
            routing[rows, :lp] = gr.prompt_routing
            routing[rows, lp: lp + t] = gr.routing
        cat = {f: np.concatenate([getattr(gr, f) for gr in groups]) for f in ("tokens", "logprobs", "versions",
                                                                             "lengths", "stopped")}
        return RolloutBatch(tokens=cat["tokens"], logprobs=cat["logprobs"], routing=routing, lengths=cat["lengths"],
                            finish_reasons=["stop" if s else "length" for s in cat["stopped"]],
                            prompt_tokens=prompt_tokens, prompt_lengths=lens,
                            weight_version=int(cat["versions"].max()), token_versions=cat["versions"])

    # -------------------------------------------------------------- checkpoints

    def state_arrays(self, prefix: str = "pool/") -> dict[str, np.ndarray]:
        """The pool as arrays for the in-flight checkpoint (rl/run/pipeline.py), read back by `load`."""
        gs = self.groups
        out = {prefix + "draws": np.array(self.draws), prefix + "count": np.array(len(gs))}
        if not gs:
            return out
        lp = max(len(gr.prompt) for gr in gs)
        prompts = np.zeros((len(gs), lp), np.int32)
        for a, gr in enumerate(gs):
            prompts[a, : len(gr.prompt)] = gr.prompt
        out[prefix + "prompt"] = prompts
        for f in ("draw", "pos", "data_index", "cap", "first_version"):
            out[prefix + f] = np.array([getattr(gr, f) for gr in gs], np.int64)
        out[prefix + "prompt_len"] = np.array([len(gr.prompt) for gr in gs], np.int64)
        out[prefix + "ref"] = np.array([gr.ref for gr in gs], dtype=str)
        for f in _ARRAYS:
            if f == "routing":
                continue
            out[prefix + f] = np.stack([getattr(gr, f) for gr in gs])
        routed = [a for a, gr in enumerate(gs) if gr.routing is not None]
        if routed:
            lk = gs[routed[0]].routing.shape[2:]
            r = np.full((len(gs), self.g, self.t) + lk, -1, np.int32)
            pr = np.full((len(gs), self.g, lp) + lk, -1, np.int32)
            for a in routed:
                r[a] = gs[a].routing
                pr[a, :, : len(gs[a].prompt)] = gs[a].prompt_routing
            out[prefix + "routing"], out[prefix + "prompt_routing"] = r, pr
            out[prefix + "routed"] = np.array([gr.routing is not None for gr in gs])
        return out

    def load(self, z, prefix: str = "pool/") -> None:
        """Restore the pool from `state_arrays`' arrays (an open npz or a dict)."""
        self.draws = int(z[prefix + "draws"])
        self.groups = []
        for a in range(int(z[prefix + "count"])):
            lp = int(z[prefix + "prompt_len"][a])
            routed = prefix + "routed" in z and bool(z[prefix + "routed"][a])
            self.groups.append(Group(
                draw=int(z[prefix + "draw"][a]), pos=int(z[prefix + "pos"][a]),
                data_index=int(z[prefix + "data_index"][a]), ref=str(z[prefix + "ref"][a]),
                prompt=np.asarray(z[prefix + "prompt"][a, :lp], np.int32), cap=int(z[prefix + "cap"][a]),
                first_version=int(z[prefix + "first_version"][a]),
                routing=np.array(z[prefix + "routing"][a]) if routed else None,
                prompt_routing=np.array(z[prefix + "prompt_routing"][a, :, :lp]) if routed else None,
                **{f: np.array(z[prefix + f][a]) for f in _ARRAYS if f != "routing"}))


def token_staleness_metrics(rb: RolloutBatch, version: int, k: int) -> dict[str, float]:
    """Share of the response tokens of `rb` per staleness j = `version` - the token's version:
    `rollout/token_staleness_<j>` for j = 0 .. max(2K, the largest seen), their mean and max
    (`rollout/token_staleness_mean|max`)."""
    tv = rb.versions_per_token()
    s = (version - tv[tv >= 0]).astype(np.int64)
    if s.size == 0:
        return {}
    top = max(2 * k, int(s.max()))
    counts = np.bincount(s.clip(0), minlength=top + 1)
    out = {f"rollout/token_staleness_{j}": float(counts[j] / s.size) for j in range(top + 1)}
    out["rollout/token_staleness_mean"] = float(s.mean())
    out["rollout/token_staleness_max"] = float(s.max())
    return out

