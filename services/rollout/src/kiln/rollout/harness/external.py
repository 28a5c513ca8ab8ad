"""An external harness (``rollout.harness``) as one harness of the sample lifecycle
(``ExternalHarness``, a ``lifecycle.Harness`` beside kiln's own loop): the lifecycle
leases its sandbox, sets its budget, takes its diff and assembles its ``Trajectory``.

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
killed (its whole process group) and ends as ``timeout``; either way the lifecycle
destroys its sandbox at once and the reason and the tail of its output are recorded; by default
(``on_failure = "zero"``) such a sample scores 0, so a policy cannot escape its failure
by crashing its harness. Its budget is the lifecycle's, the same as kiln's own loop's,
context length included: a call past ``max_total_tokens`` ends with ``length``, one whose
prompt alone fills it is refused (``context_length_exceeded``).
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

from kiln.rollout.config import HarnessSettings, RolloutSettings
from kiln.rollout.engine import InferenceEngine
from kiln.rollout.harness.server import Endpoint
from kiln.rollout.lifecycle import EpisodeSpec, Played, SampleContext, SampleLifecycle
from kiln.shared import contracts as c
from kiln.shared.envpool_client import EnvPoolClient

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


class ExternalHarness:
    """The configured external harness (``rollout.harness``) as a ``lifecycle.Harness``:
    it plays through the worker's endpoint under a key of the sample's own, and never
    suspends (an aborted generation waits inside its call)."""

    suspends = False

    def __init__(self, settings: HarnessSettings, endpoint: Endpoint, base_url: str):
        self.h, self.endpoint, self.base_url = settings, endpoint, base_url

    async def play(self, sample: SampleContext) -> Played:
        h, endpoint, base_url, task = self.h, self.endpoint, self.base_url, sample.spec.task
        sandbox = await sample.sandbox()  # the harness may use it at once
        key = endpoint.register(sample.episode, sandbox, sample.settings.tool_timeout_s)
        outcome, log = "harness_done", ""
        timeout_s = max(sample.spec.request.deadline - time.time(), 0.0) + h.grace_s
        try:
            if h.kind == "python":
                import openai

                # One connection pool for every episode of the worker (a client of its own costs ~30 ms to make).
                client = openai.AsyncOpenAI(
                    base_url=f"{base_url}/v1", api_key=key, max_retries=0, http_client=endpoint.http_client()
                )
                try:
                    await asyncio.wait_for(
                        load_entry(h.entry)(task, client, SandboxHandle(sample.envpool, sandbox)), timeout_s
                    )
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
        ep = sample.episode
        sample.messages, sample.turns = ep.transcript(), len(ep.calls)
        if outcome == "harness_done":
            return Played(outcome, log=log)
        # A failed harness scores 0 (``on_failure = "zero"``) or is left out (``mask``); its sandbox goes either way.
        masked = outcome in c.HARNESS_FAILURES and h.on_failure == "mask"
        return Played(outcome, scored=False, infra_error=f"{outcome}: {log[-300:]}" if masked else None, log=log)


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
    """One sample played by the configured external harness, through the lifecycle (tests and benchmarks)."""
    harness = ExternalHarness(settings.harness, endpoint, base_url)
    out = await SampleLifecycle(spec, harness, engine, tokenizer, envpool, settings, wait_resume=wait_resume).run()
    assert isinstance(out, c.Trajectory), "an external harness never suspends"
    return out
