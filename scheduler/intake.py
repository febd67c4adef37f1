"""The scheduler's intake: new requests from the request stream into the window.

It waits for them so that a batch leaves when its window closes. A wait on the stream
(XREADGROUP BLOCK) wakes at once when a request arrives, but its timeout ends only on Redis's
coarse clock, up to REDIS_TIMEOUT_RESOLUTION_MS late. That is harmless before an executor
poll, so with nothing to release it waits on the stream; while requests wait for a window, it
waits on the stream only while the close is more than a resolution away, and sleeps the rest
here, to the exact time.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Protocol

from scheduler.clock import RedisClock
from scheduler.queue import PendingRequest, WindowBatcher
from scheduler.streams import StreamEntry, to_pending

log = logging.getLogger(__name__)
# Most entries read from the request stream in one call.
READ_COUNT = 512
# Redis ends a timed-out BLOCK on its server clock (hz 10: every 100 ms): a BLOCK of T ms
# returns between T and T + 100 ms unless an entry arrives first, which wakes it at once.
REDIS_TIMEOUT_RESOLUTION_MS = 100
# The last read before a window closes starts early by the average time a wake-up and that
# read took, so the batch leaves on time; this is the weight of the latest in that average.
READ_LEAD_WEIGHT = 0.2


class EntrySource(Protocol):
    """What the intake needs of the request stream (scheduler.streams.RequestStream)."""

    def read_new(self, block_ms: int | None, count: int) -> list[StreamEntry]: ...

    def drop(self, entry_ids: list[str]) -> None: ...


class RequestIntake:
    """Reads new requests from `stream` into `batcher`, timing each read by the windows."""

    def __init__(self, stream: EntrySource, clock: RedisClock, batcher: WindowBatcher) -> None:
        self._stream = stream
        self._clock = clock
        self._batcher = batcher
        self.read_lead_s = 0.0  # average time a wake-up and the read after it took

    def read(self, next_poll_s: float, stalled: bool) -> list[StreamEntry]:
        """New requests, waited for until `next_poll_s` (the next executor poll), or until a
        window closes when requests wait and `stalled` is false (something could be placed)."""
        now = time.monotonic()
        wait_s = max(0.0, next_poll_s - now)
        if stalled or not len(self._batcher):
            return self._stream.read_new(max(1, math.ceil(wait_s * 1000.0)), READ_COUNT)
        wait_ms = 1000.0 * min(wait_s, self._batcher.seconds_until_due(now))
        if wait_ms > REDIS_TIMEOUT_RESOLUTION_MS + 1:
            block_ms = math.floor(wait_ms) - REDIS_TIMEOUT_RESOLUTION_MS
            return self._stream.read_new(block_ms, READ_COUNT)
        return self.read_until(now + wait_ms / 1000.0)

    def read_until(self, due_s: float) -> list[StreamEntry]:
        """Reads without waiting, so that the read ends at `due_s` (a window's close or a poll):
        sleeps to the read's lead before it, and what is left of the lead after it."""
        wake_s = due_s - self.read_lead_s
        now = time.monotonic()
        if wake_s > now:
            time.sleep(wake_s - now)
        started = max(now, wake_s)
        entries = self._stream.read_new(None, READ_COUNT)
        done_s = time.monotonic()
        self.read_lead_s += READ_LEAD_WEIGHT * (done_s - started - self.read_lead_s)
        if due_s > done_s:
            time.sleep(due_s - done_s)
        return entries

    def admit(self, entries: list[StreamEntry], now: float, block_size: int) -> None:
        """Puts the entries' requests in the window, each counted from when it was queued (on
        Redis's clock); drops entries that hold no QueuedRequest."""
        for entry in entries:
            queued_s = self._clock.monotonic(entry.queued_unix_us, now)
            request = to_pending(entry, block_size, now, queued_s)
            if request is None:
                log.warning("dropping request stream entry %s: not a QueuedRequest", entry.entry_id)
                self._stream.drop([entry.entry_id])
                continue
            self._replace_waiting(request)

    def _replace_waiting(self, request: PendingRequest) -> None:
        """A re-queued request replaces the waiting entry of the same id (a later attempt)."""
        earlier = self._batcher.remove(request.request_id)
        if earlier is not None and earlier.entry_id != request.entry_id:
            self._stream.drop([earlier.entry_id])
        self._batcher.add(request)
