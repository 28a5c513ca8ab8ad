"""rollout settings (section ``[rollout]`` of the experiment file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.shared.config import AlgorithmSettings, Section, ServiceConfig, TaskSettings, WeightsSettings


class RolloutSettings(Section):
    engine: Literal["torch"] = "torch"
    """Inference engine. ``torch``: the policy model in-process (vLLM arrives with the rollout issue)."""
    max_turns: int = 4
    """Assistant turns per episode."""
    max_new_tokens: int = 64
    """Tokens the model may generate in one turn."""
    max_total_tokens: int = 2048
    """Budget of the whole episode (prompt, generations and observations)."""
    concurrent_groups: int = 1
    """Groups one worker runs at once (samples of a group always run concurrently)."""
    sandbox_ttl_s: float = 900.0
    """Lease of each sample's sandbox: the episode plus time for reward to score it."""
    tool_timeout_s: float = 60.0
    """Timeout of one turn's batch of tool calls."""
    version_wait_s: float = 30.0
    """How long a request for a version this worker does not serve yet waits before it is
    handed back to the queue."""
    torch_threads: int = 1
    """Intra-op threads of the engine (several workers share the cores)."""
    max_observation_chars: int = 2000
    """Tool outputs longer than this are cut (head and tail kept) before the model sees them."""


class RolloutConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite (problem statements)."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    """Sampling temperature and staleness bound."""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """This service's settings."""
    weights: WeightsSettings = Field(default_factory=WeightsSettings)
    """How this worker receives policy versions (``fetch``, ``cache_dir``, ``http_token``)."""
