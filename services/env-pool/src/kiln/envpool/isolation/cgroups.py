"""Per-sandbox cgroups: memory and pids limits, and a reliable "kill everything".

Detects the host's layout: cgroup v2 (unified, ``cgroup.controllers`` at the root; the
memory and pids controllers are enabled for kiln's subtree) or v1 (separate
``memory`` and ``pids`` hierarchies). Where neither can be written (no root, a
read-only cgroupfs), ``CgroupManager.mode`` is ``none``: a warning is logged once and
sandboxes rely on rlimits alone. A process joins its sandbox's cgroup between fork and
exec (``Cgroup.join``), so everything it ever forks is counted and can be killed.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kiln.envpool.isolation.cgroups")

ROOT = Path("/sys/fs/cgroup")


@dataclass
class Cgroup:
    mode: str
    dirs: list[Path]
    """One directory (v2) or one per controller (v1)."""

    def join(self) -> None:
        """Move the calling process in; called in the child before exec."""
        pid = str(os.getpid())
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write(pid)

    def pids(self) -> list[int]:
        """Processes in the cgroup (v1: every controller's group holds the same ones)."""
        try:
            return [int(x) for x in (self.dirs[-1] / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (processes that left the session too)."""
        if self.mode == "v2" and (self.dirs[0] / "cgroup.kill").exists():
            (self.dirs[0] / "cgroup.kill").write_text("1")
            return
        for _ in range(5):  # a process may fork while we iterate; pids.max bounds how often
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer has killed in this cgroup so far."""
        name = "memory.events" if self.mode == "v2" else "memory.oom_control"
        for d in self.dirs:
            try:
                for line in (d / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except FileNotFoundError:
                continue
        return 0

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # processes are still exiting
                    time.sleep(0.01)
            else:
                log.warning("could not remove cgroup %s", d)


class CgroupManager:
    def __init__(self, node_id: str, root: Path = ROOT):
        self.root = root
        self.mode = "none"
        self.parents: list[Path] = []
        self.reason = ""
        # The process id makes the parent this process's own: two env-pools with one node
        # id on a host (two local runs, a test beside a run) must never share it, since
        # ``close`` kills and removes every sandbox group under it.
        name = f"kiln-{node_id}-{os.getpid()}"
        try:
            if (root / "cgroup.controllers").exists():
                self._setup_v2(name)
            elif (root / "memory").is_dir() and (root / "pids").is_dir():
                self._setup_v1(name)
            else:
                self.reason = f"no cgroup v2 or v1 memory+pids hierarchy under {root}"
        except OSError as e:
            self.mode, self.parents = "none", []
            self.reason = f"{type(e).__name__}: {e}"
        if self.mode == "none":
            log.warning(
                "cgroups unavailable (%s): sandboxes get rlimits only, no per-sandbox memory/pids limit", self.reason
            )

    def _reap_orphans(self, hierarchy: Path) -> None:
        """Remove parents left by env-pools that died without ``close`` (their pid is gone)."""
        for p in hierarchy.glob("kiln-*-*"):
            pid = p.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
                for child in p.iterdir():
                    if child.is_dir():
                        Cgroup(self.mode, [child]).remove()
                try:
                    p.rmdir()
                    log.info("removed cgroup %s of a dead env-pool", p)
                except OSError:
                    pass

    def _setup_v1(self, name: str) -> None:
        parents = [self.root / "memory" / name, self.root / "pids" / name]
        for p in parents:
            p.mkdir(exist_ok=True)
        self.parents, self.mode = parents, "v1"
        for h in ("memory", "pids"):
            self._reap_orphans(self.root / h)

    def _setup_v2(self, name: str) -> None:
        available = (self.root / "cgroup.controllers").read_text().split()
        if not {"memory", "pids"} <= set(available):
            raise OSError(f"cgroup v2 root lacks memory/pids controllers (has {available})")
        (self.root / "cgroup.subtree_control").write_text("+memory +pids")
        parent = self.root / name
        parent.mkdir(exist_ok=True)
        (parent / "cgroup.subtree_control").write_text("+memory +pids")
        self.parents, self.mode = [parent], "v2"
        self._reap_orphans(self.root)

    def create(self, sandbox_id: str, *, memory_bytes: int, pids: int) -> Cgroup | None:
        if self.mode == "none":
            return None
        dirs = [p / sandbox_id for p in self.parents]
        for d in dirs:
            d.mkdir(exist_ok=True)
        if self.mode == "v2":
            (dirs[0] / "memory.max").write_text(str(memory_bytes))
            if (dirs[0] / "memory.swap.max").exists():
                (dirs[0] / "memory.swap.max").write_text("0")
            (dirs[0] / "pids.max").write_text(str(pids))
        else:
            mem, pid = dirs
            (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():  # no escaping the limit into swap
                try:
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                except OSError as e:  # swap accounting off: the memory limit still holds without swap
                    log.debug("memsw limit not set: %s", e)
            (pid / "pids.max").write_text(str(pids))
        return Cgroup(self.mode, dirs)

    def close(self) -> None:
        for p in self.parents:
            for child in p.iterdir() if p.exists() else []:
                if child.is_dir():
                    Cgroup(self.mode, [child]).remove()
            try:
                p.rmdir()
            except OSError:
                pass
