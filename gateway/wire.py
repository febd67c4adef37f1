"""Requests parsed by the gateway itself, so that a malformed one is INVALID_ARGUMENT naming
its field, not UNKNOWN from inside gRPC, and one over the receive limit is refused by its
size before any parsing (RESOURCE_EXHAUSTED naming --max-receive-message-bytes).

Protobuf refuses a string field that holds invalid UTF-8 without saying which: the bytes are
walked here (the wire format's varints, fixed-size numbers and length-delimited fields) to
find it, nested messages and repeated fields included ("messages[1].content").
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc import aio

from gateway.errors import InvalidArgument, Refused

_FIXED_SIZES = {1: 8, 5: 4}  # wire types 1 (64 bits) and 5 (32 bits)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise IndexError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def bad_utf8_field(descriptor: Descriptor, data: bytes, path: str = "") -> str | None:
    """The path of the first string field of `data` that holds invalid UTF-8, or None."""
    seen: Counter[int] = Counter()
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in _FIXED_SIZES:
                pos += _FIXED_SIZES[wire_type]
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + length], pos + length
                found = _check_field(descriptor.fields_by_number.get(number), chunk, path, seen)
                if found is not None:
                    return found
            else:
                return None  # groups: none in kvgate's messages
    except IndexError:
        return None
    return None


def _check_field(
    field: FieldDescriptor | None, chunk: bytes, path: str, seen: Counter[int]
) -> str | None:
    if field is None:
        return None
    name = path + field.name
    if field.is_repeated:
        name += f"[{seen[field.number]}]"
        seen[field.number] += 1
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return name
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        return bad_utf8_field(field.message_type, chunk, name + ".")
    return None


def parse_request(message_class: type[Message], max_bytes: int, data: bytes) -> Message:
    """Parses a request message of at most `max_bytes`.

    Raises:
        Refused: a bigger message (its size is all that is read of it).
        InvalidArgument: naming the string field with invalid UTF-8, else "request".
    """
    if len(data) > max_bytes:
        raise Refused(
            "max_receive_message_bytes",
            f"request message of {len(data)} bytes; the gateway takes at most {max_bytes} "
            "(--max-receive-message-bytes)",
        )
    try:
        return message_class.FromString(data)
    except DecodeError as error:
        field = bad_utf8_field(message_class.DESCRIPTOR, data)
        if field is not None:
            raise InvalidArgument(field, "is not valid UTF-8") from None
        raise InvalidArgument(
            "request", f"not a {message_class.DESCRIPTOR.full_name}: {error}"
        ) from None


async def _parsed(raw_messages: AsyncIterator[bytes], parse: Callable[[bytes], Message]):
    async for raw in raw_messages:
        yield parse(raw)


def parse_in_behavior(
    handler: grpc.RpcMethodHandler | None, max_bytes: int
) -> grpc.RpcMethodHandler | None:
    """`handler` receiving raw bytes and parsing them with parse_request inside its behavior
    (where the error interceptor turns its errors into a status)."""
    deserialize = getattr(handler, "request_deserializer", None)
    message_class = getattr(deserialize, "__self__", None)
    if not isinstance(message_class, type):
        return handler
    parse = functools.partial(parse_request, message_class, max_bytes)
    raw = handler._replace(request_deserializer=None)
    if handler.unary_unary:
        return raw._replace(unary_unary=lambda data, ctx: handler.unary_unary(parse(data), ctx))
    if handler.unary_stream:
        return raw._replace(unary_stream=lambda data, ctx: handler.unary_stream(parse(data), ctx))
    if handler.stream_unary:
        return raw._replace(
            stream_unary=lambda datas, ctx: handler.stream_unary(_parsed(datas, parse), ctx)
        )
    return raw._replace(
        stream_stream=lambda datas, ctx: handler.stream_stream(_parsed(datas, parse), ctx)
    )


class RequestParsingInterceptor(aio.ServerInterceptor):
    """Innermost interceptor: every request of the service is parsed by parse_request, and
    refused unparsed when over `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        return parse_in_behavior(await continuation(handler_call_details), self.max_bytes)
