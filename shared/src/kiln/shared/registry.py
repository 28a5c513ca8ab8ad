"""Which services are installed: each service package registers a ``ServiceInfo`` under
the ``kiln.services`` entry-point group. ``kiln run`` starts them in ``order`` and
``kiln config show`` resolves their settings, without ``shared`` importing any
service's code until asked to.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points


@dataclass(frozen=True)
class ServiceInfo:
    name: str
    module: str
    """``python -m <module>`` runs the service."""
    config: str
    """``package.module:ConfigClass`` of its settings."""
    order: int = 0
    """Start order in ``kiln run`` (lower first); stopped in reverse."""
    command: str = ""
    """Optional ``package.module:function(config, module) -> argv prefix`` for services that
    are not started as ``python -m <module>`` (the learner on a multi-rank world: torchrun)."""

    def argv(self, config) -> list[str]:
        if not self.command:
            return [sys.executable, "-m", self.module]
        mod, _, fn = self.command.partition(":")
        return getattr(importlib.import_module(mod), fn)(config, self.module)

    def config_class(self):
        mod, _, cls = self.config.partition(":")
        return getattr(importlib.import_module(mod), cls)


def discover() -> dict[str, ServiceInfo]:
    found = {}
    for ep in entry_points(group="kiln.services"):
        info = ep.load()
        if not isinstance(info, ServiceInfo):
            raise TypeError(f"entry point {ep.name} -> {ep.value} is not a ServiceInfo")
        found[info.name] = info
    return dict(sorted(found.items(), key=lambda kv: (kv[1].order, kv[0])))
