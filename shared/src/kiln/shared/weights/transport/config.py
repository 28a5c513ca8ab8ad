"""The one typed choice of weight transport: ``[weights.transport]``, a discriminated
union on ``kind`` whose variants each carry only their own fields.

Invariants:
- a transport is chosen in one place (``WeightsSettings.transport``); the weights
  service and every engine worker read the same variant, so sender and feeds agree;
- the flat keys of earlier releases (``weights.fetch``, ``weights.broadcast_*``,
  ``weights.cache_dir``) still load, mapped onto the union with a
  ``DeprecatedKeyWarning``; a flat key that the chosen transport cannot use is an error
  (never silently dropped) unless it holds the old default.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

# one warning for every renamed key (kiln.shared.config_keys); re-exported here
from kiln.shared.config_keys import DeprecatedKeyWarning  # noqa: F401


class _Transport(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    engines: ClassVar[tuple[str, ...]] = ()
    """``rollout.engine`` values this transport can feed (empty: every engine)."""

    cache_dir: str = ""
    """Where a worker rebuilds and keeps versions it cannot read in place (delta or http;
    the file fallback of the broadcasts too); empty = ``<run.dir>/weights-cache/<instance>``."""

    def check_engine(self, engine: str) -> None:
        """Refuse an engine this transport cannot feed, before either is started."""


class FilesTransport(_Transport):
    """Engines read versions from the store's directory (a shared disk)."""

    kind: Literal["fs"] = "fs"
    """``fs``: the store directory; ``http``: the weights service's HTTP API;
    ``torch-broadcast``: a torch.distributed group (NCCL/gloo) into ``rollout.engine = "torch"``;
    ``vllm-nccl``: vLLM's weight-transfer engine into ``rollout.engine = "vllm"`` (GPUs)."""


class HttpTransport(_Transport):
    """Engines download versions through the weights service's HTTP API (any network;
    ``weights.http_token`` authenticates)."""

    kind: Literal["http"]


class _GroupTransport(_Transport):
    init_method: str = Field(min_length=1)
    """Rendezvous of the group, e.g. ``tcp://weights-0:29600`` (the weights service's address)."""
    world_size: int = Field(ge=2)
    """Members of the group: the weights service (rank 0) + every engine."""
    rank: int = Field(default=0, ge=0)
    """This member's rank (each engine its own, 1..world_size-1; the weights service is 0)."""
    fallback_s: float = Field(default=30.0, gt=0)
    """A version the event marks as broadcast but that has not arrived after this long is
    read from its files instead."""

    def check_engine(self, engine: str) -> None:
        if engine in self.engines:
            return
        other = "vllm-nccl" if engine == "vllm" else "torch-broadcast"
        old = "vllm-nccl" if engine == "vllm" else "nccl"
        raise ValueError(
            f"weights.transport.kind = {self.kind!r} feeds rollout.engine = {self.engines[0]!r}, not {engine!r}:"
            f" use kind = {other!r} (the old keys: use broadcast_backend = {old!r}),"
            " or read versions from files (kind = 'fs' or 'http')"
        )


class TorchBroadcastTransport(_GroupTransport):
    """One collective broadcast per tensor from the weights service to in-process engines."""

    engines: ClassVar[tuple[str, ...]] = ("torch",)
    kind: Literal["torch-broadcast"]
    backend: Literal["nccl", "gloo"] = "nccl"
    """``nccl`` for GPU engines, ``gloo`` on CPUs."""


class VllmNcclTransport(_GroupTransport):
    """vLLM's packed NCCL weight transfer straight into vLLM engines (CUDA on both sides)."""

    engines: ClassVar[tuple[str, ...]] = ("vllm",)
    kind: Literal["vllm-nccl"]

    @field_validator("init_method")
    @classmethod
    def _tcp(cls, v: str) -> str:
        rendezvous(v)
        return v


Transport = Annotated[
    FilesTransport | HttpTransport | TorchBroadcastTransport | VllmNcclTransport, Field(discriminator="kind")
]


def rendezvous(init_method: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port): vLLM's stateless group rendezvous."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or not parts.port:
        raise ValueError(f"weights.transport.init_method must be tcp://host:port for vllm-nccl, got {init_method!r}")
    return parts.hostname, parts.port


# old flat key of [weights] -> its place now (shown in docs/configuration.md)
DEPRECATED_KEYS: dict[str, str] = {
    "fetch": '`transport.kind`: `"fs"`, `"http"`; `"broadcast"` is `"torch-broadcast"`, or `"vllm-nccl"` with `broadcast_backend = "vllm-nccl"`',
    "broadcast_backend": '`transport.backend` (`"nccl"`, `"gloo"`, with `kind = "torch-broadcast"`); `"vllm-nccl"` is `transport.kind = "vllm-nccl"`',
    "broadcast_init_method": "`transport.init_method`",
    "broadcast_world_size": "`transport.world_size`",
    "broadcast_rank": "`transport.rank`",
    "cache_dir": "`transport.cache_dir`",
}
_RENAMED = {"broadcast_init_method": "init_method", "broadcast_world_size": "world_size", "broadcast_rank": "rank"}
_OLD_DEFAULTS = {
    "broadcast_init_method": "",
    "broadcast_world_size": 0,
    "broadcast_rank": 0,
    "broadcast_backend": "nccl",
}
_GROUPS = ("torch-broadcast", "vllm-nccl")


def migrate_flat_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``[weights]`` with the old flat keys -> the same settings with ``transport``; the
    values the old keys meant are kept exactly (``kiln config show`` resolves the same)."""
    old = {k: data[k] for k in DEPRECATED_KEYS if k in data}
    if not old:
        return data
    warnings.warn(
        f"weights.{', weights.'.join(old)}: deprecated keys, mapped to [weights.transport]; see docs/configuration.md",
        DeprecatedKeyWarning,
        stacklevel=2,
    )
    out = {k: v for k, v in data.items() if k not in DEPRECATED_KEYS}
    given = out.get("transport") or {}
    t = dict(given.model_dump() if isinstance(given, BaseModel) else given)
    before = t.get("kind", "fs")
    backend = old.get("broadcast_backend")
    fetch = old.get("fetch", "broadcast" if before in _GROUPS else before)
    kind = ("vllm-nccl" if backend == "vllm-nccl" else "torch-broadcast") if fetch == "broadcast" else fetch
    if kind == "torch-broadcast" and backend is None and before == "vllm-nccl":
        kind = "vllm-nccl"
    if kind != before:  # another variant: only what every variant has carries over
        t = {k: v for k, v in t.items() if k == "cache_dir"}
    t["kind"] = kind
    if "cache_dir" in old:
        t["cache_dir"] = old["cache_dir"]
    for key in ("broadcast_init_method", "broadcast_world_size", "broadcast_rank", "broadcast_backend"):
        if key not in old:
            continue
        if kind not in _GROUPS:
            if old[key] != _OLD_DEFAULTS[key]:
                raise ValueError(
                    f"weights.{key} = {old[key]!r} applies only to weights.fetch = 'broadcast' (now {kind!r})"
                )
        elif key == "broadcast_backend":
            if kind == "torch-broadcast":
                t["backend"] = old[key]
        else:
            t[_RENAMED[key]] = old[key]
    out["transport"] = t
    return out
