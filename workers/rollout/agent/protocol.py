"""OpenAI's chat-completions wire format: requests in, completions, chunks and errors out.

`parse_request` validates a request body (pydantic) and refuses, with OpenAI-style 400
errors naming the parameter, what the endpoint cannot honour rather than silently ignoring
it: n != 1, top_logprobs > 0, non-zero frequency/presence penalties, a logit bias, a
response_format other than text, more than 4 stop sequences, a tool_choice naming a tool
that is not offered. Fields OpenAI defines that do not change sampling (user, metadata,
store, parallel_tool_calls, service_tier, ...) are accepted and ignored; `seed` is accepted,
and not honoured (a call interrupted by new weights is continued under them, so no seed
could replay it).

`completion`, `chunks` and `error_body` build the response objects as OpenAI's schema has
them (the `openai` client parses them in the tests). Nothing here does I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ChatRequest(BaseModel):
    """The fields of POST /v1/chat/completions the endpoint reads (others are ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(None, ge=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (the current name) or max_tokens (the older one)."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


def parse_request(data: Any, *, max_request_tokens: int) -> ChatRequest:
    """The validated request, or ApiError(400) naming the parameter."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = ChatRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(
            f"invalid value for {param}: {first['msg']}", param, "invalid_value"
        ) from None
    unsupported = [
        (
            request.n not in (None, 1),
            "n",
            "only n=1 is supported: call again for more "
            "samples (each call is one training segment)",
        ),
        (
            bool(request.top_logprobs),
            "top_logprobs",
            "top_logprobs is not supported: only the sampled tokens' log-probs are recorded",
        ),
        (
            bool(request.frequency_penalty),
            "frequency_penalty",
            "frequency_penalty is not supported: it would change the distribution sampled from",
        ),
        (
            bool(request.presence_penalty),
            "presence_penalty",
            "presence_penalty is not supported: it would change the distribution sampled from",
        ),
        (
            bool(request.logit_bias),
            "logit_bias",
            "logit_bias is not supported: it would change the distribution sampled from",
        ),
        (
            (request.response_format or {}).get("type", "text") != "text",
            "response_format",
            "response_format other than text is not supported (no constrained decoding)",
        ),
        (len(request.stop_strings) > 4, "stop", "at most 4 stop sequences"),
        (any(not s for s in request.stop_strings), "stop", "a stop sequence is empty"),
    ]
    for failed, param, message in unsupported:
        if failed:
            raise bad_request(message, param, "unsupported_parameter")
    if request.max_new_tokens is not None and request.max_new_tokens > max_request_tokens:
        param = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        raise bad_request(
            f"{param} is too large: {request.max_new_tokens}. This endpoint "
            f"supports at most {max_request_tokens} completion tokens "
            "(agent.max_request_tokens).",
            param,
            "invalid_value",
        )
    _check_tool_choice(request)
    return request


def _check_tool_choice(request: ChatRequest) -> None:
    choice = request.tool_choice
    if choice is None or choice in ("none", "auto", "required"):
        return
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    offered = [(t.get("function") or {}).get("name") for t in request.tools or []]
    if name is None or name not in offered:
        raise bad_request(
            f"tool_choice {choice!r} names no tool of the request's tools",
            "tool_choice",
            "invalid_value",
        )


# -- responses --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class CallResult:
    """A finished chat call, as the endpoint answers it."""

    completion_id: str
    model: str
    message: dict[str, Any]
    """{"role": "assistant", "content": str | None, "tool_calls"?: [...]}"""
    finish_reason: str
    """stop, length or tool_calls."""
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None
    """[{"token", "logprob", "bytes", "top_logprobs": []}] when the request asked for them."""
    created: int = field(default_factory=lambda: int(time.time()))


def completion(result: CallResult) -> dict[str, Any]:
    """The `chat.completion` object."""
    choice = {
        "index": 0,
        "message": {**result.message, "refusal": None},
        "finish_reason": result.finish_reason,
        "logprobs": None
        if result.logprobs is None
        else {"content": result.logprobs, "refusal": None},
    }
    return {
        "id": result.completion_id,
        "object": "chat.completion",
        "created": result.created,
        "model": result.model,
        "choices": [choice],
        "usage": _usage(result),
        "system_fingerprint": None,
    }


def _usage(result: CallResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def chunks(result: CallResult, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a streamed answer (the whole answer is known
    when the first is sent: a call streams once it has finished)."""
    head = {
        "id": result.completion_id,
        "object": "chat.completion.chunk",
        "created": result.created,
        "model": result.model,
        "system_fingerprint": None,
    }

    def chunk(
        delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        return {
            **head,
            "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            ],
        }

    yield chunk({"role": "assistant", "content": ""})
    content = result.message.get("content")
    if content or result.logprobs:
        yield chunk(
            {"content": content or ""},
            logprobs=None
            if result.logprobs is None
            else {"content": result.logprobs, "refusal": None},
        )
    calls = result.message.get("tool_calls") or []
    if calls:
        yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
    yield chunk({}, result.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(result)}


def models_list(model_name: str) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(model_name)]}


def model_entry(model_name: str) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "areal"}
