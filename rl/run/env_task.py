"""The data and the reward of a multi-turn run (`--rollout.env`, rl/rollout/multiturn.py): what
`rl.run.wiring.load_data` builds instead of the built-in digit task's.

    key_lookup    prompts generated from the seed (`rl.agent.key_lookup.KeyLookupTask`, value digits
                  `--task-digits`, its keys `ENV_KEYS`): train = prompt indices [0, TRAIN_PROMPTS), eval = indices
                  from EVAL_START on (never a train prompt); the tokenizer is the task's `PieceTokenizer`; each
                  row's reference is its data "KEY=VALUE", which the environment's tools and reward read
    python_math   prompts from --dataset / --eval-dataset (`--data-format` fields, `--max-prompt-len`, `--on-bad-record`
                  as a single-turn run reads them), each rendered in DeepSeek-V4's chat format with the environment's
                  system text and its `python` tool section (`rl.data.chat_dsv4.render_deepseek_v4`, chat mode), encoded
                  with --tokenizer; the reward is `--reward` (auto: the data format's) on the final turn's answer
                  against the row's reference

Reward (`EnvReward`, the run's one `rl.data.rewards.RewardFn`): the environment's end-of-trajectory reward
(`rl.agent.env.reward`) on each row's last model turn (`RolloutBatch.final_turns`, what rl/run/stages.py's `score`
passes with a multi-turn batch), decoded with its special tokens, and, for an environment with a shaped credit
(key_lookup's `call_progress`), its first model turn (the trajectory up to its first EOS); exact = reward 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rl.agent import env as envlib
from rl.agent.key_lookup import KeyLookupTask
from rl.agent.registry import make_env
from rl.data.chat_dsv4 import render_deepseek_v4
from rl.data.prompts import PromptDataset
from rl.data.formats import resolve_format, resolve_reward_name
from rl.rollout.multiturn import MultiTurn
from rl.data.tokenizer import load_tokenizer

TRAIN_PROMPTS = 4096
EVAL_START = 1 << 20
ENV_KEYS = 4  # keys 0..3 (KeyLookupTask.n_keys; benchmarks/README.md, agentic.py)


@dataclasses.dataclass(frozen=True)
class EnvReward:
    """`rl.data.rewards.RewardFn` of a multi-turn run: (references [N] row data, final model turns [N] token lists,
    optional trajectories [N] token lists: each row's whole response side, model and environment turns; default
    the final turns) -> (rewards [N] float32 in [0, 1], exact [N] bool = reward 1, {}). The first model turn (what
    an environment's shaping reads) is a trajectory up to its first EOS. No worker process: the environments'
    rewards are string comparisons."""

    env: envlib.Environment
    tokenizer: Any

    def __call__(self, references, responses, trajectories=None):
        dec = getattr(self.tokenizer, "decode_with_specials", self.tokenizer.decode)
        eos = self.tokenizer.eos_id
        trajectories = responses if trajectories is None else trajectories
        r = []
        for ref, x, t in zip(references, responses, trajectories):
            t = list(map(int, t))
            first = t[:t.index(eos) + 1] if eos in t else t
            r.append(envlib.reward(self.env, dec(list(map(int, x))), ref, dec(first)))
        r = np.array(r, np.float32)
        return r, r >= 1.0, {}


def key_lookup_task(cfg) -> KeyLookupTask:
    """The run's KeyLookupTask: `--task-digits` value digits, `ENV_KEYS` keys, `--seed`."""
    return KeyLookupTask(n_keys=ENV_KEYS, value_digits=cfg.data.task_digits, seed=cfg.seed)


def load_env_data(cfg):
    """`rl.run.wiring.load_data` of a `--rollout.env` run -> (tokenizer, None, train PromptDataset, eval prompts, eval
    references, EnvReward, None). Raises ValueError (one line, naming the flag) for an environment without built-in
    prompts or with --dataset."""
    name = cfg.rollout.env
    if name == "python_math":
        return load_python_math_data(cfg)
    if cfg.data.dataset is not None or cfg.data.eval_dataset is not None:
        raise ValueError("--rollout.env key_lookup generates its own prompts; drop --dataset / --eval-dataset")
    task = key_lookup_task(cfg)
    tok = task.tokenizer
    train = task.prompts(TRAIN_PROMPTS)
    n_eval = min(cfg.eval.prompts, TRAIN_PROMPTS)
    ev = task.prompts(n_eval, start=EVAL_START)
    source = f"KeyLookupTask(n_keys={task.n_keys}, value_digits={task.value_digits}, seed={task.seed})"
    data = PromptDataset([p for p, _ in train], [d for _, d in train], max_prompt_len=max(len(p) for p, _ in train),
                         pad_id=tok.pad_id, source=source)
    return (tok, None, data, [p for p, _ in ev], [d for _, d in ev],
            EnvReward(make_env(name, thinking=task.thinking), tok), None)


def load_python_math_data(cfg):
    """`load_env_data` of `--rollout.env python_math` (module docstring). Raises ValueError naming the flag without
    --dataset (RunConfig requires --tokenizer with one); DataError / TokenizerError for a bad file, as a single-turn
    run."""
    d = cfg.data
    if d.dataset is None and d.eval_dataset is None:
        raise ValueError("--rollout.env python_math: its prompts come from a math --dataset (gsm8k / verl / miles "
                         "jsonl or parquet, --data-format), none given")
    env = make_env("python_math", reward=resolve_reward_name(cfg))
    tok = load_tokenizer(d.tokenizer)
    prompt_field, answer_field, fmt = resolve_format(cfg)

    def render(prompt, record):
        del record
        messages = envlib.reset(env, prompt) if isinstance(prompt, str) else \
            [{"role": "system", "content": env.system, "tools": list(env.tools)}, *prompt]
        return render_deepseek_v4(messages)

    def read(path):
        return PromptDataset.from_file(path, tok, on_bad_record=d.on_bad_record, prompt_field=prompt_field,
                                       answer_field=answer_field, answer_extractor=fmt.answer_extractor,
                                       max_prompt_len=d.max_prompt_len, add_bos=False, render=render,
                                       on_overlong=d.on_overlong_prompt)

    train = read(d.dataset or d.eval_dataset)
    evd = read(d.eval_dataset) if d.eval_dataset and d.eval_dataset != (d.dataset or d.eval_dataset) else train
    n = min(cfg.eval.prompts, len(evd))
    return (tok, None, train, [evd.prompt(i) for i in range(n)], evd.references[:n], EnvReward(env, tok),
            evd if evd is not train else None)


def multiturn_request(cfg, data) -> MultiTurn | None:
    """The `RolloutRequest.multiturn` of rows whose references are `data` [N] (None: not a --rollout.env run)."""
    r = cfg.rollout
    if r.env is None:
        return None
    return MultiTurn(env=r.env, data=tuple(data), max_turns=r.max_turns, tool_timeout_s=r.tool_timeout_s)
