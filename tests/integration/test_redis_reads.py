"""The gateway's Redis client against a real redis-server: its read timeout counts the time
its event loop was free, so a reply that came in time while the loop was busy elsewhere is
read, and a Redis that does not answer still fails the call with redis's TimeoutError."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import redis

from common.redis_conn import connect

TIMEOUT_S = 0.3


# Answers after ARGV[1] microseconds of work in Redis.
SLOW_REPLY = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start > tonumber(ARGV[1])
return 'done'
"""


async def slow_reply_while_the_loop_is_busy(url: str, busy_s: float) -> bytes:
    client = connect(url, timeout_s=TIMEOUT_S)
    try:
        await client.ping()
        # the reply takes 0.1 s; the loop turns to something else for busy_s after 0.02 s
        asyncio.get_running_loop().call_later(0.02, time.sleep, busy_s)
        return await client.eval(SLOW_REPLY, 0, 100_000)
    finally:
        await client.aclose()


def test_a_reply_that_came_while_the_loop_was_busy_is_read(redis_url):
    assert asyncio.run(slow_reply_while_the_loop_is_busy(redis_url, 4 * TIMEOUT_S)) == b"done"


def test_a_redis_that_does_not_answer_still_fails_the_call():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"

        async def ping() -> None:
            client = connect(url, timeout_s=TIMEOUT_S)
            try:
                # the guard only ends a read that would wait for ever: a builtin TimeoutError
                await asyncio.wait_for(client.ping(), 100 * TIMEOUT_S)
            finally:
                await client.aclose()

        with pytest.raises(redis.TimeoutError):
            asyncio.run(ping())
