"""The agent's tools, executed against one sandbox.

Invariants: a path argument never reaches outside the workspace (absolute paths, ``..``
and symlinks that resolve outside are refused); every failure is a ``ToolResult`` with
``error`` set, never an exception, so a bad call is an observation for the model; a
batch returns its results in call order, with consecutive read-only calls run
concurrently and every other call run alone, in order.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kiln.shared.contracts import ToolCall, ToolResult
from kiln.shared.tools import (
    READ_ONLY_TOOLS,
    EditFileArgs,
    ListDirArgs,
    ReadFileArgs,
    RunTerminalCmdArgs,
    ToolCallError,
    WriteFileArgs,
    validate_call,
)

from kiln.envpool.sandbox import Sandbox


class ToolExecutor:
    def __init__(self, *, max_read_bytes: int, max_timeout_s: float):
        self.max_read_bytes = max_read_bytes
        self.max_timeout_s = max_timeout_s

    async def run_batch(self, sandbox: Sandbox, calls: list[ToolCall]) -> list[ToolResult]:
        results: list[ToolResult] = []
        i = 0
        while i < len(calls):
            j = i
            while j < len(calls) and calls[j].name in READ_ONLY_TOOLS:
                j += 1
            if j > i:
                results += await asyncio.gather(*(self.run_one(sandbox, c) for c in calls[i:j]))
                i = j
            else:
                results.append(await self.run_one(sandbox, calls[i]))
                i += 1
        return results

    async def run_one(self, sandbox: Sandbox, call: ToolCall) -> ToolResult:
        try:
            args = validate_call(call.name, call.arguments)
            output = await getattr(self, f"_{call.name}")(sandbox, args)
            return ToolResult(call_id=call.id, name=call.name, output=output)
        except (ToolCallError, OSError, UnicodeDecodeError) as e:
            msg = str(e) if isinstance(e, ToolCallError) else f"{type(e).__name__}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
            return ToolResult(call_id=call.id, name=call.name, error=msg)

    def _resolve(self, sandbox: Sandbox, path: str) -> Path:
        p = Path(path)
        if p.is_absolute():
            raise ToolCallError(f"path {path!r} must be relative to the workspace root")
        if ".." in p.parts:
            raise ToolCallError(f"path {path!r} may not contain '..'")
        root = sandbox.workspace.resolve()
        full = (root / p).resolve()
        if full != root and root not in full.parents:
            raise ToolCallError(f"path {path!r} resolves outside the workspace")
        return full

    async def _read_file(self, sandbox: Sandbox, a: ReadFileArgs) -> str:
        f = self._resolve(sandbox, a.path)
        if not f.is_file():
            raise ToolCallError(f"{a.path}: no such file")
        if f.stat().st_size > self.max_read_bytes:
            raise ToolCallError(f"{a.path} is larger than {self.max_read_bytes} bytes; read a line range")
        lines = f.read_text().splitlines(keepends=True)
        start = (a.start_line or 1) - 1
        end = a.end_line or len(lines)
        if a.start_line and a.end_line and a.end_line < a.start_line:
            raise ToolCallError("end_line must not be before start_line")
        return "".join(lines[start:end])

    async def _edit_file(self, sandbox: Sandbox, a: EditFileArgs) -> str:
        f = self._resolve(sandbox, a.path)
        if a.old == "":
            if f.exists() and f.stat().st_size > 0:
                raise ToolCallError(f"{a.path} already exists; give the exact text to replace in `old`")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(a.new)
            return f"created {a.path}"
        if not f.is_file():
            raise ToolCallError(f"{a.path}: no such file")
        text = f.read_text()
        n = text.count(a.old)
        if n == 0:
            raise ToolCallError(f"`old` text not found in {a.path}")
        if n > 1:
            raise ToolCallError(f"`old` text occurs {n} times in {a.path}; include more context to make it unique")
        f.write_text(text.replace(a.old, a.new, 1))
        return f"edited {a.path}"

    async def _write_file(self, sandbox: Sandbox, a: WriteFileArgs) -> str:
        f = self._resolve(sandbox, a.path)
        if f.is_dir():
            raise ToolCallError(f"{a.path} is a directory")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(a.content)
        return f"wrote {len(a.content)} characters to {a.path}"

    async def _list_dir(self, sandbox: Sandbox, a: ListDirArgs) -> str:
        d = self._resolve(sandbox, a.path)
        if not d.is_dir():
            raise ToolCallError(f"{a.path}: no such directory")
        entries = sorted(
            (e.name + ("/" if e.is_dir() else "")) for e in d.iterdir() if not (d == sandbox.workspace.resolve() and e.name == ".tmp")
        )
        return "\n".join(entries)

    async def _run_terminal_cmd(self, sandbox: Sandbox, a: RunTerminalCmdArgs) -> str:
        r = await sandbox.exec(a.command, min(a.timeout, self.max_timeout_s))
        parts = [f"exit code: {r.exit_code}"]
        if r.stdout:
            parts.append(r.stdout.rstrip("\n"))
        if r.stderr:
            parts.append(r.stderr.rstrip("\n"))
        return "\n".join(parts)
