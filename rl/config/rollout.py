"""The rollout section of the run config (`RunConfig.rollout`, rl/config/run.py): sampling on the rollout mesh
(rl/rollout/engine.py), the rollout weights and KV cache, batching, speculative decoding, asynchrony, the weight push
to it (parallel/push/) and the MPMD / two-job layouts. Each knob is declared once (default + help in the field);
`Sampler` / `EngineSettings` and `SamplingParams` take their defaults from here (`rl.config.tree.default`); the planner
reads the run's config.
Tests: tests/rl/test_run_config.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from rl.config.algo import check_real
from rl.config.flags import check_choices, check_ints
from rl.config.tree import knob

ROLLOUT_DTYPES = ("fp8", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8+fp4experts", "bf16", "fp32", "auto")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Sampling on the rollout mesh (rl/rollout/engine.py) and the weight push to it (parallel/push/)."""

    prompts_per_step: int = knob(32, "prompts per step")
    group_size: int = knob(16, "samples per prompt (G)")
    max_new_tokens: int = knob(4, "response length limit")
    temperature: float = knob(1.0, "sampling temperature (0 = greedy)")
    top_p: float = knob(1.0, "nucleus sampling")
    top_k: int = knob(0, "top-k sampling (0 = off)")
    dtype: str = knob("fp8", "rollout weights: fp8 | fp8_e4m3fnuz (MI300/MI308) | fp8+fp4experts (FP4 routed "
                              "experts, the release's format) | bf16 | fp32 | auto")
    compute_dtype: Literal["auto", "bfloat16", "float32"] = knob(
        "auto", "rollout matmul dtype: auto (fp32 on CPU, bf16 on GPU) | bfloat16 | float32")
    matmul: Literal["auto", "dequant", "fp8", "kernel"] = knob(
        "auto", "FP8 rollout GEMMs: auto (the block-scaled FP8 GEMM kernel where XLA has FP8 GEMMs: CUDA sm90+, ROCm "
                "gfx942/gfx950; XLA:CPU dequantises) | kernel (always the kernel, dsv4/fp8_kernel.py: a Pallas "
                "Triton kernel applying the 128-block scales inside; Pallas' interpreter on CPU) | fp8 (XLA's FP8 "
                "dots, one per 128-wide K block, partial sums through HBM) | dequant (weights dequantised layer by "
                "layer). FP8 GEMMs cover the FP8-set projections and the routed experts under the padded / sized "
                "EP dispatch")
    kv_cache_dtype: Literal["fp8", "bf16", "auto"] = knob(
        "auto", "rollout KV cache: fp8 (window ring, compressed entries and indexer keys in FP8 with ue8m0 scales, "
                "the release's layout) | bf16 (unquantised) | auto (fp8 for --rollout-dtype fp8*, else bf16; "
                "resolved by `rl.rollout.settings.EngineSettings.kv_layout`)")
    push_verify_every: int = knob(10, "verify the pushed FP8 weights against the learner's every N-th push "
                                      "(0 = never)")
    slots: int | str = knob(0, "rollout batching: 0 = static (all rows until the longest ends) | N = continuous "
                               "batching over N decode slots refilled as samples finish (rl/rollout/slots.py) | auto = as "
                               "many slots as the memory plan's KV budget holds (capped by the rows)")
    prefill_chunk: int = knob(2048, "prompts longer than this prefill in chunks of this many tokens against the KV "
                                    "cache built so far (memory bounded by one chunk; dsv4/chunked.py); 0 = whole "
                                    "prompt; a multiple of the compression ratios' lcm (128 for Flash)")
    ep_backend: Literal["auto", "capacity", "ragged", "padded", "sized"] = knob(
        "auto", "the sampler's expert-parallel dispatch on an expert rollout mesh (parallel/expert.py): auto "
                "(capacity on XLA:CPU, sized on GPUs: `parallel.expert.rollout_backend`) | capacity | ragged | "
                "padded (per-expert buffers, dense batched matmuls) | sized (padded with the buffer chosen per call "
                "from the loads among a few compiled capacities: exact at the routed cost)")
    ep_capacity_factor: float | None = knob(
        None, "the sampler's EP buffer factor: none = dropless (padded: T_local rows per expert and source rank, "
              "bounded by the tokens per device of one call: use --rollout-slots) | f > 0 = capacity "
              "min(T_local, ceil(f T_local k / E)) (sized: its largest capacity), pairs past it dropped (first "
              "come in (token, pick) order; the token keeps its other experts and the shared one)")
    ep_compact: bool = knob(False, "sized EP dispatch: after the all_to_all, each local expert's rows move to the "
                                   "front and its FFN runs on the smallest of a few compiled row counts holding the "
                                   "busiest expert (parallel/padded.py; exact, ~2x the routed rows at uniform routing "
                                   "instead of ~4x; more compiled branches)")
    speculative: Literal["off", "mtp"] = knob(
        "off", "speculative decoding: off | mtp (DeepSeek-V4's MTP block drafts --rollout.draft_tokens tokens per "
               "step, one forward of the policy verifies them; the output distribution is plain sampling's; "
               "rl/rollout/speculative.py)")
    draft_tokens: int = knob(2, "tokens the MTP block drafts per step with --rollout.speculative mtp (1..3)")
    max_staleness: int = knob(0, "asynchronous rollout (rl/run/pipeline.py): K >= 1 generates the next batches while "
                                 "the actor trains, with weights at most K versions old (needs --correction tis|mis); "
                                 "0 = synchronous")
    async_rollout: bool = knob(False, "one-step-off asynchronous rollout: shorthand for --max-staleness 1")
    partial_rollout: bool = knob(False, "partial rollouts (rl/run/partial.py; needs --max-staleness K >= 1): "
                                        "generations run in segments of --rollout.partial_segment decode steps; a "
                                        "step's batch is the first groups that finished, the others continue after "
                                        "the next push under the new weights (re-prefilled from their tokens), every "
                                        "token recording its version; a sample spans at most K + 1 versions")
    partial_segment: int = knob(0, "with --partial-rollout: decode steps per segment (0 = ceil(max_new_tokens / "
                                   "(K + 1)), so no sample is cut short by the K + 1 version limit)")
    length_schedule: str | None = knob(None, "synthetic response lengths (benchmarks): FRAC:SHORT caps every "
                                             "response at SHORT new tokens except for a FRAC share of the prompts "
                                             "(evenly spread over the data index), which keep --max-new-tokens; "
                                             "e.g. 0.1:4; none = off")
    ignore_eos: bool = knob(False, "benchmarks: training samples do not stop at the tokenizer's eos, so every "
                                   "response runs to its limit (--max-new-tokens, or --rollout.length_schedule's); "
                                   "evaluation still stops at eos (vLLM's SamplingParams.ignore_eos)")
    env: str | None = knob(None, "multi-turn agentic rollout (rl/rollout/multiturn.py): the environment whose tools "
                                 "the model calls in DeepSeek-V4's format: key_lookup | python_math "
                                 "(rl/agent/registry.py); none = one response per prompt. key_lookup generates its "
                                 "prompts from --seed, python_math reads a math --dataset (rl/run/env_task.py); one "
                                 "process or MPMD")
    max_turns: int = knob(4, "with --rollout.env: model turns per trajectory (a call pending after the last one "
                             "ends it as truncated); --max-new-tokens bounds all its response-side tokens")
    tool_timeout_s: float = knob(30.0, "with --rollout.env: seconds a row's tool calls of one turn may take before "
                                       "they answer 'error: tool timed out'")
    exact: bool = knob(False, "exact mode (rl/rollout/exact.py): training samples are drawn from the learner's own forward "
                              "in a batch-invariant layout (a full forward per token), so "
                              "train/train_rollout_logprob_abs_diff is 0 (needs --max-staleness 0; with an FP8 "
                              "--rollout-dtype, --learner.fp8_forward)")
    push_timeout: float = knob(600.0, "MPMD runs (sharding/mpmd.py): a process whose heartbeat stopped for min(this, "
                                      "20) s, or never started within this, is dead (the others exit naming it); "
                                      "the weight transfer's timeout; the two-job layout: the heartbeat age after "
                                      "which the other job counts as dead")
    address: str | None = knob(None, "the two-job layout (rl/rollout/two_job.py): HOST:PORT this actor job listens on "
                                     "for a rollout job of its own (started with --rollout-job --actor-address "
                                     "HOST:PORT; a host the rollout can reach); unset: the rollout runs in this job")
    job: bool = knob(False, "this process is a rollout job of the two-job layout: it serves the actor job at "
                            "--actor-address (same run flags otherwise) and exits when the actor stops")
    actor_address: str | None = knob(None, "with --rollout-job: the actor job's --rollout-address (HOST:PORT)")
    restart_timeout: float = knob(1800.0, "the two-job layout: seconds the actor waits for a rollout job to "
                                          "register (at start, and after its rollout died) before exiting with an "
                                          "error naming it")

    def length_split(self) -> tuple[float, int]:
        """(long share, short cap) of `length_schedule` 'FRAC:SHORT'; ValueError naming the flag when malformed."""
        frac, _, short = str(self.length_schedule).partition(":")
        try:
            f, n = float(frac), int(short)
        except ValueError:
            f, n = -1.0, 0
        if not (0 <= f <= 1 and 1 <= n <= self.max_new_tokens):
            raise ValueError(f"rollout.length_schedule (--rollout.length_schedule) must be FRAC:SHORT with FRAC in "
                             f"[0, 1] and SHORT in 1..--max-new-tokens ({self.max_new_tokens}), got "
                             f"{self.length_schedule!r}")
        return f, n

    def length_caps(self, data_index) -> list[int] | None:
        """Per-prompt response length limits [n] of `length_schedule` for prompts of data indices `data_index`
        [n] (a function of the index alone: the same prompt gets the same limit in every schedule); None when
        unset. Prompt i is long (keeps max_new_tokens) iff floor((i + 1) FRAC) > floor(i FRAC)."""
        if self.length_schedule is None:
            return None
        f, short = self.length_split()
        return [self.max_new_tokens if math.floor((int(i) + 1) * f) > math.floor(int(i) * f) else short
                for i in data_index]

    def __post_init__(self):
        check_choices("rollout", self)
        slots = self.slots
        if isinstance(slots, str) and slots.strip().lower() != "auto":
            try:
                slots = int(slots)
            except ValueError:
                slots = None
        elif isinstance(slots, str):
            slots = "auto"
        if slots is None or isinstance(slots, bool) or (slots != "auto" and (not isinstance(slots, int) or slots < 0)):
            raise ValueError(f"rollout.slots (--rollout-slots) must be auto or an int >= 0 (0 = static batching), "
                             f"got {self.slots!r}")
        object.__setattr__(self, "slots", slots)
        if not check_real("rollout", "push_timeout", self.push_timeout) > 0:
            raise ValueError(f"rollout.push_timeout (--push-timeout) must be > 0 seconds, got {self.push_timeout}")
        if not check_real("rollout", "restart_timeout", self.restart_timeout) > 0:
            raise ValueError(f"rollout.restart_timeout (--rollout-restart-timeout) must be > 0 seconds, "
                             f"got {self.restart_timeout}")
        for name, flag in (("address", "--rollout-address"), ("actor_address", "--actor-address")):
            value = getattr(self, name)
            host, sep, port = str(value).rpartition(":")
            if value is not None and not (sep and host and port.isdigit() and int(port) < 65536):
                raise ValueError(f"rollout.{name} ({flag}) must be HOST:PORT, got {value!r}")
        if self.job and self.actor_address is None:
            raise ValueError("rollout.job (--rollout-job) needs --actor-address HOST:PORT (the actor job's "
                             "--rollout-address)")
        if self.job and self.address is not None:
            raise ValueError("rollout: --rollout-job and --rollout-address name the two sides of the two-job "
                             "layout; give a process one of them")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness (--max-staleness) must be an int >= 0, "
                             f"got {self.max_staleness!r}")
        check_ints("rollout", self, ("prompts_per_step", "max_new_tokens"), 1)
        check_ints("rollout", self, ("partial_segment",), 0)
        check_ints("rollout", self, ("max_turns",), 1)
        if check_real("rollout", "tool_timeout_s", self.tool_timeout_s) <= 0:
            raise ValueError(f"rollout.tool_timeout_s must be > 0, got {self.tool_timeout_s!r}")
        if self.length_schedule is not None:
            self.length_split()
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or not 1 <= self.draft_tokens <= 3:
            raise ValueError(f"rollout.draft_tokens (--rollout.draft_tokens) must be an int in 1..3, "
                             f"got {self.draft_tokens!r}")
        check_ints("rollout", self, ("top_k", "push_verify_every", "prefill_chunk"), 0)
        f = self.ep_capacity_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f)
                              or f <= 0):
            raise ValueError(f"rollout.ep_capacity_factor (--rollout.ep_capacity_factor) must be > 0, or none "
                             f"(dropless), got {f!r}")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"rollout.group_size (--group-size) must be >= 2 for group advantages, "
                             f"got {self.group_size}")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"rollout.dtype (--rollout-dtype) must be fp8|fp8_e4m3fnuz|fp8+fp4experts|bf16|fp32|auto, "
                             f"got {self.dtype!r}")
        if check_real("rollout", "temperature", self.temperature) < 0 or not 0 < self.top_p <= 1:
            raise ValueError("rollout: --temperature must be >= 0 and --top-p in (0, 1]")
