"""The sandboxes one env-pool node owns: warm pools, leases, forks and snapshots.

Invariants:
- the node never holds more than ``max_sandboxes`` (leased + warm + being created);
  when it is full an idle warm sandbox is evicted to make room, and if none is idle
  ``create`` fails at once with ``pool_exhausted``: backpressure, never a hang;
- at most ``max_creating`` sandboxes are built at once; a create waits for a slot at
  most ``create_wait_s`` and then fails with ``busy``;
- every leased sandbox has an expiry; the reaper destroys it after that unless it is
  renewed, so a worker that dies leaks nothing for longer than its lease;
- as root, each live sandbox has its own host uid (``sandbox_uid_base + slot``), its
  workspace owned by that uid and nobody else's, and its own cgroup;
- a task with an ``environment`` gets a copy-on-write view (``overlay.py``): the
  environment's layers and the task's own files read-only beneath, the sandbox's upper
  directory on top. Create copies nothing; fork copies the parent's upper directory
  (what it changed), never the environment; snapshots and diffs are of the upper
  directory alone. An environment that cannot be built fails every create of its tasks
  with ``environment_error`` naming the environment and the step (the cache remembers
  the failure: it is never rebuilt in a loop).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.envpool.config import EnvPoolSettings
from kiln.envpool.isolation.cgroups import CgroupManager
from kiln.envpool.isolation.sandbox import Identity, Limits, Sandbox
from kiln.envpool.workspaces import overlay
from kiln.envpool.workspaces import trees as wsp
from kiln.envpool.workspaces import upper as upp
from kiln.envpool.workspaces.patch import git_patch
from kiln.envpool.workspaces.walk import Bounds
from kiln.shared import contracts as c
from kiln.shared.bus import ServiceError
from kiln.shared.tasks import TaskSuite

log = logging.getLogger("kiln.envpool.pool")

SandboxFactory = Callable[[str, Path, Limits, Identity, object], Sandbox]
MAX_PATCH_PATHS = 1000
"""Paths one diff's patch shows (git's cost grows with them; the rest are listed)."""

Filler = Callable[[Path, Identity], "tuple[Path, overlay.OverlayView | None]"]
"""Writes a new sandbox's files under its folder; returns its workspace and its overlay view."""


@dataclass(frozen=True)
class TaskLayers:
    """What an environment task's sandboxes are made of."""

    environment: object
    """The ``BuiltEnvironment``."""
    layers: tuple[overlay.LowerLayer, ...]
    """Its layers and the task's own files above them, lowest first."""


@dataclass
class Lease:
    sandbox: Sandbox
    task_id: str
    run_id: str
    slot: int
    created_at: float
    expires_at: float | None
    """None while the sandbox sits idle in a warm pool."""


class SandboxPool:
    def __init__(
        self,
        settings: EnvPoolSettings,
        suite: TaskSuite,
        root: Path,
        factory: SandboxFactory,
        cgroups: CgroupManager,
        *,
        put_snapshot: Callable[[str, bytes], Awaitable[None]] | None = None,
        get_snapshot: Callable[[str], Awaitable[bytes]] | None = None,
        on_destroy: Callable[[Path], None] | None = None,
        environments=None,
    ):
        self.s = settings
        self.suite = suite
        self.root = root
        self.factory = factory
        self.cgroups = cgroups
        self.limits = Limits.from_settings(settings)
        self.put_snapshot = put_snapshot
        self.get_snapshot = get_snapshot
        self.on_destroy = on_destroy
        """Told each destroyed workspace (the search index drops what it cached for it)."""
        self.environments = environments
        """The node's ``EnvironmentCache`` (None: only tasks without an environment)."""
        self.idmaps = overlay.IdmapNamespaces()
        self.as_root = os.geteuid() == 0
        self.templates = root / "templates"
        self.spaces = root / "ws"
        for d in (self.root, self.templates, self.spaces):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o711)  # sandbox uids must traverse to their workspace, not list others
        if self.as_root and overlay.filesystem_of(self.spaces) == "tmpfs":
            # Workspaces on a tmpfs of their own: the bind of one into its sandbox then shows
            # only ``/<sandbox id>`` in mountinfo, never the node's folder and pid.
            overlay.mount_tmpfs(self.spaces)
        self.leases: dict[str, Lease] = {}
        self.warm: dict[str, list[Lease]] = {}
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.creating = 0
        self._topping_up: set[str] = set()
        self._teardowns: set[asyncio.Task] = set()
        """Destroys answered but still cleaning up; they hold their room until done."""
        self.slots = set(range(max(settings.max_sandboxes, 0)))
        self._build_slots = asyncio.Semaphore(settings.max_creating)
        self._template_locks: dict[str, asyncio.Lock] = {}
        self.created_total = 0
        self.reaped_total = 0

    # --- accounting ------------------------------------------------------------

    @property
    def idle(self) -> int:
        return sum(len(v) for v in self.warm.values())

    def total(self) -> int:
        return len(self.leases) + self.idle + self.creating + len(self._teardowns)

    async def _reserve(self) -> None:
        """Claim room for one sandbox (``creating`` += 1), evicting an idle one if full."""
        victim = None
        deadline = time.monotonic() + self.s.create_wait_s
        while self.total() >= self.s.max_sandboxes and not self._oldest_idle_exists() and self._teardowns:
            # Room is only being freed (destroys still cleaning up): that takes milliseconds.
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(set(self._teardowns), timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if self.total() >= self.s.max_sandboxes:
            victim = self._oldest_idle()
            if victim is None:
                raise ServiceError(
                    f"pool exhausted: this node holds {self.total()} of {self.s.max_sandboxes} sandboxes "
                    f"({len(self.leases)} leased, {self.creating} being created, {len(self._teardowns)} being destroyed)",
                    "pool_exhausted",
                )
        # Claim the place before yielding: the refill loop must not take the victim's room.
        self.creating += 1
        if victim is not None:
            try:
                await self._destroy_lease(victim)
            except BaseException:
                self.creating -= 1
                raise

    def _oldest_idle_exists(self) -> bool:
        return any(self.warm.values())

    def _oldest_idle(self) -> Lease | None:
        idle = [lease for pool in self.warm.values() for lease in pool]
        if not idle:
            return None
        victim = min(idle, key=lambda lease: lease.created_at)
        self.warm[victim.task_id].remove(victim)
        return victim

    # --- building --------------------------------------------------------------

    async def _template(self, task_id: str) -> Path:
        try:
            task = self.suite.get(task_id)
        except KeyError as e:
            raise ServiceError(str(e.args[0]), "unknown_task") from None
        dest = self.templates / task_id
        async with self._template_locks.setdefault(task_id, asyncio.Lock()):
            if not dest.exists():
                # An environment task's files are a layer over the repository: root-shaped.
                await asyncio.to_thread(wsp.materialize, task, dest, "workspace" if task.environment else "")
        return dest

    async def _layers(self, task_id: str) -> TaskLayers | None:
        """The environment and the lower layers of a task's sandboxes (None: a plain task)."""
        try:
            task = self.suite.get(task_id)
        except KeyError as e:
            raise ServiceError(str(e.args[0]), "unknown_task") from None
        if not task.environment:
            return None
        if self.environments is None:
            raise ServiceError(
                f"task {task_id} needs environment {task.environment!r}: this node serves no environments "
                "(they need the bwrap backend and env-pool running as root)",
                "unsupported",
            )
        from kiln.envpool.environments import EnvironmentBuildError

        try:
            built = await self.environments.get(self.suite.environments[task.environment])
        except EnvironmentBuildError as e:
            raise ServiceError(str(e), c.ENVIRONMENT_ERROR) from None
        template = await self._template(task_id)
        layers = [overlay.LowerLayer(layer.path, owned=layer.name == "repository") for layer in built.layers]
        return TaskLayers(built, (*layers, overlay.LowerLayer(template, owned=True)))

    async def _build(self, task_id: str, fill: Filler, environment=None) -> Lease:
        """A new sandbox whose files ``fill`` writes; the caller holds a reservation."""
        try:
            await asyncio.wait_for(self._build_slots.acquire(), self.s.create_wait_s)
        except TimeoutError:
            raise ServiceError(f"{self.s.max_creating} sandboxes are being created; try again", "busy") from None
        sid = f"sb-{uuid.uuid4().hex[:12]}"
        ws = self.spaces / sid
        slot = self.slots.pop()
        identity = (
            Identity(self.s.sandbox_uid_base + slot, self.s.sandbox_uid_base + slot) if self.as_root else Identity()
        )

        def prepare():  # one thread hop for all the file system work
            workspace, view = fill(ws, identity)
            try:
                return workspace, view, self.cgroups.create(sid, memory_bytes=self.s.memory_bytes, pids=self.s.pids)
            except BaseException:
                if view is not None:
                    view.unmount()
                raise

        try:
            workspace, view, cgroup = await asyncio.to_thread(prepare)
            sb = self.factory(sid, workspace, self.limits, identity, cgroup)
            sb.attach_view(view, environment)
            if environment is not None:
                self.environments.pin(environment.digest)  # never evicted under a live sandbox
        except BaseException:
            self.slots.add(slot)
            await asyncio.to_thread(shutil.rmtree, ws, True)
            raise
        finally:
            self._build_slots.release()
        self.created_total += 1
        now = time.time()
        return Lease(sb, task_id, "", slot, now, None)

    async def _new(self, task_id: str, fill: Filler, environment=None) -> Lease:
        await self._reserve()
        try:
            return await self._build(task_id, fill, environment)
        finally:
            self.creating -= 1

    @staticmethod
    def _plain(write: Callable[[Path], None]) -> Filler:
        def fill(ws: Path, identity: Identity) -> tuple[Path, None]:
            write(ws)
            if identity.uid is not None:
                wsp.chown_tree(ws, identity.uid, identity.gid)
            return ws, None

        return fill

    def _overlay(
        self, layers: tuple[overlay.LowerLayer, ...], upper_from: Callable[[Path, Identity], None] | None = None
    ) -> Filler:
        """A view over ``layers``; ``upper_from`` writes its starting upper directory
        (a fork's copy, a restored snapshot), else it starts empty."""

        def fill(ws: Path, identity: Identity) -> tuple[Path, overlay.OverlayView]:
            ws.mkdir(parents=True)
            os.chmod(ws, 0o711)  # bwrap (as the sandbox uid) must reach root/, nobody may list
            view = overlay.OverlayView(ws, layers)
            if upper_from is not None:
                upper_from(view.upper, identity)
            view.mount(identity.uid, identity.gid, self.idmaps)
            return view.workspace, view

        return fill

    async def _fresh(self, task_id: str) -> tuple[Filler, object]:
        """How to build a task's sandbox as it starts, and its environment (None: plain)."""
        env = await self._layers(task_id)
        if env is None:
            return self._plain(self._clone_of(await self._template(task_id))), None
        return self._overlay(env.layers), env.environment

    @staticmethod
    def _clone_of(template: Path) -> Callable[[Path], None]:
        return lambda ws: wsp.clone(template, ws)

    # --- API -------------------------------------------------------------------

    async def create(self, task_id: str, run_id: str, ttl_s: float, snapshot_key: str | None = None) -> Sandbox:
        if snapshot_key:
            if self.get_snapshot is None:
                raise ServiceError("this node has no snapshot store", "unsupported")
            try:
                data = await self.get_snapshot(snapshot_key)
            except Exception as e:
                raise ServiceError(f"snapshot {snapshot_key} is unavailable: {e}", "not_found") from None
            env = await self._layers(task_id)
            if env is None:
                lease = await self._new(task_id, self._plain(lambda ws: wsp.restore(data, None, ws)))
            else:
                restore = lambda up, ident: upp.restore(data, None, up, ident.uid or 0, ident.gid or 0)  # noqa: E731
                lease = await self._new(task_id, self._overlay(env.layers, restore), env.environment)
        else:
            self._touch(task_id)
            pool = self.warm.get(task_id)
            if pool:
                lease = pool.pop()
                self._top_up_soon(task_id)
            else:
                lease = await self._new(task_id, *await self._fresh(task_id))
        return self._lease(lease, run_id, ttl_s)

    async def fork(self, sandbox_id: str, ttl_s: float) -> Sandbox:
        src = self._get_lease(sandbox_id)
        view = src.sandbox.view
        if view is None:
            lease = await self._new(src.task_id, self._plain(self._clone_of(src.sandbox.workspace)))
        else:  # the parent's changes, copied; the environment is shared, not copied
            copy = lambda up, ident: overlay.copy_upper(view.upper, up, ident.uid or 0, ident.gid or 0)  # noqa: E731
            lease = await self._new(src.task_id, self._overlay(view.layers, copy), src.sandbox.environment)
        return self._lease(lease, src.run_id, ttl_s)

    async def snapshot(self, sandbox_id: str) -> tuple[str, int, str, str]:
        """(key, size, sha256, task_id) of a snapshot stored in the object store."""
        if self.put_snapshot is None:
            raise ServiceError("this node has no snapshot store", "unsupported")
        lease = self._get_lease(sandbox_id)
        view = lease.sandbox.view
        if view is None:
            data, digest = await asyncio.to_thread(wsp.snapshot, lease.sandbox.workspace)
        else:  # the changes only: a node with the same environment digest resumes it
            data, digest = await asyncio.to_thread(upp.snapshot, view.upper)
        key = f"{lease.task_id}/{sandbox_id}-{digest[:16]}"
        await self.put_snapshot(key, data)
        return key, len(data), digest, lease.task_id

    async def diff(self, sandbox_id: str) -> c.WorkspaceDiff:
        """The workspace as changes to its task's start: files (``workspace.diff``, or
        ``upper.diff`` over an environment) and a git-style patch of the same paths (at
        most ``MAX_PATCH_PATHS`` of them: the patch is for people). Bounded by the node's
        diff settings (``walk.Bounds``): a workspace past them answers at once with a
        ``truncated`` diff, never a timeout or a failure."""
        lease = self._get_lease(sandbox_id)
        view = lease.sandbox.view
        bounds = Bounds.from_settings(self.s)
        if view is not None:
            lowers = [layer.path / "workspace" for layer in reversed(view.layers)]
            compare, before = (
                functools.partial(upp.diff, view.upper / "workspace", lowers, bounds),
                functools.partial(upp.find_lower, lowers),
            )
        else:
            template = await self._template(lease.task_id)
            compare = functools.partial(wsp.diff, template, lease.sandbox.workspace, bounds)
            before = lambda rel: template / rel if os.path.lexists(template / rel) else None  # noqa: E731

        def both() -> c.WorkspaceDiff:
            ch = compare()
            paths = [*ch.changed, *ch.deleted, *ch.other]
            text, left_out = git_patch(paths[:MAX_PATCH_PATHS], before, lease.sandbox.workspace)
            return c.WorkspaceDiff(
                changed=ch.changed,
                deleted=ch.deleted,
                binary=ch.other,
                patch=text,
                patch_left_out=left_out + sorted(paths[MAX_PATCH_PATHS:]),
                omitted=ch.omitted,
                truncated=ch.truncated,
            )

        return await asyncio.to_thread(both)

    def _lease(self, lease: Lease, run_id: str, ttl_s: float) -> Sandbox:
        lease.run_id = run_id
        lease.expires_at = time.time() + (ttl_s or self.s.default_ttl_s)
        self.leases[lease.sandbox.id] = lease
        return lease.sandbox

    def _get_lease(self, sandbox_id: str) -> Lease:
        lease = self.leases.get(sandbox_id)
        if lease is None:
            raise ServiceError(f"sandbox {sandbox_id} does not exist on this node (destroyed or expired)", "not_found")
        return lease

    def get(self, sandbox_id: str) -> Sandbox:
        return self._get_lease(sandbox_id).sandbox

    def renew(self, sandbox_id: str, ttl_s: float) -> float:
        lease = self._get_lease(sandbox_id)
        lease.expires_at = max(lease.expires_at or 0.0, time.time() + ttl_s)
        return lease.expires_at

    async def destroy(self, sandbox_id: str, *, wait: bool = False) -> bool:
        """End the lease at once; the teardown (kill, cgroup, files) finishes in the
        background unless ``wait``. Its room stays taken until it has."""
        lease = self.leases.pop(sandbox_id, None)
        if lease is None:
            return False
        if wait:
            await self._destroy_lease(lease)
            return True
        task = asyncio.create_task(self._destroy_lease(lease))
        self._teardowns.add(task)
        task.add_done_callback(self._teardown_done)
        return True

    def _teardown_done(self, task: asyncio.Task) -> None:
        self._teardowns.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background sandbox work failed", exc_info=task.exception())

    async def _destroy_lease(self, lease: Lease) -> None:
        try:
            await lease.sandbox.destroy()
        finally:
            self.slots.add(lease.slot)
            if lease.sandbox.environment is not None:
                self.environments.unpin(lease.sandbox.environment.digest)
            if self.on_destroy is not None:
                self.on_destroy(lease.sandbox.workspace)

    # --- upkeep ----------------------------------------------------------------

    def _touch(self, task_id: str) -> None:
        self.recent[task_id] = None
        self.recent.move_to_end(task_id)
        while len(self.recent) > self.s.warm_tasks:
            old, _ = self.recent.popitem(last=False)
            self.warm.setdefault(old, [])

    async def reap(self) -> int:
        now = time.time()
        expired = [sid for sid, lease in self.leases.items() if lease.expires_at is not None and lease.expires_at < now]
        for sid in expired:
            log.info("lease of %s expired; destroying it", sid)
            await self.destroy(sid)
        self.reaped_total += len(expired)
        return len(expired)

    async def refill(self) -> None:
        """Top up the warm pools of recently used tasks; drop those of forgotten tasks."""
        for task_id in [t for t in self.warm if t not in self.recent]:
            for lease in self.warm.pop(task_id):
                await self._destroy_lease(lease)
        for task_id in list(self.recent):
            if not await self._top_up(task_id):
                return

    async def _top_up(self, task_id: str) -> bool:
        """Fill one task's warm pool; False when the node is busy (the next round retries)."""
        pool = self.warm.setdefault(task_id, [])
        while len(pool) < self.s.warm_per_task and self.total() < self.s.max_sandboxes:
            self.creating += 1
            try:
                pool.append(await self._build(task_id, *await self._fresh(task_id)))
            except ServiceError:
                return False
            finally:
                self.creating -= 1
        return True

    def _top_up_soon(self, task_id: str) -> None:
        """Replace a warm sandbox as soon as it is taken, not at the next reaper round."""
        if task_id in self._topping_up:
            return
        self._topping_up.add(task_id)
        task = asyncio.create_task(self._top_up(task_id))
        task.add_done_callback(lambda t: (self._topping_up.discard(task_id), self._teardown_done(t)))

    async def close(self) -> None:
        self.recent.clear()  # no more top-ups
        for sid in list(self.leases):
            await self.destroy(sid, wait=True)
        if self._teardowns:
            await asyncio.gather(*self._teardowns, return_exceptions=True)
        for pool in self.warm.values():
            for lease in pool:
                await self._destroy_lease(lease)
        self.warm.clear()
        await asyncio.to_thread(overlay.unmount_below, self.root)  # views of destroys that failed
        await asyncio.to_thread(shutil.rmtree, self.root, True)
        await asyncio.to_thread(self.cgroups.close)
        self.idmaps.close()

    def listing(self) -> list[dict]:
        rows = [(lease, "leased") for lease in self.leases.values()]
        rows += [(lease, "idle") for pool in self.warm.values() for lease in pool]
        return [
            {
                "sandbox_id": lease.sandbox.id,
                "task_id": lease.task_id,
                "run_id": lease.run_id,
                "state": state,
                "created_at": lease.created_at,
                "expires_at": lease.expires_at,
                "uid": lease.sandbox.identity.uid,
                "over_quota": lease.sandbox.over_quota,
            }
            for lease, state in rows
        ]
