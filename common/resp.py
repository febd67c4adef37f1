"""Lean Redis connections for the two calls on every request's path to its first token.

The gateway's enqueue script and the scheduler's assignment script run once per request,
and their time to reach Redis is in every TTFT. On an idle 2-core machine redis-py takes
0.3-0.4 ms from a call to its script running in Redis, asyncio or blocking; writing the
command straight to the socket takes 0.15-0.2 ms. So these two calls use the connections
here, and everything else stays on redis-py.

They speak RESP2. `RespConnection` (asyncio) writes commands at once, in order, and a
reader task matches replies to callers first in, first out, so concurrent calls share one
connection (pipelined) instead of a pool. `BlockingRespConnection` is for one thread.

Failures look like redis-py's, so REDIS_DOWN_ERRORS handling applies unchanged: no
connection, or a connection lost, raises redis.ConnectionError; no reply within
`timeout_s` raises redis.TimeoutError and drops the connection (its replies can no longer
be matched); an error reply raises redis.ResponseError (NoScriptError for NOSCRIPT).
The next call connects again.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections import deque
from dataclasses import dataclass
from urllib.parse import ParseResult, unquote, urlparse

import redis
from redis.exceptions import NoScriptError

Reply = bytes | int | list["Reply"] | redis.ResponseError | None
Arg = bytes | str | int
SCHEMES = ("redis", "unix")
READ_SIZE = 65536


class _Incomplete:
    """The buffer does not hold a whole reply yet."""


INCOMPLETE = _Incomplete()


def encode_command(args: tuple[Arg, ...]) -> bytes:
    """Args: a command and its arguments. Returns: the RESP2 array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def parse_reply(buffer: bytes | bytearray, start: int = 0) -> tuple[Reply | _Incomplete, int]:
    """Parses one RESP2 reply at `start`.

    Returns: the reply (an error reply as a redis.ResponseError instance) and where the next
    one starts, or INCOMPLETE and `start` when the buffer ends first.

    Raises:
        redis.ConnectionError: the bytes are not RESP2.
    """
    end = buffer.find(b"\r\n", start)
    if end < 0:
        return INCOMPLETE, start
    kind, body, after = buffer[start : start + 1], bytes(buffer[start + 1 : end]), end + 2
    try:
        if kind == b"+":
            return body, after
        if kind == b":":
            return int(body), after
        if kind == b"-":
            message = body.decode(errors="replace")
            error_class = NoScriptError if message.startswith("NOSCRIPT") else redis.ResponseError
            return error_class(message), after
        if kind == b"$":
            length = int(body)
            if length < 0:
                return None, after
            if len(buffer) < after + length + 2:
                return INCOMPLETE, start
            return bytes(buffer[after : after + length]), after + length + 2
        if kind == b"*":
            items: list[Reply] = []
            for _ in range(int(body)):  # -1 (a nil array) gives none
                item, after = parse_reply(buffer, after)
                if isinstance(item, _Incomplete):
                    return INCOMPLETE, start
                items.append(item)
            return (items if int(body) >= 0 else None), after
    except ValueError:
        pass
    raise redis.ConnectionError(f"not a RESP2 reply: {bytes(buffer[start : end + 2])[:40]!r}")


@dataclass(frozen=True, slots=True)
class Address:
    """Where a redis:// or unix:// URL points, and the commands that set a connection up."""

    host: str
    port: int
    path: str  # a unix socket; empty for TCP
    setup: tuple[tuple[str, ...], ...]  # AUTH and SELECT, as the URL asks

    @classmethod
    def parse(cls, url: str) -> Address:
        parsed = urlparse(url)
        if parsed.scheme not in SCHEMES:
            raise ValueError(f"a lean Redis connection takes redis:// or unix:// URLs, got {url!r}")
        path = unquote(parsed.path) if parsed.scheme == "unix" else ""
        return cls(parsed.hostname or "localhost", parsed.port or 6379, path, _setup(parsed))


def supports(url: str) -> bool:
    """Returns: whether these connections serve this URL (TLS, rediss://, is left to redis-py)."""
    return urlparse(url).scheme in SCHEMES


def _setup(url: ParseResult) -> tuple[tuple[str, ...], ...]:
    commands: list[tuple[str, ...]] = []
    if url.password is not None:
        user = (unquote(url.username),) if url.username else ()
        commands.append(("AUTH", *user, unquote(url.password)))
    db = url.path.strip("/") if url.scheme == "redis" else ""
    for pair in url.query.split("&"):
        name, _, value = pair.partition("=")
        if name == "db":
            db = value
    if db and db != "0":
        commands.append(("SELECT", db))
    return tuple(commands)


def _sha1(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def _raised(reply: Reply) -> Reply:
    if isinstance(reply, redis.ResponseError):
        raise reply
    return reply


class RespConnection:
    """One pipelined asyncio connection; `call` from any task of one event loop."""

    def __init__(self, url: str, timeout_s: float) -> None:
        """
        Args:
            url: redis://[user:password@]host[:port][/db] or unix://[user:password@]/path[?db=N].
            timeout_s: connect timeout, and longest wait for a reply.
        """
        self._address = Address.parse(url)
        self._timeout_s = timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._waiting: deque[asyncio.Future[Reply]] = deque()
        self._connecting = asyncio.Lock()

    async def call(self, *args: Arg) -> Reply:
        """Sends one command. Returns: its reply (bulk strings as bytes, integers as int)."""
        async with self._connecting:
            if self._writer is None:
                await self._connect()
        return _raised(await self._send(args))

    async def evalsha(self, script: str, keys: list[str], args: list[Arg]) -> Reply:
        """Runs a Lua script by its SHA1, loading it first if Redis does not have it."""
        try:
            return await self.call("EVALSHA", _sha1(script), len(keys), *keys, *args)
        except NoScriptError:
            await self.call("SCRIPT", "LOAD", script)
            return await self.call("EVALSHA", _sha1(script), len(keys), *keys, *args)

    async def aclose(self) -> None:
        """Closes the connection; calls still waiting fail with redis.ConnectionError."""
        self._drop(redis.ConnectionError("connection closed"))

    async def _send(self, args: tuple[Arg, ...]) -> Reply:
        assert self._writer is not None
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Reply] = loop.create_future()
        self._waiting.append(reply)
        self._writer.write(encode_command(args))
        timer = loop.call_later(self._timeout_s, self._time_out, reply)
        try:
            return await reply
        finally:
            timer.cancel()

    async def _connect(self) -> None:
        address = self._address
        if address.path:
            opening = asyncio.open_unix_connection(address.path)
        else:
            opening = asyncio.open_connection(address.host, address.port)
        try:
            reader, writer = await asyncio.wait_for(opening, self._timeout_s)
        except TimeoutError:
            raise redis.TimeoutError(f"connecting to redis took over {self._timeout_s} s") from None
        except OSError as error:
            raise redis.ConnectionError(f"cannot connect to redis: {error}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._writer = writer
        self._reading = asyncio.get_running_loop().create_task(self._read_replies(reader))
        for command in address.setup:
            reply = await self._send(command)
            if isinstance(reply, redis.ResponseError):
                self._drop(redis.ConnectionError(f"redis refused {command[0]}: {reply}"))
                raise redis.ConnectionError(f"redis refused {command[0]}: {reply}")

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        buffer = bytearray()
        try:
            while data := await reader.read(READ_SIZE):
                buffer += data
                start = 0
                while True:
                    reply, after = parse_reply(buffer, start)
                    if isinstance(reply, _Incomplete):
                        break
                    start = after
                    self._answer(reply)
                del buffer[:start]
            error: Exception = redis.ConnectionError("redis closed the connection")
        except (OSError, redis.ConnectionError) as failure:
            error = redis.ConnectionError(f"connection to redis lost: {failure}")
        if self._reading is asyncio.current_task():  # not dropped (and replaced) already
            self._drop(error)

    def _answer(self, reply: Reply) -> None:
        if not self._waiting:
            raise redis.ConnectionError("redis sent a reply nobody asked for")
        waiting = self._waiting.popleft()
        if not waiting.done():  # else its caller was cancelled
            waiting.set_result(reply)

    def _time_out(self, reply: asyncio.Future[Reply]) -> None:
        if not reply.done():
            self._drop(redis.TimeoutError(f"no reply from redis within {self._timeout_s} s"))

    def _drop(self, error: Exception) -> None:
        """Closes the socket and fails every call still waiting with `error`."""
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None and self._reading is not asyncio.current_task():
            self._reading.cancel()
        self._writer = self._reading = None
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.done():
                waiting.set_exception(error)


class BlockingRespConnection:
    """One blocking connection, for one thread."""

    def __init__(self, url: str, timeout_s: float) -> None:
        """Args: as RespConnection's."""
        self._address = Address.parse(url)
        self._timeout_s = timeout_s
        self._socket: socket.socket | None = None
        self._buffer = bytearray()

    def call(self, *args: Arg) -> Reply:
        """Sends one command and waits for its reply (bulk strings as bytes, integers as int)."""
        if self._socket is None:
            self._connect()
        return _raised(self._send(args))

    def evalsha(self, script: str, keys: list[str], args: list[Arg]) -> Reply:
        """Runs a Lua script by its SHA1, loading it first if Redis does not have it."""
        try:
            return self.call("EVALSHA", _sha1(script), len(keys), *keys, *args)
        except NoScriptError:
            self.call("SCRIPT", "LOAD", script)
            return self.call("EVALSHA", _sha1(script), len(keys), *keys, *args)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._socket = None
        self._buffer.clear()

    def _connect(self) -> None:
        address = self._address
        try:
            if address.path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._timeout_s)
                sock.connect(address.path)
            else:
                sock = socket.create_connection((address.host, address.port), self._timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError:
            raise redis.TimeoutError(f"connecting to redis took over {self._timeout_s} s") from None
        except OSError as error:
            raise redis.ConnectionError(f"cannot connect to redis: {error}") from None
        self._socket = sock
        for command in address.setup:
            reply = self._send(command)
            if isinstance(reply, redis.ResponseError):
                self.close()
                raise redis.ConnectionError(f"redis refused {command[0]}: {reply}")

    def _send(self, args: tuple[Arg, ...]) -> Reply:
        """Writes one command and reads its reply; any failure closes the connection."""
        assert self._socket is not None
        try:
            self._socket.sendall(encode_command(args))
            while True:
                reply, after = parse_reply(self._buffer)
                if not isinstance(reply, _Incomplete):
                    del self._buffer[:after]
                    return reply
                data = self._socket.recv(READ_SIZE)
                if not data:
                    raise redis.ConnectionError("redis closed the connection")
                self._buffer += data
        except TimeoutError:
            self.close()
            raise redis.TimeoutError(f"no reply from redis within {self._timeout_s} s") from None
        except OSError as error:
            self.close()
            raise redis.ConnectionError(f"connection to redis lost: {error}") from None
        except redis.ConnectionError:
            self.close()
            raise
