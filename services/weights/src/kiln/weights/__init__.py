"""kiln weights service: stores policy versions and announces them to the rollout fleet."""

from kiln.shared.registry import ServiceInfo

SERVICE = ServiceInfo(name="weights", module="kiln.weights.main", config="kiln.weights.config:WeightsConfig", order=1)
