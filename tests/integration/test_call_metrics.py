"""The gateway's MetricsInterceptor on a real grpc.aio server and channel: a call the client
cancels mid-stream is counted CANCELLED, never UNKNOWN; a call whose deadline passed is counted
DEADLINE_EXCEEDED even when the client's cancellation reaches the server before the server's own
deadline, or when its request stream ends with the deadline and the handler then ends by itself;
a call counted UNKNOWN is logged with its exception."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc import aio

from gateway import metrics as gateway_metrics
from gateway.metrics import GatewayMetrics, MetricsInterceptor
from tests.helpers import WAIT_S, wait_for

SERVICE = "kvgate.test.Endless"


async def endless(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    """Streams until the client goes: it awaits nothing but its own yields."""
    while True:
        yield b"x" * 1024


async def idle(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    """Sends nothing until the call ends."""
    await asyncio.Event().wait()
    yield b""


async def listen(requests: AsyncIterator[bytes], context: aio.ServicerContext) -> bytes:
    """Reads its request stream to the end, then answers by itself, even when grpc cancels its
    task: the way a Chat may end when its client's deadline passes (grpc ends the request stream
    before it cancels the handler, or the handler finishes before the cancellation reaches it)."""
    with contextlib.suppress(asyncio.CancelledError):
        async for _ in requests:
            pass
    return b"done"


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
            "Idle": grpc.unary_stream_rpc_method_handler(idle),
            "Listen": grpc.stream_unary_rpc_method_handler(listen),
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
        "kvgate_gateway_requests_total",
        {"service": SERVICE, "method": method, "code": code, "api": "kvgate"},
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


class SlowStartProxy:
    """A TCP proxy that holds what the client sends in its connection's first `slow_s` for
    `slow_s`, then passes everything on at once: the call's headers reach the server late, so
    the server's deadline falls `slow_s` after the client's."""

    def __init__(self, upstream: str, slow_s: float) -> None:
        self.upstream = upstream.rsplit(":", 1)
        self.slow_s = slow_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> SlowStartProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sock in self.sockets:  # ends the accept and the pumps
            sock.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            client, _ = self.listener.accept()
            server = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            self.sockets += [client, server]
            pumps = [(client, server, self.slow_s), (server, client, 0.0)]
            for args in pumps:
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, slow_s: float) -> None:
        started = time.monotonic()
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if time.monotonic() - started < slow_s:
                    time.sleep(max(0.0, started + slow_s - time.monotonic()))
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_a_call_past_its_deadline_counts_deadline_exceeded_when_its_cancel_arrives_first(served):
    """The server's deadline falls 0.5 s after the client's: within the margin (1 s for a call
    given 4 s)."""
    address, metrics = served
    with (
        SlowStartProxy(address, slow_s=0.5) as proxy,
        grpc.insecure_channel(proxy.address) as channel,
    ):
        call = channel.unary_stream(f"/{SERVICE}/Idle")(b"", timeout=4.0)
        with pytest.raises(grpc.RpcError) as raised:
            next(call)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        codes = ("DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN")
        wait_for(lambda: sum(calls(metrics, code, "Idle") for code in codes) == 1,
                 "the call counted")  # fmt: skip
    assert calls(metrics, "DEADLINE_EXCEEDED", "Idle") == 1, {
        code: calls(metrics, code, "Idle") for code in codes
    }


def test_a_request_stream_cut_off_by_its_deadline_counts_deadline_exceeded_when_the_handler_ends(
    served,
):
    """The client sends nothing; its deadline passes 0.5 s before the server's (within the 1 s
    margin of a call given 4 s), and the handler then ends by itself: DEADLINE_EXCEEDED, as the
    client saw. A stream the client closes early ends OK."""
    address, metrics = served
    codes = ("OK", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN")
    with (
        SlowStartProxy(address, slow_s=0.5) as proxy,
        grpc.insecure_channel(proxy.address) as channel,
    ):
        listen = channel.stream_unary(f"/{SERVICE}/Listen")
        with pytest.raises(grpc.RpcError) as raised:
            listen(iter(threading.Event().wait, True), timeout=4.0)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: sum(calls(metrics, code, "Listen") for code in codes) == 1,
                 "the call counted")  # fmt: skip
        assert calls(metrics, "DEADLINE_EXCEEDED", "Listen") == 1, {
            code: calls(metrics, code, "Listen") for code in codes
        }
        assert listen(iter([b"turn"]), timeout=30.0) == b"done"
        wait_for(lambda: calls(metrics, "OK", "Listen") == 1, "the closed stream counted OK")
    assert calls(metrics, "DEADLINE_EXCEEDED", "Listen") == 1


def test_a_call_cancelled_early_counts_cancelled_though_its_deadline_is_within_the_margin(
    served, monkeypatch
):
    """The margin is at most a quarter of the time a call was given: with a 10 s margin, a call
    given 8 s and cancelled as soon as the server holds it is CANCELLED (a flat margin would
    count it DEADLINE_EXCEEDED). The long times leave a loaded machine seconds to spare."""
    address, metrics = served
    monkeypatch.setattr(gateway_metrics, "DEADLINE_MARGIN_S", 10.0)

    def open_idle_calls() -> float:
        labels = {"method": "Idle", "api": "kvgate"}
        return metrics.registry.get_sample_value("kvgate_gateway_active_streams", labels) or 0.0

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Idle")(b"", timeout=8.0)
        wait_for(lambda: open_idle_calls() == 1, "the server to hold the call")
        call.cancel()
    codes = ("DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN")
    wait_for(lambda: sum(calls(metrics, code, "Idle") for code in codes) == 1, "the call counted")
    assert calls(metrics, "CANCELLED", "Idle") == 1, {
        code: calls(metrics, code, "Idle") for code in codes
    }


def test_a_call_counted_unknown_is_logged_with_its_exception(served, caplog):
    address, metrics = served
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError):
            list(channel.unary_stream(f"/{SERVICE}/Broken")(b""))
    wait_for(lambda: calls(metrics, "UNKNOWN", "Broken") == 1, "the broken call counted UNKNOWN")
    warnings = [r for r in caplog.records if r.name == "gateway.metrics"]
    assert warnings and warnings[0].levelname == "WARNING", caplog.text
    assert isinstance(warnings[0].exc_info[1], RuntimeError), caplog.text
