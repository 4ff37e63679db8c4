"""Tokenizers for RL: the `TokenizerLike` protocol and a wrapper around Hugging Face `tokenizer.json`.

Everything the RL stack needs from a tokenizer is `TokenizerLike`: `encode(text) -> list[int]`,
`decode(ids) -> str`, `vocab_size`, `eos_id`, `bos_id` (None when the vocabulary has none) and
`pad_id`. Two implementations: `HFTokenizer` (this file, from a `tokenizer.json` via the
`tokenizers` library) and `rl.data.tasks.CharTokenizer` (the built-in digit task).

Choices:
- `encode` never adds special tokens; the prompt dataset prepends BOS itself (`add_bos`), so the
  same rule holds for every tokenizer.
- `decode` drops special tokens and ids outside the vocabulary: a model's vocabulary may be larger
  than its tokenizer's (padded embeddings), and a sampled padding id must not crash a reward.
- Special tokens are found, in order: an explicit argument (`eos_token="..."`), then
  `tokenizer_config.json` beside `tokenizer.json` (its `eos_token` / `bos_token` / `pad_token`, as
  HF writes them), then the first of the candidate names below present in the vocabulary. EOS is
  required; BOS may be absent; PAD falls back to the `padding` section of `tokenizer.json`, then EOS.
- The chat template is a Python format string such as "Question: {question}\\nAnswer:" (fields are
  filled from the record; `{prompt}` is always the prompt text). Jinja templates are not supported:
  RL prompts for base models need one fixed wrapper, not a conversation renderer.

Usage:
    tok = load_tokenizer("path/to/tokenizer.json", chat_template="Question: {question}\\nAnswer:")
    check_vocab(tok, model_config.vocab_size)
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer

# Candidate special-token names, most specific first (DeepSeek's own names lead).
EOS_CANDIDATES = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]")
BOS_CANDIDATES = ("<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "[BOS]")
PAD_CANDIDATES = ("<｜▁pad▁｜>", "<|pad|>", "<|padding|>", "<pad>", "[PAD]")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or a tokenizer that does not fit the model."""


def read_tokenizer_config(folder: str, error: type[ValueError] = TokenizerError) -> dict:
    """`tokenizer_config.json` of a tokenizer folder as a dict ({} when absent). Raises `error` naming the file
    when it exists but cannot be read or is not JSON."""
    config_file = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return {}
    try:
        with open(config_file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"cannot read {config_file}: {e}") from None


@runtime_checkable
class TokenizerLike(Protocol):
    """What the RL stack needs from a tokenizer (see the module docstring for the rules)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def check_template(template: str) -> list[str]:
    """Validates a format-string template; returns its field names. Raises TokenizerError if it is
    malformed (unbalanced braces), has positional fields, or has no field at all."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise TokenizerError(f"chat template {template!r} is not a valid format string: {e}") from None
    if not fields:
        raise TokenizerError(f"chat template {template!r} has no field; write e.g. 'Question: {{question}}\\nAnswer:'")
    if any(f == "" or f.isdigit() for f in fields):
        raise TokenizerError(f"chat template {template!r} has a positional field; name it, e.g. {{prompt}}")
    return fields


def apply_template(template: str | None, prompt: str, fields: dict | None = None) -> str:
    """Fills `template` with `fields` (a record) and `prompt`; no template -> `prompt` unchanged.

    Raises KeyError naming a field the template wants and `fields` lacks.
    """
    if template is None:
        return prompt
    return template.format_map({**(fields or {}), "prompt": prompt})


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind `TokenizerLike`; build with `load_tokenizer`.

    vocab_size is 1 + the largest id (added tokens included), the size an embedding needs.
    """

    def __init__(self, tok, *, path: str, eos_id: int, bos_id: int | None, pad_id: int,
                 chat_template: str | None = None):
        self._tok = tok
        self.path = path
        self._eos_id, self._bos_id, self._pad_id = eos_id, bos_id, pad_id
        self._vocab_size = 1 + max(tok.get_vocab(with_added_tokens=True).values())
        if chat_template is not None:
            check_template(chat_template)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str) -> list[int]:
        """text -> ids, without special tokens (no BOS/EOS from the post-processor)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """ids -> text; special tokens and ids outside [0, vocab_size) are dropped."""
        keep = [int(i) for i in ids if 0 <= int(i) < self._vocab_size]
        return self._tok.decode(keep, skip_special_tokens=True)

    def decode_with_specials(self, ids: Sequence[int]) -> str:
        """ids -> text with the special tokens written out (a chat format's markup, e.g. DeepSeek-V4's EOS and
        tool-call tokens, which a multi-turn rollout parses); ids outside [0, vocab_size) are dropped."""
        keep = [int(i) for i in ids if 0 <= int(i) < self._vocab_size]
        return self._tok.decode(keep, skip_special_tokens=False)

    def format_prompt(self, prompt: str, **fields) -> str:
        """The chat template filled with `prompt` (and `fields`); the prompt itself if there is none."""
        return apply_template(self.chat_template, prompt, fields)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _config_token(config: dict, key: str) -> str | None:
    """`tokenizer_config.json` stores a special token as a string or as {"content": ...}."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _find_special(tok, path: str, role: str, explicit: str | None, config: dict, candidates: Sequence[str]):
    """-> id of the `role` token by the lookup order of the module docstring, or None if not found."""
    if explicit is not None:
        tid = tok.token_to_id(explicit)
        if tid is None:
            raise TokenizerError(f"{path}: {role} token {explicit!r} is not in the vocabulary")
        return tid
    named = _config_token(config, f"{role}_token")
    if named is not None and tok.token_to_id(named) is not None:
        return tok.token_to_id(named)
    for name in candidates:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    return None


def load_tokenizer(path: str | os.PathLike, *, eos_token: str | None = None, bos_token: str | None = None,
                   pad_token: str | None = None, chat_template: str | None = None) -> HFTokenizer:
    """Loads a Hugging Face `tokenizer.json` (or a folder holding one) as an `HFTokenizer`.

    Raises TokenizerError naming the path if the file is missing, is not valid JSON / not a
    tokenizer, has no EOS token under any name we look for, or if an explicit token is unknown.
    """
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise TokenizerError(f"tokenizer file not found: {file} (expected a Hugging Face tokenizer.json or a folder "
                             "holding one; launch/configs/gsm8k_tiny.yaml shows how to train a small BPE)")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
        tok = Tokenizer.from_str(json.dumps(raw))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read tokenizer file {file}: {e}") from None
    except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception for a JSON that is not a tokenizer
        raise TokenizerError(f"{file} is not a Hugging Face tokenizer.json: {e}") from None

    config = read_tokenizer_config(os.path.dirname(file))

    eos_id = _find_special(tok, file, "eos", eos_token, config, EOS_CANDIDATES)
    if eos_id is None:
        named = _config_token(config, "eos_token")
        seen = f"its eos_token {named!r} is not in the vocabulary" if named is not None else "it names no eos_token"
        raise TokenizerError(f"--tokenizer {file}: no EOS token found (looked for {', '.join(EOS_CANDIDATES)}; "
                             f"tokenizer_config.json: {seen}); name the tokenizer's end-of-sequence token in "
                             f"{os.path.join(os.path.dirname(file), 'tokenizer_config.json')} as "
                             '{"eos_token": "<its text>"} (Python: load_tokenizer(path, eos_token=...))')
    bos_id = _find_special(tok, file, "bos", bos_token, config, BOS_CANDIDATES)
    pad_id = _find_special(tok, file, "pad", pad_token, config, PAD_CANDIDATES)
    if pad_id is None:
        padding = raw.get("padding") if isinstance(raw, dict) else None
        pad_id = padding.get("pad_id") if isinstance(padding, dict) else None
        pad_id = eos_id if pad_id is None else int(pad_id)
    return HFTokenizer(tok, path=file, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id, chat_template=chat_template)


def check_vocab(tokenizer: TokenizerLike, model_vocab_size: int) -> None:
    """Raises TokenizerError if the tokenizer can emit ids the model's embedding does not have.

    A model vocabulary larger than the tokenizer's is fine (padded embeddings, or the 16-token
    digit task on a 256-row tiny model); a smaller one would index out of range.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"tokenizer vocabulary ({tokenizer.vocab_size} ids) is larger than the model's ({model_vocab_size}): "
            f"ids >= {model_vocab_size} have no embedding row; use the model's own tokenizer or a model config "
            f"with vocab_size >= {tokenizer.vocab_size}")
