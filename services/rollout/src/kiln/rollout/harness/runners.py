"""Running one episode with an external harness (``rollout.harness``).

``python``: ``async def run(task, client, sandbox)`` loaded from ``entry``
(``package.module:function``): ``client`` is an ``openai.AsyncOpenAI`` bound to this
episode's key, ``sandbox`` runs commands and kiln tools in the episode's sandbox.
``command``: ``entry`` run by bash, in any language, with ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` (the episode's key), ``KILN_EXEC_URL`` (the exec bridge: ``kiln-exec``
reads it), ``KILN_TASK_ID``, ``KILN_PROBLEM_STATEMENT`` and ``KILN_WORKDIR`` (the worker's
own working folder, where ``kiln run`` started) set; its working folder is a scratch
folder of its own, never the sandbox's files.

Invariants: the episode's key is revoked when the harness returns, fails or runs out of
time (a straggling call gets 401); a harness that raises or exits non-zero ends as
``harness_error``, one that outlives the episode's deadline (plus ``grace_s``) is
killed (its whole process group) and ends as ``timeout``; either way its sandbox is
destroyed at once and the reason and the tail of its output are recorded; by default
(``on_failure = "zero"``) such a sample scores 0, so a policy cannot escape its failure
by crashing its harness.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kiln.rollout.agent import EpisodeSpec
from kiln.rollout.config import HarnessSettings, RolloutSettings
from kiln.rollout.engine import InferenceEngine
from kiln.rollout.episode import Budget, Episode
from kiln.rollout.harness.server import Endpoint
from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient
from kiln.shared.toolformats import tool_format

LOG_TAIL = 4000
PASS_ENV = {
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "TMPDIR",
    "UV_CACHE_DIR",
    "XDG_CACHE_HOME",
}
PASS_ENV_PREFIXES = ("PIP_", "UV_")
"""The worker's environment a command harness sees: how to reach package indexes (a
harness may install itself on first use), nothing else (no service credentials)."""


@dataclass
class SandboxHandle:
    """The episode's sandbox, for a Python harness."""

    envpool: EnvPoolClient
    ref: c.SandboxRef

    async def exec(self, command: str, timeout_s: float = 60.0) -> c.ExecResult:
        return await self.envpool.exec(self.ref, command, timeout_s)

    async def tools(self, calls: list[c.ToolCall]) -> list[c.ToolResult]:
        return await self.envpool.tools(self.ref, calls)


def load_entry(entry: str) -> Callable[..., Awaitable[Any]]:
    module, sep, attr = entry.partition(":")
    if not sep:
        raise ValueError(f"harness entry {entry!r} is not 'package.module:function'")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise ValueError(f"harness entry {entry!r} is not callable")
    return fn


class HarnessFailed(Exception):
    def __init__(self, outcome: str, log: str):
        super().__init__(outcome)
        self.outcome, self.log = outcome, log


async def _run_command(h: HarnessSettings, env: dict[str, str], timeout_s: float) -> str:
    with tempfile.TemporaryDirectory(prefix="kiln-harness-") as cwd:
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            h.entry,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        out = bytearray()

        async def read() -> None:
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(65536):
                out.extend(chunk)
                del out[: max(0, len(out) - 4 * LOG_TAIL)]

        reader = asyncio.ensure_future(read())
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
            timed_out = False
        except TimeoutError:
            timed_out = True
        finally:
            try:  # the whole group: a harness's children go with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            try:
                await asyncio.wait_for(reader, 5)
            except TimeoutError:
                reader.cancel()
    text = out.decode(errors="replace")[-LOG_TAIL:]
    if timed_out:
        raise HarnessFailed("timeout", text)
    if proc.returncode != 0:
        raise HarnessFailed("harness_error", f"exit code {proc.returncode}\n{text}")
    return text


async def run_harness_episode(
    spec: EpisodeSpec,
    engine: InferenceEngine,
    tokenizer,
    envpool: EnvPoolClient,
    settings: RolloutSettings,
    endpoint: Endpoint,
    base_url: str,
    wait_resume: Callable[[], Awaitable[None]],
) -> c.Trajectory:
    req, task, h = spec.request, spec.task, settings.harness
    traj = dict(
        run_id=req.run_id,
        trajectory_id=f"{req.group_id}-s{spec.sample_index}",
        group_id=req.group_id,
        task_id=req.task_id,
        sample_index=spec.sample_index,
        dispatch_version=req.dispatch_version,
        worker_id=spec.worker_id,
        started_at=time.time(),
    )
    ttl = max(req.deadline - time.time(), 1.0) + settings.sandbox_score_buffer_s
    try:
        sandbox = await envpool.create(task.id, run_id=req.run_id, ttl_s=ttl)
    except RemoteError as e:
        return c.Trajectory(
            **traj,
            status=c.TrajectoryStatus.INFRA_ERROR,
            infra_error=f"sandbox create failed: {e}",
            infra_code=e.code,
            token_ids=[],
            logprobs=[],
            token_versions=[],
            loss_mask=[],
            finish_reason="error",
        )
    budget = Budget(
        max_generated_tokens=settings.max_total_tokens,
        max_calls=settings.max_turns,
        deadline=req.deadline,
        max_tokens_per_call=settings.max_new_tokens,
    )
    episode = Episode(
        traj["trajectory_id"],
        engine,
        tokenizer,
        tool_format(h.tool_format),
        budget,
        seed=spec.seed,
        temperature=spec.temperature,
        wait_resume=wait_resume,
    )
    key = endpoint.register(episode, sandbox, settings.tool_timeout_s)
    outcome, log = "harness_done", ""
    timeout_s = max(req.deadline - time.time(), 0.0) + h.grace_s
    try:
        if h.kind == "python":
            import openai

            # One connection pool for every episode of the worker (a client of its own costs ~30 ms to make).
            client = openai.AsyncOpenAI(
                base_url=f"{base_url}/v1", api_key=key, max_retries=0, http_client=endpoint.http_client()
            )
            try:
                await asyncio.wait_for(load_entry(h.entry)(task, client, SandboxHandle(envpool, sandbox)), timeout_s)
            except TimeoutError:
                raise HarnessFailed("timeout", "") from None
            except Exception as e:  # the harness's own failure: recorded, scored
                raise HarnessFailed("harness_error", "".join(traceback.format_exception(e))[-LOG_TAIL:]) from None
        else:
            passed = {k: v for k, v in os.environ.items() if k in PASS_ENV or k.startswith(PASS_ENV_PREFIXES)}
            env = {
                **passed,
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": os.environ.get("HOME", "/tmp"),
                "LANG": "C.UTF-8",
                "OPENAI_BASE_URL": f"{base_url}/v1",
                "OPENAI_API_KEY": key,
                "KILN_EXEC_URL": f"{base_url}/kiln/v1",
                "KILN_TASK_ID": task.id,
                "KILN_PROBLEM_STATEMENT": task.problem_statement,
                "KILN_WORKDIR": os.getcwd(),
                **h.env,
            }
            log = await _run_command(h, env, timeout_s)
    except HarnessFailed as e:
        outcome, log = e.outcome, e.log
    finally:
        endpoint.unregister(key)
    episode.finish()
    final_diff = None
    if outcome == "harness_done":
        try:
            final_diff = await envpool.diff(sandbox)
        except RemoteError as e:
            outcome, log = "error", f"sandbox lost: {e}"
    if outcome != "harness_done":
        try:  # nothing is scored from it: leave no sandbox behind
            await envpool.destroy(sandbox)
        except RemoteError:
            pass  # its lease ends it
        sandbox = None
    status, infra = c.TrajectoryStatus.FINISHED, None
    if outcome == "error" or (outcome in c.HARNESS_FAILURES and h.on_failure == "mask"):
        status, infra = c.TrajectoryStatus.INFRA_ERROR, f"{outcome}: {log[-300:]}"
    s = episode.seq
    return c.Trajectory(
        **traj,
        status=status,
        infra_error=infra,
        messages=episode.transcript(),
        token_ids=s.ids,
        logprobs=s.logprobs,
        token_versions=s.versions,
        loss_mask=s.mask,
        num_turns=len(episode.calls),
        malformed_tool_calls=episode.malformed,
        finish_reason=outcome,
        sandbox=sandbox,
        final_diff=final_diff,
        segments=episode.segments,
        harness_log=log,
        finished_at=time.time(),
    )
