"""env-pool settings (section ``[envpool]`` of the experiment file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.shared.config import Section, ServiceConfig, TaskSettings


class EnvPoolSettings(Section):
    node_id: str = ""
    """This node's id in per-sandbox subjects; empty = derived from host and pid."""
    backend: Literal["process"] = "process"
    """Sandbox backend. ``process``: a subprocess in its own workspace and session, with
    rlimits and a timeout (no namespace isolation: bubblewrap arrives with the env-pool issue)."""
    workspace_root: str = ""
    """Where workspaces are created; empty = ``<run.dir>/sandboxes`` or a temp dir."""
    max_sandboxes: int = 256
    """Sandboxes this node holds at once; beyond it ``create`` fails with ``pool_exhausted``."""
    default_ttl_s: float = 900.0
    """Lease length when a request gives none."""
    reap_interval_s: float = 5.0
    """How often expired leases are destroyed."""
    output_limit_bytes: int = 64 * 1024
    """Cap on captured stdout/stderr per command (head and tail kept, middle marked)."""
    max_command_timeout_s: float = 600.0
    """Upper bound on any command's timeout."""
    cpu_seconds: int = 120
    """RLIMIT_CPU of each command."""
    max_file_bytes: int = 256 * 1024 * 1024
    """RLIMIT_FSIZE of each command."""
    max_read_bytes: int = 256 * 1024
    """read_file refuses files larger than this."""


class EnvPoolConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite the sandboxes are created from."""
    envpool: EnvPoolSettings = Field(default_factory=EnvPoolSettings)
    """This service's settings."""
