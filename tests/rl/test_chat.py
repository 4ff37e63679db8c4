"""rl/data/chat.py renders a checkpoint's Jinja chat template exactly as transformers' `apply_chat_template` does: same
text and same token ids for the same messages and keywords (system prompt, thinking on / off / default), with a
small BPE tokenizer and a `tokenizer_config.json` made here (no network). Also: where templates are found, and
the errors that name the folder / flag.

    .venv/bin/python -m pytest -q tests/rl/test_chat.py
"""

from __future__ import annotations

import json
import pathlib

import pytest

from rl.data.chat import ChatTemplateError, as_messages, load_chat_template, render_chat, thinking_kwargs

from chat_fixtures import BOS, make_chat_tokenizer, train_bpe  # noqa: E402  (tests/rl on sys.path)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> pathlib.Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


CONVERSATIONS = [
    as_messages("What is 3 + 4?"),
    as_messages("What is 3 + 4?", "Please reason step by step."),
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2 + 2?", "meta": {"id": 7}}],
]


@pytest.mark.parametrize("thinking", ["auto", "on", "off"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_render_equals_transformers(chat_dir, conv, thinking):
    from transformers import AutoTokenizer

    from rl.data.tokenizer import load_tokenizer

    messages = CONVERSATIONS[conv]
    hf = AutoTokenizer.from_pretrained(str(chat_dir))
    template, specials = load_chat_template(chat_dir)
    kw = thinking_kwargs(thinking)
    ours = render_chat(template, messages, add_generation_prompt=True, special_tokens=specials, **kw)
    ref = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    assert ours == ref
    assert ours.startswith(BOS) and ours.endswith("<think>" if thinking == "on" else "</think>")
    ref_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)["input_ids"]
    assert load_tokenizer(chat_dir / "tokenizer.json").encode(ours) == list(ref_ids)  # special tokens as one id
    assert render_chat(template, messages, add_generation_prompt=False, special_tokens=specials, **kw) == \
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kw)


def test_system_prompt_is_not_doubled():
    msgs = as_messages([{"role": "system", "content": "own"}, {"role": "user", "content": "q"}], "extra")
    assert [m["content"] for m in msgs] == ["own", "q"]
    assert as_messages("q", "sys") == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]


def test_template_file_and_named_templates(tmp_path):
    a = tmp_path / "a"
    train_bpe(a, ["x y"])
    (a / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    (a / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    template, specials = load_chat_template(a / "tokenizer.json")
    assert render_chat(template, as_messages("hi", "s")) == "[s][hi]" and specials == {"eos_token": "<|pad|>"}
    b = tmp_path / "b"
    b.mkdir()
    (b / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages[0].content }}"}]}))
    template, _ = load_chat_template(b)
    assert render_chat(template, as_messages("q")) == "Dq"


def test_errors_name_the_folder_and_flag(tmp_path, chat_dir):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match=f"--apply-chat-template: no chat template in {tmp_path}"):
        load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError, match="does not compile.*line 1"):
        render_chat("{% for m in messages %}", as_messages("q"))
    template, specials = load_chat_template(chat_dir)
    with pytest.raises(ChatTemplateError, match='unknown role "tool"'):
        render_chat(template, [{"role": "tool", "content": "x"}], special_tokens=specials)
    with pytest.raises(ChatTemplateError, match="must be dicts"):
        render_chat(template, ["just text"])
    with pytest.raises(ChatTemplateError, match="--thinking"):
        thinking_kwargs("maybe")


def test_sandbox_refuses_python_internals():
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        render_chat("{{ messages.__class__.__mro__ }}", as_messages("q"))


def test_deepseek_v4_encoding_folder(tmp_path):
    """A DeepSeek-V4 checkpoint ships encoding/encoding_dsv4.py and no Jinja template: the built-in format is used
    and the Python file is never run (here it would raise)."""
    from rl.data.chat import DEEPSEEK_V4

    train_bpe(tmp_path, ["x"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text("raise RuntimeError('must not be imported')\n")
    template, _ = load_chat_template(tmp_path / "tokenizer.json")
    assert template == DEEPSEEK_V4
    one_turn = as_messages("What is 3 + 4?", "Be brief.")
    assert render_chat(template, one_turn, **thinking_kwargs("on")) == \
        f"{BOS}Be brief.<｜User｜>What is 3 + 4?<｜Assistant｜><think>"
    for thinking in ("off", "auto"):
        assert render_chat(template, one_turn, **thinking_kwargs(thinking)) == \
            f"{BOS}Be brief.<｜User｜>What is 3 + 4?<｜Assistant｜></think>"
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "r"},
               {"role": "user", "content": "1+1=?"}]
    assert render_chat(template, history, **thinking_kwargs("on")) == (
        f"{BOS}<｜User｜>hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>")
    with pytest.raises(ChatTemplateError, match="role 'developer'"):
        render_chat(template, [{"role": "developer", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")  # a Jinja template wins
    assert load_chat_template(tmp_path)[0] == "J{{ messages[0].content }}"


# DeepSeek-V4's `encoding/encoding_dsv4.py::encode_messages` (default options), three shapes the RL prompts do not
# use; the expected strings are written from its rules (module docstring of rl/data/chat.py).
EOS, USER, ASSISTANT = "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def test_deepseek_v4_consecutive_user_turns_are_joined():
    from rl.data.chat import DEEPSEEK_V4

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "c"}, {"role": "user", "content": "d"}]
    assert render_chat(DEEPSEEK_V4, msgs, **thinking_kwargs("off")) == (
        f"{BOS}S{USER}a\n\nb{ASSISTANT}</think>A{EOS}{USER}c\n\nd{ASSISTANT}</think>")
    assert render_chat(DEEPSEEK_V4, msgs, **thinking_kwargs("on")) == (
        f"{BOS}S{USER}a\n\nb{ASSISTANT}</think>A{EOS}{USER}c\n\nd{ASSISTANT}<think>")


def test_deepseek_v4_assistant_last_keeps_its_reasoning_in_thinking_mode():
    from rl.data.chat import DEEPSEEK_V4

    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    # thinking: the earlier turn loses its reasoning; the turn after the last user keeps "R2</think>"
    assert render_chat(DEEPSEEK_V4, msgs, add_generation_prompt=False, **thinking_kwargs("on")) == (
        f"{BOS}{USER}q1{ASSISTANT}</think>A1{EOS}{USER}q2{ASSISTANT}<think>R2</think>A2{EOS}")
    # chat mode: every reasoning is dropped
    assert render_chat(DEEPSEEK_V4, msgs, add_generation_prompt=False, **thinking_kwargs("off")) == (
        f"{BOS}{USER}q1{ASSISTANT}</think>A1{EOS}{USER}q2{ASSISTANT}</think>A2{EOS}")
