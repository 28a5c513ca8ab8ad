"""What must hold after a run, however many processes were killed during it, checked
from durable records only: the database, the weights store, the JetStream store of the
run's nats-server, and the host (processes, mounts, cgroups, workspace folders).

The invariants (each violation is one line saying what and where):

- **the run finished** (``runs.status``);
- **every step trained**: one ``steps`` row per step ``0..steps-1`` with ``version =
  step + 1``, and exactly ``groups_per_step`` groups stamped ``trained_version = v`` for
  every ``v`` in ``1..steps``. A step the learner lost in a crash (trained, not yet
  committed to its checkpoint) leaves no record: its groups stay ``dispatched`` until the
  resumed learner trains them again from the restored state, so what the database says
  was trained is what the surviving model lineage was trained on;
- **every dispatched group ended exactly once**: group ids are the dispatch sequence
  ``g000000..`` without a gap, each row is ``trained`` (with a version, no reason) or
  ``dropped`` with a known reason; a trained group has exactly ``n_samples`` trajectory
  rows, all stamped with its version; no trajectory of a dropped or foreign group is
  stamped; each step's ``trajectories`` count equals the rows stamped with its version;
  the dropped-log (``kiln.group.dropped`` in the run's JetStream store) names no trained
  group and no group twice with different reasons;
- **no token newer than the policy that trained it**: a trained, valid trajectory's
  tokens come from versions in ``[trained_version - 1 - limit, trained_version - 1]``
  (``limit`` = ``max_staleness``, 0 in ``sync``) and none older than its group's
  dispatch version;
- **policy versions contiguous and intact**: ``policy_versions`` holds ``0..steps``, each
  the child of the one before; every version not deleted by retention has a
  ``manifest.json`` whose sha256 is the row's, and files (a delta version: rebuilt along
  its chain) whose sha256s are the manifest's; the store holds no version without a row;
- **no sandbox left alive**: no process, mount, cgroup or workspace folder of any of the
  run's env-pool processes (each incarnation is ``<node>-<pid>``), and no process of the
  run at all (its config file in the environment, its folder in the command line);
- **no dead letters but the deliberate ones**: every message in ``KILN_DLQ`` carries a
  marker the chaos tool injected on purpose, and every injected one is there (so the
  check is known to see the stream).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from kiln.shared import contracts as c
from kiln.shared.db import Database, PolicyVersion, Run, StepRecord, TaskGroup, TrajectoryRecord

DROP_REASONS = set(c.GroupDropped.model_fields["reason"].annotation.__args__)
"""Every reason a group may be dropped with (``contracts.GroupDropped``)."""
BAD_INPUT_MARKER = b"kiln-chaos-bad-input"
"""In the body of every malformed message the chaos tool publishes on purpose."""


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    """Counts for the summary: groups by outcome, versions, dead letters, ..."""

    def fail(self, msg: str) -> None:
        self.violations.append(msg)

    @property
    def lost_groups(self) -> int:
        return self.facts.get("lost_groups", 0)


# --- the database and the weights store ----------------------------------------------


async def check_records(db_url: str, run_id: str, report: Report | None = None) -> Report:
    """Every database and weights-store invariant of ``run_id``."""
    report = report or Report()
    db = Database(db_url)
    try:
        async with db.session() as s:
            run = await s.get(Run, run_id)
            groups = (await s.scalars(select(TaskGroup).where(TaskGroup.run_id == run_id))).all()
            trajs = (
                await s.scalars(
                    select(TrajectoryRecord).where(
                        TrajectoryRecord.run_id == run_id, TrajectoryRecord.purpose == "train"
                    )
                )
            ).all()
            steps = (await s.scalars(select(StepRecord).where(StepRecord.run_id == run_id))).all()
            versions = (await s.scalars(select(PolicyVersion).where(PolicyVersion.run_id == run_id))).all()
    finally:
        await db.close()
    if run is None:
        report.fail(f"run {run_id}: no row in runs")
        return report
    if run.status != "finished":
        report.fail(f"run {run_id} is {run.status}: {run.detail[:500]}")
    a = run.config.get("algorithm", {})
    n_steps, per_step = int(a.get("steps", 0)), int(a.get("groups_per_step", 0))
    limit = 0 if a.get("mode") == "sync" else int(a.get("max_staleness", 0))
    _check_groups(report, run_id, groups, trajs, steps, n_steps, per_step, limit)
    await asyncio.to_thread(_check_versions, report, run_id, versions, n_steps)
    return report


def _check_groups(report: Report, run_id: str, groups, trajs, steps, n_steps: int, per_step: int, limit: int) -> None:
    by_id = {g.group_id: g for g in groups}
    lost: set[str] = set()
    outcomes = Counter(g.status if g.status != "dropped" else f"dropped ({g.reason})" for g in groups)
    report.facts.update(groups_dispatched=len(groups), group_outcomes=dict(outcomes))

    expected = [f"{run_id}-g{i:06d}" for i in range(len(groups))]
    if sorted(by_id) != expected:
        missing = sorted(set(expected) - set(by_id))[:5]
        report.fail(
            f"group ids are not the dispatch sequence 0..{len(groups) - 1}: missing {missing}, "
            f"unexpected {sorted(set(by_id) - set(expected))[:5]}"
        )
    for g in groups:
        if g.status == "trained":
            if g.trained_version is None or not 1 <= g.trained_version <= n_steps or g.reason:
                report.fail(f"{g.group_id}: trained with version {g.trained_version} and reason {g.reason!r}")
        elif g.status == "dropped":
            if g.reason not in DROP_REASONS:
                lost.add(g.group_id)
                report.fail(f"{g.group_id}: dropped with reason {g.reason!r} (not one of {sorted(DROP_REASONS)})")
            if g.trained_version is not None:
                report.fail(f"{g.group_id}: dropped but carries trained_version {g.trained_version}")
        else:
            lost.add(g.group_id)
            report.fail(f"{g.group_id}: still {g.status!r} after the run (neither trained nor dropped)")

    # Trajectories: a trained group's samples all stamped with its version, nobody else's.
    of_group: dict[str, list] = defaultdict(list)
    for t in trajs:
        of_group[t.group_id].append(t)
        g = by_id.get(t.group_id)
        if g is None:
            report.fail(f"{t.trajectory_id}: its group {t.group_id} was never dispatched")
            continue
        if t.trained_version is not None and g.status != "trained":
            report.fail(
                f"{t.trajectory_id}: stamped trained by version {t.trained_version} but its group is {g.status}"
            )
        if g.status != "trained" or t.trained_version is None or t.infra_error:
            continue
        trainer = t.trained_version - 1  # the policy the step started from
        if t.max_version is not None and t.max_version > trainer:
            report.fail(
                f"{t.trajectory_id}: a token of version {t.max_version} trained by version {trainer} (newer than it)"
            )
        if t.min_version is not None and t.min_version < trainer - limit:
            report.fail(
                f"{t.trajectory_id}: a token of version {t.min_version} trained by version {trainer} (max staleness {limit})"
            )
        if t.min_version is not None and t.min_version < g.dispatch_version:
            report.fail(
                f"{t.trajectory_id}: a token of version {t.min_version}, older than its dispatch version {g.dispatch_version}"
            )
    for g in groups:
        if g.status != "trained":
            continue
        rows = of_group.get(g.group_id, [])
        stamps = Counter(t.trained_version for t in rows)
        if len(rows) != g.n_samples or stamps != Counter({g.trained_version: g.n_samples}):
            lost.add(g.group_id)
            report.fail(
                f"{g.group_id}: trained by version {g.trained_version} but its {len(rows)} of {g.n_samples} "
                f"trajectory rows are stamped {dict(stamps)}"
            )

    # Steps: each one once, each with exactly its batch.
    per_version = Counter(g.trained_version for g in groups if g.status == "trained")
    stamped = Counter(t.trained_version for t in trajs if t.trained_version is not None)
    by_step = {s.step: s for s in steps}
    if sorted(by_step) != list(range(n_steps)):
        report.fail(f"steps recorded {sorted(by_step)}, expected 0..{n_steps - 1}")
    for v in range(1, n_steps + 1):
        if per_version.get(v, 0) != per_step:
            report.fail(f"version {v}: {per_version.get(v, 0)} groups trained by its step, expected {per_step}")
        s = by_step.get(v - 1)
        if s is not None and (s.version != v or s.trajectories != stamped.get(v, 0)):
            report.fail(
                f"step {v - 1}: row says version {s.version} with {s.trajectories} trajectories; "
                f"{stamped.get(v, 0)} trajectories are stamped version {v}"
            )
    report.facts.update(steps_recorded=len(by_step), trajectories_scored=len(trajs), lost_groups=len(lost))


def _check_versions(report: Report, run_id: str, versions, n_steps: int) -> None:
    rows = {v.version: v for v in versions}
    report.facts["versions"] = len(rows)
    if sorted(rows) != list(range(n_steps + 1)):
        report.fail(f"policy versions {sorted(rows)} are not 0..{n_steps}")
    for v, row in sorted(rows.items()):
        if row.parent_version != (v - 1 if v else None):
            report.fail(f"version {v}: parent {row.parent_version}, expected {v - 1 if v else None}")
    live = {v: row for v, row in rows.items() if row.deleted_at is None}
    for v, row in sorted(live.items()):
        problem = _version_problem(row, rows)
        if problem:
            report.fail(f"version {v} ({row.path}): {problem}")
    # The store holds nothing the database does not know (a version stored, never registered).
    folders = {Path(r.path).parent for r in versions}
    for d in folders:
        for p in d.glob("v[0-9]*"):
            if p.is_dir() and p.name[1:].isdigit() and (p / "manifest.json").is_file() and int(p.name[1:]) not in rows:
                report.fail(f"{p}: a stored version with no policy_versions row")
    report.facts["versions_verified"] = len(live)


def _version_problem(row: PolicyVersion, rows: dict) -> str:
    from kiln.shared.weights.delta import apply_delta
    from kiln.shared.weights.manifest import IntegrityError, verify

    folder = Path(row.path)
    mf = folder / "manifest.json"
    if not mf.is_file():
        return "no manifest.json"
    body = mf.read_bytes()
    if hashlib.sha256(body).hexdigest() != row.manifest_sha256:
        return "manifest.json's sha256 differs from the database's"
    manifest = c.WeightsManifest.model_validate_json(body)
    if manifest.version != row.version:
        return f"manifest.json is version {manifest.version}"
    try:
        if manifest.storage == "full":
            verify(folder, manifest)
            return ""
        # A delta: rebuild it along its chain (the nearest full version, then each delta).
        chain, m = [], manifest
        while m.storage == "delta":
            chain.append(m)
            base_row = rows.get(m.base_version)
            if base_row is None:
                return f"its delta chain needs version {m.base_version}, which has no row"
            m = c.WeightsManifest.model_validate_json((Path(base_row.path) / "manifest.json").read_bytes())
        tmp = Path(tempfile.mkdtemp(prefix="kiln-chaos-verify-"))
        try:
            base = Path(rows[m.version].path)
            for i, dm in enumerate(reversed(chain)):
                blob = (Path(rows[dm.version].path) / dm.delta.path).read_bytes()
                if hashlib.sha256(blob).hexdigest() != dm.delta.sha256:
                    return f"the delta of version {dm.version} does not match its sha256"
                dest = tmp / str(i)
                apply_delta(blob, base, dest)
                base = dest
            verify(base, manifest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (IntegrityError, OSError, ValueError) as e:
        return str(e)
    return ""


# --- the host: nothing of the run outlives it -----------------------------------------

CGROUP_ROOTS = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/pids")]


def envpool_incarnations(run_dir: Path, seen_pids: dict[str, set[int]] | None = None) -> dict[str, set[Path]]:
    """Each env-pool process of the run, as ``<node>-<pid>`` -> its workspace folders:
    read from the env-pool logs (each start logs where its workspaces are), plus the pids
    the caller saw alive (a process killed before it logged)."""
    out: dict[str, set[Path]] = defaultdict(set)
    for log in sorted((run_dir / "logs").glob("env-pool*.log")):
        for m in re.finditer(
            r"env-pool node (\S+) serving: .*?workspaces in (/\S+?)(?:,|\"|$)", log.read_text(errors="replace"), re.M
        ):
            folder = Path(m.group(2))
            out[folder.name].add(folder)
    for node, pids in (seen_pids or {}).items():
        for pid in pids:
            out.setdefault(f"{node}-{pid}", set())
    return dict(out)


def check_host(run_dir: Path, incarnations: dict[str, set[Path]], report: Report | None = None) -> Report:
    """No process, mount, cgroup or workspace of the run is left."""
    report = report or Report()
    run_dir = run_dir.resolve()
    config = str(run_dir / "config.toml")
    folders = {str(f) for fs in incarnations.values() for f in fs}
    needles = [str(run_dir), *folders]
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if any(n in cmd for n in needles) or f"KILN_CONFIG={config}".encode() in env:
            report.fail(f"process {p.name} of the run is still alive: {cmd[:200]}")
    mounts = Path("/proc/self/mountinfo").read_text()
    for f in folders:
        for line in mounts.splitlines():
            if f in line:
                report.fail(f"a mount of the run's sandboxes is left: {line[:200]}")
        if Path(f).exists():
            report.fail(f"workspace folder {f} of the run's env-pool is left")
    for inc in incarnations:
        for root in CGROUP_ROOTS:
            if (root / f"kiln-{inc}").exists():
                report.fail(f"cgroup {root / f'kiln-{inc}'} of the run's env-pool is left")
    report.facts["envpool_incarnations"] = len(incarnations)
    return report


# --- the run's JetStream store ----------------------------------------------------------


async def check_bus(
    store_dir: Path, groups: dict[str, tuple[str, str | None]], injected: set[str], report: Report | None = None
) -> Report:
    """Reads the dead letters and the dropped-log from the stopped run's JetStream store
    (a nats-server of our own on a copy of it, so the run's store is left as it was).
    ``groups``: group id -> (status, reason) from the database; ``injected``: the
    markers of the malformed messages published on purpose."""
    from kiln.ops.embedded import NatsServer
    from kiln.shared.bus import Bus
    from kiln.shared.config import NatsSettings

    report = report or Report()
    if not (store_dir / "jetstream").is_dir():  # a cluster's stores are per node (and replicated): not read here
        report.fail(
            f"no single-server JetStream store in {store_dir}: the dead-letter and dropped-log checks need one nats-server"
        )
        return report
    tmp = Path(tempfile.mkdtemp(prefix="kiln-chaos-js-"))
    server = None
    try:
        await asyncio.to_thread(shutil.copytree, store_dir / "jetstream", tmp / "jetstream")
        server = await asyncio.to_thread(NatsServer(tmp, log_file=str(tmp / "nats.log")).start)
        bus = await Bus.connect(NatsSettings(url=server.url), "chaos-check")
        try:
            dead = await _messages(bus, "KILN_DLQ")
            events = await _messages(bus, "KILN_EVENTS", c.GROUP_DROPPED)
        finally:
            await bus.close()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    found, deliberate = set(), 0
    for subject, headers, body in dead:
        marker = re.search(rb"kiln-chaos-bad-input (\S+)", body)
        if marker:  # at least once: a kill may have it dead-lettered twice
            found.add(marker.group(1).decode())
            deliberate += 1
            continue
        report.fail(
            f"dead letter on {subject} from {headers.get(c.HDR_DLQ_SERVICE)}: {headers.get(c.HDR_DLQ_REASON, '')[:300]}"
        )
    if missing := injected - found:
        report.fail(f"{len(missing)} deliberately malformed messages are not in KILN_DLQ: {sorted(missing)[:5]}")
    reasons: dict[str, set[str]] = defaultdict(set)
    for _, _, body in events:
        m = c.GroupDropped.model_validate_json(body)
        reasons[m.group_id].add(m.reason)
    for gid, rs in reasons.items():
        status, reason = groups.get(gid, ("unknown", None))
        if status != "dropped" or len(rs) > 1 or reason not in rs:
            report.fail(f"{gid}: the dropped-log says {sorted(rs)}, the database {status} {reason or ''}")
    report.facts.update(
        dead_letters=len(dead),
        deliberate_dead_letters=deliberate,
        deliberate_messages=len(found),
        dropped_log=len(reasons),
        drops_not_in_log=sum(1 for g, (st, _) in groups.items() if st == "dropped" and g not in reasons),
    )
    return report


async def _messages(bus, stream: str, subject: str | None = None) -> list[tuple[str, dict, bytes]]:
    from nats.js.errors import NotFoundError

    try:
        info = await bus.js.stream_info(stream)
    except NotFoundError:
        return []
    out: list[tuple[str, dict, bytes]] = []
    if not info.state.messages:  # an empty stream's sequences start at 0, which no message has
        return out
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            m = await bus.js.get_msg(stream, seq)
        except NotFoundError:  # a deleted sequence
            continue
        if subject is None or m.subject == subject:
            out.append((m.subject, dict(m.headers or {}), m.data or b""))
    return out


async def group_outcomes(db_url: str, run_id: str) -> dict[str, tuple[str, str | None]]:
    db = Database(db_url)
    try:
        async with db.session() as s:
            rows = (
                await s.execute(
                    select(TaskGroup.group_id, TaskGroup.status, TaskGroup.reason).where(TaskGroup.run_id == run_id)
                )
            ).all()
    finally:
        await db.close()
    return {g: (st, r) for g, st, r in rows}
