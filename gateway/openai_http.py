"""The OpenAI-compatible HTTP front: Starlette on uvicorn, in the gateway's own event loop.

It serves GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health and
GET /ready, and sends every generation down the gRPC front's own path
(InferenceServicer.generate): the same keys, tenants, quotas, accounting, sessions and
validation. Errors have OpenAI's shape, {"error": {message, type, param, code}}, with the HTTP
status the OpenAI SDKs map to their exceptions (gateway/openai_errors.py). A streamed answer
starts once its first chunk is there, so that a refusal before it is still an HTTP status; a
client that goes away, before or during its answer, cancels its requests as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.finish_reason import FinishReason
from common.templates import ChatTemplateError
from gateway.auth import Authenticator, bearer_key
from gateway.choices import interleaved
from gateway.errors import (
    InvalidArgument,
    NotFound,
    Refused,
    ServiceError,
    refused_limit,
    shown,
    status_of,
)
from gateway.generation import Chunk
from gateway.health import GatewayHealth
from gateway.metrics import GatewayMetrics
from gateway.openai_echo import PromptEcho
from gateway.openai_errors import BodyTooLarge, error_json, error_response, internal_error_response
from gateway.openai_responses import DONE_EVENT, Choice, ResponseShape, TokenText, sse_event
from gateway.openai_schema import OpenAIRequest, chat_request, completion_request
from gateway.openai_tools import check_tool_choice, prompt_messages
from gateway.service import InferenceServicer
from gateway.validation import check_prompt_len, check_token_ids

log = logging.getLogger(__name__)
T = TypeVar("T")

API = "openai"  # the `api` label of this front's requests
# A JSON body is bigger than the gRPC message of the same request: text escaped as \uXXXX
# pairs takes up to 3 times its UTF-8 bytes.
JSON_BYTES_FACTOR = 3
MAX_PROMPTS = 64  # prompts of one /v1/completions request (a choice each)


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


@dataclass(slots=True)
class OpenAIFrontConfig:
    """What the front needs of the gateway's configuration."""

    max_body_bytes: int  # a bigger body: 413
    max_concurrent_streams: int  # requests answered at once; one more: 429


class SSEResponse(StreamingResponse):
    """A stream of server-sent events whose iterator is closed however the response ends
    (a client gone cancels it while it waits at a yield)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]):
        super().__init__(events, headers={"cache-control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.on_close()


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed its connection (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_goes(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client goes first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


Item = tuple[int, str, Chunk]  # (choice index, request id, chunk)


async def merged(
    streams: list[AsyncIterator[tuple[str, Chunk]]], n: int = 1
) -> AsyncIterator[Item]:
    """The chunks of every prompt's generation as they come, by choice index: prompt i's
    choice j (of n) is choice i * n + j, as OpenAI numbers them."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for request_id, chunk in stream:
                yield chunk.index, request_id, chunk
        return
    async for index, (request_id, chunk) in interleaved(streams):
        yield index * n + chunk.index, request_id, chunk


class GenerationFailed(ServiceError):
    """The executors could not run a prompt (FINISH_REASON_ERROR): INTERNAL, their message."""


async def failing_on_error(stream: AsyncIterator[Item]) -> AsyncIterator[Item]:
    """The chunks, up to one that ends its generation with an error: GenerationFailed."""
    async with contextlib.aclosing(stream):
        async for index, request_id, chunk in stream:
            if chunk.finish_reason == FinishReason.ERROR:
                reason = chunk.error_message or "no reason given"
                raise GenerationFailed(f"the executors could not run the request: {reason}")
            yield index, request_id, chunk


class CallCount:
    """Counts one HTTP call in the request metrics once, with the code it ended with."""

    def __init__(self, metrics: GatewayMetrics, method: str) -> None:
        self.metrics = metrics
        self.method = method
        self.counted = False

    def end(self, code: str) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.requests.labels(API, self.method, code, API).inc()

    def end_with(self, error: Exception) -> None:
        status = status_of(error)
        self.end(status[0].name if status is not None else "UNKNOWN")
        if (limit := refused_limit(error)) is not None:
            self.metrics.refused.labels(limit, API).inc()


class OpenAIFront:
    """The routes of the OpenAI-compatible HTTP front."""

    def __init__(
        self,
        config: OpenAIFrontConfig,
        servicer: InferenceServicer,
        authenticator: Authenticator,
        health: GatewayHealth,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.servicer = servicer
        self.authenticator = authenticator
        self.health = health
        self.metrics = metrics
        self.model_text = servicer.model_text
        self.token_text = TokenText(servicer.model_text.tokenizer)
        self.open_streams = 0

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.live, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})

    async def _http_error(self, request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(
            error_json(message, "invalid_request_error", None, "unknown_route"),
            status_code=error.status_code,
        )

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(self, request: Request) -> Response:
        if self.health.conditions.serving:
            return JSONResponse({"status": "ready"})
        reason = self.health.conditions.reason
        return JSONResponse(
            error_json(f"not ready: {reason}", "service_unavailable", None, "not_ready"),
            status_code=503,
        )

    async def _tenant(self, request: Request) -> str:
        """Raises: Unauthenticated as the gRPC front does."""
        if self.authenticator.mode == "off":
            return await self.authenticator.key_tenant("")
        return await self.authenticator.key_tenant(bearer_key(request.headers.get("authorization")))

    async def models(self, request: Request) -> Response:
        count = CallCount(self.metrics, "models")
        try:
            await self._tenant(request)
        except (ServiceError, redis.RedisError) as error:
            count.end_with(error)
            return error_response(error)
        count.end("OK")
        model = {
            "id": self.model_text.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "kvgate",
            "max_model_len": self.model_text.limits.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def _body(self, request: Request) -> dict:
        """The JSON body. Raises: BodyTooLarge, InvalidArgument (not JSON, not an object)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body: {declared} bytes, over the limit of {limit}")
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise BodyTooLarge(f"request body: over the limit of {limit} bytes")
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError,
            # an integer over Python's digit limit, nesting deeper than the recursion limit
            raise InvalidArgument("body", f"not JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise InvalidArgument("body", "must be a JSON object")
        return parsed

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat.completions", chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions", completion_request)

    async def _serve(
        self, request: Request, method: str, read: Callable[[dict], OpenAIRequest]
    ) -> Response:
        count = CallCount(self.metrics, method)
        request_id = uuid.uuid4().hex
        openai = None
        try:
            tenant = await self._tenant(request)
            openai = read(await self._body(request))
            if openai.model != self.model_text.model_id:
                raise NotFound(
                    f"model: {openai.model!r} is not served here; "
                    f"this gateway serves {self.model_text.model_id!r}"
                )
            chat = method == "chat.completions"
            if chat:
                template = self.model_text.chat_template
                check_tool_choice(openai.tool_plan, template.writes_hermes_calls)
            return await self._answer(request, tenant, openai, chat, count, request_id)
        except ClientGone:
            count.end("CANCELLED")
            return Response(status_code=499)
        except (ServiceError, redis.RedisError) as error:
            count.end_with(error)
            return error_response(error, openai)
        except Exception:  # a bug: the client still gets OpenAI's shape, the log the trace
            log.exception("%s request %s failed", method, request_id)
            count.end("INTERNAL")
            return internal_error_response(request_id)

    def _generations(
        self, tenant: str, openai: OpenAIRequest, chat: bool, request_id: str, echo: PromptEcho
    ):
        """The generation stream of each prompt (one for chat); `echo` learns each prompt."""
        if chat:
            prompts = [lambda: self._chat_prompt(openai)]
        else:
            if len(openai.prompts) > MAX_PROMPTS:
                raise InvalidArgument("prompt", f"at most {MAX_PROMPTS} prompts per request")
            if len(openai.prompts) > 1 and openai.session_id:
                raise InvalidArgument("session_id", "takes one prompt, not a list")
            prompts = [
                lambda p=p, i=i: self._prompt(p, i, echo) for i, p in enumerate(openai.prompts)
            ]
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        return [
            self.servicer.generate(
                tenant, prompt, openai.params, openai.priority, openai.session_id, rid, API
            )
            for prompt, rid in zip(prompts, ids, strict=True)
        ]

    async def _chat_prompt(self, openai: OpenAIRequest) -> list[int]:
        renders_tools = self.model_text.chat_template.renders_tools
        messages, tools = prompt_messages(openai.tool_plan, openai.messages, renders_tools)
        try:
            token_ids = await self.servicer.text.encode_chat("messages", messages, tools)
        except ChatTemplateError as error:
            raise InvalidArgument("messages", str(error)) from error
        check_prompt_len("messages", len(token_ids), self.model_text.limits.max_model_len)
        return token_ids

    async def _prompt(self, prompt: str | list[int], index: int, echo: PromptEcho) -> list[int]:
        limits = self.model_text.limits
        field_name = "prompt" if index == 0 else f"prompt[{index}]"
        if isinstance(prompt, str):
            token_ids = await self.servicer.text.encode(field_name, prompt)
        else:
            token_ids = prompt
            check_token_ids(field_name, token_ids, limits.vocab_size)
        check_prompt_len(field_name, len(token_ids), limits.max_model_len)
        if echo.echo:
            text = prompt if isinstance(prompt, str) else self._decode(prompt)
            echo.record(index, text, token_ids)
        return token_ids

    def _decode(self, token_ids: list[int]) -> str:
        return self.model_text.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _open(self, num_generations: int) -> None:
        """Counts a call's generations in open_streams. Raises: Refused over the limit."""
        limit = self.config.max_concurrent_streams
        if self.open_streams + num_generations > limit:
            raise Refused(
                "max_concurrent_streams",
                f"the gateway has {self.open_streams} generations open and this request "
                f"starts {num_generations}; its limit is {limit} (--max-concurrent-streams); "
                "try again later or another gateway",
            )
        self.open_streams += num_generations

    async def _answer(
        self,
        request: Request,
        tenant: str,
        openai: OpenAIRequest,
        chat: bool,
        count: CallCount,
        request_id: str,
    ) -> Response:
        if openai.user:
            log.info("request %s for end user %s", request_id, shown(openai.user))
        shape = ResponseShape(
            chat,
            openai.model,
            request_id,
            openai.logprobs,
            self.token_text,
            openai.tool_plan,
            prompt_logprobs=openai.prompt_logprobs,
        )
        echo = PromptEcho(openai.echo, openai.echo_only, openai.params.n)
        generations = self._generations(tenant, openai, chat, request_id, echo)
        self._open(len(generations) * openai.params.n)
        stream = echoed(failing_on_error(merged(generations, openai.params.n)), echo)
        active = self.metrics.active_streams.labels(count.method, API)
        active.inc()

        async def close() -> None:
            count.end("CANCELLED")  # unless it ended otherwise before
            self.open_streams -= len(generations) * openai.params.n
            active.dec()
            await stream.aclose()

        streaming = False
        try:
            if not openai.stream:
                choices = await unless_client_goes(request, _whole(stream, openai))
                count.end("OK")
                return JSONResponse(shape.whole(choices))
            first = await unless_client_goes(request, anext(stream))
            streaming = True
            return SSEResponse(self._events(stream, first, shape, openai, count), close)
        finally:
            if not streaming:
                await close()

    async def _events(
        self,
        stream: AsyncIterator[Item],
        first: Item,
        shape: ResponseShape,
        openai: OpenAIRequest,
        count: CallCount,
    ) -> AsyncIterator[bytes]:
        """The stream's events: role, chunks, usage (include_usage), [DONE]; an error after
        the first chunk is an `error` event (the SDKs raise it) and ends the stream."""
        usages = {}
        try:
            for event in shape.first_chunks(openai.num_choices):
                yield sse_event(event)
            item = first
            while item is not None:
                index, _, chunk = item
                if chunk.usage is not None:
                    usages[index] = chunk.usage
                yield sse_event(shape.chunk(index, chunk))
                item = await anext(stream, None)
            if openai.include_usage:
                yield sse_event(shape.usage_chunk(list(usages.values())))
            yield DONE_EVENT
            count.end("OK")
        except (ServiceError, redis.RedisError) as error:
            count.end_with(error)
            yield sse_event(json.loads(error_response(error, openai).body))
        except Exception:  # a bug: as in _serve
            log.exception("request %s failed mid-stream", shape.request_id)
            count.end("INTERNAL")
            yield sse_event(json.loads(internal_error_response(shape.request_id).body))


async def echoed(stream: AsyncIterator[Item], echo: PromptEcho) -> AsyncIterator[Item]:
    """The chunks as `echo` rewrites them (unchanged without echo)."""
    async with contextlib.aclosing(stream):
        async for index, request_id, chunk in stream:
            yield index, request_id, echo.rewrite(index, chunk)


async def _whole(stream: AsyncIterator[Item], openai: OpenAIRequest) -> list[Choice]:
    choices = [Choice(i) for i in range(openai.num_choices)]
    async for index, _, chunk in stream:
        _add(choices[index], chunk)
    return choices


def _add(choice: Choice, chunk: Chunk) -> None:
    choice.text.append(chunk.text)
    choice.logprobs.extend(chunk.logprobs)
    if chunk.prompt_logprobs is not None:
        choice.prompt_logprobs = chunk.prompt_logprobs
    if chunk.finish_reason is not None:
        choice.finish_reason = chunk.finish_reason
        choice.usage = chunk.usage
