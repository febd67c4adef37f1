"""The scheduler's leader lock against a real redis-server: one holder at a time, the key
names it, a holder that stops renewing loses it."""

from __future__ import annotations

import time

import pytest
import redis

from scheduler.leader import LeaderLock
from tests.unit.gateway_harness import redis_server

TTL_MS = 300


@pytest.fixture
def client(tmp_path):
    with redis_server(tmp_path) as url:
        yield redis.Redis.from_url(url)


def test_one_holder_at_a_time_and_the_key_names_it(client):
    leader = LeaderLock(client, "leader", "scheduler-a", TTL_MS)
    standby = LeaderLock(client, "leader", "scheduler-b", TTL_MS)
    assert leader.try_acquire() and leader.try_acquire(), "the holder keeps its lock"
    assert not standby.try_acquire() and not standby.renew(), "a standby took a held lock"
    assert client.get("leader") == b"scheduler-a"
    leader.release()
    assert standby.try_acquire() and client.get("leader") == b"scheduler-b"
    leader.release()
    assert client.get("leader") == b"scheduler-b", "a former holder released another's lock"


def test_a_holder_that_stops_renewing_loses_the_lock_to_a_standby(client):
    leader = LeaderLock(client, "leader", "scheduler-a", TTL_MS)
    standby = LeaderLock(client, "leader", "scheduler-b", TTL_MS)
    assert leader.try_acquire()
    time.sleep(TTL_MS / 2000.0)
    assert leader.renew(), "a renewal within the time to live must keep the lock"
    assert 0 < client.pttl("leader") <= TTL_MS
    assert standby.wait(0.02, lambda: False), "the standby never got the expired lock"
    assert not leader.renew(), "the old holder still thinks it leads"
    assert client.get("leader") == b"scheduler-b"


def test_a_stopped_wait_returns_without_the_lock(client):
    LeaderLock(client, "leader", "scheduler-a", 10_000).try_acquire()
    standby = LeaderLock(client, "leader", "scheduler-b", 10_000)
    stops = iter([False, False, True])
    assert not standby.wait(0.01, lambda: next(stops))
