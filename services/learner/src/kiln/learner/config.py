"""learner settings (section ``[learner]`` of the experiment file)."""

from __future__ import annotations

from pydantic import Field

from kiln.shared.config import (
    AlgorithmSettings,
    DatabaseSettings,
    ModelSettings,
    Section,
    ServiceConfig,
    TaskSettings,
)


class LearnerSettings(Section):
    staging_dir: str = ""
    """Where the learner writes checkpoints for the weights service; empty = ``<run.dir>/staging``."""
    torch_threads: int = 1
    """Intra-op threads for training."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    deadline_check_s: float = 2.0
    """How often the controller drops groups past their deadline."""
    max_dropped_groups: int = 100
    """The run fails once more groups than this were dropped: a broken environment must
    end the run with its reason, not re-dispatch forever."""
    tokenizer_corpus_repeats: int = 4
    """Times the task suite is repeated in the tokenizer's training corpus."""


class LearnerConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite the controller samples groups from."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    """GRPO and dispatch settings."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """Architecture of the initial policy."""
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    """Runs, groups and trajectory records."""
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    """This service's settings."""
