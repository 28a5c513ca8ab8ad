"""Weight transports: how a stored policy version travels from the weights service to
the engines. One package, one implementation per transport, one typed choice.

=================== ================================ ===============================
``kind``            sender (weights service)         feed (engine worker)
=================== ================================ ===============================
``fs``              ``FilesOnlySender``              ``FilesFeed`` (store dir)
``http``            ``FilesOnlySender``              ``FilesFeed`` (HTTP API)
``torch-broadcast`` ``TorchBroadcastSender``         ``TorchBroadcastFeed``
``vllm-nccl``       ``VllmNcclSender``               ``VllmNcclFeed``
=================== ================================ ===============================

Invariants (``base`` states them in full): a worker serves a version only after its
sha256 checked; a feed never goes backwards; the first version and every fallback come
as files; an eval worker always reads files (``FilesFeed``), whatever the transport, so
it never takes a place in a training group. This module imports no torch: the
implementations load when chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.shared.weights.transport.config import (
    DEPRECATED_KEYS,
    DeprecatedKeyWarning,
    FilesTransport,
    HttpTransport,
    TorchBroadcastTransport,
    Transport,
    VllmNcclTransport,
    migrate_flat_keys,
)

if TYPE_CHECKING:
    from kiln.shared.weights.transport.base import FolderEngine, WeightFeed, WeightSender

__all__ = [
    "DEPRECATED_KEYS",
    "DeprecatedKeyWarning",
    "FilesTransport",
    "HttpTransport",
    "TorchBroadcastTransport",
    "Transport",
    "VllmNcclTransport",
    "make_feed",
    "make_sender",
    "migrate_flat_keys",
]


def make_sender(transport: Transport) -> WeightSender:
    """The weights service's end of ``transport``."""
    if isinstance(transport, TorchBroadcastTransport):
        from kiln.shared.weights.transport.torch_broadcast import TorchBroadcastSender

        return TorchBroadcastSender(transport)
    if isinstance(transport, VllmNcclTransport):
        from kiln.shared.weights.transport.vllm_nccl import VllmNcclSender

        return VllmNcclSender(transport)
    from kiln.shared.weights.transport.base import FilesOnlySender

    return FilesOnlySender()


def make_feed(
    transport: Transport,
    engine: FolderEngine,
    *,
    run_id: str,
    tracer,
    on_served: Callable[[int, str], None],
    cache_dir: Path,
    delta: bool,
    http_token: str = "",
    eval_worker: bool = False,
) -> WeightFeed:
    """An engine worker's end of ``transport``. ``cache_dir`` is used unless
    ``transport.cache_dir`` names one; without either and without ``delta``, a store on a
    shared disk is read in place."""
    from kiln.shared.weights.transport.files import FilesFeed, VersionFiles

    files = VersionFiles(
        http=isinstance(transport, HttpTransport),
        in_place=not delta and not transport.cache_dir,
        cache_dir=Path(transport.cache_dir) if transport.cache_dir else cache_dir,
        http_token=http_token,
    )
    common = dict(run_id=run_id, tracer=tracer, on_served=on_served)
    if isinstance(transport, TorchBroadcastTransport) and not eval_worker:
        from kiln.shared.weights.transport.torch_broadcast import TorchBroadcastFeed

        return TorchBroadcastFeed(engine, files, transport=transport, **common)
    if isinstance(transport, VllmNcclTransport) and not eval_worker:
        from kiln.shared.weights.transport.vllm_nccl import VllmNcclFeed

        return VllmNcclFeed(engine, files, transport=transport, **common)
    return FilesFeed(engine, files, **common)
