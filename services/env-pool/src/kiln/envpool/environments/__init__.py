"""Content-addressed, layered environments (project issue 22): specs live in
``kiln.shared.environments``; this package builds them into read-only layers, caches them
per node (``EnvironmentCache``) and shares them between nodes (``NatsLayerStore``,
``S3LayerStore``).
See docs/environments.md."""

from .cache import EnvironmentCache, LayerStore
from .layers import BuiltEnvironment, EnvironmentBuildError, Layer, plan_layers
from .s3 import LayerIntegrityError, S3LayerStore
from .sandbox import environment_bwrap_args
from .store import NatsLayerStore

__all__ = [
    "BuiltEnvironment",
    "EnvironmentBuildError",
    "EnvironmentCache",
    "Layer",
    "LayerIntegrityError",
    "LayerStore",
    "NatsLayerStore",
    "S3LayerStore",
    "environment_bwrap_args",
    "plan_layers",
]
