"""env-pool entrypoint: ``python -m kiln.envpool.main``.

Serves ``kiln.envpool.create`` in the ``envpool`` queue group (any node may create a
sandbox) and ``kiln.envpool.node.<node_id>.{exec,tools,destroy}`` for the sandboxes
this node owns (a sandbox's calls always reach its owner).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from opentelemetry.metrics import Observation

from kiln.shared import contracts as c
from kiln.shared.service import ServiceContext, service_main, wait_or_stop
from kiln.shared.tasks import load_suite

from kiln.envpool.config import EnvPoolConfig
from kiln.envpool.pool import SandboxPool
from kiln.envpool.tools import ToolExecutor

log = logging.getLogger("kiln.envpool")


async def serve(ctx: ServiceContext) -> None:
    cfg: EnvPoolConfig = ctx.config  # type: ignore[assignment]
    s = cfg.envpool
    node_id = s.node_id or ctx.instance
    if s.workspace_root:
        root = Path(s.workspace_root) / node_id
    elif cfg.run.dir:
        root = Path(cfg.run.dir) / "sandboxes" / node_id
    else:
        root = Path(tempfile.mkdtemp(prefix="kiln-sandboxes-"))
    log.warning(
        "sandbox backend 'process': commands run as this user without namespace isolation; "
        "use it for development only"
    )
    pool = SandboxPool(s, load_suite(cfg.tasks.suite), root)
    tools = ToolExecutor(max_read_bytes=s.max_read_bytes, max_timeout_s=s.max_command_timeout_s)
    meter = ctx.telemetry.meter
    created = meter.create_counter("kiln.envpool.sandboxes_created")
    tool_calls = meter.create_counter("kiln.envpool.tool_calls")
    tool_errors = meter.create_counter("kiln.envpool.tool_errors")
    meter.create_observable_gauge("kiln.envpool.sandboxes_live", callbacks=[lambda _o: [Observation(len(pool))]])

    async def on_create(req: c.SandboxCreate) -> c.SandboxCreated:
        with ctx.tracer.start_as_current_span("envpool.create", attributes={"task_id": req.task_id}):
            sb = await pool.create(req.task_id, req.run_id, req.ttl_s or s.default_ttl_s)
        created.add(1)
        return c.SandboxCreated(sandbox=c.SandboxRef(node_id=node_id, sandbox_id=sb.id), workspace=str(sb.workspace))

    async def on_exec(req: c.SandboxExec) -> c.ExecResult:
        sb = pool.get(req.sandbox_id)
        with ctx.tracer.start_as_current_span("envpool.exec", attributes={"sandbox_id": sb.id}):
            return await sb.exec(req.command, min(req.timeout_s, s.max_command_timeout_s))

    async def on_tools(req: c.SandboxTools) -> c.ToolResults:
        sb = pool.get(req.sandbox_id)
        with ctx.tracer.start_as_current_span("envpool.tools", attributes={"sandbox_id": sb.id, "calls": len(req.calls)}):
            results = await tools.run_batch(sb, req.calls)
        tool_calls.add(len(results))
        tool_errors.add(sum(1 for r in results if r.error))
        return c.ToolResults(results=results)

    async def on_destroy(req: c.SandboxDestroy) -> c.SandboxDestroyed:
        return c.SandboxDestroyed(sandbox_id=req.sandbox_id, existed=await pool.destroy(req.sandbox_id))

    bus = ctx.bus
    await bus.serve(c.ENVPOOL_CREATE, c.SandboxCreate, on_create, queue=c.ENVPOOL_QUEUE)
    await bus.serve(c.envpool_node_subject(node_id, "exec"), c.SandboxExec, on_exec)
    await bus.serve(c.envpool_node_subject(node_id, "tools"), c.SandboxTools, on_tools)
    await bus.serve(c.envpool_node_subject(node_id, "destroy"), c.SandboxDestroy, on_destroy)
    ctx.health_detail["node_id"] = node_id
    ctx.ready.set()
    log.info("env-pool node %s serving (capacity %d, workspaces in %s)", node_id, s.max_sandboxes, root)
    try:
        while not await wait_or_stop(ctx.stop, s.reap_interval_s):
            await pool.reap()
            ctx.health_detail.update(pool.stats())
    finally:
        await pool.close()


def main() -> None:
    service_main("env-pool", EnvPoolConfig, serve)


if __name__ == "__main__":
    main()
