"""The HTTP front's socket: its connections send small writes at once (TCP_NODELAY)."""

from __future__ import annotations

import asyncio
import socket

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.http_server import HttpServer, bind_http


async def hello(request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def served_connections_nodelay() -> list[int]:
    """TCP_NODELAY of the server's side of a kept-alive connection, after two requests."""
    server = HttpServer(Starlette(routes=[Route("/", hello)]), bind_http("127.0.0.1", 0), None, 1)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            for _ in range(2):
                assert (await client.get("/")).text == "hello"
            sockets = [
                protocol.transport.get_extra_info("socket")
                for protocol in server.server.server_state.connections
            ]
            return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets]
    finally:
        await server.stop()


def test_connections_of_the_http_front_have_nagle_off():
    # With Nagle on, a response's last small write waits for the client's delayed ACK: every
    # request after the first on a kept-alive connection then took 40 ms longer.
    nodelay = asyncio.run(served_connections_nodelay())
    assert nodelay and all(nodelay), f"expected TCP_NODELAY on every connection, got {nodelay}"
