"""Errors the gateway answers with, and the one interceptor that maps them to status codes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import redis
from grpc import aio

from common.redis_conn import ConnectionBudgetExhausted, describe, is_outage

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
    """An error with the gRPC status code the client gets, and trailing metadata to send."""

    code = grpc.StatusCode.INTERNAL
    metadata: tuple[tuple[str, str], ...] = ()


class InvalidArgument(ServiceError):
    """A request field is wrong; the message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Refused(ResourceExhausted):
    """A call refused at one of the gateway's limits (counted by the limit's flag name)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit  # the flag, without its dashes: max_queue_len, ...


# Trailing metadata of a refusal by quota: milliseconds after which the call may succeed.
RETRY_AFTER_KEY = "retry-after-ms"


class QuotaExceeded(ResourceExhausted):
    """A tenant is over one of its limits; the client gets RETRY_AFTER_KEY."""

    def __init__(self, message: str, limit: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.limit = limit  # the TenantLimits field exceeded
        self.retry_after_ms = retry_after_ms
        self.metadata = ((RETRY_AFTER_KEY, str(retry_after_ms)),)


class Unauthenticated(ServiceError):
    """No credentials, or credentials that name no tenant; the message never repeats them."""

    code = grpc.StatusCode.UNAUTHENTICATED


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


class WrappingInterceptor(aio.ServerInterceptor):
    """An interceptor that wraps the behaviour of the handlers of the methods it `wraps`:
    with `wrap_unary` when the server answers with one message, `wrap_stream` when it streams
    (each leaves the behaviour as it is unless a subclass overrides it)."""

    def wraps(self, method: str) -> bool:
        return True

    def wrap_unary(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        return behavior

    def wrap_stream(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        return behavior

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self.wraps(method):
            return handler
        if handler.unary_unary:
            return handler._replace(unary_unary=self.wrap_unary(handler.unary_unary, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=self.wrap_unary(handler.stream_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=self.wrap_stream(handler.unary_stream, method))
        return handler._replace(stream_stream=self.wrap_stream(handler.stream_stream, method))


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
            return grpc.StatusCode.UNAVAILABLE, _cut(f"redis unavailable: {describe(error)}")
        return grpc.StatusCode.INTERNAL, _cut(f"redis error: {describe(error)}")
    return None


def _cut(details: str) -> str:
    if len(details) <= MAX_DETAILS_CHARS:
        return details
    return f"{details[: MAX_DETAILS_CHARS - 32]}... ({len(details)} characters)"


# Called with the limit's name and the call's full method ('/service/Method') each time a
# call is refused at one.
OnRefused = Callable[[str, str], None]


async def _abort_with(
    context: aio.ServicerContext, error: Exception, on_refused: OnRefused, method: str
) -> None:
    status = status_of(error)
    if status is None:
        raise error
    limit = refused_limit(error)
    if limit is not None:
        on_refused(limit, method)
    log.debug("%s: %s", status[0].name, status[1])
    await context.abort(status[0], status[1], getattr(error, "metadata", ()))


def _wrap_unary(
    behavior: Callable[..., Awaitable[Any]], on_refused: OnRefused, method: str
) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
        try:
            return await behavior(request_or_iterator, context)
        except (ServiceError, redis.RedisError) as error:
            await _abort_with(context, error, on_refused, method)

    return wrapper


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], on_refused: OnRefused, method: str
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request_or_iterator, context):
                yield response
        except (ServiceError, redis.RedisError) as error:
            await _abort_with(context, error, on_refused, method)

    return wrapper


class ErrorInterceptor(WrappingInterceptor):
    """Turns ServiceError and Redis errors raised by servicers into gRPC status codes, and
    reports each refusal at a limit to `on_refused`."""

    def __init__(self, on_refused: OnRefused = lambda limit, method: None) -> None:
        self._on_refused = on_refused

    def wrap_unary(self, behavior: Callable[..., Awaitable[Any]], method: str) -> Callable:
        return _wrap_unary(behavior, self._on_refused, method)

    def wrap_stream(self, behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable:
        return _wrap_stream(behavior, self._on_refused, method)
