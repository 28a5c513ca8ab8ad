"""The two ends of every weight transport, and what a transport may call on an engine.

``WeightSender`` is the weights service's end: after a version is stored and registered
it says whether the version goes out over the transport (``will_send``, decided before
the ``WeightsPublished`` event, which carries the answer as ``broadcast``) and then
sends it. ``WeightFeed`` is an engine worker's end: it turns ``WeightsPublished`` events
(and whatever its transport delivers) into versions the engine serves.

Invariants (every implementation keeps them):
- a worker serves a version only after its sha256 checked: files against the manifest
  (``WeightReceiver``), broadcast tensors against the header, vLLM's transfer only for
  versions whose manifest both ends derived the tensor layout from;
- a feed never goes backwards: a version at or below the one served is ignored (only
  ``switch_to``, the eval worker's explicit choice, may load an older one);
- the first version always comes as files (it carries the config and tokenizer); every
  transport falls back to files for a version it could not deliver in time;
- one load at a time: every path into the engine holds the feed's lock.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kiln.shared.contracts import WeightsManifest, WeightsPublished
from kiln.shared.weights.manifest import IntegrityError

log = logging.getLogger("kiln.weights.feed")


class WeightSender(ABC):
    """The weights service's end of a transport."""

    @abstractmethod
    def will_send(self) -> bool:
        """Whether the version about to be announced goes out over this transport."""

    @abstractmethod
    async def send(self, run_id: str, version: int, folder: Path, manifest: WeightsManifest) -> None:
        """Send one stored version (called only after ``will_send`` said so and the event went out)."""


class FilesOnlySender(WeightSender):
    """``fs`` and ``http``: engines read the store; nothing is pushed."""

    def will_send(self) -> bool:
        return False

    async def send(self, run_id: str, version: int, folder: Path, manifest: WeightsManifest) -> None:
        raise RuntimeError("a files-only transport sends nothing")


@runtime_checkable
class FolderEngine(Protocol):
    """What every transport calls: load a verified checkpoint folder."""

    version: int

    async def load(self, version: int, folder: Path) -> None: ...


@runtime_checkable
class TensorEngine(FolderEngine, Protocol):
    """Engines that take a version as host tensors (HF names): the torch broadcast."""

    async def load_state(self, version: int, state: dict) -> None: ...


@runtime_checkable
class InPlaceTransferEngine(FolderEngine, Protocol):
    """Engines whose own workers join the sender's group and receive a version in place
    (vLLM's weight-transfer engine): no host copy passes through the feed."""

    async def join_transfer(self, init_info: dict) -> None: ...

    async def receive_transfer(self, version: int, update_info: dict) -> None: ...


class VersionUnavailable(RuntimeError):
    """A version's files could not be fetched or did not verify (the engine is untouched)."""


class WeightFeed(ABC):
    """An engine worker's end of a transport; the worker only reads ``tokenizer``,
    ``version`` and waits with ``wait_for``."""

    def __init__(self, engine: FolderEngine, files, run_id: str, tracer, on_served: Callable[[int, str], None]):
        self.engine = engine
        self.files = files
        """``VersionFiles``: every transport's files path (first version, fallbacks)."""
        self.run_id = run_id
        self.tracer = tracer
        self.on_served = on_served
        """Called with (version, via) after the engine serves a new version."""
        self.tokenizer: Any = None
        """The tokenizer of the first version loaded (None before)."""
        self._loading = asyncio.Lock()
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int:
        return self.engine.version

    async def start(self, stop: asyncio.Event) -> None:
        """Begin receiving what the transport pushes (after the events are watched)."""

    async def on_published(self, msg: WeightsPublished) -> None:
        if msg.run_id != self.run_id or msg.version <= self.version:
            return
        await self._deliver(msg)

    @abstractmethod
    async def _deliver(self, msg: WeightsPublished) -> None: ...

    async def wait_for(self, version: int, timeout: float | None = None) -> bool:
        """Wait until the engine serves ``version`` or newer; False after ``timeout``."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version >= version), timeout)
                return True
            except TimeoutError:
                return False

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _span(self, version: int):
        return self.tracer.start_as_current_span("rollout.load_weights", attributes={"policy.version": version})

    def _first_folder_loaded(self) -> None:
        """After the first version (the engine runs): a transport that joins a group does it here."""

    async def _load_folder(self, version: int, folder: Path) -> None:
        from kiln.shared.model.tokenizer import load_tokenizer

        with self._span(version):
            await self.engine.load(version, folder)
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(folder)
                self._first_folder_loaded()

    async def _load_files(self, msg: WeightsPublished) -> None:
        async with self._loading:
            if msg.version <= self.version:
                return
            try:
                folder = await self.files.fetch(msg)
            except (IntegrityError, OSError) as e:
                log.error("refusing version %d (still serving %d): %s", msg.version, self.version, e)
                return
            await self._load_folder(msg.version, folder)
            self.on_served(msg.version, "files")
            log.info("serving policy version %d", msg.version)
        await self._notify()

    async def switch_to(self, msg: WeightsPublished) -> None:
        """Serve exactly ``msg``'s version, older or newer (the eval worker, between episodes);
        ``VersionUnavailable`` when its files cannot be had."""
        async with self._loading:
            try:
                folder = await self.files.fetch(msg)
            except (IntegrityError, OSError) as e:
                raise VersionUnavailable(str(e)) from e
            await self._load_folder(msg.version, folder)
        await self._notify()


async def folder_tensors(folder: Path, manifest: WeightsManifest) -> dict:
    """Every tensor of a stored version, read from its safetensors shards."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for f in sorted({t.file for t in manifest.tensors.values()}):
        tensors.update(await asyncio.to_thread(load_file, str(folder / f)))
    return tensors
