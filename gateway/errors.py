"""Errors the gateway answers with, and the one interceptor that maps them to status codes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import redis
from grpc import aio

from common.redis_conn import ConnectionBudgetExhausted, is_outage

log = logging.getLogger(__name__)

# Longer status messages are cut: gRPC sends the message percent-encoded in a trailer, and a
# client drops the whole reply (RESOURCE_EXHAUSTED) once its metadata passes 8 KiB.
MAX_DETAILS_CHARS = 512
SHOWN_VALUE_CHARS = 64


def shown(value: str) -> str:
    """`repr(value)` for an error message, cut to its first SHOWN_VALUE_CHARS characters
    with the whole length noted when longer."""
    if len(value) <= SHOWN_VALUE_CHARS:
        return repr(value)
    return f"{value[:SHOWN_VALUE_CHARS]!r}... ({len(value)} characters)"


class ServiceError(Exception):
    """An error with the gRPC status code the client gets."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    """A request field is wrong; the message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Refused(ResourceExhausted):
    """A call refused at one of the gateway's limits (counted by the limit's flag name)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit  # the flag, without its dashes: max_queue_len, ...


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ServiceError):
    """A concurrent change won; the client may retry."""

    code = grpc.StatusCode.ABORTED


def refused_limit(error: Exception) -> str | None:
    """The limit a refusal was at (Refused.limit, or redis_max_connections), else None."""
    if isinstance(error, Refused):
        return error.limit
    if isinstance(error, ConnectionBudgetExhausted):
        return "redis_max_connections"
    return None


def status_of(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status for an error the interceptor maps, or None to let it through.

    Redis errors: the gateway's connection budget spent is RESOURCE_EXHAUSTED; Redis down or
    failing over (any outage reply: READONLY, LOADING, BUSY, ...) is UNAVAILABLE; any other
    error reply is INTERNAL. None of them is left to become UNKNOWN.
    """
    if isinstance(error, ServiceError):
        return error.code, _cut(str(error))
    if isinstance(error, ConnectionBudgetExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, _cut(str(error))
    if isinstance(error, redis.RedisError):
        if is_outage(error):
            return grpc.StatusCode.UNAVAILABLE, _cut(f"redis unavailable: {error}")
        return grpc.StatusCode.INTERNAL, _cut(f"redis error: {error}")
    return None


def _cut(details: str) -> str:
    if len(details) <= MAX_DETAILS_CHARS:
        return details
    return f"{details[: MAX_DETAILS_CHARS - 32]}... ({len(details)} characters)"


# Called with the limit's name each time a call is refused at one.
OnRefused = Callable[[str], None]


async def _abort_with(
    context: aio.ServicerContext, error: Exception, on_refused: OnRefused
) -> None:
    status = status_of(error)
    if status is None:
        raise error
    limit = refused_limit(error)
    if limit is not None:
        on_refused(limit)
    log.debug("%s: %s", status[0].name, status[1])
    await context.abort(status[0], status[1])


def _wrap_unary(
    behavior: Callable[..., Awaitable[Any]], on_refused: OnRefused
) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
        try:
            return await behavior(request_or_iterator, context)
        except (ServiceError, redis.RedisError) as error:
            await _abort_with(context, error, on_refused)

    return wrapper


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], on_refused: OnRefused
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request_or_iterator, context):
                yield response
        except (ServiceError, redis.RedisError) as error:
            await _abort_with(context, error, on_refused)

    return wrapper


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def wrap_handler(
    handler: grpc.RpcMethodHandler | None, wrap_unary: Wrap | None, wrap_stream: Wrap | None
) -> grpc.RpcMethodHandler | None:
    """`handler` with its behavior wrapped: by `wrap_unary` when the response is one message,
    by `wrap_stream` when it is a stream (None: left as it is). The interceptors' one way in."""
    if handler is None:
        return None
    for kind, wrap in (
        ("unary_unary", wrap_unary),
        ("stream_unary", wrap_unary),
        ("unary_stream", wrap_stream),
        ("stream_stream", wrap_stream),
    ):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler if wrap is None else handler._replace(**{kind: wrap(behavior)})
    return handler


class ErrorInterceptor(aio.ServerInterceptor):
    """Turns ServiceError and Redis errors raised by servicers into gRPC status codes, and
    reports each refusal at a limit to `on_refused`."""

    def __init__(self, on_refused: OnRefused = lambda limit: None) -> None:
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        refused = self._on_refused
        return wrap_handler(
            await continuation(handler_call_details),
            lambda behavior: _wrap_unary(behavior, refused),
            lambda behavior: _wrap_stream(behavior, refused),
        )
