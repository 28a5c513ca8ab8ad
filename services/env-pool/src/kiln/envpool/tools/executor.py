"""The agent's tools, executed against one sandbox.

Invariants: a path argument never reaches outside the workspace (absolute paths, ``..``
and symlinks that resolve outside are refused), and the file tools only touch regular
files and directories (a FIFO or socket planted by the agent cannot block env-pool);
files env-pool writes belong to the sandbox's uid; every failure is a ``ToolResult``
with ``error`` set, never an exception, so a bad call is an observation for the model;
a batch returns its results in call order, with consecutive read-only calls run
concurrently and every other call run alone, in order; a batch given a time
(``SandboxTools.timeout_s``) answers within it: each command is killed at what is left of
it (its observation says so) and a call left no time is answered with an error, so a
slow command is always the agent's observation, never a request that times out; a path
longer or deeper than the sandbox's bounds (``max_path_chars``, ``max_path_depth``) is
refused, so the file tools never make a path the host cannot walk. The file tools run on the host
side, which is safe because no sandbox process outlives a command (``sandbox.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from pathlib import Path

from opentelemetry import trace

from kiln.envpool.isolation.sandbox import Sandbox
from kiln.envpool.tools import grep, search
from kiln.shared.contracts import ToolCall, ToolResult
from kiln.shared.tools import (
    READ_ONLY_TOOLS,
    EditFileArgs,
    GrepArgs,
    ListDirArgs,
    ReadFileArgs,
    RunTerminalCmdArgs,
    SemanticSearchArgs,
    ToolCallError,
    WriteFileArgs,
    validate_call,
)

MUTATING_FILE_TOOLS = frozenset({"edit_file", "write_file"})
MIN_CALL_S = 0.05
"""A call left less time than this in its batch is not started."""

log = logging.getLogger("kiln.envpool.tools.executor")


def _shown(path: str) -> str:
    return repr(path) if len(path) <= 200 else repr(path[:100] + "..." + path[-60:])


class ToolExecutor:
    def __init__(
        self, *, max_read_bytes: int, max_timeout_s: float, grep_max_matches: int, index, metrics=None, tracer=None
    ):
        self.tracer = tracer or trace.get_tracer("kiln.envpool.tools.executor")
        self.max_read_bytes = max_read_bytes
        self.max_timeout_s = max_timeout_s
        self.grep_max_matches = grep_max_matches
        self.index = index
        self.metrics = metrics

    async def run_batch(
        self, sandbox: Sandbox, calls: list[ToolCall], timeout_s: float | None = None
    ) -> list[ToolResult]:
        """The calls' results in order; with ``timeout_s``, within it: each command's timeout
        is cut to what is left, and a call started after it is spent is answered with an error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: list[ToolResult] = []
        i = 0
        while i < len(calls):
            j = i
            while j < len(calls) and calls[j].name in READ_ONLY_TOOLS:
                j += 1
            if j > i:
                results += await asyncio.gather(*(self.run_one(sandbox, c, deadline) for c in calls[i:j]))
                i = j
            else:
                results.append(await self.run_one(sandbox, calls[i], deadline))
                i += 1
        return results

    async def run_one(self, sandbox: Sandbox, call: ToolCall, deadline: float | None = None) -> ToolResult:
        with self.tracer.start_as_current_span(f"tool {call.name}", attributes={"tool": call.name}) as span:
            result = await self._run_one(sandbox, call, deadline)
            span.set_attribute("error", result.error or "")
        return result

    async def _run_one(self, sandbox: Sandbox, call: ToolCall, deadline: float | None = None) -> ToolResult:
        t0 = time.monotonic()
        try:
            args = validate_call(call.name, call.arguments)
            if call.name in MUTATING_FILE_TOOLS and sandbox.over_quota:
                raise ToolCallError("the workspace is over its disk quota; no more writes")
            left = None if deadline is None else deadline - t0
            if left is not None and left <= MIN_CALL_S:
                raise ToolCallError("not run: this turn's time for tool calls was spent by the calls before it")
            run = getattr(self, f"_{call.name}")
            if call.name == "run_terminal_cmd":
                output = await run(sandbox, args, left)
            else:  # file tools finish at once; grep and search are cut at what is left
                output = await (run(sandbox, args) if left is None else asyncio.wait_for(run(sandbox, args), left))
            result = ToolResult(call_id=call.id, name=call.name, output=output)
        except TimeoutError:
            result = ToolResult(
                call_id=call.id,
                name=call.name,
                error=f"{call.name} did not finish within this turn's time for tool calls",
            )
        except (ToolCallError, OSError, UnicodeError) as e:
            if isinstance(e, ToolCallError):
                msg = str(e)
            elif isinstance(e, OSError) and e.strerror:
                msg = f"{type(e).__name__}: {e.strerror}"
            else:
                msg = f"{type(e).__name__}: {e}"
            result = ToolResult(call_id=call.id, name=call.name, error=msg)
        except Exception as e:  # whatever the workspace holds, the agent gets an observation
            log.exception("tool %s failed on sandbox %s", call.name, sandbox.id)
            result = ToolResult(
                call_id=call.id, name=call.name, error=f"{call.name} failed: {type(e).__name__}: {str(e)[:200]}"
            )
        if self.metrics is not None:
            name = call.name if call.name in READ_ONLY_TOOLS | MUTATING_FILE_TOOLS | {"run_terminal_cmd"} else "unknown"
            self.metrics.tool_calls.labels(name).inc()
            self.metrics.tool_seconds.labels(name).observe(time.monotonic() - t0)
            if result.error:
                self.metrics.tool_errors.labels(name).inc()
        return result

    def _regular(self, f: Path, shown: str) -> Path:
        try:
            mode = f.stat().st_mode
        except FileNotFoundError:
            raise ToolCallError(f"{shown}: no such file") from None
        if stat.S_ISDIR(mode):
            raise ToolCallError(f"{shown} is a directory")
        if not stat.S_ISREG(mode):
            raise ToolCallError(f"{shown} is not a regular file")
        return f

    def _own(self, sandbox: Sandbox, path: Path) -> None:
        """Files env-pool creates belong to the sandbox (as root it would own them itself)."""
        ident = sandbox.identity
        if ident.uid is None:
            return
        root = sandbox.workspace.resolve()
        while path != root and root in path.parents:
            os.chown(path, ident.uid, ident.gid, follow_symlinks=False)
            path = path.parent

    def _resolve(self, sandbox: Sandbox, path: str) -> Path:
        p = Path(path)
        if p.is_absolute():
            raise ToolCallError(f"path {_shown(path)} must be relative to the workspace root")
        if ".." in p.parts:
            raise ToolCallError(f"path {_shown(path)} may not contain '..'")
        lim = sandbox.limits
        if len(str(p)) > lim.max_path_chars or len(p.parts) > lim.max_path_depth:
            raise ToolCallError(
                f"path {_shown(path)} is {len(str(p))} characters and {len(p.parts)} levels long; "
                f"workspace paths have at most {lim.max_path_chars} characters and {lim.max_path_depth} levels"
            )
        if "\0" in path:
            raise ToolCallError("a path may not contain a NUL character")
        root = sandbox.workspace.resolve()
        full = (root / p).resolve()
        if full != root and root not in full.parents:
            raise ToolCallError(f"path {path!r} resolves outside the workspace")
        return full

    async def _read_file(self, sandbox: Sandbox, a: ReadFileArgs) -> str:
        f = self._regular(self._resolve(sandbox, a.path), a.path)
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
            if f.exists() and (not f.is_file() or f.stat().st_size > 0):
                raise ToolCallError(f"{a.path} already exists; give the exact text to replace in `old`")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(a.new)
            self._own(sandbox, f)
            return f"created {a.path}"
        text = self._regular(f, a.path).read_text()
        n = text.count(a.old)
        if n == 0:
            raise ToolCallError(f"`old` text not found in {a.path}")
        if n > 1:
            raise ToolCallError(f"`old` text occurs {n} times in {a.path}; include more context to make it unique")
        f.write_text(text.replace(a.old, a.new, 1))
        return f"edited {a.path}"

    async def _write_file(self, sandbox: Sandbox, a: WriteFileArgs) -> str:
        f = self._resolve(sandbox, a.path)
        if f.exists() or f.is_symlink():
            self._regular(f, a.path)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(a.content)
        self._own(sandbox, f)
        return f"wrote {len(a.content)} characters to {a.path}"

    async def _list_dir(self, sandbox: Sandbox, a: ListDirArgs) -> str:
        d = self._resolve(sandbox, a.path)
        if not d.is_dir():
            raise ToolCallError(f"{a.path}: no such directory")
        hide = {".tmp"} if d == sandbox.workspace.resolve() else set()
        with os.scandir(d) as it:  # never follow links: a link to /etc says "link", not what /etc holds
            entries = sorted(
                e.name + ("/" if e.is_dir(follow_symlinks=False) else "@" if e.is_symlink() else "")
                for e in it
                if e.name not in hide
            )
        return "\n".join(entries)

    async def _grep(self, sandbox: Sandbox, a: GrepArgs) -> str:
        target = self._resolve(sandbox, a.path)
        if not target.exists():
            raise ToolCallError(f"{a.path}: no such file or directory")
        return await grep.grep(sandbox.workspace.resolve(), target, a, max_matches=self.grep_max_matches)

    async def _semantic_search(self, sandbox: Sandbox, a: SemanticSearchArgs) -> str:
        method, hits = await self.index.search(sandbox.workspace.resolve(), a.query, a.k)
        return search.format_hits(method, hits)

    async def _run_terminal_cmd(self, sandbox: Sandbox, a: RunTerminalCmdArgs, left: float | None = None) -> str:
        r = await sandbox.exec(a.command, min(a.timeout, self.max_timeout_s, left if left is not None else a.timeout))
        parts = [f"exit code: {r.exit_code}"]
        if r.stdout:
            parts.append(r.stdout.rstrip("\n"))
        if r.stderr:
            parts.append(r.stderr.rstrip("\n"))
        return "\n".join(parts)
