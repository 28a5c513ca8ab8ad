"""weights settings (section ``[weights]`` of the experiment file)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from kiln.shared.config import DatabaseSettings, ServiceConfig, WeightsSettings


class WeightsConfig(ServiceConfig):
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    """Registry of stored versions."""
    weights: WeightsSettings = Field(default_factory=WeightsSettings)
    """This service's settings (rollout reads the same section to receive versions)."""


def store_dir(cfg: ServiceConfig, configured: str) -> str:
    """The store root every service agrees on (weights stores, rollout reads)."""
    if configured:
        return configured
    if not cfg.run.dir:
        raise ValueError("weights.store_dir is empty and run.dir is unset: set one of them")
    return f"{cfg.run.dir}/weights"


def staging_dir(cfg: ServiceConfig, configured: str) -> Path:
    """Where checkpoints may come from (``weights.staging_dir``, else ``<run.dir>/staging``)."""
    if configured:
        return Path(configured).resolve()
    if not cfg.run.dir:
        raise ValueError("weights.staging_dir is empty and run.dir is unset: set one of them")
    return (Path(cfg.run.dir) / "staging").resolve()


def confined(src: Path, staging: Path) -> str | None:
    """Why the checkpoint folder ``src`` may not be taken (None: it may): it must be a folder
    inside ``staging`` (links resolved) holding plain files and folders only, so that no
    message can make the store read or link anything else on this machine."""
    try:
        real = src.resolve()
    except (ValueError, OSError) as e:  # a NUL byte, a name too long: no such folder can exist
        return f"checkpoint folder {str(src)[:200]!r} is not a valid path ({e})"
    if real == staging or staging not in real.parents:
        return f"checkpoint folder {src} is not inside the staging folder {staging}"
    if src.is_symlink() or not real.is_dir():
        return f"checkpoint folder {src} is not a folder"
    for p in real.rglob("*"):
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            return f"checkpoint folder {src} holds {p.relative_to(real)}, which is not a plain file"
    return None
