"""rl/data/chat_dsv4.py: DeepSeek-V4's chat format with tools, and the parser of generated tool calls.

Where the expected strings come from: DeepSeek-V4's release file `encoding/encoding_dsv4.py` (read from public
mirrors of the checkpoint folder, e.g. sfxnz/DeepSeek-V4-Flash-Vision-Exp-vLLM-2x-DGX-Spark and supermy/ds4rs on
GitHub), run by hand on each conversation below with `encode_messages(messages, thinking_mode)`:
- `TOOLS_TEXT` is its `TOOLS_TEMPLATE` formatted by `render_tools` (dsml_token "｜DSML｜", each function schema one
  `json.dumps(..., ensure_ascii=False)` line), appended to the system text after "\\n\\n";
- a tool message becomes a `<tool_result>...</tool_result>` block of a user turn (`merge_tool_messages`), so the
  next assistant turn opens with `<｜Assistant｜>` + `</think>` (chat) or `<think>` (thinking; with tools present
  `drop_thinking` is off, so every assistant turn keeps its reasoning);
- an assistant's calls are "\\n\\n<｜DSML｜tool_calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜tool_calls>" after
  its content, then the EOS (`tool_calls_template`, `tool_call_template`, `encode_arguments_to_dsml`).
"""

from __future__ import annotations

import pytest

from rl.data.chat_dsv4 import ChatTemplateError, ToolCallError, parse_completion, render_deepseek_v4, tool_result_turn

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Value of a key",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}
SCHEMA = ('{"name": "lookup", "description": "Value of a key", "parameters": {"type": "object", "properties": '
          '{"key": {"type": "string"}}, "required": ["key"]}}')
TOOLS_TEXT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

""" + SCHEMA + """

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
CALL_K7 = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="lookup">\n'
           '<｜DSML｜parameter name="key" string="true">k7</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


def _call(name, arguments, id_=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return c if id_ is None else {**c, "id": id_}


def conversation():
    return [{"role": "system", "content": "S", "tools": [LOOKUP]}, {"role": "user", "content": "key k7?"},
            {"role": "assistant", "content": "", "reasoning_content": "R1", "tool_calls": [_call("lookup", '{"key": "k7"}')]},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "42", "reasoning_content": "R2"}]


def test_tools_calls_and_results_render_as_the_release():
    msgs = conversation()
    chat = f"{BOS}S\n\n{TOOLS_TEXT}{USER}key k7?{ASSISTANT}</think>{CALL_K7}{EOS}{USER}<tool_result>42</tool_result>"
    assert render_deepseek_v4(msgs, thinking=False) == chat + f"{ASSISTANT}</think>42{EOS}"
    # thinking: tools switch drop_thinking off, so the first assistant turn keeps R1 and opens with <think>
    assert render_deepseek_v4(msgs, thinking=True) == (
        f"{BOS}S\n\n{TOOLS_TEXT}{USER}key k7?{ASSISTANT}<think>R1</think>{CALL_K7}{EOS}"
        f"{USER}<tool_result>42</tool_result>{ASSISTANT}<think>R2</think>42{EOS}")
    # the prompt of the next generation = the conversation so far + the environment's turn
    assert render_deepseek_v4(msgs[:4]) == chat + f"{ASSISTANT}</think>"
    assert render_deepseek_v4(msgs[:3], add_generation_prompt=False) + tool_result_turn(["42"]) == \
        render_deepseek_v4(msgs[:4])


def test_argument_types_several_calls_and_result_order():
    calls = [_call("f", '{"s": "a b", "n": 3, "x": [1, {"é": true}], "z": null}', "c1"), _call("g", "{}", "c2"),
             _call("h", "not json", "c3")]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "C", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c3", "content": "r3"}, {"role": "tool", "tool_call_id": "c1",
                                                                       "content": [{"type": "text", "text": "r1"}, {"type": "image"}]},
            {"role": "user", "content": "more"}, {"role": "tool", "tool_call_id": "c2", "content": "r2"}]
    d = "｜DSML｜"
    block = (f'\n\n<{d}tool_calls>\n<{d}invoke name="f">\n'
             f'<{d}parameter name="s" string="true">a b</{d}parameter>\n<{d}parameter name="n" string="false">3</{d}parameter>\n'
             f'<{d}parameter name="x" string="false">[1, {{"é": true}}]</{d}parameter>\n'
             f'<{d}parameter name="z" string="false">null</{d}parameter>\n</{d}invoke>\n'
             f'<{d}invoke name="g">\n\n</{d}invoke>\n'  # no parameters: an empty line
             f'<{d}invoke name="h">\n<{d}parameter name="arguments" string="true">not json</{d}parameter>\n</{d}invoke>\n'
             f'</{d}tool_calls>')
    # one user turn; its tool results sorted by call order (c1, c2, c3) into the tool slots, the text stays put
    assert render_deepseek_v4(msgs) == (
        f"{BOS}{USER}q{ASSISTANT}</think>C{block}{EOS}{USER}<tool_result>r1\n\n[Unsupported image]</tool_result>"
        f"\n\n<tool_result>r2</tool_result>\n\nmore\n\n<tool_result>r3</tool_result>{ASSISTANT}</think>")


def test_unsupported_shapes_are_one_line_errors():
    for msgs, match in [([{"role": "developer", "content": "x"}], "role 'developer'"),
                        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                             "tool_calls": [_call("f", "[1, 2]")]}], "JSON object"),
                        ([{"role": "user", "content": "q", "task": "title"}], "'task'"),
                        ([{"role": "system", "content": "S", "tools": [{"name": "f"}]}], "'tools'")]:
        with pytest.raises(ChatTemplateError, match=match) as e:
            render_deepseek_v4(msgs)
        assert "\n" not in str(e.value)


def test_parse_round_trips_the_rendered_turn():
    for thinking in (False, True):
        head = "R1</think>" if thinking else ""
        calls = [_call("lookup", '{"key": "k7"}'), _call("f", '{"n": 3, "s": "x\\ny", "l": [1, 2]}'),
                 _call("g", "{}")]
        msgs = [{"role": "system", "content": "", "tools": [LOOKUP]}, {"role": "user", "content": "q"}]
        prompt = render_deepseek_v4(msgs, thinking=thinking)
        full = render_deepseek_v4(msgs + [{"role": "assistant", "content": "Let me look.", "reasoning_content": "R1",
                                           "tool_calls": calls}], thinking=thinking)
        completion = full[len(prompt):]
        assert completion.startswith(head + "Let me look.\n\n<｜DSML｜tool_calls>")
        got = parse_completion(completion, thinking=thinking)
        assert got["content"] == "Let me look." and got["reasoning_content"] == ("R1" if thinking else "")
        # the release rebuilds the arguments with ", " / ": " separators: the same JSON values
        assert [c["function"]["name"] for c in got["tool_calls"]] == ["lookup", "f", "g"]
        assert got["tool_calls"][0]["function"]["arguments"] == '{"key": "k7"}'
        assert got["tool_calls"][1]["function"]["arguments"] == '{"n": 3, "s": "x\\ny", "l": [1, 2]}'
        assert got["tool_calls"][2]["function"]["arguments"] == "{}"
    assert parse_completion(f"42{EOS}") == {"role": "assistant", "content": "42", "reasoning_content": "",
                                            "tool_calls": []}


@pytest.mark.parametrize("text, match", [
    ("42", "not ended"),
    (f"42{EOS}tail", "after"),
    (f"{CALL_K7}", "not ended"),
    (f"{CALL_K7} x{EOS}", "after the tool calls"),
    (f"{CALL_K7[:-25]}{EOS}", "'>\\\\n'"),  # the block cut inside: no close
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS, "name="),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="maybe">1'
     '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS, "parameter"),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">1</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS,
     "twice"),
    (f"a<think>b{EOS}", "special token"),
])
def test_malformed_turns_raise_one_line(text, match):
    with pytest.raises(ToolCallError, match=match) as e:
        parse_completion(text)
    assert "\n" not in str(e.value)


def test_thinking_needs_its_end():
    with pytest.raises(ToolCallError, match="</think>"):
        parse_completion(f"reasoning{CALL_K7}{EOS}", thinking=True)
