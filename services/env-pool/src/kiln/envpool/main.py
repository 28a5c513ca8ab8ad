"""env-pool entrypoint: ``python -m kiln.envpool.main``.

Serves ``kiln.envpool.create`` in the ``envpool`` queue group (any node may create a
sandbox, from a task or from a snapshot) and ``kiln.envpool.node.<node_id>.<op>`` for
what only the owner can do (exec, tools, fork, snapshot, renew, destroy, stats), plus
the operator HTTP API. With the ``bwrap`` backend the node refuses to start when
bubblewrap cannot run here; the ``process`` backend must be chosen explicitly.

Stopping (SIGTERM/SIGINT, ``ServiceContext.stop``): from the first signal on, creates
and forks are refused (``node_stopping``, an infrastructure error to the caller), the
sandboxes being built are waited for, then every sandbox is destroyed (its commands
killed: their calls get the killed result) and the node's folder and cgroups removed,
and the process exits 0. Without the refusal a create served during the close built a
sandbox in a folder and cgroup being removed, and the node exited 1 with its workspaces
left behind (tests/test_shutdown.py).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from opentelemetry import trace

from kiln.envpool.api import build_app
from kiln.envpool.config import EnvPoolConfig, EnvPoolSettings
from kiln.envpool.isolation import bwrap
from kiln.envpool.isolation.cgroups import CgroupManager
from kiln.envpool.isolation.sandbox import Identity, ProcessSandbox
from kiln.envpool.isolation.spawner import Spawner
from kiln.envpool.metrics import NodeMetrics
from kiln.envpool.pool import SandboxPool
from kiln.envpool.tools.executor import ToolExecutor
from kiln.envpool.tools.search import SemanticIndex
from kiln.envpool.workspaces import overlay
from kiln.shared import contracts as c
from kiln.shared.bus import ServiceError
from kiln.shared.http import serve_http
from kiln.shared.service import ServiceContext, service_main, wait_or_stop
from kiln.shared.tasks import load_suite

log = logging.getLogger("kiln.envpool")


def workspace_root(s: EnvPoolSettings, run_dir: str, node_id: str) -> Path:
    """This process's own folder: ``<base>/<node id>-<pid>``. Two env-pools with one node id
    on a host (two local runs, a test beside a run) must never share it, since ``close``
    removes it with every workspace in it (measured: a test's env-pool removed a run's
    bwrap identity files, and every later test command failed to start). Folders of
    env-pools that died without ``close`` are removed here, under the host-local defaults
    only: a configured ``workspace_root`` may be shared by hosts whose pids mean nothing here."""
    local = not s.workspace_root
    if s.workspace_root:
        base = Path(s.workspace_root)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = Path("/dev/shm/kiln-envpool")
    elif run_dir:
        base, local = Path(run_dir) / "sandboxes", False
    else:
        base = Path(tempfile.gettempdir()) / "kiln-envpool"
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o711)
    if local:
        for old in base.glob(f"{node_id}-*"):
            pid = old.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
                overlay.unmount_below(old)  # its environment sandboxes' views outlive it
                shutil.rmtree(old, ignore_errors=True)
                log.info("removed the workspaces of a dead env-pool: %s", old)
    return base / f"{node_id}-{os.getpid()}"


async def sandbox_factory(s: EnvPoolSettings, root: Path, spawner: Spawner):
    """The backend's constructor, after checking that it can run here."""
    if s.backend == "process":
        log.error(
            "UNSAFE: envpool.backend = 'process' runs agent commands without any isolation "
            "(host network, host files); use it only for development"
        )
        return lambda sid, ws, lim, ident, cg: ProcessSandbox(sid, ws, lim, ident, cg, spawner)
    etc = root / "etc"
    bwrap.write_identity_files(etc)
    system = bwrap.system_args(s.ro_binds, etc, seccomp=s.seccomp)
    probe_ws = root / "probe"
    probe_ws.mkdir(parents=True, exist_ok=True)
    identity = Identity()
    if os.geteuid() == 0:  # probe as an unprivileged uid, like every sandbox will run
        uid = s.sandbox_uid_base + s.max_sandboxes
        os.chown(probe_ws, uid, uid)
        identity = Identity(uid, uid)
    bwrap_binary = bwrap.bwrap_binary()  # a clear error if it is not installed at all
    await bwrap.probe(system, identity, probe_ws, spawner)
    log.info("bubblewrap sandboxes work here (%s)", bwrap_binary)
    return lambda sid, ws, lim, ident, cg: bwrap.BwrapSandbox(sid, ws, lim, ident, cg, spawner, system=system)


async def snapshot_store(ctx: ServiceContext, ttl_s: float):
    obs = await ctx.bus.object_store(c.SNAPSHOTS_BUCKET, ttl_s=ttl_s, description="workspace snapshots")

    async def put(key: str, data: bytes) -> None:
        await obs.put(key, data)

    async def get(key: str) -> bytes:
        buf = io.BytesIO()
        await obs.get(key, writeinto=buf)  # writeinto: a plain get() is quadratic in the size
        return buf.getvalue()

    return put, get


def layer_store(s: EnvPoolSettings, js, replicas: int = 1):
    """Where this node shares built environment layers (``envpool.environments.store``)."""
    from kiln.envpool.environments import NatsLayerStore, S3LayerStore

    st = s.environments.store
    if st.kind == "s3":
        store = S3LayerStore(st.bucket, st.prefix, st.endpoint_url, st.region)
        log.info("environment layers are shared through %s", store.where)
        return store
    return NatsLayerStore(js, replicas=replicas) if st.kind == "nats" else None


def raise_open_files_limit() -> None:
    """A full node holds a user-namespace descriptor per sandbox uid (environment views)
    beside each command's pipes: the common soft limit of 1,024 is too low, the hard one is not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def use_pidfd_child_watcher() -> None:
    """Python 3.11's default watcher starts a thread per child process, a real cost at
    hundreds of sandbox commands per second; pidfds need none (3.12+ uses them itself)."""
    if sys.version_info < (3, 12) and hasattr(asyncio, "PidfdChildWatcher"):
        if isinstance(asyncio.get_child_watcher(), asyncio.PidfdChildWatcher):
            return  # once per process: replacing a watcher drops the children it watches
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(asyncio.get_running_loop())
        asyncio.set_child_watcher(watcher)


async def serve(ctx: ServiceContext) -> None:
    use_pidfd_child_watcher()
    raise_open_files_limit()
    cfg: EnvPoolConfig = ctx.config  # type: ignore[assignment]
    s = cfg.envpool
    node_id = s.node_id or ctx.instance
    boot = uuid.uuid4().hex[:16]  # sandboxes do not outlive their process: a restart is a new boot
    root = workspace_root(s, cfg.run.dir, node_id)
    root.mkdir(parents=True, exist_ok=True)
    spawner = Spawner()
    try:
        factory = await sandbox_factory(s, root, spawner)
    except BaseException:
        await spawner.close()
        raise
    cgroups = CgroupManager(node_id)
    put, get = await snapshot_store(ctx, s.snapshot_ttl_s)
    environments = None
    why_not = "the process backend isolates nothing" if s.backend != "bwrap" else overlay.supported()
    if why_not is None:
        from kiln.envpool.environments import EnvironmentCache

        environments = EnvironmentCache(
            Path(s.environments.root),
            s.environments.budget_bytes,
            layer_store(s, ctx.bus.js, ctx.bus.settings.stream_replicas),
        )
    else:
        log.info("this node serves no environment tasks: %s", why_not)
    index = SemanticIndex(mode=s.semantic_mode)
    pool = SandboxPool(
        s,
        load_suite(cfg.tasks.suite),
        root,
        factory,
        cgroups,
        put_snapshot=put,
        get_snapshot=get,
        on_destroy=lambda ws: index.forget(ws.resolve()),
        environments=environments,
    )
    metrics = NodeMetrics(pool)
    if s.semantic_mode != "bm25":
        index.start_loading()  # in a thread; BM25 answers until it is ready
    tools = ToolExecutor(
        max_read_bytes=s.max_read_bytes,
        max_timeout_s=s.max_command_timeout_s,
        grep_max_matches=s.grep_max_matches,
        index=index,
        metrics=metrics,
        tracer=ctx.tracer,
    )
    http_url = ""

    def created(sb, t0: float) -> c.SandboxCreated:
        metrics.create_seconds.observe(time.monotonic() - t0)
        metrics.created.inc()
        return c.SandboxCreated(
            sandbox=c.SandboxRef(node_id=node_id, sandbox_id=sb.id, boot=boot), workspace=str(sb.workspace)
        )

    def refuse_when_stopping() -> None:
        if ctx.stop.is_set():
            raise ServiceError(f"env-pool node {node_id} is stopping", "node_stopping")

    async def on_create(req: c.SandboxCreate) -> c.SandboxCreated:
        refuse_when_stopping()
        t0 = time.monotonic()
        trace.get_current_span().set_attribute("task_id", req.task_id)  # on the request's own span
        try:
            sb = await pool.create(req.task_id, req.run_id, req.ttl_s or s.default_ttl_s, req.snapshot_key)
        except ServiceError as e:
            if e.code == "pool_exhausted":
                metrics.exhausted.inc()
            raise
        return created(sb, t0)

    async def on_fork(req: c.SandboxFork) -> c.SandboxCreated:
        refuse_when_stopping()
        t0 = time.monotonic()
        trace.get_current_span().set_attribute("sandbox_id", req.sandbox_id)
        return created(await pool.fork(req.sandbox_id, req.ttl_s or s.default_ttl_s), t0)

    async def on_snapshot(req: c.SandboxSnapshot) -> c.SnapshotRef:
        trace.get_current_span().set_attribute("sandbox_id", req.sandbox_id)
        key, size, digest, task_id = await pool.snapshot(req.sandbox_id)
        return c.SnapshotRef(key=key, size=size, sha256=digest, task_id=task_id)

    async def on_exec(req: c.SandboxExec) -> c.ExecResult:
        sb = pool.get(req.sandbox_id)
        trace.get_current_span().set_attribute("sandbox_id", sb.id)
        r = await sb.exec(req.command, min(req.timeout_s, s.max_command_timeout_s))
        metrics.exec_seconds.observe(r.duration_s)
        return r

    async def on_tools(req: c.SandboxTools) -> c.ToolResults:
        sb = pool.get(req.sandbox_id)
        trace.get_current_span().set_attributes({"sandbox_id": sb.id, "calls": len(req.calls)})
        return c.ToolResults(results=await tools.run_batch(sb, req.calls, req.timeout_s))

    async def on_diff(req: c.SandboxDiff) -> c.WorkspaceDiff:
        return await pool.diff(req.sandbox_id)

    async def on_renew(req: c.SandboxRenew) -> c.SandboxRenewed:
        return c.SandboxRenewed(sandbox_id=req.sandbox_id, expires_at=pool.renew(req.sandbox_id, req.ttl_s))

    async def on_destroy(req: c.SandboxDestroy) -> c.SandboxDestroyed:
        return c.SandboxDestroyed(sandbox_id=req.sandbox_id, existed=await pool.destroy(req.sandbox_id))

    async def on_stats(_req: c.NodeStatsRequest) -> c.NodeStats:
        return c.NodeStats(
            node_id=node_id,
            backend=s.backend,
            cgroups=cgroups.mode,
            leased=len(pool.leases),
            idle=pool.idle,
            creating=pool.creating,
            capacity=s.max_sandboxes,
            created_total=pool.created_total,
            reaped_total=pool.reaped_total,
            http_url=http_url,
            boot=boot,
            workspace_root=str(root),
        )

    bus = ctx.bus
    await bus.serve(c.ENVPOOL_CREATE, c.SandboxCreate, on_create, queue=c.ENVPOOL_QUEUE)
    handlers = {
        "exec": on_exec,
        "tools": on_tools,
        "fork": on_fork,
        "snapshot": on_snapshot,
        "renew": on_renew,
        "destroy": on_destroy,
        "stats": on_stats,
        "diff": on_diff,
    }
    for op, handler in handlers.items():
        await bus.serve(c.envpool_node_subject(node_id, op), c.ENVPOOL_NODE_MESSAGES[op][0], handler)
    http_task = None
    if s.http.port >= 0:
        http_url, http_task = await serve_http(
            build_app(node_id, pool, metrics, s.http.token), s.http.host, s.http.port, s.http.token, ctx.stop
        )
    ctx.health_detail.update(node_id=node_id, backend=s.backend, cgroups=cgroups.mode, http_url=http_url)
    ctx.ready.set()
    log.info(
        "env-pool node %s serving: backend %s, cgroups %s, capacity %d, workspaces in %s%s",
        node_id,
        s.backend,
        cgroups.mode,
        s.max_sandboxes,
        root,
        f", HTTP on {http_url}" if http_url else "",
    )
    try:
        while not await wait_or_stop(ctx.stop, s.reap_interval_s):
            metrics.reaped.inc(await pool.reap())
            await pool.refill()
            ctx.health_detail.update(
                leased=len(pool.leases), idle=pool.idle, creating=pool.creating, live=len(pool.leases)
            )
    finally:
        ctx.stop.set()  # also when the loop above raised: creates are refused from here on
        if pool.creating:
            log.info("stopping: waiting for %d sandbox(es) being built", pool.creating)
        while pool.creating:  # each ends as a lease or warm sandbox, which close destroys
            await asyncio.sleep(0.05)
        await pool.close()
        await spawner.close()
        if http_task is not None:
            ctx.stop.set()
            await http_task


def main() -> None:
    service_main("env-pool", EnvPoolConfig, serve)


if __name__ == "__main__":
    main()
