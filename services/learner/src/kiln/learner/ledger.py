"""The one interface between the learner's two roles: what the trainer may ask the
controller and what it may tell it.

The controller (``controller.py``) owns the run: which groups exist and are in flight,
what they are dispatched under, the run's counters and its end. The trainer
(``trainer.py``) turns complete groups into steps. The trainer holds the controller only
as a ``TrainerLedger`` and uses nothing of it but these methods: no counter, no
in-flight table, no configuration of the controller's.

Invariants:
- only the controller ends the run (``Controller.finish_run``, which sets the run's
  ``RunOutcome`` once): when the last version is published, when more groups failed
  than ``learner.max_dropped_groups``, or when a drop leaves no task to dispatch (every
  environment set aside); the trainer only reports drops, set-asides and steps;
- a step's drop count is the groups dropped since the previous step's count was taken:
  ``take_step_drops`` returns it and starts the next count in one call, so no drop is
  counted twice or lost, whenever the trainer takes it;
- per step the trainer tells, in this order: ``take_step_drops`` (as it builds the step's
  metrics, which ride in its checkpoint), ``mark_trained`` (after the version is handed
  over, before the step's messages are acked), ``step_finished`` (after the acks); the
  last version ends the run only after its ``step_finished``.
"""

from __future__ import annotations

from typing import Protocol

from kiln.shared import contracts as c

NO_SIGNAL = "no_signal"
"""Drop reason of a complete group whose samples all scored alike (dynamic sampling,
``algorithm.uniform_group_retries``): filtered on purpose, so not a failure that counts
against ``learner.max_dropped_groups``."""


class TrainerLedger(Protocol):
    """What the trainer sees of the controller (``Controller`` implements it)."""

    # --- asks ------------------------------------------------------------------

    def group_size(self, group_id: str) -> int | None:
        """The samples the group was dispatched with; None when it is not in flight
        (another run's, or ended: trained or dropped)."""
        ...

    def staleness_limit(self) -> int:
        """How many versions a group's oldest token may lag the version it trains
        (``sync``: 0); the bound admission control keeps as well."""
        ...

    def last_published(self) -> int:
        """The newest version the weights service has published (-1: none yet)."""
        ...

    async def expired(self, exclude: set[str]) -> list[str]:
        """In-flight groups past their deadline (``exclude``: complete ones waiting to train)."""
        ...

    # --- tells -----------------------------------------------------------------

    def set_aside(self, task_id: str, reason: str) -> None:
        """The task's environment cannot be built (told before its group is dropped, so
        that the replacement does not need it)."""
        ...

    async def drop(self, group_id: str, reason: str, detail: str = "") -> None:
        """End an in-flight group as dropped; the controller refills, or ends the run."""
        ...

    async def batch_full(self, version: int, batch: list[str]) -> None:
        """The batch that makes ``version`` is full (``april``: suspend the rest)."""
        ...

    def take_step_drops(self) -> int:
        """The groups dropped since the last call; the next count starts now."""
        ...

    async def mark_trained(
        self, group_ids: list[str], trajectory_ids: list[str], version: int, *, resumed: bool = False
    ) -> None:
        """The step producing ``version`` trained these groups and trajectories."""
        ...

    async def step_finished(self, version: int, metrics: c.StepMetrics | None, *, resumed: bool = False) -> None:
        """Everything the step producing ``version`` used is stamped and acked."""
        ...
