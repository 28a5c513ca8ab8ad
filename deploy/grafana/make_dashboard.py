"""Writes deploy/grafana/dashboards/kiln.json, the provisioned Grafana dashboard.

    .venv/bin/python deploy/grafana/make_dashboard.py

The same views as the run dashboard (kiln.ops.dashboard) from Prometheus: reward and
pass rate, trajectories/s and tokens/s, learner idle, staleness, queue depths, groups
in flight and dropped, sandboxes and their start latency, weight publishing.
``tests/test_compose.py`` checks that every query names a metric of kiln.shared.metrics.
"""

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "kiln-prometheus"}
PANELS = [
    (
        "Reward and pass rate (last step)",
        "timeseries",
        ["kiln_learner_mean_reward", "kiln_learner_pass_rate"],
        "percentunit",
    ),
    ("Policy version", "stat", ["max(kiln_learner_policy_version)", "min(kiln_rollout_policy_version)"], "none"),
    ("Trajectories trained / s", "timeseries", ["rate(kiln_learner_trajectories_trained_total[1m])"], "none"),
    ("Generated tokens / s", "timeseries", ["sum(rate(kiln_rollout_generated_tokens_total[1m]))"], "none"),
    (
        "Learner idle fraction",
        "timeseries",
        [
            "rate(kiln_learner_wait_seconds_total[2m]) / (rate(kiln_learner_wait_seconds_total[2m]) + rate(kiln_learner_step_seconds_total[2m]))"
        ],
        "percentunit",
    ),
    (
        "Staleness of trained trajectories",
        "heatmap",
        ["sum by (le) (increase(kiln_learner_staleness_versions_bucket[5m]))"],
        "none",
    ),
    (
        "Off-policy token share",
        "timeseries",
        ["rate(kiln_learner_off_policy_tokens_total[2m]) / rate(kiln_learner_generated_tokens_total[2m])"],
        "percentunit",
    ),
    ("Queue depth per consumer", "timeseries", ["kiln_queue_pending", "kiln_queue_ack_pending"], "none"),
    (
        "Groups in flight / dropped",
        "timeseries",
        ["kiln_controller_groups_in_flight", "sum by (reason) (increase(kiln_controller_groups_dropped_total[5m]))"],
        "none",
    ),
    (
        "Episodes in flight, suspended, resumed",
        "timeseries",
        [
            "sum(kiln_rollout_episodes_in_flight)",
            "sum(rate(kiln_rollout_suspended_total[1m]))",
            "sum(rate(kiln_rollout_resumed_total[1m]))",
        ],
        "none",
    ),
    ("Scored trajectories by outcome", "timeseries", ["sum by (outcome) (rate(kiln_reward_scored_total[1m]))"], "none"),
    (
        "Sandboxes",
        "timeseries",
        [
            "sum(kiln_envpool_sandboxes_leased)",
            "sum(kiln_envpool_sandboxes_idle)",
            "sum(kiln_envpool_sandboxes_creating)",
            "sum(kiln_envpool_capacity)",
        ],
        "none",
    ),
    (
        "Sandbox start latency p50 / p99",
        "timeseries",
        [
            "histogram_quantile(0.5, sum by (le) (rate(kiln_envpool_create_seconds_bucket[2m])))",
            "histogram_quantile(0.99, sum by (le) (rate(kiln_envpool_create_seconds_bucket[2m])))",
        ],
        "s",
    ),
    (
        "Episode duration p50 / p99",
        "timeseries",
        [
            "histogram_quantile(0.5, sum by (le) (rate(kiln_rollout_episode_seconds_bucket[5m])))",
            "histogram_quantile(0.99, sum by (le) (rate(kiln_rollout_episode_seconds_bucket[5m])))",
        ],
        "s",
    ),
    (
        "Weight publish time p50",
        "timeseries",
        ["histogram_quantile(0.5, sum by (le) (rate(kiln_weights_publish_seconds_bucket[5m])))"],
        "s",
    ),
    ("Malformed tool calls / s", "timeseries", ["sum(rate(kiln_rollout_malformed_tool_calls_total[1m]))"], "none"),
]


def dashboard() -> dict:
    panels = []
    for i, (title, kind, exprs, unit) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "title": title,
                "type": kind,
                "datasource": DS,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(65 + j), "datasource": DS, "expr": e, "legendFormat": "__auto"}
                    for j, e in enumerate(exprs)
                ],
            }
        )
    return {
        "uid": "kiln-run",
        "title": "kiln: asynchronous RL run",
        "tags": ["kiln"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "dashboards" / "kiln.json"
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out} ({len(PANELS)} panels)")
