"""uvicorn serving a Starlette app on a socket of its own, in the running event loop (the
gateway's, beside its grpc.aio servers), with TLS from the --tls-* files."""

from __future__ import annotations

import asyncio
import socket
import ssl

import uvicorn
from starlette.applications import Starlette


class HttpTLS:
    """The HTTP port's TLS context, built from the --tls-* files; `reload` reads them again
    (SIGHUP, as the gRPC port's): new connections get them."""

    def __init__(self, cert: str, key: str, client_ca: str) -> None:
        self.cert, self.key = cert, key
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        if client_ca:
            self.context.load_verify_locations(client_ca)
            self.context.verify_mode = ssl.CERT_REQUIRED

    def reload(self) -> None:
        self.context.load_cert_chain(self.cert, self.key)


class HttpServer:
    """uvicorn serving an app on a socket of its own, in the running event loop."""

    def __init__(self, app: Starlette, sock: socket.socket, tls: HttpTLS | None, grace_s: float):
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=grace_s,
            http="h11",
        )
        config.load()
        config.ssl = tls.context if tls is not None else None
        self.server = uvicorn.Server(config)
        self.server.lifespan = config.lifespan_class(config)
        self.sock = sock
        self.tls = tls
        self._ticks: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    async def start(self) -> None:
        await self.server.startup(sockets=[self.sock])
        self._ticks = asyncio.create_task(self.server.main_loop())  # its Date header

    async def stop(self) -> None:
        """Stop taking connections; running answers get the grace period, then are cancelled."""
        self.server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        await self.server.shutdown()


def bind_http(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: a free port), without SO_REUSEPORT.

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections only of such a socket;
    # without it a response's last small write waits for the client's delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
