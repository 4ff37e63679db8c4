"""Dataset layouts RL users already have, and how a prompt becomes text: presets, field paths, chat templates.

Presets (`--data-format`; `--prompt-field` / `--answer-field` override a preset's fields):

    format  prompt field   answer field                 answer text                 --reward auto
    gsm8k   question       answer                       after "#### " (GSM8K)        gsm8k
    verl    prompt         reward_model.ground_truth    as is (str / number)         dapo
    miles   prompt         label                        as is (str / number)         dapo

- veRL parquet (e.g. DAPO-Math-17K as veRL's recipe prepares it): `prompt` is a list of chat messages
  [{"role": "user", "content": ...}], `reward_model` = {"style": "rule", "ground_truth": "34"}, `data_source`.
- Miles / slime jsonl (`--input-key prompt --label-key label` in slime's DAPO and AIME-2024 examples): `prompt`
  is a string or a list of messages, `label` the answer.
- AIME-24/25 jsonl with other names: `--data-format miles --prompt-field problem --answer-field answer`.
Field names are dotted paths into nested records (`get_field`).

Prompt text (`make_renderer`):
- `--apply-chat-template`: a one-turn conversation ([system if --system-prompt, user], or the record's own list
  of messages) rendered by the tokenizer folder's Jinja chat template (rl/data/chat.py) with the generation prompt and
  `--thinking`; a string prompt is first filled into `--chat-template` when that is given (e.g. an instruction
  around `{prompt}`). Rendered templates write their own BOS, so none is added.
- otherwise: `--chat-template` (a Python format string over the record's fields and `{prompt}`) or the prompt as
  it is, with the tokenizer's BOS first. A list of messages needs `--apply-chat-template`.

Run the tests: `.venv/bin/python -m pytest -q tests/rl/test_data_formats.py`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from rl.data.chat import DEEPSEEK_V4, as_messages, compile_template, load_chat_template, render_chat, thinking_kwargs
from rl.data.prompts import DataError, PromptDataset, gsm8k_final_answer
from rl.data.tokenizer import apply_template, check_template

log = logging.getLogger("dsv4rl")

DATA_FORMATS = ("gsm8k", "verl", "miles")


def plain_answer(value: Any) -> str:
    """A dataset's answer as reference text: strings stripped, numbers as written ("204", "0.5").

    Raises ValueError for other types (lists, dicts, None)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected the answer as a string or a number, got {type(value).__name__} {value!r:.60}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if not text:
        raise ValueError("the answer is empty")
    return text


@dataclasses.dataclass(frozen=True)
class DataFormat:
    """A dataset layout: where prompt and answer are, how the answer becomes a reference, the default reward."""

    prompt_field: str
    answer_field: str
    answer_extractor: Callable[[Any], str]
    reward: str


PRESETS = {
    "gsm8k": DataFormat("question", "answer", gsm8k_final_answer, "gsm8k"),
    "verl": DataFormat("prompt", "reward_model.ground_truth", plain_answer, "dapo"),
    "miles": DataFormat("prompt", "label", plain_answer, "dapo"),
}


def resolve_format(cfg) -> tuple[str, str, DataFormat]:
    """(prompt field, answer field, preset) of a RunConfig: the flags, else the `--data-format` preset's."""
    fmt = PRESETS[cfg.data.data_format]
    return cfg.data.prompt_field or fmt.prompt_field, cfg.data.answer_field or fmt.answer_field, fmt


def resolve_reward_name(cfg) -> str:
    """`--reward auto` -> the data format's reward; any other name as given."""
    return PRESETS[cfg.data.data_format].reward if cfg.data.reward in ("auto", "task") else cfg.data.reward


def make_renderer(cfg) -> tuple[Callable[[Any, dict], str], bool]:
    """(render(prompt value, record) -> text, add_bos) for a RunConfig (module docstring).

    Raises rl.data.chat.ChatTemplateError (a ValueError) naming the folder if --apply-chat-template finds no
    template, or the template does not compile; TokenizerError for a malformed --chat-template."""
    fmt_string = cfg.data.chat_template
    if fmt_string is not None:
        check_template(fmt_string)
    if not cfg.data.apply_chat_template:
        def render(prompt, record):
            if not isinstance(prompt, str):
                raise ValueError(f"the prompt is a list of chat messages: render it with --apply-chat-template "
                                 f"(the tokenizer folder's chat template), got {prompt!r:.60}")
            return apply_template(fmt_string, prompt, record)
        return render, True

    template, specials = load_chat_template(cfg.data.tokenizer)
    compile_template(template)  # a syntax error is reported now, once, not per record
    if template == DEEPSEEK_V4:
        log.info("--apply-chat-template: no Jinja template beside %s; using the built-in DeepSeek-V4 chat format "
                 "(encoding/encoding_dsv4.py is not run)", cfg.data.tokenizer)
    extra = thinking_kwargs(cfg.data.thinking)

    def render(prompt, record):
        if isinstance(prompt, str) and fmt_string is not None:
            prompt = apply_template(fmt_string, prompt, record)
        return render_chat(template, as_messages(list(prompt) if not isinstance(prompt, str) else prompt,
                                                 cfg.data.system_prompt), add_generation_prompt=True,
                           special_tokens=specials, **extra)
    return render, False


def load_prompt_dataset(path: str, tokenizer, cfg) -> PromptDataset:
    """The PromptDataset of one file under a RunConfig's data flags (format, fields, template, limits)."""
    prompt_field, answer_field, fmt = resolve_format(cfg)
    render, add_bos = make_renderer(cfg)
    return PromptDataset.from_file(path, tokenizer, on_bad_record=cfg.data.on_bad_record, prompt_field=prompt_field,
                                   answer_field=answer_field, answer_extractor=fmt.answer_extractor,
                                   max_prompt_len=cfg.data.max_prompt_len, add_bos=add_bos, render=render,
                                   on_overlong=cfg.data.on_overlong_prompt)


def build_datasets(cfg, tokenizer) -> tuple[PromptDataset, PromptDataset]:
    """(train, eval) PromptDatasets of a RunConfig with a dataset; logs the first rendered prompt once.

    Without --eval-dataset, eval uses the training prompts; with --eval-only and no --dataset, the eval set also
    feeds the (unused) training iterator. Raises DataError naming file and record for bad input."""
    train_path = cfg.data.dataset or cfg.data.eval_dataset
    if train_path is None:
        raise DataError("no --dataset (or --eval-dataset) given")
    train = load_prompt_dataset(train_path, tokenizer, cfg)
    log.info("first prompt as the model sees it (%s, %d tokens):\n%s", train.locations[0], len(train.prompt(0)),
             train.first_text)
    if cfg.data.eval_dataset and cfg.data.eval_dataset != train_path:
        evd = load_prompt_dataset(cfg.data.eval_dataset, tokenizer, cfg)
    else:
        if not cfg.data.eval_dataset:
            log.warning("no --eval-dataset: evaluating on the first %d training prompts", cfg.eval.prompts)
        evd = train
    return train, evd
