"""The scheduler's Redis I/O: the request stream, executor inboxes and heartbeats.

Protobuf stops here: the rest of the scheduler sees `PendingRequest` and
`ExecutorReport`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
from google.protobuf.message import DecodeError

from common.choices import num_sequences
from common.keys import PAYLOAD_FIELD, QUEUED_AT_FIELD, SCHEDULER_GROUP, RedisKeys, stream_id
from common.prefix import block_hashes
from common.requeue import next_attempt
from protos.kvgate.v1 import internal_pb2
from scheduler.queue import PendingRequest
from scheduler.registry import ExecutorReport

log = logging.getLogger(__name__)
# The block size assumed for cache-hit estimates before any executor reported its own.
DEFAULT_BLOCK_SIZE = 16
# Farthest a request entry's QUEUED_AT_FIELD may be from the time in its entry id, in us; the
# enqueue script writes both from one clock, so a value beyond this is malformed and ignored.
MAX_QUEUED_AT_SKEW_US = 1_000_000

# Every write of the scheduler to the request stream and the inboxes is one script that first
# checks that the writer holds the leader lock (a fencing check): a leader that was paused
# past its lock's life (SIGSTOP, a long GC, a partition) and wakes up cannot assign, drop or
# re-queue what its successor now owns; the script returns NOT_LEADER and writes nothing.
NOT_LEADER = -1
FENCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
"""
# KEYS: the leader lock, the request's cancel marker, the request stream, the executor's inbox.
# ARGV: scheduler id, consumer group, entry id, payload field, inbox message.
# Writes the assignment unless the request was cancelled, then acknowledges and deletes the
# entry, atomically. Returns 1 when assigned, 0 when it was cancelled (and only dropped). The
# marker stays until it expires: another entry of the same request (a re-queue) may follow.
ASSIGN_SCRIPT = (
    FENCE
    + """
local cancelled = redis.call('EXISTS', KEYS[2]) == 1
if not cancelled then
  redis.call('XADD', KEYS[4], '*', ARGV[4], ARGV[5])
end
redis.call('XACK', KEYS[3], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[3], ARGV[3])
if cancelled then return 0 end
return 1
"""
)
# KEYS: the leader lock, the request stream. ARGV: scheduler id, consumer group, entry ids...
DROP_SCRIPT = (
    FENCE
    + """
for i = 3, #ARGV do
  redis.call('XACK', KEYS[2], ARGV[2], ARGV[i])
  redis.call('XDEL', KEYS[2], ARGV[i])
end
return 1
"""
)
# KEYS: the leader lock, the request stream, the executor's inbox, the executors set.
# ARGV: scheduler id, executor id, payload field, then each re-queued request's payload.
REQUEUE_SCRIPT = (
    FENCE
    + """
for i = 4, #ARGV do
  redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[i])
end
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], ARGV[2])
return 1
"""
)


class NotLeader(Exception):
    """A fenced write found another scheduler holding the leader lock."""


def _fenced(result: int) -> int:
    if result == NOT_LEADER:
        raise NotLeader("another scheduler holds the leader lock")
    return result


@dataclass(slots=True, frozen=True)
class StreamEntry:
    """One entry of the request stream."""

    entry_id: str
    payload: bytes  # a serialized QueuedRequest, unless malformed
    # Redis time it was queued at, in unix microseconds: the gateway's QUEUED_AT_FIELD, else
    # the end of the millisecond in the entry id (entries re-queued without the field).
    queued_unix_us: int


class RequestStream:
    """The requests stream, read through the schedulers' consumer group."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, consumer: str) -> None:
        """
        Args:
            consumer: the scheduler's id: its consumer name, and the leader lock's value
                while it leads (every write checks it).
        """
        self._client = client
        self._keys = keys
        self._consumer = consumer
        self._assign = client.register_script(ASSIGN_SCRIPT)
        self._drop = client.register_script(DROP_SCRIPT)

    def ensure_group(self) -> None:
        """Creates the consumer group (and the stream) unless it exists."""
        try:
            self._client.xgroup_create(self._keys.requests, SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def reclaim(self, min_idle_ms: int = 0) -> list[StreamEntry]:
        """Takes over the pending entries of other schedulers (XAUTOCLAIM): at a takeover all
        of them; later, those idle for `min_idle_ms` (read by a former leader after it lost
        the lock, which it can no longer assign).

        Returns: each reclaimed entry, this consumer's own included.
        """
        entries: list[StreamEntry] = []
        start = "0-0"
        while True:
            reply = self._client.xautoclaim(
                self._keys.requests,
                SCHEDULER_GROUP,
                self._consumer,
                min_idle_ms,
                start_id=start,
                count=500,
            )
            start, claimed = reply[0], reply[1]
            entries.extend(_entries(claimed))
            if start in (b"0-0", "0-0"):
                return entries

    def read_new(self, block_ms: int | None, count: int) -> list[StreamEntry]:
        """Args: how long to wait for entries (None: do not wait) and how many at most.

        Returns: the new entries, now pending for this consumer.
        """
        reply = self._client.xreadgroup(
            SCHEDULER_GROUP, self._consumer, {self._keys.requests: ">"}, count=count, block=block_ms
        )
        return [entry for _, entries in reply or [] for entry in _entries(entries)]

    def drop(self, entry_ids: list[str]) -> None:
        """Acknowledges and deletes entries that will not be assigned.

        Raises:
            NotLeader: another scheduler leads now (nothing was dropped).
        """
        if entry_ids:
            keys = [self._keys.scheduler_leader, self._keys.requests]
            _fenced(self._drop(keys=keys, args=[self._consumer, SCHEDULER_GROUP, *entry_ids]))

    def assign(self, request: PendingRequest, executor_id: str, scheduler_id: str) -> bool:
        """Writes the assignment to the executor's inbox, then acknowledges the request.

        One script, atomic: the entry leaves the request stream only with the assignment
        written, or, when its gateway marked it cancelled meanwhile, without one.

        Returns: True when assigned, False when it was cancelled and has been dropped.

        Raises:
            NotLeader: another scheduler leads now (nothing was written).
        """
        message = internal_pb2.AssignmentEnvelope(
            assignment=internal_pb2.PlacedRequest(
                request=request.payload,
                executor_id=executor_id,
                assigned_unix_ms=int(time.time() * 1000),
                scheduler_id=scheduler_id,
            )
        )
        keys = [
            self._keys.scheduler_leader,
            self._keys.cancelled(request.request_id),
            self._keys.requests,
            self._keys.executor_inbox(executor_id),
        ]
        args = [
            scheduler_id,
            SCHEDULER_GROUP,
            request.entry_id,
            PAYLOAD_FIELD,
            message.SerializeToString(),
        ]
        return _fenced(self._assign(keys=keys, args=args)) == 1

    def cancelled(self, request_ids: list[str]) -> set[str]:
        """Returns: the ids among `request_ids` whose gateway marked them cancelled."""
        if not request_ids:
            return set()
        pipe = self._client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(self._keys.cancelled(request_id))
        return {rid for rid, found in zip(request_ids, pipe.execute(), strict=True) if found}


class ExecutorDirectory:
    """Executor heartbeats and inboxes in Redis."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, scheduler_id: str) -> None:
        self._client = client
        self._keys = keys
        self._scheduler_id = scheduler_id
        self._requeue = client.register_script(REQUEUE_SCRIPT)

    def read(self) -> tuple[list[ExecutorReport], list[str]]:
        """Returns: reports of live executors, and registered ids whose heartbeat expired."""
        ids = sorted(m.decode() for m in self._client.smembers(self._keys.executors))
        if not ids:
            return [], []
        statuses = self._client.mget([self._keys.executor_status(eid) for eid in ids])
        reports = [_report(raw) for raw in statuses if raw is not None]
        dead = [eid for eid, raw in zip(ids, statuses, strict=True) if raw is None]
        return reports, dead

    def requeue_inbox(self, executor_id: str) -> int:
        """Moves the assignments left in a dead executor's inbox back to the request stream
        (next attempt), deletes the inbox and forgets the executor, in one fenced script.

        Returns: how many requests were re-queued.

        Raises:
            NotLeader: another scheduler leads now (nothing was written).
        """
        inbox = self._keys.executor_inbox(executor_id)
        payloads = []
        for entry in _entries(self._client.xrange(inbox)):
            message = _inbox_message(entry.payload)
            if message is not None and message.HasField("assignment"):
                requeued = next_attempt(message.assignment.request)
                payloads.append(requeued.SerializeToString())
        keys = [self._keys.scheduler_leader, self._keys.requests, inbox, self._keys.executors]
        args = [self._scheduler_id, executor_id, PAYLOAD_FIELD, *payloads]
        _fenced(self._requeue(keys=keys, args=args))
        return len(payloads)


def to_pending(
    entry: StreamEntry, block_size: int, now_s: float, queued_s: float
) -> PendingRequest | None:
    """Args: a request stream entry, the block size for hashes, the monotonic time now and the
    one it was queued at (RedisClock.monotonic: never later than now).

    Returns: the pending request, None when the payload is not a QueuedRequest.
    """
    queued = internal_pb2.QueuedRequest()
    try:
        queued.ParseFromString(entry.payload)
    except DecodeError:
        return None
    if not queued.request_id:
        return None
    tokens = list(queued.prompt_token_ids) + list(queued.resume_token_ids)
    return PendingRequest(
        request_id=queued.request_id,
        entry_id=entry.entry_id,
        num_prompt_tokens=len(tokens),
        block_hashes=block_hashes(tokens, block_size, queued.tenant),
        priority=queued.priority,
        session_id=queued.session_id or None,
        session_executor_id=queued.session_executor_id or None,
        arrival_s=queued_s,
        deadline_s=_monotonic_deadline(queued.queue_deadline_unix_ms, now_s),
        payload=entry.payload,
        num_sequences=num_sequences(queued.params),
    )


def _monotonic_deadline(deadline_unix_ms: int, now_s: float) -> float | None:
    if deadline_unix_ms <= 0:
        return None
    return now_s + (deadline_unix_ms / 1000.0 - time.time())


def _report(raw: bytes) -> ExecutorReport:
    status = internal_pb2.ExecutorStatus()
    status.ParseFromString(raw)
    return ExecutorReport(
        executor_id=status.executor_id,
        heartbeat_unix_ms=status.heartbeat_unix_ms,
        block_size=status.block_size or DEFAULT_BLOCK_SIZE,
        num_free_blocks=status.num_free_blocks,
        num_total_blocks=status.num_total_blocks,
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        draining=status.draining,
        moves_kv=bool(status.kv_transfer_address),
        session_ids=frozenset(status.session_ids),
        cached_block_hashes=tuple(status.cached_block_hashes),
        max_num_seqs=status.max_num_seqs,
    )


def _inbox_message(payload: bytes) -> internal_pb2.InboxMessage | None:
    message = internal_pb2.InboxMessage()
    try:
        message.ParseFromString(payload)
    except DecodeError:
        return None
    return message


def _entries(raw_entries: list) -> list[StreamEntry]:
    """Returns: the stream entries of a reply; entries deleted meanwhile are skipped."""
    result = []
    for raw_id, fields in raw_entries:
        if fields is not None:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
            payload = fields.get(PAYLOAD_FIELD.encode(), b"")
            result.append(StreamEntry(entry_id, payload, _queued_unix_us(entry_id, fields)))
    return result


def _queued_unix_us(entry_id: str, fields: dict[bytes, bytes]) -> int:
    """The entry's QUEUED_AT_FIELD when it agrees with its id's millisecond (the script that
    writes it also sets the id), else the end of that millisecond."""
    id_us = stream_id(entry_id)[0] * 1000
    queued_at = fields.get(QUEUED_AT_FIELD.encode(), b"")
    if queued_at.isdigit() and len(queued_at) <= 20:
        queued_us = int(queued_at)
        if abs(queued_us - id_us) <= MAX_QUEUED_AT_SKEW_US:
            return queued_us
    return id_us + 1000
