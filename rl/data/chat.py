"""Chat templates: a checkpoint's own Jinja template, rendered the way transformers' `apply_chat_template` does.

A chat model has been trained on conversations in one exact text format; its checkpoint ships that format as a
Jinja template, either in `tokenizer_config.json` ("chat_template": a string, or a list of {"name", "template"}
where "default" is used) or in a `chat_template.jinja` file beside it (transformers >= 4.43 saves it there).
`load_chat_template(dir)` finds it; `render_chat(template, messages, ...)` renders it.

How the rendering matches transformers (5.23, `transformers.utils.chat_template_utils`): the same jinja2
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the `loopcontrols` extension, the same
`tojson` filter (no HTML escaping), `raise_exception`, `strftime_now`, and the template sees `messages`,
`tools=None`, `documents=None`, `add_generation_prompt`, the special tokens by name (`bos_token`, `eos_token`,
... from `tokenizer_config.json`) and any extra keyword (e.g. `enable_thinking`). The `{% generation %}` tag
(assistant masks) is accepted and renders its body unchanged. tests/rl/test_chat.py compares the text and the
token ids with transformers' own `apply_chat_template` for the same messages.

The sandbox: templates come with checkpoints from the internet; the immutable sandbox refuses attribute access
to Python internals and mutation of the inputs, as in transformers (which also requires jinja2 >= 3.1.6).

Thinking switch: chat templates of reasoning models read a boolean keyword to open or close the thinking block
(`enable_thinking` in Qwen3 / GLM templates, `thinking` in DeepSeek-V3.1 / V3.2 templates). `thinking_kwargs`
maps `--thinking on|off` to both names; `auto` passes neither (the template's default).

DeepSeek-V4 checkpoints ship their chat encoding as Python (`encoding/encoding_dsv4.py`) instead of a Jinja
template. That code is never imported or run here: when a folder has no Jinja template but has that file,
`load_chat_template` returns `DEEPSEEK_V4`, and `render_chat` renders the format it implements, tools, tool calls
and tool results included (rl/data/chat_dsv4.py, written from its behaviour). `--thinking on` is its thinking mode,
`off` and `auto` its chat mode. A `chat_template.jinja` in the folder takes precedence over this built-in format.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rl.data.chat_dsv4 import ChatTemplateError, render_deepseek_v4
from rl.data.tokenizer import read_tokenizer_config

DEEPSEEK_V4 = "builtin:deepseek_v4"  # the format of DeepSeek-V4's encoding/encoding_dsv4.py (rl/data/chat_dsv4.py)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _config_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(tokenizer_path: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """The Jinja chat template of a tokenizer folder (or of the folder of a `tokenizer.json`).

    Looks in `chat_template.jinja`, then `tokenizer_config.json` ("chat_template": str, or a list of
    {"name", "template"} from which "default" is taken), then for DeepSeek-V4's `encoding/encoding_dsv4.py`
    (-> `DEEPSEEK_V4`, the built-in renderer; the file is not read). Returns (template text or DEEPSEEK_V4,
    special tokens {name: text} read from `tokenizer_config.json`). Raises ChatTemplateError naming the folder
    and the files looked at.
    """
    path = os.fspath(tokenizer_path)
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    config_file = os.path.join(folder, "tokenizer_config.json")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    config = read_tokenizer_config(folder, ChatTemplateError)
    specials = {k: v for k in SPECIAL_TOKEN_KEYS if (v := _config_token(config, k)) is not None}
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), specials
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ChatTemplateError(f"{config_file}: chat_template lists {sorted(map(str, named))} but no 'default'")
    if (not isinstance(template, str) or not template.strip()) and os.path.isfile(
            os.path.join(folder, "encoding", "encoding_dsv4.py")):
        return DEEPSEEK_V4, specials
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError(
            f"--apply-chat-template: no chat template in {folder} (looked for chat_template.jinja, a "
            f"'chat_template' string in tokenizer_config.json and DeepSeek-V4's encoding/encoding_dsv4.py); use --chat-template 'FORMAT {{prompt}}' for a plain "
            f"prompt wrapper instead")
    return template, specials


@lru_cache(maxsize=8)
def compile_template(template: str):
    """Jinja template text -> compiled template, in transformers' sandboxed environment (module docstring).

    Raises ChatTemplateError on a syntax error (with its line number). DEEPSEEK_V4 -> None (nothing to compile).
    """
    if template == DEEPSEEK_V4:
        return None
    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (template line {e.lineno})") from None


def thinking_kwargs(thinking: str) -> dict[str, bool]:
    """`--thinking` -> template keywords: "on" / "off" set both `enable_thinking` and `thinking`; "auto" none."""
    if thinking == "auto":
        return {}
    if thinking not in ("on", "off"):
        raise ChatTemplateError(f"--thinking must be auto|on|off, got {thinking!r}")
    return {"enable_thinking": thinking == "on", "thinking": thinking == "on"}


def render_chat(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **kwargs: Any) -> str:
    """`messages` ([{"role": ..., "content": ...}]) rendered by the Jinja `template` -> text.

    Same result as transformers' `tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=add_generation_prompt, **kwargs)` for a tokenizer whose special tokens are
    `special_tokens`. Raises ChatTemplateError if a message is not a dict or the template raises.
    """
    msgs = []
    for m in messages:
        if not isinstance(m, dict):
            raise ChatTemplateError(f"chat messages must be dicts with 'role' and 'content', got {m!r:.80}")
        msgs.append(dict(m))
    if template == DEEPSEEK_V4:
        return render_deepseek_v4(msgs, add_generation_prompt=add_generation_prompt,
                                  thinking=bool(kwargs.get("thinking", False)))
    compiled = compile_template(template)
    try:
        return compiled.render(messages=msgs, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                               **{**(special_tokens or {}), **kwargs})
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None


def as_messages(prompt: str | Sequence[dict], system_prompt: str | None = None) -> list[dict]:
    """A prompt (a string, or a list of messages as veRL / slime datasets store it) -> a one-turn conversation:
    [system?, user]. A given `system_prompt` is added only when the messages have no system message."""
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    else:
        msgs = [dict(m) for m in prompt]
    if system_prompt is not None and not any(m.get("role") == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs
