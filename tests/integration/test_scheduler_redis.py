"""The scheduler against a real redis-server: its leader lock, its wait on the request
stream, the assignment script, and when a queued request's window starts (Redis's clock)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from common.keys import PAYLOAD_FIELD, QUEUED_AT_FIELD, SCHEDULER_GROUP, RedisKeys
from gateway.request_queue import RequestQueue
from protos.kvgate.v1 import internal_pb2
from scheduler.clock import RedisClock
from scheduler.config import SchedulerConfig
from scheduler.intake import RequestIntake
from scheduler.leader import LeaderLock
from scheduler.queue import FcfsPolicy, WindowBatcher, WindowLimits
from scheduler.service import Scheduler
from scheduler.streams import ExecutorDirectory, NotLeader, RequestStream, to_pending
from tests.helpers import wait_for

TTL_MS = 300


def test_one_holder_at_a_time_and_the_key_names_it(redis_client):
    leader = LeaderLock(redis_client, "leader", "scheduler-a", TTL_MS)
    standby = LeaderLock(redis_client, "leader", "scheduler-b", TTL_MS)
    assert leader.try_acquire() and leader.try_acquire(), "the holder keeps its lock"
    assert not standby.try_acquire() and not standby.renew(), "a standby took a held lock"
    assert redis_client.get("leader") == b"scheduler-a"
    leader.release()
    assert standby.try_acquire() and redis_client.get("leader") == b"scheduler-b"
    leader.release()
    assert redis_client.get("leader") == b"scheduler-b", "a former holder released another's lock"


def test_a_holder_that_stops_renewing_loses_the_lock_to_a_standby(redis_client):
    leader = LeaderLock(redis_client, "leader", "scheduler-a", TTL_MS)
    standby = LeaderLock(redis_client, "leader", "scheduler-b", TTL_MS)
    assert leader.try_acquire()
    wait_for(lambda: redis_client.pttl("leader") <= TTL_MS / 2, "the lock's TTL to run down")
    assert leader.renew(), "a renewal within the time to live must keep the lock"
    assert TTL_MS / 2 < redis_client.pttl("leader") <= TTL_MS, "the renewal did not reset the TTL"
    assert standby.wait(0.02, lambda: False), "the standby never got the expired lock"
    assert not leader.renew(), "the old holder still thinks it leads"
    assert redis_client.get("leader") == b"scheduler-b"


def test_a_stopped_wait_returns_without_the_lock(redis_client):
    LeaderLock(redis_client, "leader", "scheduler-a", 10_000).try_acquire()
    standby = LeaderLock(redis_client, "leader", "scheduler-b", 10_000)
    stops = iter([False, False, True])
    assert not standby.wait(0.01, lambda: next(stops))


def blocked_stream_reads(client: redis.Redis) -> list[dict]:
    return [c for c in client.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"]]


@pytest.mark.parametrize("registry_poll_ms", [20.0, 90.0])
def test_an_idle_scheduler_waits_on_the_stream_between_polls(
    redis_url, redis_client, registry_poll_ms
):
    """Between executor polls, even ones closer than Redis's 100 ms timeout resolution, the
    scheduler waits inside XREADGROUP BLOCK, so a request that arrives wakes it at once
    instead of waiting out a sleep until the next poll."""
    client = redis_client
    config = SchedulerConfig(
        redis_url=redis_url,
        registry_poll_ms=registry_poll_ms,
        scheduler_id="intake-test",
        metrics_port=-1,
    )
    scheduler = Scheduler(config, redis.Redis.from_url(config.redis_url))
    RequestStream(client, RedisKeys(config.redis_prefix), config.scheduler_id).ensure_group()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            scheduler.tick()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        wait_for(lambda: blocked_stream_reads(client), "the scheduler blocked in XREADGROUP")
    finally:
        stop.set()
        thread.join(5.0)


@pytest.mark.parametrize("cancelled", [False, True])
def test_assignment_checks_the_cancel_marker_in_the_same_atomic_step(redis_client, cancelled):
    """The assignment is written unless the gateway marked the request cancelled; either way
    the request stream entry is acknowledged and deleted."""

    client, keys = redis_client, RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "scheduler-a")
    stream.ensure_group()
    client.set(keys.scheduler_leader, "scheduler-a")
    queued = internal_pb2.QueuedRequest(request_id="r1", prompt_token_ids=[5, 6, 7])
    client.xadd(keys.requests, {PAYLOAD_FIELD: queued.SerializeToString()})
    [entry] = stream.read_new(None, 10)
    if cancelled:
        client.set(keys.cancelled("r1"), b"1")
    now = time.monotonic()
    request = to_pending(entry, 16, now, now)
    assert stream.assign(request, "exec-1", "scheduler-a") is (not cancelled)
    inbox = client.xrange(keys.executor_inbox("exec-1"))
    assert len(inbox) == (0 if cancelled else 1)
    if inbox:
        message = internal_pb2.InboxMessage.FromString(inbox[0][1][PAYLOAD_FIELD.encode()])
        assert message.assignment.request.request_id == "r1"
        assert message.assignment.executor_id == "exec-1"
    assert client.xlen(keys.requests) == 0, "the request entry should be deleted"
    assert client.xpending(keys.requests, SCHEDULER_GROUP)["pending"] == 0, "not acknowledged"


def test_a_scheduler_that_lost_the_leader_lock_writes_nothing(redis_client):
    """A leader paused past its lock's life wakes up holding requests its successor now owns:
    its assignment, drop and re-queue are refused (NotLeader) and change nothing."""
    client, keys = redis_client, RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "old-leader")
    stream.ensure_group()
    client.xadd(keys.requests, {PAYLOAD_FIELD: b"x"})
    queued = internal_pb2.QueuedRequest(request_id="r1", prompt_token_ids=[5, 6, 7])
    client.xadd(keys.requests, {PAYLOAD_FIELD: queued.SerializeToString()})
    first, entry = stream.read_new(None, 10)
    assignment = internal_pb2.InboxMessage()
    assignment.assignment.request.CopyFrom(queued)
    client.xadd(keys.executor_inbox("gone"), {PAYLOAD_FIELD: assignment.SerializeToString()})
    client.set(keys.scheduler_leader, "new-leader")
    now = time.monotonic()
    with pytest.raises(NotLeader):
        stream.assign(to_pending(entry, 16, now, now), "exec-1", "old-leader")
    with pytest.raises(NotLeader):
        stream.drop([first.entry_id])
    with pytest.raises(NotLeader):
        ExecutorDirectory(client, keys, "old-leader").requeue_inbox("gone")
    assert client.xlen(keys.requests) == 2, "nothing may leave the request stream"
    assert client.xlen(keys.executor_inbox("exec-1")) == 0, "nothing may be assigned"
    assert client.xlen(keys.executor_inbox("gone")) == 1, "the inbox must stay for the leader"
    assert client.xpending(keys.requests, SCHEDULER_GROUP)["pending"] == 2, "nothing acked"


def redis_time_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1_000_000 + micros


def test_the_gateway_queues_a_request_with_the_redis_time(redis_url, redis_client):
    """The enqueue script stores the server's TIME in the entry: where the window starts."""

    client, keys = redis_client, RedisKeys("kvgate-test:")
    client.sadd(keys.executors, "exec-1")
    client.set(keys.executor_status("exec-1"), b"")

    async def enqueue() -> None:
        async with aioredis.Redis.from_url(redis_url) as aio_client:
            queue = RequestQueue(aio_client, keys, max_queue_len=8, cancel_ttl_s=1.0)
            await queue.enqueue(internal_pb2.QueuedRequest(request_id="r1"))

    before = redis_time_us(client)
    asyncio.run(enqueue())
    after = redis_time_us(client)
    [(_, fields)] = client.xrange(keys.requests)
    assert before <= int(fields[QUEUED_AT_FIELD.encode()]) <= after


def test_the_redis_clock_reads_server_times_onto_the_monotonic_clock(redis_client):
    client = redis_client
    clock = RedisClock(client)
    now = time.monotonic()
    assert clock.monotonic(redis_time_us(client), now) == now, "before a sync: now"
    for _ in range(3):
        clock.sync()
    now = time.monotonic()
    server_now = redis_time_us(client)
    mapped = clock.monotonic(server_now - 2_000_000, now + 1.0)
    assert abs(mapped - (now - 2.0)) < 0.2, (mapped, now)
    assert clock.monotonic(server_now + 5_000_000, now) == now, "a future time is clamped to now"


def queue_raw(client: redis.Redis, keys, request_id: str, queued_us: int | None) -> None:

    payload = internal_pb2.QueuedRequest(request_id=request_id, prompt_token_ids=[1, 2])
    fields = {PAYLOAD_FIELD: payload.SerializeToString()}
    if queued_us is not None:
        fields[QUEUED_AT_FIELD] = str(queued_us)
    client.xadd(keys.requests, fields)


def test_the_window_counts_from_when_the_request_was_queued(redis_client):
    """A request that spent the window in the stream before the scheduler read it is due at
    once; one queued just now waits the whole window."""
    client, keys = redis_client, RedisKeys("kvgate-test:")
    stream, clock = RequestStream(client, keys, "s"), RedisClock(client)
    batcher = WindowBatcher(WindowLimits(500.0, 64, 8192), FcfsPolicy())
    intake = RequestIntake(stream, clock, batcher)
    clock.sync()
    stream.ensure_group()
    queue_raw(client, keys, "late", redis_time_us(client) - 800_000)
    intake.admit(stream.read_new(None, 10), time.monotonic(), 16)
    assert batcher.release_reason(time.monotonic()) == "window"
    assert [r.request_id for r in batcher.release(time.monotonic())] == ["late"]

    queued_s = time.monotonic()
    queue_raw(client, keys, "fresh", redis_time_us(client))
    intake.admit(stream.read_new(None, 10), time.monotonic(), 16)
    now = time.monotonic()
    assert batcher.release_reason(now) is None
    # The whole window less the time since it was queued, give or take the clock's own error
    # (half the round trip of the TIME read it maps by).
    assert 0.5 - (now - queued_s) - clock.error_s <= batcher.seconds_until_due(now) <= 0.5


def test_an_entry_without_a_queued_time_counts_from_the_end_of_its_id_millisecond(redis_client):
    """Entries re-queued by plain XADD (an executor's hand-back, a gateway's re-queue)."""
    client, keys = redis_client, RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "s")
    stream.ensure_group()
    queue_raw(client, keys, "r1", None)
    queue_raw(client, keys, "r2", 1_700_000_000_123_456)
    first, second = stream.read_new(None, 10)
    millis = int(first.entry_id.split("-")[0])
    assert first.queued_unix_us == (millis + 1) * 1000
    assert second.queued_unix_us == (int(second.entry_id.split("-")[0]) + 1) * 1000, (
        "a queued time a year away from the entry's own time is malformed"
    )


@pytest.mark.parametrize("queued_at", ["0", "9" * 400, "9" * 5000, "-5", "12.5", "abc", ""])
def test_a_malformed_queued_time_is_ignored(redis_client, queued_at):
    """A queued time that is not the script's (garbage, far from the entry id's time) counts
    as absent: the scheduler neither stops nor thinks the request waited for decades."""
    client, keys = redis_client, RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "s")
    stream.ensure_group()
    client.xadd(keys.requests, {PAYLOAD_FIELD: b"", QUEUED_AT_FIELD: queued_at})
    [entry] = stream.read_new(None, 10)
    assert entry.queued_unix_us == (int(entry.entry_id.split("-")[0]) + 1) * 1000


def test_a_queued_time_near_the_entry_id_is_kept(redis_client):
    client, keys = redis_client, RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "s")
    stream.ensure_group()
    queued_us = redis_time_us(client) - 123
    queue_raw(client, keys, "r1", queued_us)
    [entry] = stream.read_new(None, 10)
    assert entry.queued_unix_us == queued_us
