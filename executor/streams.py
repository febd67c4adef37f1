"""The executor's Redis stream: its inbox, read off the step loop while the engine has work
(scheduler/streams.py is the other end). The heartbeat is executor/heartbeat.py."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from google.protobuf.message import DecodeError

from common.keys import PAYLOAD_FIELD, RedisKeys, stream_id
from common.logs import request_fields
from common.redis_conn import Backoff, OutageLog, describe
from common.requeue import stream_fields
from protos.kvgate.v1 import internal_pb2

log = logging.getLogger(__name__)
# Longest XREAD BLOCK of the inbox reader thread, in ms: how fast it notices a stop, and how
# often it deletes handled entries while paused.
INBOX_BLOCK_MS = 200
# Most inbox entries read at once.
INBOX_COUNT = 64


@dataclass(slots=True, frozen=True)
class InboxEntry:
    """One message read from the executor's inbox stream."""

    entry_id: str
    message: internal_pb2.InboxMessage


class InboxReader:
    """Reads the inbox stream and hands entries to the step loop.

    Two readers share it, and both put what they read on the `deliver` queue. While the
    engine runs work, a thread of its own reads, so the step loop never waits on Redis.
    While the engine is idle, the step loop reads itself (`read_while_idle`) and the thread
    pauses: an entry then goes from the socket to admission on one thread, without a
    hand-off between threads (traced on a busy 2-core machine: 0.83 ms from the read to the
    step's start with the hand-off, 0.43 ms without).
    Around a switch both may read the same entry; each is delivered once, in stream order.

    Entries stay in the stream until the step loop is done with them (`handled`: an
    assignment once its request finished, was refused or aborted here); they are XDEL'd
    then, so the scheduler re-queues whatever a dead executor owed. Once the executor
    drains (`hand_back_assignments`), the reader moves each assignment it reads back to the
    request stream instead, and `stop` hands back whatever is still unread.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        executor_id: str,
        deliver: queue.SimpleQueue[InboxEntry],
    ) -> None:
        self._client = client
        self._inbox_key = keys.executor_inbox(executor_id)
        self._requests_key = keys.requests
        self._deliver = deliver
        self._handled: deque[str] = deque()
        self._to_hand_back: list[tuple[str, internal_pb2.QueuedRequest | None]] = []
        self._handing_back = threading.Event()
        self._lock = threading.Lock()  # _last_id and _to_hand_back, between the two readers
        self._last_id = "0"
        self._thread_reads = threading.Event()
        self._thread_reads.set()
        self._idle_read_delays: Iterator[float] | None = None  # while the idle read fails
        self._outage = OutageLog(log, "inbox")  # one log line per outage, for both readers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def hand_back_assignments(self) -> None:
        """From now on, assignments read are re-queued instead of delivered, and the reader
        thread reads (the step loop no longer does); does no I/O."""
        with self._lock:  # an entry being queued now is queued before the step loop looks
            self._handing_back.set()
        self._thread_reads.set()

    def read_on_thread(self) -> None:
        """The reader thread reads from now on (the step loop has work); does no I/O."""
        self._thread_reads.set()

    def read_while_idle(self, block_ms: int) -> None:
        """The idle step loop's read: pauses the reader thread, then waits up to `block_ms`
        (Redis rounds it up to its 100 ms timer) for new entries and puts them on the
        `deliver` queue, after any the thread put there. Redis down is logged once and
        waited out here, and a paused Redis holds the read for the client's socket timeout;
        either way nothing runs meanwhile. Nothing is read once the executor drains.
        """
        if self._handing_back.is_set():
            return
        self._thread_reads.clear()
        with self._lock:
            # Whatever the thread queues from now on comes after `after_id`, so the read below
            # returns at once instead of waiting with an entry already queued.
            after_id = self._last_id
            queued = not self._deliver.empty()
        try:
            self._read(None if queued else block_ms, after_id)
        except redis.RedisError as error:
            self._outage.failed(error)
            if self._idle_read_delays is None:
                self._idle_read_delays = Backoff(initial_s=block_ms / 1000.0).delays()
            time.sleep(next(self._idle_read_delays))
            return
        self._idle_read_delays = None
        self._outage.succeeded()

    def stop(self) -> None:
        """Stops reading (if started), then hands back the assignments left unread.

        One try: Redis down leaves them to the scheduler, which re-queues a gone executor's inbox.
        """
        self._stop.set()
        self._thread_reads.set()
        if self._thread.ident is not None:
            self._thread.join()
        try:
            self._delete_handled()
            self._sweep_unread()
        except redis.RedisError as error:
            log.warning(
                "inbox: redis failed at exit (%s); the scheduler re-queues it", describe(error)
            )

    def handled(self, entry_id: str) -> None:
        """Marks an entry as handled; the reader deletes it from the stream."""
        self._handled.append(entry_id)

    def _run(self) -> None:
        delays = Backoff().delays()
        while not self._stop.is_set():
            try:
                # Only a pass that sent Redis a command tells that it is reachable again: an
                # idle pass (the step loop reading the inbox itself) proves nothing.
                talked = self._delete_handled() | self._hand_back_pending()
                if self._thread_reads.wait(INBOX_BLOCK_MS / 1000.0) and not self._stop.is_set():
                    self._read(INBOX_BLOCK_MS, self._last_id)
                    talked = True
                talked |= self._hand_back_pending()
                delays = Backoff().delays()
                if talked:
                    self._outage.succeeded()
            except redis.RedisError as error:  # down, or an error reply such as BUSY
                self._outage.failed(error)
                self._stop.wait(next(delays))

    def _read(self, block_ms: int | None, after_id: str) -> None:
        """Waits up to `block_ms` (None: not at all) for entries after `after_id`, and puts
        those after the last one either reader took on the `deliver` queue, under the lock, so
        that the queue holds them in stream order whichever reader took them. Assignments of
        a draining executor are queued for hand-back instead, and malformed entries for
        deletion.
        """
        reply = self._client.xread({self._inbox_key: after_id}, count=INBOX_COUNT, block=block_ms)
        with self._lock:
            for _, entries in reply or []:
                for raw_id, fields in entries:
                    entry_id = raw_id.decode()
                    if stream_id(entry_id) <= stream_id(self._last_id):
                        continue  # the other reader took it
                    self._last_id = entry_id
                    entry = self._parse(entry_id, fields.get(PAYLOAD_FIELD.encode(), b""))
                    if entry is not None:
                        self._deliver.put(entry)

    def _parse(self, entry_id: str, payload: bytes) -> InboxEntry | None:
        message = internal_pb2.InboxMessage()
        try:
            message.ParseFromString(payload)
        except DecodeError:
            log.warning("inbox entry %s is not an InboxMessage: deleted", entry_id)
            self.handled(entry_id)
            return None
        if self._handing_back.is_set() and message.HasField("assignment"):
            self._to_hand_back.append((entry_id, message.assignment.request))
            return None
        return InboxEntry(entry_id, message)

    def _delete_handled(self) -> bool:
        """Returns: whether there were entries to delete (and Redis took the XDEL)."""
        ids = list(self._handled)
        if ids:
            self._client.xdel(self._inbox_key, *ids)
            for _ in ids:
                self._handled.popleft()
        return bool(ids)

    def _sweep_unread(self) -> None:
        """Queues for hand-back every assignment still in the inbox, and deletes the rest."""
        for raw_id, fields in self._client.xrange(self._inbox_key, min=f"({self._last_id}"):
            entry_id = raw_id.decode()
            message = internal_pb2.InboxMessage()
            try:
                message.ParseFromString(fields.get(PAYLOAD_FIELD.encode(), b""))
            except DecodeError:
                message.Clear()
            request = message.assignment.request if message.HasField("assignment") else None
            self._to_hand_back.append((entry_id, request))
        self._hand_back_pending()

    def hand_back(self, entry_id: str, request: internal_pb2.QueuedRequest) -> None:
        """Hand back an assignment read before the drain and not run (it was waiting on the
        event queue), at once; if Redis does not answer, the reader's next round retries."""
        with self._lock:
            self._to_hand_back.append((entry_id, request))
            try:
                self._hand_back_locked()
            except redis.RedisError as error:
                log.warning("draining: hand-back deferred (%s)", error)

    def _hand_back_pending(self) -> bool:
        """Moves the assignments a draining executor will not run back to the request stream.

        The same request: the same id and attempt (it never ran here: nothing of it can
        come late), and the gateway's queue deadline kept: the gateway
        enforces that deadline itself, so a later one here would not help the client, and
        a hand-back within one inbox read of the drain costs the request well under a second.
        One MULTI/EXEC: an entry leaves the inbox only with its request re-queued.

        Returns: whether there were any (and Redis took them).
        """
        with self._lock:
            return self._hand_back_locked()

    def _hand_back_locked(self) -> bool:
        if not self._to_hand_back:
            return False
        pipe = self._client.pipeline(transaction=True)
        for _, request in self._to_hand_back:
            if request is not None:
                pipe.xadd(self._requests_key, stream_fields(request))
        pipe.xdel(self._inbox_key, *(entry_id for entry_id, _ in self._to_hand_back))
        pipe.execute()
        for _, request in self._to_hand_back:
            if request is not None:
                log.info(
                    "draining: assignment handed back to the request stream (attempt %d)",
                    request.attempt,
                    extra=request_fields(request.request_id, request.session_id),
                )
        self._to_hand_back.clear()
        return True
