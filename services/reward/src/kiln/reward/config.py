"""reward settings (section ``[reward]`` of the experiment file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.shared.config import DatabaseSettings, Section, ServiceConfig, TaskSettings


class RewardSettings(Section):
    function: Literal["binary", "fraction"] = "binary"
    """``binary``: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0.
    ``fraction``: share of FAIL_TO_PASS tests passing, 0 if any PASS_TO_PASS test broke."""
    harness_grace_s: float = 15.0
    """Time beyond the task's own test timeout before the scoring request itself counts
    as an infrastructure failure."""
    concurrency: int = 4
    """Trajectories one replica scores at once."""
    max_test_output_chars: int = 20000
    """Test output kept in the record (head and tail)."""
    destroy_sandbox: bool = True
    """Destroy the trajectory's sandbox once it is scored."""


class RewardConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite (tests and their expected outcomes)."""
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    """Where trajectory records are written."""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """This service's settings."""
