"""Sandboxes: a workspace and a way to run commands in it.

``Sandbox`` is the interface every backend implements (``exec``, ``destroy``). The
``process`` backend here runs each command as ``bash -c`` in a fresh session whose
working directory is the workspace, with a cleared environment, rlimits (CPU seconds,
file size, open files), a wall-clock timeout that kills the whole process group, and
captured output capped to head + tail with the cut marked. It isolates nothing else:
it is the development backend; the bubblewrap backend (namespaces, no network,
read-only system) implements the same interface.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import time
from abc import ABC, abstractmethod
from pathlib import Path

from kiln.shared.contracts import ExecResult

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


class Sandbox(ABC):
    def __init__(self, sandbox_id: str, workspace: Path):
        self.id = sandbox_id
        self.workspace = workspace

    @abstractmethod
    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        """Run ``command`` in the workspace; never raises for the command's own failures."""

    @abstractmethod
    async def destroy(self) -> None:
        """Kill anything still running and delete the workspace."""


class ProcessSandbox(Sandbox):
    def __init__(self, sandbox_id: str, workspace: Path, *, output_limit: int, cpu_seconds: int, max_file_bytes: int):
        super().__init__(sandbox_id, workspace)
        self.output_limit = output_limit
        self.cpu_seconds = cpu_seconds
        self.max_file_bytes = max_file_bytes
        self._procs: set[asyncio.subprocess.Process] = set()

    def _env(self) -> dict[str, str]:
        return {
            "PATH": SANDBOX_PATH,
            "HOME": str(self.workspace),
            "TMPDIR": str(self.workspace / ".tmp"),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def _limits(self) -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_seconds, self.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_file_bytes, self.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        (self.workspace / ".tmp").mkdir(exist_ok=True)
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            command,
            cwd=self.workspace,
            env=self._env(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=self._limits,
        )
        self._procs.add(proc)
        out, err = _Capped(self.output_limit), _Capped(self.output_limit)
        readers = asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            await proc.wait()
            self._procs.discard(proc)
        # The group is dead; a grandchild that escaped into its own session could still
        # hold the pipes open, so do not wait for EOF forever.
        try:
            await asyncio.wait_for(readers, 2.0)
        except asyncio.TimeoutError:
            readers.cancel()
        return ExecResult(
            exit_code=-9 if timed_out else proc.returncode,
            stdout=out.text(),
            stderr=err.text() + (f"\n[killed: command exceeded its {timeout_s:g}s timeout]" if timed_out else ""),
            timed_out=timed_out,
            duration_s=time.monotonic() - t0,
            truncated=out.truncated or err.truncated,
        )

    async def destroy(self) -> None:
        for proc in list(self._procs):
            _kill_group(proc.pid)
        await asyncio.to_thread(shutil.rmtree, self.workspace, True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Capped:
    """Keeps the first and last ``limit/2`` bytes of a stream and counts what was cut."""

    def __init__(self, limit: int):
        self.half = max(1, limit // 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        while chunk := await stream.read(65536):
            room = self.half - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail += chunk
                if len(self.tail) > self.half:
                    cut = len(self.tail) - self.half
                    self.dropped += cut
                    del self.tail[:cut]

    def text(self) -> str:
        mid = f"\n[... {self.dropped} bytes truncated ...]\n" if self.dropped else ""
        return self.head.decode(errors="replace") + mid + self.tail.decode(errors="replace")
