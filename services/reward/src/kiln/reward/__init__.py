"""kiln reward service: runs a finished trajectory's tests and scores it."""

from kiln.shared.registry import ServiceInfo

SERVICE = ServiceInfo(name="reward", module="kiln.reward.main", config="kiln.reward.config:RewardConfig", order=2)
