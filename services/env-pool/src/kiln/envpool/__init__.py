"""kiln env-pool service: sandboxes for coding tasks, served over NATS request/reply."""

from kiln.shared.registry import ServiceInfo

SERVICE = ServiceInfo(name="env-pool", module="kiln.envpool.main", config="kiln.envpool.config:EnvPoolConfig", order=0)
