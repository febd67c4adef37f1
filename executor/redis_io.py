"""The executor's Redis I/O, off the step loop: the inbox reader and the heartbeat."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import redis
from google.protobuf.message import DecodeError

from common.keys import EXECUTOR_STATUS_TTL_MS, HEARTBEAT_INTERVAL_S, PAYLOAD_FIELD, RedisKeys
from common.redis_conn import REDIS_DOWN_ERRORS, Backoff
from protos.kvgate.v1 import internal_pb2

log = logging.getLogger(__name__)
# Longest XREAD BLOCK of the inbox reader, in ms: how fast it notices a stop.
INBOX_BLOCK_MS = 200
# Most inbox entries read at once.
INBOX_COUNT = 64


@dataclass(slots=True, frozen=True)
class InboxEntry:
    """One message read from the executor's inbox stream."""

    entry_id: str
    message: internal_pb2.InboxMessage


class InboxReader:
    """Reads the inbox stream on its own thread and hands entries to the step loop.

    Entries stay in the stream until the step loop handled them (`handled`);
    they are XDEL'd then, so the scheduler re-queues whatever a dead executor
    left unread.
    """

    def __init__(
        self, client: redis.Redis, inbox_key: str, deliver: queue.SimpleQueue[InboxEntry]
    ) -> None:
        self._client = client
        self._inbox_key = inbox_key
        self._deliver = deliver
        self._handled: deque[str] = deque()
        self._last_id = "0"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops reading; returns once no more entries can be delivered."""
        self._stop.set()
        self._thread.join()
        self._delete_handled()

    def handled(self, entry_id: str) -> None:
        """Marks an entry as handled; the reader deletes it from the stream."""
        self._handled.append(entry_id)

    def _run(self) -> None:
        delays = Backoff().delays()
        while not self._stop.is_set():
            try:
                self._delete_handled()
                self._read_once()
                delays = Backoff().delays()
            except REDIS_DOWN_ERRORS as error:
                delay_s = next(delays)
                log.warning("inbox: redis unreachable (%s); retrying in %.2fs", error, delay_s)
                self._stop.wait(delay_s)

    def _read_once(self) -> None:
        reply = self._client.xread(
            {self._inbox_key: self._last_id}, count=INBOX_COUNT, block=INBOX_BLOCK_MS
        )
        for _, entries in reply or []:
            for raw_id, fields in entries:
                self._last_id = raw_id.decode()
                self._deliver_entry(self._last_id, fields.get(PAYLOAD_FIELD.encode(), b""))

    def _deliver_entry(self, entry_id: str, payload: bytes) -> None:
        message = internal_pb2.InboxMessage()
        try:
            message.ParseFromString(payload)
        except DecodeError:
            log.warning("inbox entry %s is not an InboxMessage: deleted", entry_id)
            self.handled(entry_id)
            return
        self._deliver.put(InboxEntry(entry_id, message))

    def _delete_handled(self) -> None:
        ids = [self._handled.popleft() for _ in range(len(self._handled))]
        if ids:
            self._client.xdel(self._inbox_key, *ids)


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
    """Publishes the executor's status every HEARTBEAT_INTERVAL_S, with a TTL."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, board: StatusBoard) -> None:
        self._client = client
        self._keys = keys
        self._board = board
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
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

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.beat()
            except REDIS_DOWN_ERRORS as error:
                log.warning("heartbeat: redis unreachable (%s)", error)
