"""The executor's heartbeat: its status, published in Redis with a short TTL (it is alive while
the key exists), and the check that no live executor has its id."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import redis

from common.keys import EXECUTOR_STATUS_TTL_MS, HEARTBEAT_INTERVAL_S, RedisKeys
from common.redis_conn import REDIS_DOWN_ERRORS, Backoff
from protos.kvgate.v1 import internal_pb2

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StatusBoard:
    """The latest ExecutorStatus, written by the step loop, published by the heartbeat."""

    status: internal_pb2.ExecutorStatus = field(default_factory=internal_pb2.ExecutorStatus)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, status: internal_pb2.ExecutorStatus) -> None:
        with self.lock:
            self.status = status

    def read(self) -> internal_pb2.ExecutorStatus:
        with self.lock:
            return self.status


class Heartbeat:
    """Publishes the executor's status every HEARTBEAT_INTERVAL_S, with a TTL.

    Redis down is logged once; beats are then retried with backoff until it answers.
    """

    def __init__(self, client: redis.Redis, keys: RedisKeys, board: StatusBoard) -> None:
        self._client = client
        self._keys = keys
        self._board = board
        self._redis_down = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Beats once (when Redis answers), then every HEARTBEAT_INTERVAL_S on a thread."""
        self.try_beat()
        self._thread.start()

    def stop(self) -> None:
        """Stops beating and removes the status: the executor is gone."""
        self._stop.set()
        self._thread.join()
        status = self._board.read()
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._keys.executor_status(status.executor_id))
            pipe.srem(self._keys.executors, status.executor_id)
            pipe.execute()
        except REDIS_DOWN_ERRORS as error:
            log.warning("could not remove the executor status: %s", error)

    def beat(self) -> None:
        """Writes the current status once."""
        status = internal_pb2.ExecutorStatus()
        status.CopyFrom(self._board.read())
        status.heartbeat_unix_ms = int(time.time() * 1000)
        pipe = self._client.pipeline(transaction=True)
        pipe.set(
            self._keys.executor_status(status.executor_id),
            status.SerializeToString(),
            px=EXECUTOR_STATUS_TTL_MS,
        )
        pipe.sadd(self._keys.executors, status.executor_id)
        pipe.execute()

    def try_beat(self) -> bool:
        """Writes the current status once. Returns: False when Redis is unreachable."""
        try:
            self.beat()
        except REDIS_DOWN_ERRORS as error:
            if not self._redis_down:
                log.warning("heartbeat: redis unreachable (%s); retrying with backoff", error)
                self._redis_down = True
            return False
        if self._redis_down:
            log.info("heartbeat: redis reachable again")
            self._redis_down = False
        return True

    def _run(self) -> None:
        delays = Backoff(max_s=HEARTBEAT_INTERVAL_S).delays()
        wait_s = HEARTBEAT_INTERVAL_S if not self._redis_down else next(delays)
        while not self._stop.wait(wait_s):
            if self.try_beat():
                delays = Backoff(max_s=HEARTBEAT_INTERVAL_S).delays()
                wait_s = HEARTBEAT_INTERVAL_S
            else:
                wait_s = next(delays)


def another_executor_has_the_id(client: redis.Redis, keys: RedisKeys, executor_id: str) -> bool:
    """Whether a live executor already uses `executor_id`: its status key is still there one
    heartbeat TTL later (a crashed one's key expires by then). False when Redis is down."""
    key = keys.executor_status(executor_id)
    try:
        if not client.exists(key):
            return False
        time.sleep(EXECUTOR_STATUS_TTL_MS / 1000 + HEARTBEAT_INTERVAL_S)
        return bool(client.exists(key))
    except redis.RedisError:
        return False
