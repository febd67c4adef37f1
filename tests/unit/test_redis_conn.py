"""common/redis_conn.py: which Redis error replies are outages, how errors read, and the
Sentinel URL form."""

from __future__ import annotations

import pytest
import redis
from redis._parsers.base import BaseParser

from common.config import check_redis_url
from common.redis_conn import ConnectionBudgetExhausted, connect_sync, describe, is_outage
from common.redis_url import SentinelUrl, parse_sentinel_url
from deploy.stack import free_port

# Replies Redis sends while it cannot serve, as redis-py's parser turns them into errors.
OUTAGE_REPLIES = [
    "READONLY You can't write against a read only replica.",
    "LOADING Redis is loading the dataset in memory",
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "NOREPLICAS Not enough good replicas to write.",
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
    "TRYAGAIN Multiple keys request during rehashing of slot",
]
MISTAKES = [
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "ERR unknown command 'FOO'",
    "NOSCRIPT No matching script. Please use EVAL.",
]


@pytest.mark.parametrize("reply", OUTAGE_REPLIES)
def test_every_reply_of_a_redis_that_cannot_serve_is_an_outage(reply):
    assert is_outage(BaseParser.parse_error(reply)), reply


@pytest.mark.parametrize("reply", MISTAKES)
def test_a_mistake_in_a_command_is_not_an_outage(reply):
    assert not is_outage(BaseParser.parse_error(reply)), reply


def test_connection_loss_is_an_outage_and_a_spent_budget_is_not():
    assert is_outage(redis.ConnectionError("Connection closed by server."))
    assert is_outage(redis.TimeoutError("Timeout reading from socket"))
    assert not is_outage(ConnectionBudgetExhausted(8, 0.1))


def test_the_sentinel_url_names_the_sentinels_the_master_and_the_database():
    url = "redis+sentinel://:s3cret@10.0.0.1:26379,[::1]:26380/kvgate/2"
    assert parse_sentinel_url(url) == SentinelUrl(
        (("10.0.0.1", 26379), ("::1", 26380)), "kvgate", 2, None, "s3cret"
    )
    assert parse_sentinel_url("redis+sentinel://h:1/m").db == 0


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://h:26379", "no master name"),
        ("redis+sentinel://h/kvgate", "is not HOST:PORT"),
        ("redis+sentinel://h:26379/kvgate/x", "is not a number"),
        ("sentinel://h:26379/kvgate", "must be a redis://"),
    ],
)
def test_a_bad_redis_url_is_a_flag_error_saying_what_is_wrong(url, problem):
    with pytest.raises(ValueError, match=f"--redis-url .*{problem}"):
        check_redis_url("--redis-url", url)


def test_a_pipelines_error_reads_without_the_commands_binary_values():
    """redis-py quotes a failed pipeline command whole: a heartbeat's SET carried its
    serialized status into the log."""
    error = BaseParser.parse_error("READONLY You can't write against a read only replica.")
    command = ("SET", "kvgate:executor:e0", b"\n\x02e0\x10\x80\x04\xff\xfe", "PX", 3000)
    redis.client.Pipeline.annotate_exception(None, error, 1, command)
    assert "\\x" in str(error) or "\ufffd" in str(error), "redis-py quotes the value"
    assert describe(error) == (
        "You can't write against a read only replica. (SET, command 1 of a pipeline)"
    )
    assert describe(redis.ConnectionError("Connection refused")) == "Connection refused"


def test_no_master_names_the_sentinels_asked_and_the_master_not_their_clients():
    ports = [free_port(), free_port()]
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    client = connect_sync(f"redis+sentinel://{hosts}/kvmaster", timeout_s=1.0)
    with pytest.raises(redis.ConnectionError) as raised:
        client.ping()
    message = str(raised.value)
    assert message.startswith("no master named 'kvmaster' from the sentinels "), message
    assert all(f"127.0.0.1:{port}" in message for port in ports), message
    assert "ConnectionError" in message and "<redis." not in message, message
    assert len(message) < 200, message
