"""The gateway's Prometheus metrics, and the interceptor that counts calls by method and code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from common.metrics import ProcessMetrics
from gateway.errors import WrappingInterceptor


class GatewayMetrics(ProcessMetrics):
    """Every kvgate_gateway_ metric of common.metrics.METRICS, on a registry of its own."""

    def __init__(self) -> None:
        super().__init__("kvgate_gateway_")


def _split_method(full_method: str) -> tuple[str, str]:
    """'/kvgate.v1.Inference/Generate' -> ('kvgate.v1.Inference', 'Generate')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def _code_of(context: aio.ServicerContext, ended: str) -> str:
    """The status code a call ended with, as a label value.

    Args:
        ended: "completed", "cancelled" (its task was cancelled) or "raised".
    """
    code = context.code()
    if code is not None:
        return code.name if isinstance(code, grpc.StatusCode) else str(code)
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        # The client's deadline passed: it got DEADLINE_EXCEEDED, even when the handler then
        # ended by itself (a Chat ends when its request stream breaks off).
        return grpc.StatusCode.DEADLINE_EXCEEDED.name
    if ended == "cancelled" or context.cancelled():
        # The client cancelled, even when the handler then ended by itself (seen now and
        # then for a Generate cancelled mid-stream).
        return grpc.StatusCode.CANCELLED.name
    if ended == "completed":
        return grpc.StatusCode.OK.name
    return grpc.StatusCode.UNKNOWN.name


class MetricsInterceptor(WrappingInterceptor):
    """Counts every call by service, method and status code; tracks open response streams.

    Placed before ErrorInterceptor, it sees the status that interceptor aborted with.
    """

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def _count(self, full_method: str, context: aio.ServicerContext, ended: str) -> None:
        service, method = _split_method(full_method)
        self.metrics.requests.labels(service, method, _code_of(context, ended)).inc()

    def wrap_unary(self, behavior: Callable[..., Awaitable[Any]], full_method: str) -> Callable:
        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
            ended = "raised"
            try:
                response = await behavior(request_or_iterator, context)
                ended = "completed"
                return response
            except asyncio.CancelledError:
                ended = "cancelled"
                raise
            finally:
                self._count(full_method, context, ended)

        return wrapper

    def wrap_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], full_method: str
    ) -> Callable:
        active = self.metrics.active_streams.labels(_split_method(full_method)[1])

        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator:
            ended = "raised"
            active.inc()
            try:
                async for response in behavior(request_or_iterator, context):
                    yield response
                ended = "completed"
            except (asyncio.CancelledError, GeneratorExit):
                # gRPC stops reading a response stream whose client has gone either by
                # cancelling the call's task or by closing this generator at its yield
                # (GeneratorExit), the latter at times before context.cancelled() says so.
                ended = "cancelled"
                raise
            finally:
                active.dec()
                self._count(full_method, context, ended)

        return wrapper
