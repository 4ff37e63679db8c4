"""One steady-state GRPO step: dsv4-rl (JAX: `rl.rollout.engine.Sampler` + `rl.algo.learner.Learner`) vs TRL's
`GRPOTrainer` (transformers generate + torch autograd), same tiny DeepSeek-V4 weights, same work, same CPU, fp32 on both
sides.

The work of one step, on both sides: 2 prompts (8 tokens each) x 4 generations = 8 samples of exactly 16 new
tokens (temperature 1; no stop token on our side, `min_new_tokens=16` on TRL's, so no sample ends early), a
trivial reward (distinct tokens / length of the completion), group advantages, one policy-gradient update
(AdamW, grad-norm clip 1.0, no KL term, so no reference model on either side), and the new weights made
available to the generator:
- ours: `Sampler.generate` (fp32 weights and compute, jitted prefill + while_loop decode) -> reward ->
  `rl.algo.advantages.grpo_advantages` -> `Learner.update` (fp32 compute, routing replay + TIS correction, as the
  default run) -> `Sampler.update_weights(learner.params_for_push(), version)`; each stage is blocked on, and the
  step is timed end to end with `time.perf_counter` after 2 warm-up (compile) steps.
- TRL: `GRPOTrainer` with `per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=1`
  (one optimizer step = one generation round of 2 prompts x 4), `max_completion_length=16`, no vLLM,
  `bf16=False` (fp32, as ours; TRL's default is bf16 mixed precision) and
  `gradient_checkpointing=False` (TRL's default is True, which recomputes activations), `router_aux_loss_coef=0.0`
  (else TRL reads `config.num_experts`, which DeepseekV4Config lacks, and crashes). It trains the transformers
  model in place, so generation always uses the current weights (no push needed). Step time = from the end of
  the previous `on_step_end` callback (or `on_train_begin`) to the next `on_step_end` (it covers data loading,
  generation, reward, loss, backward, optimizer and the trainer's bookkeeping); the first 2 steps are skipped.
Paired timing: after every TRL step, inside its `on_step_end` callback and outside TRL's timed interval, 3 of our
steps run, so both sides are measured under the same load of the shared machine (ours' steps beside TRL's 2
skipped steps are dropped too). Reported: the median (and min) step time of each side.
Weights: `tests/dsv4/hf_ref.py`'s transformers `DeepseekV4ForCausalLM` with non-trivial random weights
(`DSV4Config.tiny()`, 256-token vocabulary), saved with `save_pretrained` and loaded with
`dsv4.load_hf_checkpoint`; the logits of both are compared before timing. Prompts: random token ids rendered as a
word-level tokenizer's words (`t17 t42 ...`), so TRL's text pipeline and our id lists see the same tokens.

Threads: ours is XLA's default (all cores). TRL is timed at torch 1 and 2 threads (`--torch-threads`) and its
faster setting is its figure: on a 2-core machine shared with other jobs, 2 torch threads were measured up to ~10x
slower than 1 (thousands of small ops, each waiting for both threads to be scheduled).
ratio = TRL median step time (its faster thread count) / ours (> 1: ours faster). The load average is printed.

Run:   .venv/bin/python benchmarks/grpo_step_vs_trl.py            (about 3-5 minutes on 2 busy cores)
       .venv/bin/python benchmarks/grpo_step_vs_trl.py --trl-steps 8 --ours-per-trl-step 3
Needs `pip install trl` (tested with 1.16.0; not a project dependency).
The last line is `RESULT ours_step_s=.. trl_step_s=.. ratio=..`.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import copy  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv4 import DSV4Config, load_hf_checkpoint  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "dsv4"))
from hf_ref import hf_model  # noqa: E402

PROMPTS, GENERATIONS, NEW_TOKENS, PROMPT_LEN = 2, 4, 16, 8
SPECIALS = ("<pad>", "<bos>", "<eos>")


def distinct_reward(ids) -> float:
    """The trivial reward of both sides: distinct tokens / length (0 for an empty completion)."""
    return len(set(ids)) / len(ids) if len(ids) else 0.0


def make_tokenizer(vocab_size: int):
    """A word-level fast tokenizer over `<pad> <bos> <eos> t3 ... t{V-1}`: ids == the model's token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)} | {f"t{i}": i for i in range(len(SPECIALS), vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def make_prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [list(map(int, rs.randint(len(SPECIALS), vocab_size, PROMPT_LEN))) for _ in range(n)]


def as_text(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


# ---------------------------------------------------------------------------------------------------------- ours

def make_ours(ckpt: str, prompts: list[list[int]], warmup: int = 2):
    """-> (step(i) -> seconds, per-stage times {stage: [s]}, warm-up seconds): our GRPO step, compiled."""
    from rl.algo.advantages import grpo_advantages
    from rl.config.algo import LearnerConfig, LossConfig
    from rl.algo.batch import TrainBatch
    from rl.algo.learner import Learner
    from rl.rollout.engine import Sampler, SamplingParams

    model = load_hf_checkpoint(ckpt, dtype=jnp.float32)
    sampler = Sampler(model, weights="fp32", max_prompt_len=PROMPT_LEN)
    learner = Learner(model, LearnerConfig(lr=1e-6, compute_dtype="float32", routing_replay=True, max_grad_norm=1.0,
                                           loss=LossConfig(correction="tis")))
    del model
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)  # no stop ids: always 16 tokens
    pidx = [i for i in range(PROMPTS) for _ in range(GENERATIONS)]
    sidx = [j for _ in range(PROMPTS) for j in range(GENERATIONS)]
    stages = {"rollout": [], "reward+adv": [], "update": [], "push": []}

    def step(i: int) -> float:
        t0 = time.perf_counter()
        group = [prompts[(PROMPTS * i + k) % len(prompts)] for k in range(PROMPTS)]
        rb = sampler.generate([p for p in group for _ in range(GENERATIONS)], sp, seed=0, step=i,
                              prompt_index=pidx, sample_index=sidx)
        t1 = time.perf_counter()
        rewards = np.array([distinct_reward(r) for r in rb.response_lists()], np.float32)
        adv, _ = grpo_advantages(jnp.asarray(rewards), GENERATIONS)
        ids, mask, resp, rlp = rb.sequences()
        batch = TrainBatch(input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                           response_mask=jnp.asarray(resp), rollout_logprobs=jnp.asarray(rlp),
                           advantages=jax.block_until_ready(adv), routing=jnp.asarray(rb.routing))
        t2 = time.perf_counter()
        metrics = jax.block_until_ready(learner.update(batch))
        t3 = time.perf_counter()
        sampler.update_weights(learner.params_for_push(), version=i + 1)
        jax.block_until_ready(sampler.weight_state())
        t4 = time.perf_counter()
        assert rb.lengths.min() == NEW_TOKENS and np.isfinite(float(metrics["train/grad_norm"]))
        for k, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            stages[k].append(dt)
        return t4 - t0

    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    warm_s = time.perf_counter() - t0
    for v in stages.values():
        v.clear()
    return step, stages, warm_s


# ----------------------------------------------------------------------------------------------------------- TRL

def bench_trl(hf, tokenizer, prompts: list[list[int]], steps: int, between, skip: int = 2) -> dict:
    """TRL's step times (s); `between()` runs after every TRL step, outside the timed intervals."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.resumed = [], None

        def on_train_begin(self, args, state, control, **kw):
            self.resumed = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.resumed)
            between()
            self.resumed = time.perf_counter()

    def reward(prompts, completions, completion_ids, **kw):
        return [distinct_reward(c) for c in completion_ids]

    lengths = []

    def length_probe(prompts, completions, completion_ids, **kw):  # weight 0: only records the completion lengths
        lengths.extend(len(c) for c in completion_ids)
        return [0.0] * len(completion_ids)

    total = skip + steps
    ds = datasets.Dataset.from_dict({"prompt": [as_text(prompts[i % len(prompts)]) for i in range(PROMPTS * total)]})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=total, per_device_train_batch_size=PROMPTS * GENERATIONS,
            num_generations=GENERATIONS, gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS}, temperature=1.0, learning_rate=1e-6,
            max_grad_norm=1.0, beta=0.0, bf16=False, fp16=False, gradient_checkpointing=False,
            router_aux_loss_coef=0.0, use_vllm=False, use_cpu=True, report_to="none", logging_steps=10_000,
            save_strategy="no", disable_tqdm=True, shuffle_dataset=False, dataloader_num_workers=0,
            reward_weights=[1.0, 0.0], seed=0,
        )
        timer = StepTimer()
        trainer = GRPOTrainer(model=hf, reward_funcs=[reward, length_probe], args=args, train_dataset=ds,
                              processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    times = timer.times
    if len(times) != total:
        raise RuntimeError(f"TRL ran {len(times)} optimizer steps, expected {total}")
    if set(lengths) != {NEW_TOKENS}:
        raise RuntimeError(f"TRL completions were not all {NEW_TOKENS} tokens: {sorted(set(lengths))}")
    if len(lengths) != total * PROMPTS * GENERATIONS:
        raise RuntimeError(f"TRL generated {len(lengths)} completions, expected {total * PROMPTS * GENERATIONS}")
    timed = list(times[skip:])
    return {"step_s": statistics.median(timed), "min_s": min(timed), "first_s": float(times[0]), "n": len(timed),
            "all": timed}


# ---------------------------------------------------------------------------------------------------------- main

def machine_context() -> str:
    import flax
    import torch
    import transformers
    import trl

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"machine: {platform.machine()} {platform.processor() or ''} | usable cores {cores} "
            f"(os.cpu_count {os.cpu_count()}) | load average {load()}\n"
            f"versions: python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, "
            f"torch {torch.__version__} (default threads {torch.get_num_threads()}), "
            f"transformers {transformers.__version__}, trl {trl.__version__} | jax devices {jax.devices()}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-steps", type=int, default=6, help="timed TRL steps (after 2 skipped steps)")
    ap.add_argument("--ours-per-trl-step", type=int, default=3, help="our steps run after each TRL step")
    ap.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2],
                    help="torch thread counts TRL is timed at; the fastest is TRL's figure")
    args = ap.parse_args(argv)

    import torch

    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: .venv/bin/pip install trl  (tested with 1.16.0)", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    print(machine_context(), flush=True)

    cfg = DSV4Config.tiny()
    hf = hf_model(cfg, seed=0)  # fp32, eager attention
    hf.config.router_aux_loss_coef = 0.0
    tokenizer = make_tokenizer(cfg.vocab_size)
    prompts = make_prompts(64, cfg.vocab_size)
    assert tokenizer(as_text(prompts[0]), add_special_tokens=False)["input_ids"] == prompts[0]

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours_model = load_hf_checkpoint(d, dtype=jnp.float32)
        x = np.array(prompts[:2])
        with torch.no_grad():
            ref = hf(torch.tensor(x), use_cache=False).logits.numpy()
        delta = float(np.abs(np.asarray(ours_model(jnp.asarray(x, jnp.int32)).logits) - ref).max())
        del ours_model
        print(f"tiny DeepSeek-V4: {sum(p.numel() for p in hf.parameters()):,} parameters; "
              f"max |logits ours - transformers| = {delta:.2e}", flush=True)
        if not delta < 1e-3:
            raise RuntimeError(f"the two models disagree (max logit difference {delta})")
        print(f"work per step: {PROMPTS} prompts x {GENERATIONS} generations x {NEW_TOKENS} new tokens "
              f"(prompts of {PROMPT_LEN} tokens), fp32", flush=True)
        step, stages, warm_s = make_ours(d, prompts)
    print(f"[ours] 2 warm-up steps (compile) {warm_s:.1f} s", flush=True)

    # Paired timing: after every TRL optimizer step, `ours_per_trl_step` of our steps run (outside TRL's timed
    # interval), so the two sides are measured under the same load of the shared machine.
    ours_times: list[float] = []
    ours_skip: set[int] = set()

    def between():
        for _ in range(args.ours_per_trl_step):
            ours_times.append(step(2 + len(ours_times)))

    runs = {}
    t0 = time.perf_counter()
    for threads in args.torch_threads:
        torch.set_num_threads(threads)
        n0 = len(ours_times)
        runs[threads] = bench_trl(copy.deepcopy(hf), tokenizer, prompts, args.trl_steps, between)
        ours_skip.update(range(n0, n0 + 2 * args.ours_per_trl_step))  # beside TRL's 2 skipped steps
        r = runs[threads]
        print(f"[trl ] torch threads {threads}: step {r['step_s'] * 1e3:.1f} ms median of {r['n']} "
              f"(min {r['min_s'] * 1e3:.1f}) | first step {r['first_s']:.1f} s | steps (s) "
              + " ".join(f"{x:.2f}" for x in r["all"]) + f" | load {load()}", flush=True)
    timed = [t for i, t in enumerate(ours_times) if i not in ours_skip]
    keep = [i for i in range(len(ours_times)) if i not in ours_skip]
    ours = {"step_s": statistics.median(timed), "min_s": min(timed), "n": len(timed),
            **{f"{k}_s": statistics.median([v[i] for i in keep]) for k, v in stages.items()}}
    print(f"[ours] step {ours['step_s'] * 1e3:.1f} ms median of {ours['n']} (min {ours['min_s'] * 1e3:.1f}) | "
          f"rollout {ours['rollout_s'] * 1e3:.1f}, reward+adv {ours['reward+adv_s'] * 1e3:.1f}, "
          f"update {ours['update_s'] * 1e3:.1f}, push {ours['push_s'] * 1e3:.1f} ms | steps (s) "
          + " ".join(f"{x:.3f}" for x in timed), flush=True)
    print(f"timing of both: {time.perf_counter() - t0:.0f} s", flush=True)

    best = min(runs, key=lambda k: runs[k]["step_s"])  # TRL at its fastest torch thread count
    theirs = runs[best]
    ratio = theirs["step_s"] / ours["step_s"]
    print("\n| | step (median) | min | notes |\n|---|---|---|---|")
    print(f"| dsv4-rl (JAX, jit) | {ours['step_s'] * 1e3:.1f} ms | {ours['min_s'] * 1e3:.1f} ms | rollout "
          f"{ours['rollout_s'] * 1e3:.1f} / reward+adv {ours['reward+adv_s'] * 1e3:.1f} / update "
          f"{ours['update_s'] * 1e3:.1f} / push {ours['push_s'] * 1e3:.1f} ms (medians) |")
    for threads, r in runs.items():
        print(f"| TRL GRPOTrainer, torch threads {threads} | {r['step_s'] * 1e3:.1f} ms | {r['min_s'] * 1e3:.1f} ms | "
              f"ratio {r['step_s'] / ours['step_s']:.1f}x{' (used)' if threads == best else ''} |")
    print(f"| ratio (TRL at {best} thread(s) / ours) | {ratio:.1f}x | {theirs['min_s'] / ours['min_s']:.1f}x | |\n")
    print(f"RESULT ours_step_s={ours['step_s']:.4f} trl_step_s={theirs['step_s']:.4f} ratio={ratio:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
