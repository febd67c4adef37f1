"""The gateway's Prometheus metrics, and the interceptor that counts calls by method and code."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from common.metrics import ProcessMetrics
from gateway.errors import WrappingInterceptor

log = logging.getLogger(__name__)


class GatewayMetrics(ProcessMetrics):
    """Every kvgate_gateway_ metric of common.metrics.METRICS, on a registry of its own."""

    def __init__(self) -> None:
        super().__init__("kvgate_gateway_")


# The `api` label of a gRPC service's calls: the front they came through.
API_OF_SERVICE = {"vllm.grpc.engine.VllmEngine": "vllm"}
DEFAULT_API = "kvgate"


def api_of(service: str) -> str:
    """The front ("kvgate", "vllm") whose calls `service` serves."""
    return API_OF_SERVICE.get(service, DEFAULT_API)


def api_of_method(full_method: str) -> str:
    """The front whose service serves `full_method` ('/vllm.grpc.engine.VllmEngine/Generate')."""
    return api_of(_split_method(full_method)[0])


def _split_method(full_method: str) -> tuple[str, str]:
    """'/kvgate.v1.Inference/Generate' -> ('kvgate.v1.Inference', 'Generate')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


# The server learns a call's deadline when its headers arrive, so its deadline falls later
# than the client's by the headers' transit time, and the client's own cancellation at its
# deadline can reach the server first. A call cancelled within this margin of its deadline
# (at most this share of the time it was given) is counted as past it: the client saw
# DEADLINE_EXCEEDED. (A client that cancels by itself that close to its deadline is counted
# the same way.)
DEADLINE_MARGIN_S = 1.0
DEADLINE_MARGIN_SHARE = 0.25


def deadline_margin_s(context: aio.ServicerContext) -> float | None:
    """The margin for a call that is starting (None when it has no deadline)."""
    given_s = context.time_remaining()
    return None if given_s is None else min(DEADLINE_MARGIN_S, DEADLINE_MARGIN_SHARE * given_s)


class RequestStream:
    """A call's request stream, passed on to its handler as it is; notes the time the call had
    left when the stream ended (the client closed it, or it broke off).

    grpc.aio ends a request stream the same way whether the client half-closed it or the call
    was cancelled (its client went, or its deadline passed): the handler reads the end of the
    stream and may end by itself (a Chat does) before grpc cancels its task, so neither the
    task's cancellation nor context.cancelled() says what happened. The time the stream ended
    does: a stream that ended within the deadline margin ended with the call.
    """

    def __init__(self, requests: AsyncIterator[Any], context: aio.ServicerContext) -> None:
        self.requests = requests
        self.context = context
        self.ended_with_s: float | None = None
        self._stream: AsyncIterator[Any] | None = None

    def __aiter__(self) -> AsyncIterator[Any]:
        if self._stream is None:  # one stream, however often the handler asks for it
            self._stream = self._read()
        return self._stream

    async def __anext__(self) -> Any:
        return await self.__aiter__().__anext__()

    async def _read(self) -> AsyncIterator[Any]:
        try:
            async for request in self.requests:
                yield request
        except GeneratorExit:  # the handler stopped reading: the stream did not end
            raise
        except BaseException:
            self.ended_with_s = self.context.time_remaining()
            raise
        self.ended_with_s = self.context.time_remaining()


def _requests_of(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
    """The request stream wrapped in a RequestStream, or the one request as it is."""
    if hasattr(request_or_iterator, "__aiter__"):
        return RequestStream(request_or_iterator, context)
    return request_or_iterator


def _code_of(
    context: aio.ServicerContext, ended: str, margin_s: float | None, requests: Any = None
) -> str:
    """The status code a call ended with, as a label value.

    Args:
        ended: "completed", "cancelled" (its task was cancelled, or grpc closed its response
            stream early) or "raised".
        margin_s: deadline_margin_s, read when the call started.
        requests: what _requests_of passed to the handler.
    """
    code = context.code()
    if code is not None:
        return code.name if isinstance(code, grpc.StatusCode) else str(code)
    remaining = context.time_remaining()
    cancelled = ended == "cancelled" or context.cancelled()
    margin = margin_s or 0
    stream_end_s = requests.ended_with_s if isinstance(requests, RequestStream) else None
    if remaining is not None and (
        remaining <= 0
        or (cancelled and remaining <= margin)
        or (stream_end_s is not None and stream_end_s <= margin)
    ):
        # The client's deadline passed: it got DEADLINE_EXCEEDED, even when the handler then
        # ended by itself (a Chat ends when its request stream breaks off). A client that
        # half-closes its request stream within the margin is counted the same way.
        return grpc.StatusCode.DEADLINE_EXCEEDED.name
    if cancelled:
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

    def _count(
        self,
        full_method: str,
        context: aio.ServicerContext,
        ended: str,
        error: BaseException | None,
        margin_s: float | None,
        requests: Any,
    ) -> None:
        service, method = _split_method(full_method)
        code = _code_of(context, ended, margin_s, requests)
        if code == grpc.StatusCode.UNKNOWN.name:
            log.warning("%s ended without a status code: UNKNOWN", full_method, exc_info=error)
        self.metrics.requests.labels(service, method, code, api_of(service)).inc()

    def wrap_unary(self, behavior: Callable[..., Awaitable[Any]], full_method: str) -> Callable:
        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
            ended, error, margin_s = "raised", None, deadline_margin_s(context)
            requests = _requests_of(request_or_iterator, context)
            try:
                response = await behavior(requests, context)
                ended = "completed"
                return response
            except asyncio.CancelledError:
                ended = "cancelled"
                raise
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._count(full_method, context, ended, error, margin_s, requests)

        return wrapper

    def wrap_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], full_method: str
    ) -> Callable:
        service, method = _split_method(full_method)
        active = self.metrics.active_streams.labels(method, api_of(service))

        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator:
            ended, error, margin_s = "raised", None, deadline_margin_s(context)
            requests = _requests_of(request_or_iterator, context)
            active.inc()
            try:
                # aclosing: the handler's own cleanup runs now, not when it is collected.
                async with contextlib.aclosing(behavior(requests, context)) as stream:
                    async for response in stream:
                        yield response
                ended = "completed"
            except (asyncio.CancelledError, GeneratorExit):
                # gRPC stops reading a response stream whose client has gone either by
                # cancelling the call's task or by closing this generator at its yield
                # (GeneratorExit), the latter at times before context.cancelled() says so.
                ended = "cancelled"
                raise
            except BaseException as exc:
                error = exc
                raise
            finally:
                active.dec()
                self._count(full_method, context, ended, error, margin_s, requests)

        return wrapper
