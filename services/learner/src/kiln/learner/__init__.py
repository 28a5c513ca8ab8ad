"""kiln learner service: the controller (dispatch, accounting) and the GRPO trainer."""

from kiln.shared.registry import ServiceInfo

SERVICE = ServiceInfo(
    name="learner",
    module="kiln.learner.main",
    config="kiln.learner.config:LearnerConfig",
    order=4,
    command="kiln.learner.world:command",
)
