"""The lean Redis connections (common/resp.py): RESP2 parsing, and both connections against
a real redis-server: pipelined replies matched to their callers, scripts, errors, timeouts,
Redis down, and the URL's database and password."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoScriptError

from common.resp import (
    INCOMPLETE,
    Address,
    BlockingRespConnection,
    RespConnection,
    encode_command,
    parse_reply,
    supports,
)
from tests.unit.gateway_harness import redis_server

SCRIPT = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    client.script_flush()
    return client


@pytest.fixture
def silent_server(tmp_path: Path) -> Iterator[str]:
    """A unix socket that accepts connections and never answers."""
    path = tmp_path / "silent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
    thread.start()
    yield f"unix://{path}"
    server.close()
    for connection in accepted:
        connection.close()


def test_parse_reply_reads_every_kind_and_waits_for_whole_replies():
    replies = [
        (b"+OK\r\n", b"OK"),
        (b":-42\r\n", -42),
        (b"$5\r\nhe\r\no\r\n", b"he\r\no"),
        (b"$-1\r\n", None),
        (b"*-1\r\n", None),
        (b"*0\r\n", []),
        (b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n+x\r\n", [1, [b"a", None], b"x"]),
    ]
    stream = b"".join(data for data, _ in replies)
    start = 0
    for data, expected in replies:
        for cut in range(start, start + len(data)):
            got, at = parse_reply(stream[:cut], start)
            assert got is INCOMPLETE and at == start, f"{data!r} cut at {cut - start} parsed"
        got, start = parse_reply(stream, start)
        assert got == expected, f"{data!r} parsed as {got!r}"
    assert start == len(stream)
    error, _ = parse_reply(b"-NOSCRIPT No matching script\r\n")
    assert isinstance(error, NoScriptError)
    error, _ = parse_reply(b"-ERR wrong\r\n")
    assert type(error) is redis.ResponseError and str(error) == "ERR wrong"
    with pytest.raises(redis.ConnectionError, match="not a RESP2 reply"):
        parse_reply(b"?what\r\n")
    with pytest.raises(redis.ConnectionError, match="not a RESP2 reply"):
        parse_reply(b"$x\r\n")


def test_encode_command_is_an_array_of_bulk_strings():
    assert encode_command(("SET", b"k\r\n", 7)) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$1\r\n7\r\n"


def test_urls():
    assert supports("redis://h:1/2") and supports("unix:///tmp/r.sock")
    assert not supports("rediss://h:1")
    address = Address.parse("redis://user:p%40ss@h:7000/3")
    assert (address.host, address.port, address.path) == ("h", 7000, "")
    assert address.setup == (("AUTH", "user", "p@ss"), ("SELECT", "3"))
    address = Address.parse("unix://:pw@/tmp/r.sock?db=2")
    assert address.path == "/tmp/r.sock"
    assert address.setup == (("AUTH", "pw"), ("SELECT", "2"))
    assert Address.parse("redis://localhost").setup == ()
    with pytest.raises(ValueError, match="rediss://h"):
        Address.parse("rediss://h")


def test_concurrent_calls_share_one_connection_and_each_gets_its_reply(client, redis_url):
    async def scenario() -> None:
        connection = RespConnection(redis_url, timeout_s=2.0)
        values = [f"value-{i}".encode() * (i + 1) for i in range(200)]
        replies = await asyncio.gather(*(connection.call("ECHO", v) for v in values))
        assert replies == values
        assert await connection.call("INCRBY", "n", 5) == 5
        assert await connection.call("GET", "missing") is None
        await connection.aclose()

    asyncio.run(scenario())
    assert client.get("n") == b"5"


def test_a_cancelled_caller_does_not_shift_the_replies_of_later_calls(redis_url):
    async def scenario() -> None:
        connection = RespConnection(redis_url, timeout_s=2.0)
        await connection.call("PING")
        slow = asyncio.ensure_future(connection.call("BLPOP", "empty-list", "0.2"))
        await asyncio.sleep(0.05)
        slow.cancel()
        assert await connection.call("ECHO", b"after") == b"after"
        await connection.aclose()

    asyncio.run(scenario())


def test_scripts_load_on_noscript_and_error_replies_raise_without_breaking_it(client, redis_url):
    async def scenario() -> None:
        connection = RespConnection(redis_url, timeout_s=2.0)
        assert await connection.evalsha(SCRIPT, ["k"], [b"v", 41]) == [b"k", b"v", 42]
        assert await connection.evalsha(SCRIPT, ["k2"], [b"w", 1]) == [b"k2", b"w", 2]
        with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
            await connection.call("GET")
        assert await connection.call("PING") == b"PONG"
        await connection.aclose()

    asyncio.run(scenario())
    assert client.script_exists(hashlib.sha1(SCRIPT.encode()).hexdigest())[0], "not loaded"


def test_blocking_connection_calls_scripts_and_errors(client, redis_url):
    connection = BlockingRespConnection(redis_url, timeout_s=2.0)
    assert connection.evalsha(SCRIPT, ["k"], [b"v", 1]) == [b"k", b"v", 2]
    assert connection.call("SET", "big", b"x" * 200_000) == b"OK"
    assert connection.call("GET", "big") == b"x" * 200_000
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        connection.call("GET")
    assert connection.call("PING") == b"PONG"
    connection.close()


def test_redis_down_raises_connection_error(tmp_path: Path):
    url = f"unix://{tmp_path}/nobody.sock"
    with pytest.raises(redis.ConnectionError, match="cannot connect"):
        BlockingRespConnection(url, timeout_s=0.5).call("PING")

    async def scenario() -> None:
        with pytest.raises(redis.ConnectionError, match="cannot connect"):
            await RespConnection(url, timeout_s=0.5).call("PING")

    asyncio.run(scenario())


def test_no_reply_times_out_and_fails_every_waiting_call(silent_server):
    with pytest.raises(redis.TimeoutError, match="no reply"):
        BlockingRespConnection(silent_server, timeout_s=0.2).call("PING")

    async def scenario() -> None:
        connection = RespConnection(silent_server, timeout_s=0.2)
        calls = [asyncio.ensure_future(connection.call("PING")) for _ in range(3)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, redis.TimeoutError) for r in results), results

    asyncio.run(scenario())


def test_a_lost_connection_fails_its_calls_and_the_next_call_reconnects(client, redis_url):
    async def scenario() -> None:
        connection = RespConnection(redis_url, timeout_s=2.0)
        blocked = asyncio.ensure_future(connection.call("BLPOP", "empty-list", "5"))
        await asyncio.sleep(0.1)
        assert client.client_kill_filter(_type="normal", skipme=True) >= 1
        with pytest.raises(redis.ConnectionError, match="lost|closed"):
            await blocked
        assert await connection.call("PING") == b"PONG"
        await connection.aclose()

    asyncio.run(scenario())


def test_the_urls_database_and_password_apply(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis-auth")) as url:
        admin = redis.Redis.from_url(url)
        admin.config_set("requirepass", "s3cret")
        path = url.removeprefix("unix://")
        good = f"unix://:s3cret@{path}?db=3"
        BlockingRespConnection(good, timeout_s=2.0).call("SET", "k", b"blocking")

        async def scenario() -> None:
            connection = RespConnection(good, timeout_s=2.0)
            assert await connection.call("APPEND", "k", b"+async") == len(b"blocking+async")
            await connection.aclose()
            with pytest.raises(redis.ConnectionError, match="refused AUTH"):
                await RespConnection(f"unix://:wrong@{path}", timeout_s=2.0).call("PING")

        asyncio.run(scenario())
        with pytest.raises(redis.ConnectionError, match="refused AUTH"):
            BlockingRespConnection(f"unix://:wrong@{path}", timeout_s=2.0).call("PING")
        checker = redis.Redis(unix_socket_path=path, password="s3cret", db=3)
        assert checker.get("k") == b"blocking+async"
