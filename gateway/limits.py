"""The gateway's explicit limits on its public server: concurrent streams, the size of a
request message, and the gRPC core's queue of calls not yet picked up.

The size of a request message is bounded by --max-receive-message-bytes, by default derived
from what the model can take (`receive_limit`): a request message past it could only hold
text refused anyway. The gateway refuses such a message by its size as soon as it has it,
before parsing it (gateway/wire.py; RESOURCE_EXHAUSTED naming the flag and the limit).
gRPC core's own limit (`grpc.max_receive_message_length`) is kept above it, at
CORE_RECEIVE_FLOOR_BYTES at least, as the bound of what is received at all: core refuses
only once it has received the whole message, and then at least 100 ms later than the
gateway's check does (grpcio 1.85 on loopback, any size over its limit, even 2 KB), and its
message names no flag. So a prompt of a few megabytes is refused by the gateway at once,
and only an absurd one by gRPC core.

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

from common.model_text import ModelText
from gateway.errors import OnRefused, WrappingInterceptor

# How far gRPC core's queue of calls not yet picked up may grow (at least this, or 16 times
# --max-concurrent-streams): past it, gRPC core drops calls unseen.
PENDING_LIMIT = 100_000
PENDING_STREAM_FACTOR = 16
UNREQUESTED_LIMIT_S = 3600


# What a request message may hold besides its text, for the derived receive limit:
UTF8_MAX_BYTES = 4  # bytes of one character of text, at most
# bytes per token of max_model_len: prompt_token_ids as varints (5 bytes each at most), or a
# Tokenize conversation's messages (each renders to one token of the template at least)
# with their role and framing
BYTES_PER_TOKEN = 16
STOP_STRING_FRAMING_BYTES = 4  # a stop string's tag and length
FIXED_BYTES = 16 << 10  # ids, numbers and the framing of every other field
# bytes per vocabulary entry for logit_bias (a map entry: tags, length, id, float) and
# allowed_token_ids, which may name the whole vocabulary
BYTES_PER_VOCAB_ENTRY = 16


def receive_limit(
    model_text: ModelText, max_stop_strings: int, max_stop_len: int, max_constraint_chars: int = 0
) -> int:
    """The largest request message a gateway serving `model_text` needs to take: its text
    at the character budget (`max_prompt_chars`, all of it in 4-byte characters), token
    ids or conversation messages for max_model_len, the stop strings the flags allow, a
    constraint of `max_constraint_chars`, logit_bias and allowed_token_ids over the whole
    vocabulary, and FIXED_BYTES for the rest."""
    limits = model_text.limits
    stops = max_stop_strings * (UTF8_MAX_BYTES * max_stop_len + STOP_STRING_FRAMING_BYTES)
    return (
        UTF8_MAX_BYTES * (limits.max_prompt_chars + max_constraint_chars)
        + BYTES_PER_TOKEN * limits.max_model_len
        + BYTES_PER_VOCAB_ENTRY * limits.vocab_size
        + stops
        + FIXED_BYTES
    )


# Request messages up to this size (or the receive limit, if more) reach the gateway's own
# size check; gRPC core refuses bigger ones.
CORE_RECEIVE_FLOOR_BYTES = 16 << 20


def public_server_options(max_concurrent_streams: int, max_receive_message_bytes: int) -> list:
    """gRPC channel arguments of the public server for these limits."""
    pending = max(PENDING_LIMIT, PENDING_STREAM_FACTOR * max_concurrent_streams)
    core_receive_bytes = max(max_receive_message_bytes, CORE_RECEIVE_FLOOR_BYTES)
    return [
        ("grpc.max_receive_message_length", core_receive_bytes),
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", pending),
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_LIMIT_S),
    ]


class StreamLimitInterceptor(WrappingInterceptor):
    """Refuses a server-streaming call of `services` (Generate, Chat) while `max_streams` of
    them are open together (health Watch streams are not counted)."""

    def __init__(self, services: tuple[str, ...], max_streams: int, on_refused: OnRefused) -> None:
        self.method_prefixes = tuple(f"/{service}/" for service in services)
        self.max_streams = max_streams
        self.open_streams = 0
        self._on_refused = on_refused

    def wraps(self, method: str) -> bool:
        return method.startswith(self.method_prefixes)

    def wrap_stream(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        async def wrapper(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator:
            if self.open_streams >= self.max_streams:
                self._on_refused("max_concurrent_streams", method)
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
