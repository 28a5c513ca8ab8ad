"""The ``grep`` tool: ripgrep over a sandbox's workspace.

Invariants: ripgrep runs with ``--no-follow``, so a link planted in the workspace cannot
show what lies outside it; what it returns is capped (matches, file size, stderr); a
grep that runs too long is killed and its pipes drained, so no process outlives the call.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from pathlib import Path

from kiln.shared.tools import GrepArgs, ToolCallError

GREP_MAX_FILESIZE = "1M"
GREP_STDERR_KEEP = 4000


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def _drain(stream: asyncio.StreamReader | None) -> None:
    """Read a pipe to EOF, discarding. A StreamReader whose buffer is full stops reading
    its pipe, and the process's ``wait()`` does not return until every pipe is closed."""
    if stream is not None:
        while await stream.read(1 << 16):
            pass


async def grep(
    workspace: Path,
    search_path: Path,
    args: GrepArgs,
    *,
    max_matches: int = 200,
    max_line_chars: int = 300,
    timeout_s: float = 10.0,
) -> str:
    """ripgrep for ``args.pattern`` in ``search_path``, which the caller has resolved and
    confined to ``workspace`` (``args.path`` is only used in messages). Output lines are
    ``path:line:text`` with paths relative to the workspace, in path order (deterministic),
    at most ``max_matches`` of them and each cut to about ``max_line_chars``."""
    rg = shutil.which("rg")
    if rg is None:
        raise RuntimeError("ripgrep (rg) is not installed: apt-get install ripgrep (scripts/setup.sh does)")
    workspace = Path(workspace)
    try:
        mode = os.stat(search_path).st_mode
    except FileNotFoundError:
        raise ToolCallError(f"{args.path}: no such file or directory") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):  # a FIFO would block rg's open()
        raise ToolCallError(f"{args.path} is not a regular file or directory")
    rel = os.path.relpath(search_path, workspace)
    if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
        raise ToolCallError(f"path {args.path!r} resolves outside the workspace")

    argv = [
        rg,
        "--no-config",
        "--no-heading",
        "--with-filename",
        "--line-number",
        "--color",
        "never",
        "--no-follow",
        "--max-filesize",
        GREP_MAX_FILESIZE,
        "--sort",
        "path",
        "--max-columns",
        str(max_line_chars),
        "--max-columns-preview",
        "--glob",
        "!.tmp",
    ]
    if args.glob:
        argv += ["--glob", args.glob]
    if args.ignore_case:
        argv.append("-i")
    argv += ["--", args.pattern, rel]

    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=workspace,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=1 << 20,
    )
    lines: list[str] = []
    err = bytearray()
    capped = False

    async def read_out() -> None:
        nonlocal capped
        assert proc.stdout is not None
        while True:
            try:
                raw = await proc.stdout.readline()
            except ValueError:  # a line over the stream limit; cannot happen with --max-columns
                capped = True
                return
            if not raw:
                return
            if len(lines) >= max_matches:
                capped = True
                return
            line = raw.decode(errors="replace").rstrip("\r\n")
            line = line.removeprefix("./")
            if len(line) > max_line_chars + 200:  # the path is not counted by --max-columns
                line = line[: max_line_chars + 200] + " [...]"
            lines.append(line)

    async def read_err() -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(1 << 16):
            err.extend(chunk[: max(0, GREP_STDERR_KEEP - len(err))])

    err_task = asyncio.create_task(read_err())
    try:
        async with asyncio.timeout(timeout_s):
            await read_out()
            if capped:
                _kill(proc)
            await err_task
            code = await proc.wait()
    except TimeoutError:
        raise ToolCallError(
            f"grep took longer than {timeout_s:g}s and was stopped; narrow the pattern or the path"
        ) from None
    finally:
        _kill(proc)
        err_task.cancel()
        await _drain(proc.stdout)
        await proc.wait()

    message = err.decode(errors="replace").strip()
    if capped:
        return "\n".join(lines) + f"\n[... more matches not shown (first {max_matches}); narrow the pattern or path]"
    if code == 1 and not lines:
        return "no matches"
    if code not in (0, 1) and not lines:  # 2: a bad pattern or glob, or every file unreadable
        raise ToolCallError(f"grep failed (ripgrep exit {code}):\n{message or 'no message'}")
    out = "\n".join(lines)
    if code not in (0, 1) and message:  # some matches, and some files could not be read
        out += f"\n[ripgrep reported errors: {message.splitlines()[0]}]"
    return out
