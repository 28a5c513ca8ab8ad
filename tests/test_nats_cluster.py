"""kiln on a three-node NATS cluster (``nats.cluster_size = 3``), real nats-servers:

- every stream, durable consumer and object store kiln declares has three replicas; one
  that already exists with one replica is scaled to three; asking three of a single server fails
  with a reason that says so;
- a work queue keeps flowing while the node that leads its stream is SIGKILLed: every
  message published (before, during and after the loss) is consumed, none is lost, the
  queue ends empty; the restarted node rejoins and catches up.

Waits are for states (counts, leaders, replicas current), each with a generous deadline.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kiln.ops.embedded import NatsCluster, NatsServer
from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.config import NatsSettings


@pytest.fixture
def cluster(tmp_path):
    cl = NatsCluster(tmp_path / "nats", 3, log_dir=tmp_path).start()
    yield cl
    cl.stop()


async def until(what: str, check, timeout: float = 60.0):
    """Poll the async ``check()`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if got := await check():
                return got
        except Exception as e:  # a cluster electing a leader answers with errors meanwhile
            last = e
        else:
            last = None
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout}s (last error: {last})"
        await asyncio.sleep(0.1)


def request(i: int) -> c.RolloutRequest:
    return c.RolloutRequest(run_id="r", group_id=f"g{i}", task_id="t", n_samples=1, dispatch_version=0, deadline=0.0)


@pytest.mark.timeout(180)
async def test_streams_are_replicated_and_work_survives_the_loss_of_a_leader(cluster):
    settings = NatsSettings(url=cluster.url, cluster_size=3, ack_wait_s={c.ROLLOUT_WORKERS.durable: 2.0})
    pub = await Bus.connect(settings, "publisher")
    sub = await Bus.connect(settings, "consumer")
    try:
        await pub.ensure_topology()
        for spec in c.STREAMS:
            assert (await pub.js.stream_info(spec.name)).config.num_replicas == 3, spec.name
        await assert_replicated(pub)

        total, seen, stop = 300, [], asyncio.Event()

        async def handler(req: c.RolloutRequest, delivery) -> None:
            seen.append(req.group_id)

        consumer = asyncio.create_task(
            sub.consume(c.ROLLOUT_WORKERS, c.RolloutRequest, handler, stop=stop, concurrency=8)
        )
        published = 0

        async def publish_upto(n: int) -> None:
            nonlocal published
            while published < n:
                await pub.publish(c.ROLLOUT_WORK, request(published), msg_id=f"g{published}")
                published += 1

        await publish_upto(100)
        await until("the first 100 consumed", lambda: _true(len(set(seen)) >= 100))
        # Kill the node that leads the work stream, in the middle of the traffic.
        leader = (await pub.js.stream_info(c.ROLLOUT_WORKERS.stream)).cluster.leader
        (victim,) = [n for n in cluster.nodes if n.name == f"nats-server {leader}"]
        more = asyncio.create_task(publish_upto(total))
        await until("publishing resumed past 150", lambda: _true(published >= 150))
        victim.kill()

        async def new_leader():
            info = await pub.js.stream_info(c.ROLLOUT_WORKERS.stream)
            return info.cluster.leader not in (None, "", leader)

        await until("a new leader for the work stream", new_leader)
        await asyncio.wait_for(more, 120)
        await until("every message consumed", lambda: _true(set(seen) == {f"g{i}" for i in range(total)}))

        async def drained():
            info = await sub.consumer_info(c.ROLLOUT_WORKERS)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await until("the queue acked empty", drained)
        assert (await pub.js.stream_info(c.ROLLOUT_WORKERS.stream)).state.messages == 0  # work queue: acked = gone

        # The dead node comes back on its port and store and catches up.
        victim.start()

        async def all_current():
            info = await pub.js.stream_info(c.ROLLOUT_WORKERS.stream)
            peers = [info.cluster.leader] + [r.name for r in info.cluster.replicas or [] if r.current and not r.offline]
            return len(set(peers)) == 3

        await until("the restarted node current again", all_current)
        stop.set()
        await asyncio.wait_for(consumer, 30)
    finally:
        await pub.close()
        await sub.close()


async def _true(value: bool) -> bool:
    return value


async def assert_replicated(bus: Bus, replicas: int = 3) -> None:
    for spec in c.STREAMS:
        assert (await bus.js.stream_info(spec.name)).config.num_replicas == replicas, spec.name
    for spec in c.CONSUMERS:  # a consumer left on one node would die with it
        assert (await bus.js.consumer_info(spec.stream, spec.durable)).config.num_replicas == replicas, spec.durable
    assert (await bus.js.stream_info(f"OBJ_{c.CLAIMS_BUCKET}")).config.num_replicas == replicas


@pytest.mark.slow  # JetStream takes ~10 s to scale the work-queue streams
@pytest.mark.timeout(180)
async def test_a_topology_declared_with_one_replica_is_scaled_to_three(cluster):
    old = await Bus.connect(NatsSettings(url=cluster.url, replicas=1), "old")
    try:
        await old.ensure_topology()
        await assert_replicated(old, 1)
        await old.publish(c.ROLLOUT_WORK, request(0), msg_id="g0")
    finally:
        await old.close()
    new = await Bus.connect(NatsSettings(url=cluster.url, cluster_size=3), "new")
    try:
        await new.ensure_topology()
        await assert_replicated(new, 3)
        assert (await new.js.stream_info(c.ROLLOUT_WORKERS.stream)).state.messages == 1  # scaled in place: kept
    finally:
        await new.close()


async def test_three_replicas_on_a_single_server_fail_with_the_reason(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    try:
        bus = await Bus.connect(NatsSettings(url=server.url, replicas=3, publish_retry_s=5), "t")
        try:
            with pytest.raises(Exception, match="cluster have that many"):
                await bus.ensure_topology()
        finally:
            await bus.close()
    finally:
        server.stop()


@pytest.mark.slow  # a whole smoke run
@pytest.mark.timeout(900)
def test_a_run_on_a_three_node_cluster_survives_killed_nodes(tmp_path):
    """``kiln run`` with ``nats.cluster_size = 3`` (authenticated bus): SIGKILL one node
    after version 1 and another after version 2; each is restarted, the run finishes and
    every group is accounted for once: trained, or dropped with its reason."""
    import signal

    from test_supervision import assert_every_group_accounted, pids_with, smoke_run

    with smoke_run(tmp_path, "nats.cluster_size=3") as (out, run_dir):
        out.wait(r"a 3-node NATS cluster with JetStream \(3 replicas per stream\)")
        for version, node in ((1, "nats-1"), (2, "nats-2")):
            out.wait(rf"version {version}/4:")
            (pid,) = pids_with("nats-server", f"{run_dir}/nats/{node} ")
            os.kill(pid, signal.SIGKILL)
            out.wait(rf"nats-server {node} exited with code -9; restarting it")
    assert_every_group_accounted(out)


def test_cluster_settings_from_the_environment(monkeypatch):
    from kiln.shared.config import ServiceConfig, load_config

    monkeypatch.setenv("KILN_NATS__CLUSTER_SIZE", "3")  # as compose and Kubernetes give it: a string
    assert load_config(ServiceConfig, None).nats.stream_replicas == 3
    monkeypatch.setenv("KILN_NATS__REPLICAS", "1")
    assert load_config(ServiceConfig, None).nats.stream_replicas == 1
    monkeypatch.setenv("KILN_NATS__CLUSTER_SIZE", "2")
    with pytest.raises(Exception, match="1, 3 or 5"):
        load_config(ServiceConfig, None)
