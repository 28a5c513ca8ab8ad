"""rollout entrypoint: ``python -m kiln.rollout.main``.

Watches ``kiln.weights.published.<run_id>`` (starting from the latest version) and
pulls ``RolloutRequest``s from the shared ``rollout-resume`` (suspended groups, first)
and ``rollout-workers`` consumers, so any number of replicas share the work; watches
``kiln.rollout.control`` for APRIL aborts.
"""

from __future__ import annotations

import logging

from kiln.rollout.config import RolloutConfig
from kiln.rollout.engine import InferenceEngine, TorchEngine
from kiln.rollout.evaluator import EvalWorker
from kiln.rollout.worker import RolloutWorker
from kiln.shared import contracts as c
from kiln.shared.service import ServiceContext, service_main
from kiln.shared.tasks import load_suite

log = logging.getLogger("kiln.rollout")


async def serve(ctx: ServiceContext) -> None:
    cfg: RolloutConfig = ctx.config  # type: ignore[assignment]
    if not cfg.run.id:
        raise ValueError("run.id is empty: rollout serves one run (set KILN_RUN__ID or start with `kiln run`)")
    check_broadcast(cfg)
    engine = make_engine(cfg, ctx.instance)
    if cfg.rollout.role == "eval":
        evaluator = EvalWorker(ctx, engine, load_suite(cfg.tasks.suite))
        ctx.health_detail.update(engine=cfg.rollout.engine, role="eval")
        try:
            await ctx.bus.consume(
                c.EVAL_WORKERS,
                c.EvalRequest,
                evaluator.on_eval,
                stop=ctx.stop,
                concurrency=cfg.rollout.concurrent_groups,
                ready=ctx.ready,
            )
        finally:
            await engine.close()
        return
    worker = RolloutWorker(ctx, engine, load_suite(cfg.tasks.suite))
    ctx.health_detail["engine"] = cfg.rollout.engine
    try:
        if cfg.rollout.harness.kind != "builtin":
            await worker.serve_endpoint()
        await ctx.bus.watch(c.ROLLOUT_CONTROL, c.RolloutControl, worker.on_control, deliver="new")
        await ctx.bus.watch(c.weights_published_subject(cfg.run.id), c.WeightsPublished, worker.on_weights)
        await worker.feed.start(ctx.stop)
        await ctx.bus.consume(
            c.ROLLOUT_WORKERS,
            c.RolloutRequest,
            worker.on_request,
            stop=ctx.stop,
            concurrency=cfg.rollout.concurrent_groups,
            ready=ctx.ready,
            before=(c.ROLLOUT_RESUMERS,),
            hold_back=worker.holding_back,
        )
    finally:
        if worker.endpoint is not None:
            await worker.endpoint.close()
        await engine.close()


def check_broadcast(cfg: RolloutConfig) -> None:
    """The broadcast transports each feed one kind of engine: torch.distributed tensors the
    in-process ``torch`` engine, vLLM's weight transfer a ``vllm`` engine."""
    cfg.weights.transport.check_engine(cfg.rollout.engine)


def make_engine(cfg: RolloutConfig, instance: str) -> InferenceEngine:
    r = cfg.rollout
    if r.engine == "vllm":
        from kiln.rollout.vllm_engine import VllmEngine

        return VllmEngine(r.vllm, instance, transfer=cfg.weights.transport.kind == "vllm-nccl")
    if r.engine == "sim":
        from kiln.rollout.sim import SimEngine

        log.warning("engine = sim: tokens are random and logprobs made up (benchmarks and tests only)")
        return SimEngine(r.sim)
    if r.engine == "scripted":
        from kiln.rollout.scripted import ScriptedEngine

        log.warning("engine = scripted: every episode replays [rollout.scripted] (tests only)")
        return ScriptedEngine(r.scripted)
    return TorchEngine(r.torch_threads)


def main() -> None:
    service_main("rollout", RolloutConfig, serve)


if __name__ == "__main__":
    main()
