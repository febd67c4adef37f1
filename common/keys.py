"""Every Redis key, stream and group name kvgate uses, under one prefix.

Who writes and reads each is in docs/serving-contract.md. Stream entries hold
one serialized protobuf message in the field PAYLOAD_FIELD; a gateway's request
entries also hold the Redis time they were queued at in QUEUED_AT_FIELD.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "kvgate:"
# The field of a stream entry that holds the serialized protobuf message.
PAYLOAD_FIELD = "pb"
# The field of a request entry that holds the Redis server's time (TIME) it was queued at, in
# unix microseconds: the scheduler's latency window counts from then.
QUEUED_AT_FIELD = "queued_us"
# The consumer group of the schedulers on the requests stream.
SCHEDULER_GROUP = "schedulers"
# An executor refreshes its status key every HEARTBEAT_INTERVAL_S with this TTL;
# it is dead once the key expires.
HEARTBEAT_INTERVAL_S = 0.5
EXECUTOR_STATUS_TTL_MS = 2000


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as (unix ms, sequence): pairs sort as Redis orders ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names under one prefix (default `kvgate:`)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(
                f"--redis-prefix must be non-empty without spaces, got {self.prefix!r}"
            )

    @property
    def requests(self) -> str:
        """Stream of QueuedRequest: gateways XADD, schedulers read with SCHEDULER_GROUP."""
        return f"{self.prefix}requests"

    @property
    def executors(self) -> str:
        """Set of executor ids that have registered; an id is alive while its status key exists."""
        return f"{self.prefix}executors"

    def executor_status(self, executor_id: str) -> str:
        """ExecutorStatus of one executor, SET with a TTL at each heartbeat."""
        return f"{self.prefix}exec:{executor_id}:status"

    def executor_inbox(self, executor_id: str) -> str:
        """Stream of InboxMessage for one executor: the scheduler and gateways XADD, it reads."""
        return f"{self.prefix}exec:{executor_id}:inbox"

    def session(self, session_id: str) -> str:
        """SessionState of one session, with a TTL renewed at each turn."""
        return f"{self.prefix}session:{session_id}"

    def cancelled(self, request_id: str) -> str:
        """Marker that a request was cancelled while maybe still queued; the scheduler drops it."""
        return f"{self.prefix}cancel:{request_id}"

    @property
    def scheduler_leader(self) -> str:
        """Lock held by the active scheduler (SET NX PX, renewed); standbys wait for it."""
        return f"{self.prefix}scheduler:leader"
