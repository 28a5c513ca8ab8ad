"""The chat format the policy sees: ChatML turns with Hermes/Qwen tool calls.

``render_*`` produce exactly what ``CHAT_TEMPLATE`` (the Jinja template saved with every
checkpoint, so HF and vLLM format prompts identically) renders for the same messages;
``test_chat`` checks the two agree. Tool calls are ``<tool_call>{"name": ..,
"arguments": {..}}</tool_call>`` blocks in an assistant turn; tool results go back in a
user turn wrapped in ``<tool_response>``, as Qwen's template does.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
EOS = "<|im_end|>"
PAD = "<|endoftext|>"

SYSTEM_PROMPT = (
    "You are a coding agent working in a repository. Use the tools to inspect and edit files "
    "and to run the tests. When the task is done, reply without a tool call."
)


def render_system(system: str, tools: list[dict]) -> str:
    tool_lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        f"<|im_start|>system\n{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tool_lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )


def render_user(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n"


def assistant_prefix() -> str:
    return "<|im_start|>assistant\n"


def render_tool_results(results: list[str]) -> str:
    """One user turn carrying every tool result of the previous assistant turn, in call order."""
    body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
    return f"<|im_start|>user\n{body}<|im_end|>\n"


CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "<|im_start|>system\n{{ m.content }}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n{% else %}\n{% endif %}"
    "<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Jinja form of the renderers (``tojson`` as in HF: ``json.dumps(x, ensure_ascii=False)``)."""

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class ParsedCall:
    id: str
    name: str | None
    arguments: dict | None
    error: str | None
    """Why the block is malformed (bad JSON, missing name...); None when it parsed."""


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>`` block of an assistant turn, parsed or with the reason it did not."""
    calls = []
    for n, body in enumerate(_CALL.findall(text)):
        cid = f"call_{n}_{uuid.uuid4().hex[:6]}"
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ParsedCall(cid, None, None, f"tool call is not valid JSON: {e.msg} at position {e.pos}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParsedCall(cid, None, None, 'tool call must be {"name": <string>, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append(ParsedCall(cid, obj["name"], args, None))
    if text.count("<tool_call>") > len(calls):
        calls.append(ParsedCall(f"call_{len(calls)}_open", None, None, "unterminated <tool_call> block"))
    return calls
