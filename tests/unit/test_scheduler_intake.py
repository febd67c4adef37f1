"""The scheduler's intake against a real redis-server: how it waits for new requests."""

from __future__ import annotations

import threading

import pytest
import redis

from scheduler.config import SchedulerConfig
from scheduler.service import Scheduler
from tests.unit.gateway_harness import redis_server, wait_for


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as url:
        yield url


def blocked_stream_reads(client: redis.Redis) -> list[dict]:
    return [c for c in client.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"]]


@pytest.mark.parametrize("registry_poll_ms", [20.0, 90.0, 500.0])
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
