"""The rollout worker's OpenAI-compatible endpoint, one key per episode.

Routes (every one needs ``Authorization: Bearer <episode key>``):
- ``GET /v1/models``: the served model;
- ``POST /v1/chat/completions``: ``messages``, ``tools``, ``tool_choice`` (``none``
  hides the tools from the prompt; any other value leaves the choice to the model),
  ``temperature``, ``top_p`` (1 only: kiln trains on the distribution it samples from),
  ``max_tokens``/``max_completion_tokens``, ``n``, ``stream``; answered by the episode
  (``kiln.rollout.episode``), tool calls in ``tool_calls``;
- ``POST /kiln/v1/exec`` and ``POST /kiln/v1/tools``: the exec bridge, a command or
  kiln tool calls in the episode's own sandbox (``kiln-exec`` is its CLI).

Invariants: a key is 32 random bytes, known only to the worker and the episode's
harness, and names exactly one episode: no call reaches another episode's tokens or
sandbox; an unknown or finished key gets 401; malformed requests get OpenAI-style errors
(``{"error": {"message", "type", "param", "code"}}``) and change nothing; the server
binds to loopback unless a token-protected wider bind is configured (``serve_http``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.rollout.episode import Choice, Episode, EpisodeError
from kiln.shared import contracts as c
from kiln.shared.bus import RemoteError
from kiln.shared.envpool_client import EnvPoolClient


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    seed: int | None = None


class ExecRequest(BaseModel):
    command: str
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class ToolsRequest(BaseModel):
    calls: list[c.ToolCall]


@dataclass
class Binding:
    episode: Episode
    sandbox: c.SandboxRef
    exec_timeout_s: float


def _error(
    status: int, message: str, code: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class Endpoint:
    def __init__(self, model_name: str, envpool: EnvPoolClient):
        self.model_name = model_name
        self.envpool = envpool
        self.bindings: dict[str, Binding] = {}
        self._http = None
        self.app = self._app()

    def http_client(self):
        """The connection pool in-process (Python) harnesses share (made on first use)."""
        if self._http is None:
            import openai

            self._http = openai.DefaultAsyncHttpxClient(timeout=None)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def register(self, episode: Episode, sandbox: c.SandboxRef, exec_timeout_s: float = 600.0) -> str:
        key = "kiln-ep-" + secrets.token_urlsafe(32)
        self.bindings[key] = Binding(episode, sandbox, exec_timeout_s)
        return key

    def unregister(self, key: str) -> None:
        self.bindings.pop(key, None)

    def _binding(self, request: Request) -> Binding | None:
        given = request.headers.get("authorization", "")
        key = given[7:] if given.startswith("Bearer ") else ""
        return self.bindings.get(key)

    def _app(self) -> FastAPI:
        app = FastAPI(title="kiln rollout endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/v1/models")
        async def models(request: Request):
            if self._binding(request) is None:
                return _error(401, "unknown or finished episode key", "invalid_api_key", "authentication_error")
            return {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "kiln"}],
            }

        @app.post("/v1/chat/completions")
        async def completions(request: Request):
            b = self._binding(request)
            if b is None:
                return _error(401, "unknown or finished episode key", "invalid_api_key", "authentication_error")
            try:
                req = ChatRequest.model_validate(await request.json())
            except ValidationError as e:
                first = e.errors()[0]
                return _error(
                    400,
                    f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                    "invalid_request",
                    param=str(first["loc"][0]),
                )
            except json.JSONDecodeError:
                return _error(400, "the body is not JSON", "invalid_json")
            if req.top_p is not None and req.top_p != 1.0:
                return _error(
                    400,
                    "top_p must be 1: kiln trains on the exact distribution it samples from",
                    "unsupported_parameter",
                    param="top_p",
                )
            tools = [] if req.tool_choice == "none" else req.tools
            try:
                call = await b.episode.complete(
                    req.messages,
                    tools,
                    n=req.n,
                    max_tokens=req.max_completion_tokens or req.max_tokens,
                    temperature=req.temperature,
                )
            except EpisodeError as e:
                return _error(e.status, str(e), e.code)
            body = self._response(call.choices, len(call.prompt_ids))
            if not req.stream:
                return body
            return StreamingResponse(self._chunks(body), media_type="text/event-stream")

        @app.post("/kiln/v1/exec")
        async def bridge_exec(request: Request):
            async def run(b: Binding, req: ExecRequest):
                r = await self.envpool.exec(b.sandbox, req.command, min(req.timeout_s, b.exec_timeout_s))
                return r.model_dump(mode="json")

            return await self._bridge(request, ExecRequest, run)

        @app.post("/kiln/v1/tools")
        async def bridge_tools(request: Request):
            async def run(b: Binding, req: ToolsRequest):
                return {"results": [r.model_dump(mode="json") for r in await self.envpool.tools(b.sandbox, req.calls)]}

            return await self._bridge(request, ToolsRequest, run)

        return app

    async def _bridge(self, request: Request, model: type[BaseModel], run) -> Any:
        """An exec-bridge call: the episode's key, a valid body, then ``run`` in its sandbox."""
        b = self._binding(request)
        if b is None:
            return _error(401, "unknown or finished episode key", "invalid_api_key", "authentication_error")
        try:
            req = model.model_validate(await request.json())
        except (ValidationError, json.JSONDecodeError) as e:
            return _error(400, f"invalid {model.__name__}: {e}", "invalid_request")
        try:
            return await run(b, req)
        except RemoteError as e:
            return _error(502, f"the sandbox could not run it: {e}", e.code, "server_error")

    def _response(self, choices: list[Choice], prompt_tokens: int) -> dict:
        out = []
        for i, ch in enumerate(choices):
            tool_calls = [
                {
                    "id": p.id,
                    "type": "function",
                    "function": {"name": p.name, "arguments": json.dumps(p.arguments, ensure_ascii=False)},
                }
                for p in ch.calls
                if not p.error
            ]
            message: dict[str, Any] = {"role": "assistant", "content": ch.prose or (None if tool_calls else "")}
            if tool_calls:
                message["tool_calls"] = tool_calls
            out.append({"index": i, "message": message, "finish_reason": ch.finish, "logprobs": None})
        generated = sum(len(ch.completion.ids) for ch in choices)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": out,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated,
            },
        }

    @staticmethod
    async def _chunks(body: dict):
        """The whole answer as OpenAI stream chunks (role, content, tool calls, finish)."""
        base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

        def chunk(index: int, delta: dict, finish: str | None = None) -> str:
            return (
                "data: "
                + json.dumps({**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]})
                + "\n\n"
            )

        for ch in body["choices"]:
            i, msg = ch["index"], ch["message"]
            yield chunk(i, {"role": "assistant", "content": ""})
            if msg.get("content"):
                yield chunk(i, {"content": msg["content"]})
            for k, tc in enumerate(msg.get("tool_calls", [])):
                yield chunk(
                    i,
                    {
                        "tool_calls": [
                            {
                                "index": k,
                                "id": tc["id"],
                                "type": "function",
                                "function": {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]},
                            }
                        ]
                    },
                )
            yield chunk(i, {}, ch["finish_reason"])
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"
