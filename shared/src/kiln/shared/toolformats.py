"""Tool-call syntaxes a served model may write, behind one interface.

``ToolFormat``: ``instructions`` (what the system turn tells the model about its tools),
``render`` (an assistant turn's calls as the model would have written them, for history
the harness wrote itself) and ``parse`` (an assistant turn's text -> its prose and its
calls, each parsed or with the reason it did not). The rollout endpoint speaks OpenAI
``tool_calls`` whichever one the model writes.

- ``hermes``: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` (kiln's own
  models, Qwen2.5, Hermes);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`` (Qwen3-Coder; a parameter is a string unless its schema says
  otherwise, then JSON);
- ``llama3_json``: the whole turn is ``{"name": .., "parameters": {..}}`` (Llama 3.1+,
  optionally after ``<|python_tag|>``; several calls separated by ``;``).

Invariant: ``parse(render(calls))`` gives back ``calls`` for every format (tested), so
history a harness wrote and calls the model wrote read the same.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from typing import Any

from kiln.shared.chat import ParsedCall, parse_tool_calls


def _id(n: int) -> str:
    return f"call_{n}_{uuid.uuid4().hex[:6]}"


class ToolFormat(ABC):
    name: str

    @abstractmethod
    def instructions(self, tools: list[dict]) -> str:
        """The system turn's tools section (empty without tools)."""

    @abstractmethod
    def render(self, calls: list[tuple[str, dict]]) -> str:
        """(name, arguments) calls as the text the model writes for them."""

    @abstractmethod
    def parse(self, text: str, tools: list[dict] = ()) -> tuple[str, list[ParsedCall]]:
        """(prose without the calls, calls) of an assistant turn."""


class Hermes(ToolFormat):
    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.S)

    def instructions(self, tools: list[dict]) -> str:
        if not tools:
            return ""
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render(self, calls: list[tuple[str, dict]]) -> str:
        return "".join(
            "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
            for n, a in calls
        )

    def parse(self, text: str, tools: list[dict] = ()) -> tuple[str, list[ParsedCall]]:
        return self._BLOCK.sub("", text).strip(), parse_tool_calls(text)


def _param_types(tools: list[dict]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for t in tools or ():
        fn = t.get("function", t)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {k: (v or {}).get("type", "string") for k, v in props.items()}
    return out


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    _CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
    _ANY = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.S)

    def instructions(self, tools: list[dict]) -> str:
        if not tools:
            return ""
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            f"\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{lines}\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
            "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
            "</function>\n</tool_call>"
        )

    def render(self, calls: list[tuple[str, dict]]) -> str:
        out = []
        for name, args in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                for k, v in args.items()
            )
            out.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
        return "\n".join(out)

    def parse(self, text: str, tools: list[dict] = ()) -> tuple[str, list[ParsedCall]]:
        types = _param_types(tools)
        calls = []
        for n, m in enumerate(self._ANY.finditer(text)):
            block = m.group(0)
            full = self._CALL.search(block)
            if not full:
                calls.append(
                    ParsedCall(_id(n), None, None, "malformed <tool_call>: expected <function=NAME>...</function>")
                )
                continue
            name, body = full.group(1), full.group(2)
            args: dict[str, Any] = {}
            for key, raw in self._PARAM.findall(body):
                if types.get(name, {}).get(key, "string") == "string":
                    args[key] = raw
                else:
                    try:
                        args[key] = json.loads(raw)
                    except json.JSONDecodeError:
                        args[key] = raw
            calls.append(ParsedCall(_id(n), name, args, None))
        return self._ANY.sub("", text).strip(), calls


class Llama3Json(ToolFormat):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def instructions(self, tools: list[dict]) -> str:
        if not tools:
            return ""
        lines = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments "
            'that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary '
            f"of argument name and its value}}. Do not use variables.\n\n{lines}"
        )

    def render(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def parse(self, text: str, tools: list[dict] = ()) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        if not body.startswith("{"):
            return text.strip(), []
        calls, decoder, i, n = [], json.JSONDecoder(), 0, 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError as e:
                calls.append(ParsedCall(_id(n), None, None, f"invalid JSON tool call: {e.msg}"))
                break
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                calls.append(ParsedCall(_id(n), None, None, 'a tool call is {"name": str, "parameters": object}'))
            else:
                calls.append(ParsedCall(_id(n), obj["name"], args, None))
            n += 1
            i = end
            while i < len(body) and body[i] in " \n;":
                i += 1
        return "", calls


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Qwen3Coder(), Llama3Json())}


def tool_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}: one of {sorted(FORMATS)}") from None
