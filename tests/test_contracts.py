"""The contracts module: every subject is captured by exactly one stream, consumers
filter subjects their stream holds, and messages validate strictly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.shared import contracts as c


def test_every_subject_has_exactly_one_stream():
    subjects = list(c.SUBJECT_MESSAGES) + [c.weights_published_subject("r1"), c.dead_letter_subject(c.ROLLOUT_WORK)]
    for s in subjects:
        if s == c.ENVPOOL_CREATE:
            continue  # request/reply, not a stream
        owners = [spec.name for spec in c.STREAMS if any(c.subject_matches(p, s) for p in spec.subjects)]
        assert len(owners) == 1, f"{s} is captured by {owners}"
    for k in c.CONSUMERS:
        assert c.stream_for_subject(k.filter_subject).name == k.stream


def test_subject_tokens_are_checked():
    assert c.envpool_node_subject("node-1", "exec") == "kiln.envpool.node.node-1.exec"
    with pytest.raises(ValueError):
        c.envpool_node_subject("a.b", "exec")
    with pytest.raises(ValueError):
        c.envpool_node_subject("n", "rm")
    with pytest.raises(ValueError):
        c.weights_published_subject("run*")
    assert c.subject_matches("kiln.dlq.>", "kiln.dlq.kiln.rollout.work")
    assert not c.subject_matches("kiln.weights.published.*", "kiln.weights.published.a.b")


def test_messages_round_trip_and_validate():
    t = c.Trajectory(
        run_id="r",
        trajectory_id="g-s0",
        group_id="g",
        task_id="t",
        sample_index=0,
        dispatch_version=0,
        status=c.TrajectoryStatus.FINISHED,
        token_ids=[1, 2],
        logprobs=[0.0, -1.0],
        token_versions=[-1, 0],
        loss_mask=[0, 1],
    )
    back = c.Trajectory.from_bytes(t.to_bytes())
    assert back == t and b'"schema":1' in t.to_bytes()
    assert back.generated_versions() == [0]
    with pytest.raises(ValidationError, match="equal length"):
        c.Trajectory(**{**t.model_dump(), "logprobs": [0.0]})
    with pytest.raises(ValidationError):
        c.RunEvent.model_validate_json('{"schema": 2, "run_id": "r", "kind": "started"}')
    with pytest.raises(ValidationError):
        c.RunEvent.model_validate_json('{"schema": 1, "run_id": "r", "kind": "started", "surprise": 1}')
    with pytest.raises(ValidationError, match="one entry per sample"):
        c.RolloutRequest(
            run_id="r", group_id="g", task_id="t", n_samples=2, dispatch_version=0, deadline=0, sample_traces=["x"]
        )


def test_a_group_asks_for_a_bounded_number_of_samples_it_has():
    """A worker runs a group's samples at once: one message must not ask for millions, nor
    name samples or partials the group does not have."""
    import pydantic

    base = dict(run_id="r", group_id="g", task_id="t", dispatch_version=0, deadline=1.0)
    c.RolloutRequest(n_samples=c.MAX_GROUP_SAMPLES, **base)
    for bad in (
        dict(n_samples=c.MAX_GROUP_SAMPLES + 1),
        dict(n_samples=2, samples=[2]),
        dict(n_samples=2, samples=[-1]),
    ):
        with pytest.raises(pydantic.ValidationError):
            c.RolloutRequest(**base, **bad)
