"""The gateway's MetricsInterceptor on a real grpc.aio server and channel: a call the client
cancels mid-stream is counted CANCELLED, never UNKNOWN; a call counted UNKNOWN is logged with
its exception."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc import aio

from gateway.metrics import GatewayMetrics, MetricsInterceptor
from tests.helpers import WAIT_S, wait_for

SERVICE = "kvgate.test.Endless"


async def endless(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    """Streams until the client goes: it awaits nothing but its own yields."""
    while True:
        yield b"x" * 1024


async def broken(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    """Fails with an exception no interceptor maps to a status code."""
    yield b"first"
    raise RuntimeError("broken handler")


@pytest.fixture
def served() -> Iterator[tuple[str, GatewayMetrics]]:
    """An aio server with the interceptor, on its own event loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    metrics = GatewayMetrics()

    async def start() -> tuple[aio.Server, int]:
        server = aio.server(interceptors=[MetricsInterceptor(metrics)])
        handlers = {
            "Stream": grpc.unary_stream_rpc_method_handler(endless),
            "Broken": grpc.unary_stream_rpc_method_handler(broken),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(WAIT_S)
    try:
        yield f"127.0.0.1:{port}", metrics
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)


def calls(metrics: GatewayMetrics, code: str, method: str = "Stream") -> float:
    value = metrics.registry.get_sample_value(
        "kvgate_gateway_requests_total", {"service": SERVICE, "method": method, "code": code}
    )
    return value or 0.0


def test_a_stream_cancelled_by_its_client_counts_cancelled(served):
    address, metrics = served
    num_calls = 5
    with grpc.insecure_channel(address) as channel:
        stream = channel.unary_stream(f"/{SERVICE}/Stream")
        for _ in range(num_calls):
            call = stream(b"")
            next(call)
            call.cancel()
    wait_for(lambda: calls(metrics, "CANCELLED") + calls(metrics, "UNKNOWN") == num_calls,
             f"{num_calls} cancelled calls counted")  # fmt: skip
    assert calls(metrics, "UNKNOWN") == 0, "a cancelled call was counted UNKNOWN"
    assert calls(metrics, "CANCELLED") == num_calls


def test_a_call_counted_unknown_is_logged_with_its_exception(served, caplog):
    address, metrics = served
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError):
            list(channel.unary_stream(f"/{SERVICE}/Broken")(b""))
    wait_for(lambda: calls(metrics, "UNKNOWN", "Broken") == 1, "the broken call counted UNKNOWN")
    warnings = [r for r in caplog.records if r.name == "gateway.metrics"]
    assert warnings and warnings[0].levelname == "WARNING", caplog.text
    assert isinstance(warnings[0].exc_info[1], RuntimeError), caplog.text
