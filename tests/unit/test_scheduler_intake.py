"""The scheduler's intake: how it waits for new requests (against a real redis-server, and
its choice of wait with the stream recorded)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from scheduler.config import SchedulerConfig
from scheduler.queue import PendingRequest
from scheduler.service import Scheduler
from tests.unit.gateway_harness import redis_server, wait_for

real_sleep = time.sleep


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as url:
        yield url


def blocked_stream_reads(client: redis.Redis) -> list[dict]:
    return [c for c in client.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"]]


@pytest.mark.parametrize("registry_poll_ms", [20.0, 90.0])
def test_an_idle_scheduler_waits_on_the_stream_between_polls(redis_url, registry_poll_ms):
    """Between executor polls, even ones closer than Redis's 100 ms timeout resolution, the
    scheduler waits inside XREADGROUP BLOCK, so a request that arrives wakes it at once
    instead of waiting out a sleep until the next poll."""
    client = redis.Redis.from_url(redis_url)
    config = SchedulerConfig(
        redis_url=redis_url,
        registry_poll_ms=registry_poll_ms,
        scheduler_id="intake-test",
        metrics_port=-1,
    )
    scheduler = Scheduler(config, redis.Redis.from_url(config.redis_url))
    scheduler._stream.ensure_group()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            scheduler.tick()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: blocked_stream_reads(client) or None, "the scheduler blocked in XREADGROUP"
        )
    finally:
        stop.set()
        thread.join(5.0)


class RecordingStream:
    """Stands in for the request stream: records how each read was asked to wait; each read
    takes `read_s`."""

    def __init__(self, read_s: float = 0.0) -> None:
        self.blocks: list[int | None] = []
        self.read_s = read_s

    def read_new(self, block_ms: int | None, count: int) -> list:
        self.blocks.append(block_ms)
        real_sleep(self.read_s)
        return []


def waits_of(monkeypatch, window_ms: float, poll_in_ms: float, waiting: bool, stalled=False):
    """One `_read_new` of a scheduler: (the read's block_ms, the seconds slept)."""
    config = SchedulerConfig(batch_window_ms=window_ms, scheduler_id="waits", metrics_port=-1)
    scheduler = Scheduler(config, redis.Redis(port=1))  # never connects: the stream is replaced
    stream = RecordingStream()
    scheduler._stream = stream
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr("scheduler.service.time.sleep", sleep)
    now = time.monotonic()
    scheduler._next_poll_s = now + poll_in_ms / 1000.0
    scheduler._stalled = stalled
    if waiting:
        scheduler._batcher.add(pending("r1", arrival_s=now))
    scheduler._read_new()
    return stream.blocks[0], slept


def pending(request_id: str, arrival_s: float) -> PendingRequest:
    return PendingRequest(
        request_id=request_id,
        entry_id="0-1",
        num_prompt_tokens=8,
        block_hashes=[],
        priority=0,
        session_id=None,
        session_executor_id=None,
        arrival_s=arrival_s,
        deadline_s=None,
        payload=b"",
    )


def test_with_nothing_waiting_it_waits_on_the_stream_until_the_poll(monkeypatch):
    block_ms, slept = waits_of(monkeypatch, window_ms=2.0, poll_in_ms=50.0, waiting=False)
    assert slept == [] and block_ms is not None and 1 <= block_ms <= 50, (block_ms, slept)


@pytest.mark.parametrize("poll_in_ms", [60.0, 10.0])
def test_a_window_closing_within_redis_resolution_is_slept_out_exactly(monkeypatch, poll_in_ms):
    """A BLOCK would end on Redis's 100 ms clock, so a 30 ms window would close up to 100 ms
    late; the scheduler sleeps to the close (or to a poll due sooner) instead, then reads
    without waiting."""
    block_ms, slept = waits_of(monkeypatch, window_ms=30.0, poll_in_ms=poll_in_ms, waiting=True)
    assert block_ms is None, f"read with BLOCK {block_ms} while a window closes in 30 ms"
    expected_s = min(30.0, poll_in_ms) / 1000.0
    assert slept and 0.0 < slept[0] <= expected_s and sum(slept) <= expected_s, slept


def test_the_last_read_before_a_window_closes_starts_early_by_what_reads_take(monkeypatch):
    """The read before a close starts early by the average of what the reads took, and the
    batch still leaves no earlier than the close."""
    config = SchedulerConfig(scheduler_id="lead", metrics_port=-1)
    scheduler = Scheduler(config, redis.Redis(port=1))  # never connects: the stream is replaced
    scheduler._stream = RecordingStream(read_s=0.005)
    wake_targets: list[float] = []

    def sleep(seconds: float) -> None:
        wake_targets.append(time.monotonic() + seconds)
        real_sleep(seconds)

    monkeypatch.setattr("scheduler.service.time.sleep", sleep)
    for _ in range(10):
        due_s = time.monotonic() + 0.02
        wake_targets.clear()
        scheduler._read_until(due_s)
        assert time.monotonic() >= due_s
    assert 0.004 < scheduler._read_lead_s, scheduler._read_lead_s
    assert wake_targets[0] <= due_s - 0.004, "the last read did not start early"


def test_a_long_window_waits_on_the_stream_only_until_a_resolution_before_its_close(monkeypatch):
    block_ms, slept = waits_of(monkeypatch, window_ms=250.0, poll_in_ms=1000.0, waiting=True)
    assert slept == [] and block_ms is not None and 1 <= block_ms <= 150, (block_ms, slept)


def test_a_stalled_batch_waits_for_the_next_poll(monkeypatch):
    block_ms, slept = waits_of(
        monkeypatch, window_ms=2.0, poll_in_ms=80.0, waiting=True, stalled=True
    )
    assert slept == [] and block_ms is not None and 1 <= block_ms <= 80, (block_ms, slept)


@pytest.mark.parametrize("cancelled", [False, True])
def test_assignment_checks_the_cancel_marker_in_the_same_atomic_step(redis_url, cancelled):
    """The assignment is written unless the gateway marked the request cancelled; either way
    the request stream entry is acknowledged and deleted."""
    from common.keys import PAYLOAD_FIELD, SCHEDULER_GROUP, RedisKeys
    from protos.kvgate.v1 import internal_pb2
    from scheduler.streams import RequestStream, to_pending

    client, keys = redis.Redis.from_url(redis_url), RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "scheduler-a")
    stream.ensure_group()
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


def redis_time_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1_000_000 + micros


def test_the_gateway_queues_a_request_with_the_redis_time(redis_url):
    """The enqueue script stores the server's TIME in the entry: where the window starts."""
    import asyncio

    import redis.asyncio as aioredis

    from common.keys import QUEUED_AT_FIELD, RedisKeys
    from gateway.request_queue import RequestQueue
    from protos.kvgate.v1 import internal_pb2

    client, keys = redis.Redis.from_url(redis_url), RedisKeys("kvgate-test:")
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


def test_the_redis_clock_reads_server_times_onto_the_monotonic_clock(redis_url):
    from scheduler.clock import RedisClock

    client = redis.Redis.from_url(redis_url)
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
    from common.keys import PAYLOAD_FIELD, QUEUED_AT_FIELD
    from protos.kvgate.v1 import internal_pb2

    payload = internal_pb2.QueuedRequest(request_id=request_id, prompt_token_ids=[1, 2])
    fields = {PAYLOAD_FIELD: payload.SerializeToString()}
    if queued_us is not None:
        fields[QUEUED_AT_FIELD] = str(queued_us)
    client.xadd(keys.requests, fields)


def test_the_window_counts_from_when_the_request_was_queued(redis_url):
    """A request that spent the window in the stream before the scheduler read it is due at
    once; one queued just now waits the whole window."""
    from common.keys import RedisKeys

    client, keys = redis.Redis.from_url(redis_url), RedisKeys("kvgate-test:")
    config = SchedulerConfig(
        redis_prefix=keys.prefix, batch_window_ms=500.0, scheduler_id="s", metrics_port=-1
    )
    scheduler = Scheduler(config, client)
    scheduler._clock.sync()
    scheduler._stream.ensure_group()
    queue_raw(client, keys, "late", redis_time_us(client) - 800_000)
    scheduler._admit(scheduler._stream.read_new(None, 10), time.monotonic())
    assert scheduler._batcher.release_reason(time.monotonic()) == "window"
    assert [r.request_id for r in scheduler._batcher.release(time.monotonic())] == ["late"]

    queue_raw(client, keys, "fresh", redis_time_us(client))
    scheduler._admit(scheduler._stream.read_new(None, 10), time.monotonic())
    now = time.monotonic()
    assert scheduler._batcher.release_reason(now) is None
    assert 0.3 < scheduler._batcher.seconds_until_due(now) <= 0.5


def test_an_entry_without_a_queued_time_counts_from_the_end_of_its_id_millisecond(redis_url):
    """Entries re-queued by plain XADD (an executor's hand-back, a gateway's re-queue)."""
    from common.keys import RedisKeys
    from scheduler.streams import RequestStream

    client, keys = redis.Redis.from_url(redis_url), RedisKeys("kvgate-test:")
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
def test_a_malformed_queued_time_is_ignored(redis_url, queued_at):
    """A queued time that is not the script's (garbage, far from the entry id's time) counts
    as absent: the scheduler neither stops nor thinks the request waited for decades."""
    from common.keys import PAYLOAD_FIELD, QUEUED_AT_FIELD, RedisKeys
    from scheduler.streams import RequestStream

    client, keys = redis.Redis.from_url(redis_url), RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "s")
    stream.ensure_group()
    client.xadd(keys.requests, {PAYLOAD_FIELD: b"", QUEUED_AT_FIELD: queued_at})
    [entry] = stream.read_new(None, 10)
    assert entry.queued_unix_us == (int(entry.entry_id.split("-")[0]) + 1) * 1000


def test_a_queued_time_near_the_entry_id_is_kept(redis_url):
    from common.keys import RedisKeys
    from scheduler.streams import RequestStream

    client, keys = redis.Redis.from_url(redis_url), RedisKeys("kvgate-test:")
    stream = RequestStream(client, keys, "s")
    stream.ensure_group()
    queued_us = redis_time_us(client) - 123
    queue_raw(client, keys, "r1", queued_us)
    [entry] = stream.read_new(None, 10)
    assert entry.queued_unix_us == queued_us
