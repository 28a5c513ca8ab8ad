"""The per-node environment cache: build (or fetch) each environment once per digest, share
concurrent builds, remember failures, evict least recently used environments past a budget.

Layout of ``root``::

    layers/<digest>/                 a layer's tree (its root stands for the sandbox's /)
    layers/<digest>.partial-<pid>-n  a layer being built (removed at start when its process is gone)
    envs/<digest>.json               a built environment (BuiltEnvironment); mtime = last use
    uv-cache/                        uv's cache, shared by every build of the node (hard links)
    build/<digest>.partial-<pid>-n   a python layer being built (beside uv-cache: one mount)
    locks/<digest>.lock              flock held while a process builds that environment
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from kiln.shared.environments import EnvironmentInputError, EnvironmentSpec

from .builder import build_layers, partial_path, publish
from .layers import (
    BuiltEnvironment,
    EnvironmentBuildError,
    environment_from_plan,
    plan_layers,
    tree_size,
    write_json_atomic,
)

log = logging.getLogger(__name__)


class LayerStore(Protocol):
    """Where built layers are shared between nodes (``NatsLayerStore``, ``S3LayerStore``)."""

    async def put(self, digest: str, path: Path) -> None:
        """Store the layer tree at ``path`` under ``digest`` (no-op when present)."""

    async def fetch(self, digest: str, dest: Path) -> bool:
        """Write the layer ``digest`` as a tree at ``dest`` (absent); False when not stored."""


class EnvironmentCache:
    def __init__(self, root: Path, budget_bytes: int, store: LayerStore | None = None):
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.store = store
        self.builds = 0
        """Environments this process built (not fetched, not found on disk)."""
        self.fetches = 0
        """Layers this process fetched from the store."""
        self._pending: dict[str, asyncio.Future[BuiltEnvironment]] = {}
        self._failed: dict[str, EnvironmentBuildError] = {}
        self._pins: dict[str, int] = {}
        self._inputs: dict[str, dict[str, str]] = {}
        """Spec (as JSON) -> its input hashes, computed once."""
        self._uploads: set[asyncio.Task] = set()
        """Layers being stored for other nodes (``published`` waits for them)."""
        for d in ("layers", "envs", "uv-cache", "locks", "build"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._remove_stale_partials()

    # -- public ---------------------------------------------------------------------------

    async def get(self, spec: EnvironmentSpec) -> BuiltEnvironment:
        """The built environment of ``spec``: from disk, else fetched from the store, else
        built. Concurrent callers of one digest share one build; a failed build is
        re-raised for that digest without rebuilding (``forget_failure`` to retry). A spec's
        inputs are hashed once per cache object, not per call: env-pool calls this on every
        create, and hashing an image archive or a folder is O(its size)."""
        key = spec.model_dump_json()
        inputs = self._inputs.get(key)
        if inputs is None:
            try:
                inputs = self._inputs[key] = await asyncio.to_thread(spec.input_hashes)
            except EnvironmentInputError as e:
                raise EnvironmentBuildError(spec.name, e.input, str(e)) from e
        plan = plan_layers(spec, inputs)
        digest = plan.digest
        if digest in self._failed:
            raise self._failed[digest]
        fut = self._pending.get(digest)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._pending[digest] = fut
            try:
                built = await self._obtain(plan)
                fut.set_result(built)
            except EnvironmentBuildError as e:
                self._failed[digest] = e
                fut.set_exception(e)
            except Exception as e:  # noqa: BLE001 - an unexpected error is a build error too
                err = EnvironmentBuildError(spec.name, "build", f"{type(e).__name__}: {e}")
                self._failed[digest] = err
                fut.set_exception(err)
            finally:
                self._pending.pop(digest, None)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
        built = await asyncio.shield(fut)
        return replace(built, name=spec.name)

    def pin(self, digest: str) -> None:
        """Keep an environment from eviction while sandboxes use it (counted)."""
        self._pins[digest] = self._pins.get(digest, 0) + 1

    def unpin(self, digest: str) -> None:
        n = self._pins.get(digest, 0) - 1
        if n > 0:
            self._pins[digest] = n
        else:
            self._pins.pop(digest, None)

    def forget_failure(self, digest: str) -> None:
        self._failed.pop(digest, None)

    def cached(self, spec: EnvironmentSpec) -> BuiltEnvironment | None:
        """The environment if it is on disk now (no build)."""
        m = self.root / "envs" / f"{spec.digest()}.json"
        return BuiltEnvironment.from_json(json.loads(m.read_text())) if m.exists() else None

    def environments(self) -> list[BuiltEnvironment]:
        """Every environment on disk, least recently used first."""
        out = []
        for m in sorted((self.root / "envs").glob("*.json"), key=lambda p: p.stat().st_mtime):
            try:
                out.append(BuiltEnvironment.from_json(json.loads(m.read_text())))
            except (OSError, ValueError, KeyError):
                continue
        return out

    def used_bytes(self) -> int:
        return sum(tree_size(p) for p in (self.root / "layers").iterdir() if p.is_dir() and ".partial-" not in p.name)

    # -- internals ------------------------------------------------------------------------

    async def _obtain(self, plan) -> BuiltEnvironment:
        manifest = self.root / "envs" / f"{plan.digest}.json"
        if manifest.exists():
            built = BuiltEnvironment.from_json(json.loads(manifest.read_text()))
            if all(la.path.is_dir() for la in built.layers):
                os.utime(manifest)
                return built
        layers = self.root / "layers"
        want = [d for d in (plan.base, plan.python, plan.repository) if d]
        missing = {d for d in want if not (layers / d).is_dir()}
        if missing and self.store is not None:
            coupled = {d for d in (plan.python, plan.repository) if d} if plan.coupled else set()
            for d in sorted(missing):
                if await self._fetch(d):
                    missing.discard(d)
            if coupled & missing:  # coupled layers come as a pair or are rebuilt together
                missing |= coupled
        built = await asyncio.to_thread(self._locked, plan.digest, self._build_sync, plan, missing)
        if self.store is not None:
            # In the background: the first sandbox must not wait for the upload (packing a
            # 250 MB environment took 13 s of a 17 s first create). Pinned meanwhile.
            self.pin(plan.digest)
            task = asyncio.create_task(self._publish(plan.spec.name, built))
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)
        await asyncio.to_thread(self.evict, keep=plan.digest)
        return built

    async def _publish(self, name: str, built: BuiltEnvironment) -> None:
        try:
            for layer in built.layers:
                try:
                    await self.store.put(layer.digest, layer.path)
                except Exception as e:  # noqa: BLE001 - sharing is best effort
                    log.warning("environment %s: storing layer %s failed: %s", name, layer.digest[:12], e)
        finally:
            self.unpin(built.digest)

    async def published(self) -> None:
        """Until every layer this cache built has been offered to the store."""
        while self._uploads:
            await asyncio.gather(*list(self._uploads))

    def _locked(self, digest: str, fn, *args):
        with open(self.root / "locks" / f"{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process on this root may be building it
            return fn(*args)

    def _build_sync(self, plan, missing: set[str]) -> BuiltEnvironment:
        manifest = self.root / "envs" / f"{plan.digest}.json"
        layers = self.root / "layers"
        missing = {d for d in missing if not (layers / d).is_dir()}  # another process may have built them
        if missing:
            t0 = time.monotonic()
            build_layers(plan, self.root, missing)
            self.builds += 1
            log.info("environment %s (%s) built in %.1fs", plan.spec.name, plan.digest[:12], time.monotonic() - t0)
        want = [d for d in (plan.base, plan.python, plan.repository) if d]
        sizes = {d: tree_size(layers / d) for d in want}
        built = environment_from_plan(plan, self.root, sizes)
        write_json_atomic(manifest, built.to_json())
        return built

    async def _fetch(self, digest: str) -> bool:
        final = self.root / "layers" / digest
        partial = partial_path(final)
        try:
            ok = await self.store.fetch(digest, partial)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - a broken store means: build it
            log.warning("fetching layer %s failed: %s", digest[:12], e)
            ok = False
        if ok and partial.is_dir():
            publish(partial, final)
            self.fetches += 1
            return True
        shutil.rmtree(partial, ignore_errors=True)
        return False

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used environments (never a pinned one, nor ``keep``) until
        the layers fit ``budget_bytes``; then every layer no environment names. Returns the
        evicted digests."""
        evicted: list[str] = []
        envs = self.environments()
        layer_size = {}
        for e in envs:
            for la in e.layers:
                layer_size[la.digest] = tree_size(la.path) if la.path.is_dir() else 0
        used = sum(layer_size.values())
        for e in envs:
            if used <= self.budget_bytes:
                break
            if e.digest == keep or self._pins.get(e.digest):
                continue
            (self.root / "envs" / f"{e.digest}.json").unlink(missing_ok=True)
            evicted.append(e.digest)
            still = {la.digest for x in envs if x.digest not in evicted for la in x.layers}
            for la in e.layers:
                if la.digest not in still and la.path.is_dir():
                    shutil.rmtree(la.path, ignore_errors=True)
                    used -= layer_size.pop(la.digest, 0)
        if evicted:
            log.info("evicted environments %s (budget %d bytes)", [d[:12] for d in evicted], self.budget_bytes)
        return evicted

    def _remove_stale_partials(self) -> None:
        for p in [*(self.root / "layers").glob("*.partial-*"), *(self.root / "build").glob("*.partial-*")]:
            try:
                pid = int(p.name.split(".partial-")[1].split("-")[0])
                os.kill(pid, 0)
                continue  # its process is alive (possibly this one): a build in flight
            except (ValueError, IndexError, ProcessLookupError):
                pass
            except PermissionError:
                continue
            shutil.rmtree(p, ignore_errors=True)
