"""Errors the gateway answers with, and the one interceptor that maps them to status codes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from common.redis_conn import REDIS_DOWN_ERRORS

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


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ServiceError):
    """A concurrent change won; the client may retry."""

    code = grpc.StatusCode.ABORTED


def status_of(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status for an error the interceptor maps, or None to let it through."""
    if isinstance(error, ServiceError):
        return error.code, _cut(str(error))
    if isinstance(error, REDIS_DOWN_ERRORS):
        return grpc.StatusCode.UNAVAILABLE, _cut(f"redis unreachable: {error}")
    return None


def _cut(details: str) -> str:
    if len(details) <= MAX_DETAILS_CHARS:
        return details
    return f"{details[: MAX_DETAILS_CHARS - 32]}... ({len(details)} characters)"


async def _abort_with(context: aio.ServicerContext, error: Exception) -> None:
    status = status_of(error)
    if status is None:
        raise error
    log.debug("%s: %s", status[0].name, status[1])
    await context.abort(status[0], status[1])


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
        try:
            return await behavior(request_or_iterator, context)
        except (ServiceError, *REDIS_DOWN_ERRORS) as error:
            await _abort_with(context, error)

    return wrapper


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request_or_iterator, context):
                yield response
        except (ServiceError, *REDIS_DOWN_ERRORS) as error:
            await _abort_with(context, error)

    return wrapper


class ErrorInterceptor(aio.ServerInterceptor):
    """Turns ServiceError and Redis outages raised by servicers into gRPC status codes."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
