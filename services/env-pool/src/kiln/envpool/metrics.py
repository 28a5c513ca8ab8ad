"""The node's Prometheus metrics (one registry per node, served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class NodeMetrics:
    def __init__(self, pool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("kiln_envpool_sandboxes_leased", "Sandboxes leased to a caller", registry=r).set_function(
            lambda: len(pool.leases)
        )
        Gauge("kiln_envpool_sandboxes_idle", "Warm sandboxes waiting for a lease", registry=r).set_function(
            lambda: pool.idle
        )
        Gauge("kiln_envpool_sandboxes_creating", "Sandboxes being created", registry=r).set_function(
            lambda: pool.creating
        )
        Gauge("kiln_envpool_capacity", "Sandboxes this node may hold", registry=r).set_function(
            lambda: pool.s.max_sandboxes
        )
        self.created = Counter("kiln_envpool_sandboxes_created", "Sandboxes created", registry=r)
        self.reaped = Counter("kiln_envpool_sandboxes_reaped", "Leases that expired and were destroyed", registry=r)
        self.exhausted = Counter("kiln_envpool_pool_exhausted", "Creates refused because the node was full", registry=r)
        self.create_seconds = Histogram(
            "kiln_envpool_create_seconds",
            "Time to hand out a sandbox (warm or built)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.exec_seconds = Histogram(
            "kiln_envpool_exec_seconds", "Wall time of a command run in a sandbox", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tool_seconds = Histogram(
            "kiln_envpool_tool_seconds", "Wall time of one tool call", ["tool"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.tool_calls = Counter("kiln_envpool_tool_calls", "Tool calls run", ["tool"], registry=r)
        self.tool_errors = Counter(
            "kiln_envpool_tool_errors", "Tool calls answered with an error", ["tool"], registry=r
        )
