"""Sandboxes: a workspace and a way to run commands in it.

``Sandbox`` is the interface every backend implements: ``run`` (an argv, in the
workspace, under the sandbox's limits) and ``destroy``; ``exec`` runs a bash command
through ``run``. Shared by all backends (``spawn``): a cleared environment, rlimits
(CPU seconds, address space, file size, open files, processes), the sandbox's cgroup
joined before exec, a wall-clock timeout that kills the whole process group (and
everything left in the cgroup), and output capped to head + tail with the cut marked;
a command that floods its output past ``output_kill_bytes`` is killed; a command too
long for execve (or holding a NUL) is refused with exit code 126 and a note, not raised.
The quota's usage walk and the removal of a workspace are bounded whatever the tree
holds (``walk.py``: any depth, any path length).

Processes start through the node's ``Spawner`` (a zygote that joins the cgroup, sets
the rlimits and drops the uid between fork and exec, see ``spawner.py``).

Invariant: when ``run`` returns, no process of the sandbox is left running, so the
host-side file tools never race a sandboxed process (no check-then-use window).

The ``process`` backend here isolates nothing beyond that; ``bwrap.py`` is the real
one (namespaces, read-only system, no network, unprivileged uid).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import resource
import shutil
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from kiln.envpool.isolation.cgroups import Cgroup
from kiln.envpool.isolation.spawner import Spawner
from kiln.envpool.workspaces.walk import remove_tree, usage
from kiln.shared.contracts import ExecResult

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
MAX_ARG_BYTES = 128 * 1024
"""Linux's MAX_ARG_STRLEN: the longest single argument (``bash -c COMMAND``) execve takes."""


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int
    address_space_bytes: int
    max_file_bytes: int
    open_files: int
    processes: int
    output_limit_bytes: int
    output_kill_bytes: int
    tmp_bytes: int
    workspace_quota_bytes: int
    max_path_chars: int = 1024
    """Longest workspace path the file tools accept (``walk.Bounds``)."""
    max_path_depth: int = 128

    @classmethod
    def from_settings(cls, s) -> Limits:
        return cls(**{k: getattr(s, k) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Identity:
    """Host uid/gid the sandbox's processes run as (None: env-pool's own)."""

    uid: int | None = None
    gid: int | None = None


class Sandbox(ABC):
    def __init__(
        self,
        sandbox_id: str,
        workspace: Path,
        limits: Limits,
        identity: Identity,
        cgroup: Cgroup | None,
        spawner: Spawner,
    ):
        self.id = sandbox_id
        self.spawner = spawner
        self.workspace = workspace
        self.limits = limits
        self.identity = identity
        self.cgroup = cgroup
        self.over_quota = False
        self.oom_seen = 0
        self._entries = 0
        self.view = None
        """The overlay view (``overlay.OverlayView``) of an environment sandbox, else None."""
        self.environment = None
        """The ``BuiltEnvironment`` it runs in (None: the host system, a plain workspace)."""

    def attach_view(self, view, environment) -> None:
        self.view, self.environment = view, environment

    @property
    def storage(self) -> Path:
        """What counts against the quota: the workspace, or an overlay view's upper layer."""
        return self.view.upper if self.view is not None else self.workspace

    @abstractmethod
    async def run(self, argv: list[str], timeout_s: float) -> ExecResult:
        """Run ``argv`` in the workspace; never raises for the command's own failures."""

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        return await self.run(["bash", "-c", command], timeout_s)

    async def destroy(self) -> None:
        """Kill anything still running, drop the cgroup, delete the workspace."""

        def remove() -> None:
            if self.cgroup is not None:
                self.cgroup.remove()
            if self.view is not None:
                self.view.unmount()
                remove_tree(self.view.dir)
            else:
                remove_tree(self.workspace)

        await asyncio.to_thread(remove)

    async def usage(self) -> int:
        """Bytes the workspace uses; walked inline while it is small (a thread hop costs
        more than walking a few dozen files), in a thread once it is big."""
        if self._entries < 256:
            used, self._entries = usage(self.storage)
        else:
            used, self._entries = await asyncio.to_thread(usage, self.storage)
        return used

    def rlimits(self) -> list[tuple[int, int]]:
        lim = self.limits
        return [
            (resource.RLIMIT_CPU, lim.cpu_seconds),
            (resource.RLIMIT_AS, lim.address_space_bytes),
            (resource.RLIMIT_FSIZE, lim.max_file_bytes),
            (resource.RLIMIT_NOFILE, lim.open_files),
            (resource.RLIMIT_NPROC, lim.processes),
            (resource.RLIMIT_CORE, 0),
        ]


async def spawn(
    sb: Sandbox,
    argv: list[str],
    timeout_s: float,
    *,
    cwd: Path | None,
    env: dict[str, str],
    files: list[str] | None = None,
) -> ExecResult:
    """Run ``argv`` under ``sb``'s limits; the whole process tree is gone when this returns.
    ``files`` are opened (read-only) for the command at fds 3, 4, ... (``Spawner.spawn``)."""
    if sb.over_quota:
        return ExecResult(
            exit_code=-1, stdout="", stderr=_quota_note(sb), timed_out=False, duration_s=0.0, truncated=False
        )
    size = max(len(a.encode(errors="surrogateescape")) for a in argv)
    if size >= MAX_ARG_BYTES or "\0" in "".join(argv):
        # execve refuses an argument past MAX_ARG_STRLEN, and the spawner's message has a size
        # limit too: the caller's command, refused as an observation, never a node failure.
        why = (
            f"{size} bytes, more than the {MAX_ARG_BYTES - 1} one command may hold"
            if size >= MAX_ARG_BYTES
            else "a NUL character"
        )
        return ExecResult(
            exit_code=126,
            stdout="",
            stderr=f"[not run: the command holds {why}]",
            timed_out=False,
            duration_s=0.0,
            truncated=False,
        )
    t0 = time.monotonic()
    try:
        child = await sb.spawner.spawn(
            [_absolute(argv[0]), *argv[1:]],
            env=env,
            cwd=str(cwd) if cwd else None,
            cgroups=[str(d / "cgroup.procs") for d in sb.cgroup.dirs] if sb.cgroup is not None else [],
            rlimits=sb.rlimits(),
            uid=sb.identity.uid,
            gid=sb.identity.gid,
            files=files or [],
        )
    except OSError as e:
        if e.errno not in (errno.EMSGSIZE, errno.E2BIG):
            raise
        return ExecResult(
            exit_code=126,
            stdout="",
            stderr=f"[not run: the command is too long to start ({e.strerror})]",
            timed_out=False,
            duration_s=time.monotonic() - t0,
            truncated=False,
        )
    flood = asyncio.Event()
    out = _Capped(sb.limits.output_limit_bytes, sb.limits.output_kill_bytes, flood)
    err = _Capped(sb.limits.output_limit_bytes, sb.limits.output_kill_bytes, flood)
    readers = asyncio.gather(out.drain(child.stdout), err.drain(child.stderr))
    waiter = asyncio.ensure_future(child.wait())
    flooded = asyncio.ensure_future(flood.wait())
    try:
        done, _ = await asyncio.wait({waiter, flooded}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        flooded.cancel()
        _kill_group(child.pid)
        if sb.cgroup is not None and sb.cgroup.pids():  # a few bytes to read: no thread hop
            await asyncio.to_thread(sb.cgroup.kill)
        returncode = await waiter
    timed_out = not done
    try:  # the tree is dead, so EOF is near; never wait for it forever
        await asyncio.wait_for(readers, 2.0)
    except TimeoutError:
        readers.cancel()
    notes = []
    if await sb.usage() > sb.limits.workspace_quota_bytes:
        sb.over_quota = True
        notes.append(_quota_note(sb))
    if timed_out:
        notes.append(f"[killed: command exceeded its {timeout_s:g}s timeout]")
    if sb.cgroup is not None and returncode in (-9, 137):  # SIGKILLed: was it the OOM killer?
        ooms = sb.cgroup.oom_kills()
        if ooms > sb.oom_seen:
            notes.append("[killed: the sandbox ran out of memory]")
        sb.oom_seen = ooms
    if flood.is_set():
        notes.append(f"[killed: command wrote more than {sb.limits.output_kill_bytes} bytes of output]")
    return ExecResult(
        exit_code=-9 if (timed_out or flood.is_set()) else returncode,
        stdout=out.text(),
        stderr=err.text() + "".join("\n" + n for n in notes),
        timed_out=timed_out,
        duration_s=time.monotonic() - t0,
        truncated=out.truncated or err.truncated,
    )


class ProcessSandbox(Sandbox):
    """A plain subprocess in the workspace: limits, but no isolation (development only)."""

    async def run(self, argv: list[str], timeout_s: float) -> ExecResult:
        tmp = self.workspace / ".tmp"
        tmp.mkdir(exist_ok=True)
        env = {
            "PATH": SANDBOX_PATH,
            "HOME": str(self.workspace),
            "TMPDIR": str(tmp),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        return await spawn(self, argv, timeout_s, cwd=self.workspace, env=env)


@functools.cache
def _absolute(program: str) -> str:
    if os.path.isabs(program):
        return program
    found = shutil.which(program, path=SANDBOX_PATH)
    if found is None:
        raise FileNotFoundError(f"{program} not found on {SANDBOX_PATH}")
    return found


def _quota_note(sb: Sandbox) -> str:
    return f"[workspace is over its {sb.limits.workspace_quota_bytes} byte quota: this sandbox runs no more commands]"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Capped:
    """Keeps the first and last ``limit/2`` bytes of a stream; sets ``flood`` past ``kill_at``."""

    def __init__(self, limit: int, kill_at: int, flood: asyncio.Event):
        self.half = max(1, limit // 2)
        self.kill_at = kill_at
        self.flood = flood
        self.head = bytearray()
        self.tail = bytearray()
        self.seen = 0
        self.dropped = 0

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        while chunk := await stream.read(65536):
            self.seen += len(chunk)
            if self.seen > self.kill_at:
                self.flood.set()
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
