"""The run dashboard: a FastAPI app over the platform's database, nothing else.

Pages: ``/`` (runs), ``/runs/{run}`` (curves per version, evaluations, throughput,
learner idle, staleness histogram, reward integrity per version (trajectories that
touched protected files or tampered with the test framework) and failure reasons,
group outcomes, recent trajectories) and
``/runs/{run}/trajectories/{id}`` (one episode turn by turn: model text, tool calls
and their results, test output, reward and its terms, token versions, and its trace: the span tree read from the run's
trace files when the app is given them).
The same data as JSON under ``/api/...``. Read-only: it never writes the database, so
it can watch a live run or a finished one.

Every page is server-rendered HTML with inline SVG (``plots``), so it works offline
and in a headless browser without JavaScript. With a token configured every route
demands ``Authorization: Bearer <token>`` (``serve_http`` refuses a non-loopback bind
without one).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import case, func, select

from kiln.ops.dashboard.plots import Series, histogram, line_chart
from kiln.ops.dashboard.traces import span_tree
from kiln.shared.db import Database, EvalRecord, PolicyVersion, Run, StepRecord, TaskGroup, TrajectoryRecord
from kiln.shared.http import bearer_auth

TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=select_autoescape(["html"])
)


def _row(obj, *cols: str) -> dict:
    return {k: getattr(obj, k) for k in cols}


async def runs_summary(db: Database) -> list[dict]:
    async with db.session() as s:
        runs = (await s.scalars(select(Run).order_by(Run.created_at.desc()))).all()
        versions = dict(
            (
                await s.execute(
                    select(PolicyVersion.run_id, func.max(PolicyVersion.version)).group_by(PolicyVersion.run_id)
                )
            ).all()
        )
        trajs = dict(
            (await s.execute(select(TrajectoryRecord.run_id, func.count()).group_by(TrajectoryRecord.run_id))).all()
        )
        last = {}
        for r in runs:
            step = await s.scalar(
                select(StepRecord).where(StepRecord.run_id == r.id).order_by(StepRecord.step.desc()).limit(1)
            )
            last[r.id] = step
    return [
        {
            **_row(r, "id", "name", "status", "detail", "created_at", "finished_at"),
            "version": versions.get(r.id),
            "trajectories": trajs.get(r.id, 0),
            "pass_rate": last[r.id].pass_rate if last[r.id] else None,
            "mean_reward": last[r.id].mean_reward if last[r.id] else None,
        }
        for r in runs
    ]


async def run_detail(db: Database, run_id: str, limit: int = 200) -> dict:
    async with db.session() as s:
        run = await s.get(Run, run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        steps = (await s.scalars(select(StepRecord).where(StepRecord.run_id == run_id).order_by(StepRecord.step))).all()
        evals = (
            await s.scalars(
                select(EvalRecord).where(EvalRecord.run_id == run_id).order_by(EvalRecord.version, EvalRecord.id)
            )
        ).all()
        groups = (
            await s.execute(
                select(TaskGroup.status, TaskGroup.reason, func.count())
                .where(TaskGroup.run_id == run_id)
                .group_by(TaskGroup.status, TaskGroup.reason)
            )
        ).all()
        ages = (
            await s.execute(
                select(TrajectoryRecord.trained_version, TrajectoryRecord.min_version).where(
                    TrajectoryRecord.run_id == run_id,
                    TrajectoryRecord.trained_version.is_not(None),
                    TrajectoryRecord.min_version.is_not(None),
                )
            )
        ).all()
        T = TrajectoryRecord
        integrity = (
            await s.execute(
                select(
                    T.max_version,
                    func.count(),
                    func.sum(case((T.touched_protected, 1), else_=0)),
                    func.sum(case((T.tampered, 1), else_=0)),
                    func.sum(case((T.failure.is_not(None), 1), else_=0)),
                )
                .where(T.run_id == run_id, T.infra_error.is_(None))
                .group_by(T.max_version)
                .order_by(T.max_version)
            )
        ).all()
        failures = (
            await s.execute(
                select(T.failure, func.count()).where(T.run_id == run_id, T.failure.is_not(None)).group_by(T.failure)
            )
        ).all()
        recent = (
            await s.scalars(
                select(TrajectoryRecord)
                .where(TrajectoryRecord.run_id == run_id)
                .order_by(TrajectoryRecord.scored_at.desc())
                .limit(limit)
            )
        ).all()
    cols = (
        "trajectory_id",
        "group_id",
        "task_id",
        "sample_index",
        "reward",
        "passed",
        "infra_error",
        "num_turns",
        "num_generated",
        "min_version",
        "max_version",
        "trained_version",
        "finish_reason",
        "trace_id",
        "purpose",
        "failure",
        "touched_protected",
        "tampered",
    )
    return {
        "run": _row(run, "id", "name", "status", "detail", "created_at", "finished_at", "config"),
        "steps": [{**s.metrics, "recorded_at": s.recorded_at} for s in steps],
        "evaluations": [
            _row(
                e,
                "version",
                "suite",
                "split",
                "tasks",
                "samples",
                "seed",
                "greedy_pass_rate",
                "pass_at_k",
                "per_task",
                "seconds",
                "created_at",
            )
            for e in evals
        ],
        "groups": [{"status": st, "reason": reason, "count": n} for st, reason, n in groups],
        # Versions between the policy that sampled a trajectory's oldest token and the
        # one its step started from: what the learner reports as staleness.
        "staleness": dict(Counter(trained - 1 - oldest for trained, oldest in ages)),
        # Reward hacking shows up here first: per policy version (of a trajectory's newest
        # token), how many scored trajectories changed protected paths or tampered.
        "integrity": [
            {
                "version": v,
                "scored": n,
                "touched_protected": int(p or 0),
                "tampered": int(t or 0),
                "failed": int(f or 0),
            }
            for v, n, p, t, f in integrity
        ],
        "failures": {reason: n for reason, n in failures},
        "trajectories": [_row(t, *cols) for t in recent],
    }


async def trajectory_detail(db: Database, run_id: str, trajectory_id: str) -> dict:
    async with db.session() as s:
        t = await s.get(TrajectoryRecord, trajectory_id)
    if t is None or t.run_id != run_id:
        raise HTTPException(404, f"no trajectory {trajectory_id!r} in run {run_id!r}")
    return _row(
        t,
        "trajectory_id",
        "run_id",
        "group_id",
        "task_id",
        "sample_index",
        "dispatch_version",
        "min_version",
        "max_version",
        "trained_version",
        "reward",
        "passed",
        "infra_error",
        "num_tokens",
        "num_generated",
        "num_turns",
        "malformed_tool_calls",
        "finish_reason",
        "tests",
        "reward_terms",
        "test_output",
        "log_key",
        "messages",
        "failure",
        "failure_detail",
        "touched_protected",
        "tampered",
        "integrity",
        "report",
        "trace_id",
        "worker_id",
        "scored_at",
        "purpose",
        "eval_id",
    )


def run_plots(d: dict) -> dict[str, str]:
    steps = d["steps"]
    v = lambda key: [(s["version"], s.get(key, 0.0)) for s in steps]  # noqa: E731 (older rows lack newer keys)
    rates, prev = [], 0.0
    for s in steps:
        dt = s["elapsed_seconds"] - prev
        prev = s["elapsed_seconds"]
        if dt > 0:
            rates.append((s["version"], s["trajectories"] / dt))
    idle = [(s["version"], s["wait_seconds"] / max(1e-9, s["wait_seconds"] + s["step_seconds"])) for s in steps]
    greedy = [(e["version"], e["greedy_pass_rate"]) for e in d["evaluations"]]
    pass_k = {}
    for e in d["evaluations"]:
        for k, p in e["pass_at_k"].items():
            pass_k.setdefault(k, []).append((e["version"], p))
    return {
        "reward": line_chart(
            "reward",
            "Training reward and pass rate per version",
            [Series("mean reward", v("mean_reward")), Series("pass rate", v("pass_rate"))],
            xlabel="version",
        ),
        "eval": line_chart(
            "eval",
            "Held-out pass rate per version",
            [Series("greedy", greedy), *(Series(f"pass@{k}", p) for k, p in sorted(pass_k.items()))],
            xlabel="version",
            ylim=(0.0, 1.0),
        ),
        "update": line_chart(
            "update",
            "Policy update: PPO clip fraction and KL to the reference",
            [Series("clip fraction", v("clip_frac")), Series("KL", v("kl"))],
            xlabel="version",
        ),
        "throughput": line_chart(
            "throughput", "Trajectories trained per second", [Series("traj/s", rates)], xlabel="version"
        ),
        "idle": line_chart(
            "idle",
            "Learner idle fraction (waiting for a batch)",
            [Series("idle", idle)],
            xlabel="version",
            ylim=(0.0, 1.0),
        ),
        "integrity": line_chart(
            "integrity",
            "Reward integrity per version: trajectories that touched protected files or tampered",
            [
                Series(
                    "touched protected",
                    [(r["version"], r["touched_protected"]) for r in d["integrity"] if r["version"] is not None],
                ),
                Series("tampered", [(r["version"], r["tampered"]) for r in d["integrity"] if r["version"] is not None]),
            ],
            xlabel="version",
        ),
        "staleness": histogram(
            "staleness", "Staleness of trained trajectories (versions)", d["staleness"], xlabel="versions behind"
        ),
        "tokens": line_chart(
            "tokens",
            "Generated tokens per step (off-policy share)",
            [Series("generated", v("generated_tokens")), Series("off-policy", v("off_policy_tokens"))],
            xlabel="version",
        ),
    }


def create_app(db: Database, *, token: str = "", title: str = "kiln", traces_dir: Path | None = None) -> FastAPI:
    """``traces_dir``: the run's span files; the trajectory page then shows its trace."""
    app = FastAPI(title=f"{title} dashboard", dependencies=[Depends(bearer_auth(token))])

    def page(name: str, **ctx) -> HTMLResponse:
        return HTMLResponse(TEMPLATES.get_template(name).render(title=title, **ctx))

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/api/runs")
    async def api_runs() -> list[dict]:
        return await runs_summary(db)

    @app.get("/api/runs/{run_id}")
    async def api_run(run_id: str) -> dict:
        return await run_detail(db, run_id)

    @app.get("/api/runs/{run_id}/trajectories/{trajectory_id}")
    async def api_trajectory(run_id: str, trajectory_id: str) -> dict:
        return await trajectory_detail(db, run_id, trajectory_id)

    @app.get("/", response_class=HTMLResponse)
    async def runs_page() -> HTMLResponse:
        return page("runs.html", runs=await runs_summary(db))

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    async def run_page(run_id: str) -> HTMLResponse:
        d = await run_detail(db, run_id)
        return page("run.html", d=d, plots=run_plots(d))

    @app.get("/runs/{run_id}/trajectories/{trajectory_id}", response_class=HTMLResponse)
    async def trajectory_page(run_id: str, trajectory_id: str) -> HTMLResponse:
        t = await trajectory_detail(db, run_id, trajectory_id)
        spans = span_tree(traces_dir, t["trace_id"]) if traces_dir else []
        return page("trajectory.html", t=t, spans=spans, traces_dir=traces_dir)

    return app
