"""kiln rollout service: agents that generate trajectories with the current policy."""

from kiln.shared.registry import ServiceInfo

SERVICE = ServiceInfo(name="rollout", module="kiln.rollout.main", config="kiln.rollout.config:RolloutConfig", order=3)
