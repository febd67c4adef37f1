"""The gateway's explicit limits on its public server: concurrent streams, the size of a
request message, and the gRPC core's queue of calls not yet picked up.

gRPC core holds calls that arrived but that the server has not asked for yet; past
`grpc.server.max_pending_requests` (default 1000) it drops them at random, and past
`grpc.server.max_pending_requests_hard_limit` (default 3000) all of them, and a dropped call
ends CANCELLED without reaching the servicer (no log line, no metric). A burst of streams
on an asyncio server, which picks calls up one at a time on its event loop, reaches those
numbers. So both are set far above any stream limit (PENDING_LIMIT, one value: no random
drops before the hard limit): every call of a burst reaches the servicer, and one past
--max-concurrent-streams is refused there, at once, with RESOURCE_EXHAUSTED naming it. A
waiting call holds a few kilobytes; PENDING_LIMIT of them is the memory bound.

gRPC core also cancels a call left unrequested for `grpc.server_max_unrequested_time_in_server`
(default 30 s), again CANCELLED and unseen. A loaded event loop picks a burst of thousands
of calls up more slowly than that (one per turn of the loop), so it is raised to
UNREQUESTED_LIMIT_S: such a call waits its turn, bounded by the client's deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio

from gateway.errors import OnRefused, WrappingInterceptor

# How far gRPC core's queue of calls not yet picked up may grow (at least this, or 16 times
# --max-concurrent-streams): past it, gRPC core drops calls unseen.
PENDING_LIMIT = 100_000
PENDING_STREAM_FACTOR = 16
UNREQUESTED_LIMIT_S = 3600


def public_server_options(max_concurrent_streams: int, max_receive_message_bytes: int) -> list:
    """gRPC channel arguments of the public server for these limits."""
    pending = max(PENDING_LIMIT, PENDING_STREAM_FACTOR * max_concurrent_streams)
    return [
        ("grpc.max_receive_message_length", max_receive_message_bytes),
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", pending),
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_LIMIT_S),
    ]


class StreamLimitInterceptor(WrappingInterceptor):
    """Refuses a server-streaming call of `service` (Generate, Chat) while `max_streams` are
    open (health Watch streams are not counted)."""

    def __init__(self, service: str, max_streams: int, on_refused: OnRefused) -> None:
        self.method_prefix = f"/{service}/"
        self.max_streams = max_streams
        self.open_streams = 0
        self._on_refused = on_refused

    def wraps(self, method: str) -> bool:
        return method.startswith(self.method_prefix)

    def wrap_stream(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator:
            if self.open_streams >= self.max_streams:
                self._on_refused("max_concurrent_streams")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the gateway has {self.max_streams} streams open, its limit "
                    "(--max-concurrent-streams); try again later or another gateway",
                )
            self.open_streams += 1
            try:
                async for response in behavior(request_or_iterator, context):
                    yield response
            finally:
                self.open_streams -= 1

        return wrapper
