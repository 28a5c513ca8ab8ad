"""The authenticated bus, against a real nats-server started with kiln's credentials
(``kiln.shared.bus.auth``, what ``kiln run`` does): no credential, no connection; a
rollout credential cannot publish a checkpoint or dispatch work; only rollout and reward
reach env-pool's subjects; what each service does need still works."""

from __future__ import annotations

import pytest
from harness import request_once_served

from kiln.ops.embedded import NatsServer
from kiln.shared import contracts as c
from kiln.shared.bus import Bus, RemoteError
from kiln.shared.bus.auth import Credentials, denied, server_config
from kiln.shared.config import NatsSettings

SERVICES = ["env-pool", "rollout", "reward", "learner", "weights"]


@pytest.fixture
def server(tmp_path):
    creds = Credentials.generate(SERVICES)
    conf = tmp_path / "auth.conf"
    conf.write_text(server_config(creds))
    nats = NatsServer(tmp_path / "store", config_file=conf).start()
    yield nats, creds
    nats.stop()


async def connect(nats, creds, who: str, **kw) -> Bus:
    return await Bus.connect(
        NatsSettings(url=nats.url, user=who, password=creds.users[who], connect_timeout_s=3, **kw), who
    )


def checkpoint() -> c.PolicyCheckpoint:
    return c.PolicyCheckpoint(run_id="r", version=1, step=1, parent_version=0, path="/etc")


async def test_no_credential_no_connection(server):
    nats, creds = server
    with pytest.raises(Exception):
        await Bus.connect(NatsSettings(url=nats.url, connect_timeout_s=2), "stranger")
    with pytest.raises(Exception):
        await Bus.connect(NatsSettings(url=nats.url, user="rollout", password="guess", connect_timeout_s=2), "guesser")


async def test_each_service_publishes_only_what_it_may(server):
    nats, creds = server
    admin = await connect(nats, creds, "launcher")
    await admin.ensure_topology()
    rollout = await connect(nats, creds, "rollout", publish_retry_s=0.5)
    learner = await connect(nats, creds, "learner", publish_retry_s=0.5)
    try:
        # a rollout credential cannot publish a checkpoint or dispatch work...
        with pytest.raises(Exception):
            await rollout.publish(c.WEIGHTS_CHECKPOINT, checkpoint())
        req = c.RolloutRequest(run_id="r", group_id="g", task_id="t", n_samples=1, dispatch_version=0, deadline=0.0)
        with pytest.raises(Exception):
            await rollout.publish(c.ROLLOUT_WORK, req, msg_id="g")
        assert (await admin.js.stream_info("KILN_CHECKPOINTS")).state.messages == 0
        # ...the learner can, and rollout publishes its trajectories
        await learner.publish(c.WEIGHTS_CHECKPOINT, checkpoint())
        await learner.publish(c.ROLLOUT_WORK, req, msg_id="g")
        traj = c.Trajectory(
            run_id="r",
            trajectory_id="t",
            group_id="g",
            task_id="t",
            sample_index=0,
            dispatch_version=0,
            status=c.TrajectoryStatus.FINISHED,
            token_ids=[],
            logprobs=[],
            token_versions=[],
            loss_mask=[],
        )
        await rollout.publish(c.TRAJECTORY_FINISHED, traj, msg_id="t")
        # only rollout and reward drive sandboxes: the learner's request never reaches env-pool
        envpool = await connect(nats, creds, "env-pool")
        try:

            async def created(req: c.SandboxCreate) -> c.SandboxCreated:
                return c.SandboxCreated(sandbox=c.SandboxRef(node_id="n", sandbox_id="s"), workspace="/w")

            await envpool.serve(c.ENVPOOL_CREATE, c.SandboxCreate, created, queue=c.ENVPOOL_QUEUE)
            ok = await request_once_served(rollout, c.ENVPOOL_CREATE, c.SandboxCreate(task_id="t"), c.SandboxCreated)
            assert ok.sandbox.sandbox_id == "s"
            with pytest.raises(RemoteError):
                await learner.request(c.ENVPOOL_CREATE, c.SandboxCreate(task_id="t"), c.SandboxCreated, timeout=2)
        finally:
            await envpool.close()
    finally:
        for b in (rollout, learner, admin):
            await b.close()


def test_permissions_are_as_documented():
    assert denied("launcher") == [] and denied("learner") == ["kiln.envpool.>", "kiln.weights.published.>"]
    for service in ("rollout", "reward", "env-pool", "weights"):
        assert c.WEIGHTS_CHECKPOINT in denied(service) and c.ROLLOUT_WORK in denied(service)
    assert "kiln.envpool.>" in denied("weights") and "kiln.envpool.>" not in denied("reward")
    assert "kiln.weights.published.>" not in denied("weights")
