"""DeepSeek-V4's chat format, tools included: the renderer and the parser of the model's tool calls.

DeepSeek-V4 checkpoints ship their chat encoding as Python (`encoding/encoding_dsv4.py`) instead of a Jinja
template. That code is never imported or run here; this module renders the format it implements, written from its
behaviour (`encode_messages` with its default options: BOS added, reasoning of earlier turns dropped unless the
conversation has tools, no `reasoning_effort`), and parses completions as its `parse_message_from_completion_text`
does. tests/rl/test_chat_dsv4.py holds the expected strings, each derived from the release's rules.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>{user}
    <｜Assistant｜><think>          (the last turn: "<think>" in thinking mode, "</think>" in chat mode)

- consecutive user and tool messages are one user turn (the release's `merge_tool_messages`): its blocks, user text
  as is and each tool result as `<tool_result>{content}</tool_result>`, joined by "\\n\\n"; the tool results of one
  turn are put in the order of the calls of the last assistant turn that made calls (matched by `tool_call_id`);
- `tools` (OpenAI format, on the system message) append "\\n\\n" + the tools section (`TOOLS_SECTION`, each function
  schema one JSON line) to the system text; `response_format` appends "\\n\\n## Response Format: ..." likewise;
- an assistant turn is `{reasoning}</think>{content}{calls}<｜end▁of▁sentence｜>` where the reasoning part is
  written in thinking mode only, and only for turns after the last user turn unless the conversation has tools
  (then every turn keeps its reasoning, and every assistant turn opens with `<think>`);
- assistant `tool_calls` (OpenAI format, `arguments` a JSON string) become a DSML block after the content:

      \\n\\n<｜DSML｜tool_calls>
      <｜DSML｜invoke name="NAME">
      <｜DSML｜parameter name="KEY" string="true">text as is</｜DSML｜parameter>
      <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  Arguments that are not a JSON string become one parameter named "arguments" (as the release does, a dict
  included: it is not a string); a JSON value that is not an object is a ChatTemplateError (the release crashes).
- not supported (a one-line ChatTemplateError): roles other than system / user / assistant / tool (developer,
  latest_reminder), the `task` switch, content given as a list of blocks.

The parser (`parse_completion`) reads one generated assistant turn (special tokens kept, ending at
<｜end▁of▁sentence｜>): reasoning (thinking mode) up to `</think>`, content up to the EOS or the DSML block, the
calls, then only the EOS. The calls come back in OpenAI format with `arguments` the JSON text the release builds
(string parameters quoted, the others pasted as written, so it may not be valid JSON: the tool runner checks it).
Anything else raises ToolCallError (one line), as the release's asserts do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
DSML = "｜DSML｜"
CALLS_START = f"\n\n<{DSML}tool_calls"  # what starts a turn's call block (the parser's marker; ">" follows)
CALLS_CLOSE = f"</{DSML}tool_calls>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

TOOLS_SECTION = (  # the release's tools section, with {schemas}: one JSON line per function
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f"\"<{DSML}tool_calls>\" block like the following:\n\n"
    f"<{DSML}tool_calls>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
    f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, compiled or rendered."""


class ToolCallError(ValueError):
    """A generated assistant turn that is not in the format (one line, says what was expected)."""


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: Sequence[dict]) -> str:
    """OpenAI-format tools ([{"type": "function", "function": {...}}]) -> the tools section (module docstring).
    Raises ChatTemplateError for a tool without a "function" dict."""
    try:
        schemas = [_json(t["function"]) for t in tools]
    except (KeyError, TypeError):
        raise ChatTemplateError("the DeepSeek-V4 chat format: each of 'tools' must be "
                                "{'type': 'function', 'function': {...}}") from None
    return TOOLS_SECTION.replace("{schemas}", "\n".join(schemas))


def render_tool_calls(calls: Sequence[dict]) -> str:
    """OpenAI-format tool calls ([{"function": {"name", "arguments": JSON text}}]) -> the DSML block, "\\n\\n" first
    (module docstring). Raises ChatTemplateError for a call without a function name or with JSON arguments that
    are not an object."""
    invokes = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"the DeepSeek-V4 chat format: a tool call needs function.name, got {c!r:.80}")
        raw = fn.get("arguments")
        try:
            args = json.loads(raw)
        except (TypeError, ValueError):
            args = {"arguments": raw}
        if not isinstance(args, dict):
            raise ChatTemplateError(f"the DeepSeek-V4 chat format: tool call {fn['name']!r} arguments must be a JSON "
                                    f"object, got {raw!r:.80}")
        params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items()]
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"{CALLS_START}>\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def render_tool_result(content) -> str:
    """One tool result block: `<tool_result>{content}</tool_result>`; list content keeps its text blocks joined by
    "\\n\\n" (other blocks: "[Unsupported TYPE]"), as the release does."""
    if isinstance(content, list):
        content = "\n\n".join(b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                              for b in content)
    return RESULT_OPEN + (content or "") + RESULT_CLOSE


def _turns(messages: Sequence[dict]) -> list[dict]:
    """Checked messages with consecutive user / tool messages merged into one user turn of text blocks, the tool
    results ordered by the calls of the last assistant turn that made calls (module docstring)."""
    turns: list[dict] = []
    order: dict[str, int] = {}
    for m in messages:
        role = m.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"the DeepSeek-V4 chat format takes {' / '.join(ROLES)} messages, got role "
                                    f"{role!r}")
        if m.get("task") is not None or (role != "tool" and isinstance(m.get("content"), list)):
            raise ChatTemplateError(f"the DeepSeek-V4 chat format: 'task' and list content in a {role} message are "
                                    f"not supported by the built-in renderer")
        if role == "assistant" and m.get("tool_calls"):
            order = {c["id"]: i for i, c in enumerate(m["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        if role in ("user", "tool"):
            block = ({"id": m.get("tool_call_id") or "", "text": render_tool_result(m.get("content"))}
                     if role == "tool" else {"id": None, "text": m.get("content") or ""})
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block], "order": order})
        else:
            turns.append(dict(m))
    for t in turns:
        results = [b for b in t.get("blocks", ()) if b["id"] is not None]
        if len(results) > 1 and t["order"]:
            ranked = iter(sorted(results, key=lambda b: t["order"].get(b["id"], 0)))  # stable, unknown ids first
            t["blocks"] = [next(ranked) if b["id"] is not None else b for b in t["blocks"]]
    return turns


def render_deepseek_v4(messages: Sequence[dict], *, add_generation_prompt: bool = True, thinking: bool = False
                       ) -> str:
    """`messages` (system / user / assistant / tool; system may carry `tools`, `response_format`; assistant
    `reasoning_content`, `tool_calls`; tool `tool_call_id`) in DeepSeek-V4's chat format (module docstring; the
    release's `encode_messages` with thinking_mode "thinking" if `thinking` else "chat"). add_generation_prompt:
    after a final user turn, open the assistant turn (the release always does). Raises ChatTemplateError for what
    is not supported.
    """
    turns = _turns(messages)
    keep_all = any(m.get("tools") for m in messages)  # the release keeps every turn's reasoning when tools are on
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    out = [BOS]
    for i, m in enumerate(turns):
        role = m["role"]
        if role == "system":
            out.append(m.get("content") or "")
            if m.get("tools"):
                out.append("\n\n" + render_tools(m["tools"]))
            if m.get("response_format"):
                out.append("\n\n" + RESPONSE_FORMAT + _json(m["response_format"]))
            continue
        if role == "assistant":
            for key in ("tools", "response_format"):
                if m.get(key):
                    raise ChatTemplateError(f"the DeepSeek-V4 chat format: {key!r} belongs on the system message, "
                                            f"not an assistant message")
            reasoning = ""
            if thinking and (keep_all or i > last_user):
                reasoning = (m.get("reasoning_content") or "") + END_THINK
            calls = render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
            out.append(reasoning + (m.get("content") or "") + calls + EOS)
            continue
        out.append(USER + "\n\n".join(b["text"] for b in m["blocks"]))
        follows = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if follows == "assistant" or (follows is None and add_generation_prompt):
            out.append(ASSISTANT + (THINK if thinking and (keep_all or i >= last_user) else END_THINK))
    return "".join(out)


def tool_result_turn(contents: Sequence[str], *, thinking: bool = False) -> str:
    """The text an environment appends after an assistant turn that made calls: one user turn holding the results
    (in call order) and the opening of the next assistant turn, exactly what `render_deepseek_v4` writes there for
    a conversation with tools: `<｜User｜><tool_result>r1</tool_result>\\n\\n...<｜Assistant｜><think>|</think>`."""
    return USER + "\n\n".join(render_tool_result(c) for c in contents) + ASSISTANT + (THINK if thinking else END_THINK)


def _until(text: str, i: int, stops: Sequence[str]) -> tuple[int, str, str | None]:
    """-> (index after the earliest stop found from i, text before it, that stop); no stop: (len, rest, None)."""
    found = [(p, s) for s in stops if (p := text.find(s, i)) != -1]
    if not found:
        return len(text), text[i:], None
    p, s = min(found)
    return p + len(s), text[i:p], s


def _parse_calls(text: str, i: int) -> tuple[int, list[dict]]:
    """The invokes of a DSML block whose opener ends at i -> (index after its close, OpenAI-format calls)."""
    invoke, end_invoke, param = f"<{DSML}invoke", f"</{DSML}invoke", f"<{DSML}parameter"
    calls = []
    while True:
        i, between, stop = _until(text, i, [invoke, CALLS_CLOSE])
        if between != ">\n":
            raise ToolCallError(f"tool call block: expected '>\\n' before an invoke or the block's end, got "
                                f"{between[:40]!r}")
        if stop is None:
            raise ToolCallError("tool call block: not closed")
        if stop == CALLS_CLOSE:
            return i, calls
        i, head, stop = _until(text, i, [param, end_invoke])
        name = re.fullmatch(r'\s*name="(.*?)">\n\n?', head, flags=re.DOTALL)
        if name is None or stop is None:
            raise ToolCallError(f"tool call: expected ' name=\"TOOL\">\\n', got {head[:40]!r}")
        args: dict[str, tuple[str, str]] = {}
        while stop == param:
            i, body, stop = _until(text, i, [f"/{DSML}parameter"])
            kv = re.fullmatch(r' name="(.*?)" string="(true|false)">(.*?)<', body, flags=re.DOTALL)
            if kv is None or stop is None:
                raise ToolCallError(f"tool call parameter: expected ' name=\"KEY\" string=\"true|false\">VALUE', "
                                    f"got {body[:40]!r}")
            if kv.group(1) in args:
                raise ToolCallError(f"tool call: parameter {kv.group(1)!r} given twice")
            args[kv.group(1)] = (kv.group(3), kv.group(2))
            i, between, stop = _until(text, i, [param, end_invoke])
            if between != ">\n":
                raise ToolCallError(f"tool call parameter: expected '>\\n' after it, got {between[:40]!r}")
        arguments = "{" + ", ".join(f"{_json(k)}: {_json(v) if s == 'true' else v}" for k, (v, s) in args.items()) + "}"
        calls.append({"type": "function", "function": {"name": name.group(1), "arguments": arguments}})


def parse_completion(text: str, *, thinking: bool = False) -> dict:
    """One generated assistant turn (text after the prompt, special tokens kept, ending with <｜end▁of▁sentence｜>)
    -> {"role": "assistant", "content", "reasoning_content", "tool_calls": [OpenAI format]} (module docstring).

    Raises ToolCallError (one line) when the text is not a complete turn in the format: no EOS, no `</think>` in
    thinking mode, a malformed call block, text after the calls, special tokens inside the content.
    """
    i, reasoning = 0, ""
    if thinking:
        i, reasoning, stop = _until(text, i, [END_THINK, CALLS_START])
        if stop != END_THINK:
            raise ToolCallError("assistant turn: thinking mode needs '</think>' before the answer")
    i, content, stop = _until(text, i, [EOS, CALLS_START])
    calls: list[dict] = []
    if stop == CALLS_START:
        i, calls = _parse_calls(text, i)
        i, after, stop = _until(text, i, [EOS])
        if after:
            raise ToolCallError(f"assistant turn: unexpected text after the tool calls: {after[:40]!r}")
    if stop != EOS:
        raise ToolCallError("assistant turn: not ended by <｜end▁of▁sentence｜>")
    if i != len(text):
        raise ToolCallError(f"assistant turn: text after <｜end▁of▁sentence｜>: {text[i:i + 40]!r}")
    for sp in (BOS, EOS, THINK, END_THINK, DSML):
        if sp in content or sp in reasoning:
            raise ToolCallError(f"assistant turn: special token {sp!r} inside the content")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}
