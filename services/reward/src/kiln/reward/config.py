"""reward settings (section ``[reward]`` of the experiment file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.shared.config import DatabaseSettings, Section, ServiceConfig, TaskSettings


class RewardSettings(Section):
    function: str = "binary"
    """``binary`` (1 when every FAIL_TO_PASS and PASS_TO_PASS test passes), ``fraction`` (share
    of FAIL_TO_PASS passing, 0 if a PASS_TO_PASS test broke), the name of a
    ``kiln.reward_functions`` entry point, or ``package.module:function`` (docs/reward.md)."""
    shaping: dict[Literal["malformed_tool_calls", "generated_tokens_k", "turns", "no_final_answer"], float] = Field(
        default_factory=dict
    )
    """Weights of shaping terms added to the tests' reward and recorded apart, e.g.
    ``{malformed_tool_calls = -0.1}``."""
    harness_grace_s: float = 15.0
    """Time beyond the task's own test timeout before the scoring request itself counts
    as an infrastructure failure."""
    max_change_bytes: int = 32 * 1024 * 1024
    """Text a trajectory's diff may write into its clean room; more scores 0 (failure
    ``not_applied``) without writing any of it."""
    concurrency: int = 4
    """Trajectories one replica scores at once."""
    max_test_output_chars: int = 20000
    """Test output kept in the record (head and tail)."""
    destroy_sandbox: bool = True
    """Destroy the trajectory's sandbox once it is scored."""
    logs_ttl_s: float = 30 * 24 * 3600
    """How long whole test logs stay in the ``kiln-reward-logs`` object store."""


class RewardConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite (tests and their expected outcomes)."""
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    """Where trajectory records are written."""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """This service's settings."""
