"""The OpenAI-compatible HTTP endpoint of a rollout worker (Starlette on uvicorn).

    POST /v1/chat/completions   Authorization: Bearer <episode key>
        -> the key's AgentSession.chat -> chat.completion (or, stream=true, SSE chunks)
    GET  /v1/models, /v1/models/{id}

It runs in the rollout worker's event loop, next to the engine's: a call is a `generate` on
this worker's engine like any other sequence. Every episode has its own key
(`SessionRegistry.open`); an unknown key, or one whose episode ended, gets 401. Bodies over
`max_request_bytes` are refused (400) before they are parsed, whatever Content-Length says.
Errors are OpenAI's JSON (`{"error": {...}}`), with its status codes, so the `openai`
client raises its usual exceptions; an unexpected failure is a 500, which the client
retries (the retry runs anew: a failed call is not remembered).

The server binds `host:port` (port 0: a free one) with no limit on concurrent connections
of its own; a request never waits for another except in the engine. Not here: token
accounting (session.py), the agents (runner.py).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from areal.workers.rollout.agent.protocol import (
    ApiError,
    bad_request,
    chunks,
    completion,
    error_body,
    model_entry,
    models_list,
    parse_request,
)
from areal.workers.rollout.agent.session import AgentSession

log = logging.getLogger(__name__)

KEY_PREFIX = "areal-"
FINISHED_KEYS_KEPT = 1 << 16
"""Keys of ended episodes remembered to say so in their 401 (older ones read as unknown)."""


class SessionRegistry:
    """The open sessions by API key."""

    def __init__(self) -> None:
        self._open: dict[str, AgentSession] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()

    def open(self, session: AgentSession) -> str:
        key = f"{KEY_PREFIX}{secrets.token_urlsafe(24)}"
        self._open[key] = session
        return key

    def close(self, key: str) -> None:
        if self._open.pop(key, None) is not None:
            self._finished[key] = None
            while len(self._finished) > FINISHED_KEYS_KEPT:
                self._finished.popitem(last=False)

    def __len__(self) -> int:
        return len(self._open)

    def session(self, request: Request) -> AgentSession:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401,
                "You didn't provide an API key: give the episode's key as "
                "'Authorization: Bearer <key>' (the client the agent is "
                "called with has it).",
                code="invalid_api_key",
            )
        key = key.strip()
        session = self._open.get(key)
        if session is not None:
            return session
        if key in self._finished:
            raise ApiError(
                401,
                "The episode of this API key has ended; its key serves no more calls.",
                code="invalid_api_key",
            )
        raise ApiError(
            401,
            "Incorrect API key provided: it belongs to no episode of this endpoint.",
            code="invalid_api_key",
        )


class Endpoint:
    """The HTTP app over a `SessionRegistry` (see the module doc)."""

    def __init__(
        self,
        registry: SessionRegistry,
        *,
        model_name: str,
        max_request_bytes: int,
        max_request_tokens: int,
    ) -> None:
        self.registry = registry
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.max_request_tokens = max_request_tokens
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            ],
            exception_handlers={
                ApiError: _api_error,
                HTTPException: _http_error,
                Exception: _unexpected,
            },
        )

    async def chat(self, request: Request) -> Response:
        arrived = time.monotonic()
        session = self.registry.session(request)
        body = await self._body(request)
        try:
            data = json.loads(body)
        except ValueError as err:
            raise bad_request(f"the request body is not valid JSON: {err}") from None
        chat = parse_request(data, max_request_tokens=self.max_request_tokens)
        retry = _retry_count(request) > 0
        result = await session.chat(
            chat, body_digest=hashlib.sha256(body).digest(), retry=retry, arrived=arrived
        )
        if not chat.stream:
            return JSONResponse(completion(result))
        events = [f"data: {json.dumps(c)}\n\n" for c in chunks(result, chat.include_usage)]
        return StreamingResponse(
            _stream(events + ["data: [DONE]\n\n"]), media_type="text/event-stream"
        )

    async def _body(self, request: Request) -> bytes:
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_large = bad_request(
            f"the request body is larger than {limit} bytes (agent.max_request_bytes)",
            None,
            "request_too_large",
        )
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large
                parts.append(part)
        except ClientDisconnect:
            raise bad_request("the client disconnected before sending the whole body") from None
        return b"".join(parts)

    async def models(self, request: Request) -> Response:
        self.registry.session(request)
        return JSONResponse(models_list(self.model_name))

    async def model(self, request: Request) -> Response:
        self.registry.session(request)
        name = request.path_params["model"]
        if name != self.model_name:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this endpoint serves '{self.model_name}'.",
                code="model_not_found",
            )
        return JSONResponse(model_entry(self.model_name))


def _retry_count(request: Request) -> int:
    value = request.headers.get("x-stainless-retry-count", "0")
    return int(value) if value.isdigit() else 0


async def _stream(events: list[str]) -> AsyncIterator[str]:
    for event in events:
        yield event


async def _api_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, ApiError)
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, HTTPException)
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        error_body(f"{request.method} {request.url.path}: {err.detail}", kind),
        status_code=err.status_code,
    )


async def _unexpected(request: Request, err: Exception) -> Response:
    log.exception("the agent endpoint failed on %s %s", request.method, request.url.path)
    return JSONResponse(
        error_body(f"the endpoint failed: {type(err).__name__}: {err}", "server_error"),
        status_code=500,
    )


class EndpointServer:
    """`Endpoint` served by uvicorn in this event loop, on a socket bound at construction."""

    def __init__(self, endpoint: Endpoint, host: str, port: int) -> None:
        self.socket = socket.create_server((host, port), backlog=4096)
        # Accepted connections inherit it (Linux). Without it, a response's headers and body
        # (two writes) meet Nagle's algorithm and the client's delayed ACK: ~40 ms a call.
        # asyncio sets it itself only on sockets created with proto=IPPROTO_TCP.
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(
            endpoint.app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=60,
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        """Listening when it returns. uvicorn's `serve()` in its three steps: the start is
        awaited instead of polled, and serve()'s SIGINT/SIGTERM handlers stay out of the
        worker, which owns its signals."""
        server, config = self._server, self._server.config
        if not config.loaded:
            config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self.socket])
        self._task = asyncio.create_task(server.main_loop(), name="agent-endpoint")
        log.info("agent endpoint serving at %s", self.base_url)

    async def close(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            await self._server.shutdown(sockets=[self.socket])
        self.socket.close()
