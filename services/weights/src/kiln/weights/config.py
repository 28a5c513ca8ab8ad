"""weights settings (section ``[weights]`` of the experiment file)."""

from __future__ import annotations

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
