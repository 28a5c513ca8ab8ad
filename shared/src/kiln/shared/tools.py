"""The agent's tools as a contract: argument models and the JSON Schemas shown to the model.

env-pool implements these tools; rollout renders ``tool_schemas()`` into the prompt and
validates the model's calls with ``validate_call`` before sending them, so a malformed
call becomes an error observation for the model instead of a failed request. The
schema the model sees and the one the sandbox enforces are the same object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ReadFileArgs(_Args):
    path: str
    """Path relative to the workspace root."""
    start_line: int | None = Field(default=None, ge=1)
    """First line to return (1-based, inclusive)."""
    end_line: int | None = Field(default=None, ge=1)
    """Last line to return (1-based, inclusive)."""


class EditFileArgs(_Args):
    path: str
    """Path relative to the workspace root."""
    old: str
    """Exact text to replace; must occur exactly once. Empty: create the file with `new`."""
    new: str
    """Replacement text."""


class WriteFileArgs(_Args):
    path: str
    """Path relative to the workspace root; parent folders are created."""
    content: str
    """The whole new content of the file."""


class ListDirArgs(_Args):
    path: str = "."
    """Directory relative to the workspace root."""


class GrepArgs(_Args):
    pattern: str = Field(min_length=1)
    """Regular expression (ripgrep syntax)."""
    path: str = "."
    """File or directory to search, relative to the workspace root."""
    glob: str | None = None
    """Only search files matching this glob, e.g. `*.py`."""
    ignore_case: bool = False
    """Match case-insensitively."""


class SemanticSearchArgs(_Args):
    query: str = Field(min_length=1)
    """What to look for, in natural language or code."""
    k: int = Field(default=5, ge=1, le=50)
    """How many code chunks to return."""


class RunTerminalCmdArgs(_Args):
    command: str
    """A bash command, run in the workspace root."""
    timeout: float = Field(default=30.0, gt=0, le=600)
    """Seconds before the command is killed."""


TOOLS: dict[str, tuple[type[_Args], str]] = {
    "read_file": (ReadFileArgs, "Read a text file of the workspace, optionally a range of lines."),
    "edit_file": (EditFileArgs, "Replace one exact, unique occurrence of `old` with `new` in a file."),
    "write_file": (WriteFileArgs, "Create or overwrite a file with the given content."),
    "list_dir": (ListDirArgs, "List the entries of a directory of the workspace."),
    "grep": (GrepArgs, "Search file contents with a regular expression (ripgrep); returns path:line:text matches."),
    "semantic_search": (SemanticSearchArgs, "Find the code chunks of the workspace most related to a query."),
    "run_terminal_cmd": (RunTerminalCmdArgs, "Run a bash command in the workspace and return its output."),
}

READ_ONLY_TOOLS = frozenset({"read_file", "list_dir", "grep", "semantic_search"})
"""Tools that may run concurrently within one turn; the others run in call order."""


def offered(names: Sequence[str] = ()) -> list[str]:
    """The tools a run offers, in ``TOOLS`` order: ``names`` (checked), or all when empty."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; the tools are {', '.join(TOOLS)}")
    return [n for n in TOOLS if not names or n in names]


def tool_schemas(names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """OpenAI/Hermes-style function schemas of the offered tools (all when ``names`` is
    empty), in a stable order."""
    out = []
    for name in offered(names):
        args, desc = TOOLS[name]
        schema = args.model_json_schema()
        schema.pop("title", None)
        for key, prop in schema.get("properties", {}).items():
            schema["properties"][key] = _compact(prop)
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": schema}})
    return out


def _compact(prop: dict) -> dict:
    """``anyOf: [X, null]`` with ``default: null`` -> X: optional is already said by ``required``."""
    prop = {k: v for k, v in prop.items() if k != "title"}
    variants = prop.get("anyOf")
    if variants and len(variants) == 2 and {"type": "null"} in variants and prop.get("default", 0) is None:
        (inner,) = [v for v in variants if v != {"type": "null"}]
        prop = {**inner, **{k: v for k, v in prop.items() if k not in ("anyOf", "default")}}
    return prop


class ToolCallError(ValueError):
    """A call the model made that cannot run; its message is the model's observation."""


def validate_call(name: str, arguments: Any, names: Sequence[str] = ()) -> _Args:
    """The parsed arguments of a call to one of the offered tools (all when ``names`` is empty)."""
    available = offered(names)
    if name not in available:
        raise ToolCallError(f"unknown tool {name!r}; available tools: {', '.join(available)}")
    if not isinstance(arguments, dict):
        raise ToolCallError(f"arguments of {name} must be a JSON object, got {type(arguments).__name__}")
    try:
        return TOOLS[name][0].model_validate(arguments)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {err['msg']}" for err in e.errors())
        raise ToolCallError(f"bad arguments for {name}: {problems}") from None
