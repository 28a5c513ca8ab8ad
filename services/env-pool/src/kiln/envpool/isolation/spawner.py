"""Starting sandbox processes through a zygote (``zygote.py``).

Why: a sandboxed command must join its cgroup, take its rlimits and drop to its uid
between fork and exec. Doing that in env-pool itself means forking a big Python
process and running Python in the child (several ms of CPU, and the event loop stalls
until the exec), and doing it with exec'd tools (sh, setpriv, prlimit) costs one exec
each. The zygote is a small stdlib-only process that forks cheaply and does all of it
in the child with plain syscalls; env-pool keeps the pipes and the pid.

Invariants: every spawned child is reported exactly once by ``wait`` (its exit code,
or -9 with a reason if the zygote died); a dead zygote is restarted on the next spawn,
and its children die with it (they are in its sandbox's process group, and bwrap runs
``--die-with-parent``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kiln.envpool.isolation.spawner")

ZYGOTE = Path(__file__).with_name("zygote.py")
FIRST_FILE_FD = 3
"""``spawn(files=[...])`` opens them in the child at this fd and the next ones, in order."""


@dataclass
class SpawnedProcess:
    pid: int
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    exited: asyncio.Future = field(repr=False)

    async def wait(self) -> int:
        return await self.exited


@dataclass
class _Pending:
    started: asyncio.Future
    exited: asyncio.Future


class Spawner:
    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()

    async def _ensure(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            str(ZYGOTE),
            str(theirs.fileno()),
            pass_fds=(theirs.fileno(),),
            stdin=asyncio.subprocess.DEVNULL,
        )
        theirs.close()
        ours.setblocking(False)
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_readable)
        self._sock = ours
        return ours

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost("the sandbox spawner (zygote) exited")
                return
            msg = json.loads(data)
            p = self._pending.get(msg["id"])
            if p is None:
                continue
            if "pid" in msg:
                p.started.set_result(msg["pid"])
            elif "error" in msg:
                p.started.set_exception(OSError(msg["error"]))
                self._pending.pop(msg["id"])
            elif "exit" in msg:
                p.exited.set_result(msg["exit"])
                self._pending.pop(msg["id"])

    def _lost(self, why: str) -> None:
        log.error("%s; %d sandbox commands lost it", why, len(self._pending))
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
        self._sock = None
        for p in self._pending.values():
            if not p.started.done():
                p.started.set_exception(OSError(why))
            if not p.exited.done():
                p.exited.set_result(-9)
        self._pending.clear()

    async def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str | None,
        cgroups: list[str],
        rlimits: list[tuple[int, int]],
        uid: int | None,
        gid: int | None,
        files: list[str] | None = None,
    ) -> SpawnedProcess:
        """Start ``argv``; ``files`` are opened read-only in the child, as its uid, at fds 3,
        4, ... (the only fds it has beyond 0-2): a fresh open file per command, so a program
        that reads one to its end (``bwrap --seccomp``) leaves it whole for the next."""
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        rid = next(self._ids)
        pending = _Pending(loop.create_future(), loop.create_future())
        self._pending[rid] = pending
        req = {
            "id": rid,
            "argv": argv,
            "env": env,
            "cwd": cwd,
            "cgroups": cgroups,
            "rlimits": rlimits,
            "uid": uid,
            "gid": gid,
            "files": files or [],
        }
        try:
            async with self._lock:
                sock = await self._ensure()
                await _send(loop, sock, json.dumps(req).encode(), [null, out_w, err_w])
        except BaseException:
            self._pending.pop(rid, None)
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        try:
            pid = await pending.started
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        return SpawnedProcess(pid, await _reader(loop, out_r), await _reader(loop, err_r), pending.exited)

    async def close(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                await asyncio.wait_for(self._proc.wait(), 5)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes, fds: list[int]) -> None:
    while True:
        try:
            socket.send_fds(sock, [data], fds)
            return
        except BlockingIOError:
            await _writable(loop, sock)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()
    loop.add_writer(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(sock.fileno())


async def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader
