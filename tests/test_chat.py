"""The chat format: Python renderers equal the Jinja chat template saved with every
checkpoint, and tool-call parsing reports every malformed block with its reason."""

from __future__ import annotations

import json

import jinja2

from kiln.shared import chat
from kiln.shared.tools import tool_schemas


def test_renderers_match_the_chat_template():
    env = jinja2.Environment()
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string(chat.CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": chat.SYSTEM_PROMPT},
        {"role": "user", "content": "fix calc.py"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "read_file", "arguments": {"path": "calc.py"}}\n</tool_call>',
        },
        {"role": "tool", "content": "def add(a, b): ..."},
        {"role": "tool", "content": '{"error": "no"}'},
        {"role": "assistant", "content": "done"},
    ]
    jinja = template.render(messages=messages, tools=tool_schemas(), add_generation_prompt=True)
    ours = (
        chat.render_system(chat.SYSTEM_PROMPT, tool_schemas())
        + chat.render_user("fix calc.py")
        + chat.assistant_prefix()
        + messages[2]["content"]
        + chat.EOS
        + "\n"
        + chat.render_tool_results(["def add(a, b): ...", '{"error": "no"}'])
        + chat.assistant_prefix()
        + "done"
        + chat.EOS
        + "\n"
        + chat.assistant_prefix()
    )
    assert jinja == ours


def test_parse_tool_calls():
    text = (
        'thinking <tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'
        '<tool_call>{"name": "edit_file", "arguments": "{\\"path\\": \\"b\\"}"}</tool_call>'
        "<tool_call>{not json</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        "<tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "x"'
    )
    calls = chat.parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("read_file", {"path": "a.py"}), ("edit_file", {"path": "b"})]
    assert "not valid JSON" in calls[2].error
    assert "must be" in calls[3].error and "must be" in calls[4].error
    assert calls[5].error == "unterminated <tool_call> block"
    assert len({c.id for c in calls}) == len(calls)
    assert chat.parse_tool_calls("no calls here") == []
