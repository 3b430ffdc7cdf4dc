"""One agent episode's chat calls, token for token: segments, budgets, retries.

    request (messages, tools) --> extends a segment's last call (its messages + the reply
                                  we gave)?  yes: context = that segment's tokens + the
                                  template's rendering of the new messages only
                                             no: a new segment, the whole conversation
                                  rendered as its prompt
      --> InterruptibleGenerator.generate(context) --> sampled tokens, behaviour log-probs,
          versions (a weight update interrupts and continues the call, invisibly)
      --> the reply (text, tool calls) --> the segment grows: rendered tokens (loss mask
          False, version -1) then sampled tokens (loss mask True)

A segment is one training sequence: its first prompt, then everything after it exactly as
the model saw and sampled it, so no token is ever re-tokenized from text. A call whose
messages do not extend a finished call (the agent edited or dropped history, or called
again while its previous call was running) starts a new segment. Each segment has its own
token budget, `max_new_tokens` after its first prompt (rollout.max_new_tokens), within the
engine's longest sequence; a call asks for at most what is left (a larger max_tokens is cut
to it) and a call with nothing left is refused (400 context_length_exceeded). After
`max_calls` calls every further call is refused (400). Either refusal is remembered
(`limit`): an agent that then fails ends its episode at that limit (reward 0, no answer),
not in an error.

Retries: a request carrying x-stainless-retry-count >= 1 (the openai client's retries, after
a timeout or a 5xx) whose body equals an earlier call's is answered by that call, running
or finished, and is not sampled again (`num_retries`). A call that failed is forgotten, so
its retry runs anew.

Tokenizing and rendering run on the runner's tokenizer thread (`run_in_thread`). No HTTP
here (endpoint.py), no agent (runner.py).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

from areal.messages import EpisodeEnd
from areal.tasks.chat_render import (
    ChatError,
    ChatFormat,
    Reply,
    normalize_messages,
    normalize_tools,
    same_message,
)
from areal.workers.rollout.agent.protocol import ApiError, CallResult, ChatRequest, bad_request
from areal.workers.rollout.engine import FinishReason, SamplingParams
from areal.workers.rollout.episode import EpisodeResult
from areal.workers.rollout.interruptible import GenerationResult, InterruptibleGenerator

RunInThread = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, kw_only=True)
class SessionLimits:
    max_new_tokens: int
    """A segment's token budget after its first prompt (rendered and sampled tokens)."""
    context_len: int | None
    """The engine's longest sequence (prompt + completion); None: unknown."""
    max_calls: int


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """The episode's sampling settings (its Generate's) and whether requests may set theirs."""

    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]
    request_sampling: bool = False


class Segment:
    """One training sequence of an episode (see the module doc)."""

    def __init__(self, prompt_ids: list[int], tools: list[dict[str, Any]]) -> None:
        self.index = -1
        """Position among the episode's segments, set when its first call finishes."""
        self.prompt_ids = prompt_ids
        self.tokens = EpisodeResult()
        """Everything after the prompt: token ids, log-probs, versions, loss mask."""
        self.history: list[dict[str, Any]] = []
        """The last call's messages and our reply, normalized: what a request must extend."""
        self.tools = tools
        self.stop_text: str | None = None
        """Text of the stop token the last sampled turn ended with (None: it was cut)."""
        self.busy = False
        """A call on it is running: nothing else may extend it before that call's reply."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.tokens.token_ids)


@dataclass(kw_only=True)
class _Prepared:
    segment: Segment
    fresh: bool
    rendered: list[int]
    """Tokens of the new messages (and template framing) appended before sampling."""
    stop_ids: tuple[int, ...]
    stop_strings: list[str]
    """Stop sequences longer than one token: the reply is cut after generation."""


class AgentSession:
    """The chat calls of one episode (one API key). See the module doc."""

    def __init__(
        self,
        *,
        request_id: str,
        generator: InterruptibleGenerator,
        chat: ChatFormat,
        run_in_thread: RunInThread,
        limits: SessionLimits,
        sampling: Sampling,
    ) -> None:
        self.request_id = request_id
        self.generator = generator
        self.format = chat
        self._thread = run_in_thread
        self.limits = limits
        self.sampling = sampling
        self.segments: list[Segment] = []
        self.calls: list[tuple[str, int]] = []
        """(completion id, segment index) of each finished call, in the order they finished."""
        self.limit: EpisodeEnd | None = None
        """TOKEN_LIMIT or TURN_LIMIT once a call was refused for one."""
        self.num_started = 0
        self.num_retries = 0
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        self.num_interruptions = 0
        self.queue_s = 0.0
        self.decode_s = 0.0
        self.call_s = 0.0
        """Wall seconds during which at least one call ran."""
        self._by_body: dict[bytes, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self._running = 0
        self._busy_since = 0.0
        self.closed = False

    # -- calls ------------------------------------------------------------------------------

    async def chat(
        self, request: ChatRequest, *, body_digest: bytes, retry: bool, arrived: float
    ) -> CallResult:
        """Answer one request (ApiError for what cannot be served)."""
        if self.closed:  # looked up just before its episode ended
            raise ApiError(
                401,
                "The episode of this API key has ended; its key serves no more calls.",
                code="invalid_api_key",
            )
        if retry:
            earlier = self._by_body.get(body_digest)
            if earlier is not None:
                self.num_retries += 1
                return await asyncio.shield(earlier)
        if self.num_started >= self.limits.max_calls:
            self.limit = EpisodeEnd.TURN_LIMIT
            raise bad_request(
                f"this episode has made its {self.limits.max_calls} calls "
                "(agent.max_calls); no more are served",
                None,
                "episode_call_limit",
            )
        index = self.num_started
        self.num_started += 1
        task = asyncio.ensure_future(self._call(request, arrived, index))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: self._forget_failed(body_digest, t))
        self._by_body[body_digest] = task
        return await asyncio.shield(task)

    def _forget_failed(self, body_digest: bytes, task: asyncio.Task) -> None:
        if (task.cancelled() or task.exception() is not None) and self._by_body.get(
            body_digest
        ) is task:
            del self._by_body[body_digest]

    async def _call(self, request: ChatRequest, arrived: float, index: int) -> CallResult:
        try:
            messages = normalize_messages(request.messages)
            tools = normalize_tools(request.tools)
        except ChatError as err:
            raise bad_request(str(err), err.param, "invalid_value") from None
        tools_active = bool(tools) and request.tool_choice != "none"
        held = self._extendable(messages, tools)
        if held is not None:
            held.busy = True  # before the first await: no other call may extend it now
        try:
            prep = await self._thread(
                self._prepare, held, messages, tools, tools_active, request.stop_strings
            )
            if prep.segment is not held:  # not an extension after all: a new segment
                if held is not None:
                    held.busy = False
                held = prep.segment
                held.busy = True
            return await self._sample(request, prep, messages, tools, arrived, index)
        finally:
            if held is not None:
                held.busy = False

    def _extendable(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> Segment | None:
        """The latest idle segment whose last call these messages extend."""
        for segment in reversed(self.segments):
            history = segment.history
            if segment.busy or segment.tools != tools or len(messages) < len(history):
                continue
            # `messages` may be longer: it extends `history` if they agree where both exist.
            if all(same_message(a, b) for a, b in zip(history, messages, strict=False)):
                return segment
        return None

    def _prepare(
        self,
        candidate: Segment | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        tools_active: bool,
        stop_strings: list[str],
    ) -> _Prepared:
        """(tokenizer thread) The segment this call samples on and what it appends first."""
        stop_ids = set(self.sampling.stop_token_ids)
        stop_ids.update(self.format.end_of_turn_ids(tools_active))
        longer = []
        for stop in stop_strings:
            ids = self.format.encode(stop)
            if len(ids) == 1:
                stop_ids.add(ids[0])
            else:
                longer.append(stop)
        stops = tuple(sorted(stop_ids))
        if candidate is not None:
            text = self.format.continuation(
                candidate.history, messages[len(candidate.history) :], tools, candidate.stop_text
            )
            if text is not None:
                return _Prepared(
                    segment=candidate,
                    fresh=False,
                    rendered=self.format.encode(text),
                    stop_ids=stops,
                    stop_strings=longer,
                )
        prompt = self.format.encode(self.format.render(messages, tools, add_generation_prompt=True))
        if not prompt:
            raise bad_request("the messages render to no tokens", "messages", "invalid_value")
        return _Prepared(
            segment=Segment(prompt, tools),
            fresh=True,
            rendered=[],
            stop_ids=stops,
            stop_strings=longer,
        )

    def _budget(self, prep: _Prepared, request: ChatRequest) -> int:
        segment = prep.segment
        used = len(segment.tokens.token_ids) + len(prep.rendered)
        context = segment.num_tokens + len(prep.rendered)
        left = self.limits.max_new_tokens - used
        if self.limits.context_len is not None:
            left = min(left, self.limits.context_len - context)
        if left < 1:
            self.limit = EpisodeEnd.TOKEN_LIMIT
            raise bad_request(
                f"This conversation has used its token budget: {context} tokens in the "
                f"messages of a segment allowed {self.limits.max_new_tokens} after its first "
                f"prompt (rollout.max_new_tokens) and {self.limits.context_len} in all (the "
                "engine's longest sequence). Start a shorter conversation or end the episode.",
                "messages",
                "context_length_exceeded",
            )
        asked = request.max_new_tokens
        return left if asked is None else min(asked, left)

    async def _sample(
        self,
        request: ChatRequest,
        prep: _Prepared,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        arrived: float,
        index: int,
    ) -> CallResult:
        max_new_tokens = self._budget(prep, request)
        own = self.sampling.request_sampling
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=request.temperature
            if own and request.temperature is not None
            else self.sampling.temperature,
            top_p=request.top_p if own and request.top_p is not None else self.sampling.top_p,
            stop_token_ids=prep.stop_ids,
        )
        segment = prep.segment
        context = segment.prompt_ids + segment.tokens.token_ids + prep.rendered
        self._enter()
        submitted = time.monotonic()
        try:
            result = await self.generator.generate(f"{self.request_id}/c{index}", context, params)
        finally:
            self._exit()
        decoded = time.monotonic()
        self.queue_s += submitted - arrived + result.wait_s
        self.decode_s += decoded - submitted - result.wait_s
        self.num_interruptions += result.num_interruptions
        tokens, reply, finish, stop_text, logprobs = await self._thread(
            self._reply, result, prep, tools, request.tool_choice, bool(request.logprobs)
        )
        # Commit: no await from here on, so a cancelled call leaves its segment unchanged.
        if prep.fresh:
            segment.index = len(self.segments)
            self.segments.append(segment)
        else:
            segment.tokens.append(prep.rendered, None, None)
        n = len(tokens)
        segment.tokens.append(tokens, result.logprobs[:n], result.versions[:n])
        segment.history = messages + normalize_messages([reply.message()])
        segment.stop_text = stop_text
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        self.calls.append((completion_id, segment.index))
        self.num_tool_calls += len(reply.tool_calls)
        self.num_tool_errors += reply.num_tool_errors
        return CallResult(
            completion_id=completion_id,
            model=request.model,
            message=reply.message(),
            finish_reason=finish,
            prompt_tokens=len(context),
            completion_tokens=n,
            logprobs=logprobs,
        )

    def _reply(
        self,
        result: GenerationResult,
        prep: _Prepared,
        tools: list[dict[str, Any]],
        tool_choice: Any,
        want_logprobs: bool,
    ) -> tuple[list[int], Reply, str, str | None, list[dict[str, Any]] | None]:
        """(tokenizer thread) Tokens kept, the reply, its finish reason, the stop token's
        text, the log-prob entries."""
        decode = self.format.tokenizer.decode
        tokens = list(result.token_ids)
        text = decode(tokens, skip_special_tokens=True)
        cut = _first_stop(text, prep.stop_strings)
        stop_text = None
        if cut is not None:  # a multi-token stop sequence: keep the tokens up to its end
            tokens = tokens[: _tokens_to(tokens, prep.stop_strings, decode)]
            text = text[:cut]
        elif result.finish_reason is FinishReason.STOP and tokens and tokens[-1] in prep.stop_ids:
            stop_text = decode(tokens[-1:])
        reply = self.format.parse(text, stop_text, tools, tool_choice)
        finish = (
            "tool_calls"
            if reply.tool_calls
            else (
                "length" if result.finish_reason is FinishReason.LENGTH and cut is None else "stop"
            )
        )
        logprobs = None
        if want_logprobs:
            logprobs = []
            for token, logprob in zip(tokens, result.logprobs, strict=False):
                piece = decode([token])
                logprobs.append(
                    {
                        "token": piece,
                        "logprob": float(logprob),
                        "bytes": list(piece.encode()),
                        "top_logprobs": [],
                    }
                )
        return tokens, reply, finish, stop_text, logprobs

    def _enter(self) -> None:
        if self._running == 0:
            self._busy_since = time.monotonic()
        self._running += 1

    def _exit(self) -> None:
        self._running -= 1
        if self._running == 0:
            self.call_s += time.monotonic() - self._busy_since

    # -- end --------------------------------------------------------------------------------

    async def close(self) -> None:
        """The episode is over: calls still running are cancelled and recorded nowhere."""
        self.closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _tokens_to(tokens: list[int], stops: list[str], decode: Callable[..., str]) -> int:
    """The fewest leading tokens whose text holds a stop sequence (binary search: holding
    one only grows with more tokens)."""
    low, high = 1, len(tokens)
    while low < high:
        mid = (low + high) // 2
        if _first_stop(decode(tokens[:mid], skip_special_tokens=True), stops) is None:
            low = mid + 1
        else:
            high = mid
    return low
