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

    def session(self, tenant: str, session_id: str) -> str:
        """SessionState of one of `tenant`'s sessions, with a TTL renewed at each turn; every
        tenant has a session id space of its own (tenant names hold no ':')."""
        return f"{self.prefix}session:{tenant}:{session_id}"

    def cancelled(self, request_id: str) -> str:
        """Marker that a request was cancelled while maybe still queued; the scheduler drops it."""
        return f"{self.prefix}cancel:{request_id}"

    def api_key(self, key_id: str) -> str:
        """Hash of one API key: its tenant, the SHA-256 of the whole key, when it was made
        (common/tenants.py); deleted when the key is revoked."""
        return f"{self.prefix}apikey:{key_id}"

    @property
    def api_key_ids(self) -> str:
        """Set of the ids of every API key not revoked (for `kvgate admin keys list`)."""
        return f"{self.prefix}apikeys"

    def tenant_limits(self, tenant: str) -> str:
        """Hash of a tenant's quotas (common/tenants.py TenantLimits); absent: no limits."""
        return f"{self.prefix}tenant:{tenant}:limits"

    def tenant_buckets(self, tenant: str) -> str:
        """Hash of a tenant's token buckets (requests per second, generated tokens per
        minute), written by the gateways' quota script only."""
        return f"{self.prefix}tenant:{tenant}:buckets"

    def tenant_streams(self, tenant: str) -> str:
        """Sorted set of a tenant's open streams: member gateway/stream id, score the end of
        its lease (Redis time, ms); gateways renew the leases of the streams they hold."""
        return f"{self.prefix}tenant:{tenant}:streams"

    def tenant_usage(self, tenant: str, day: str) -> str:
        """Hash of a tenant's usage counters on one UTC day (YYYY-MM-DD)."""
        return f"{self.prefix}usage:{tenant}:{day}"

    def tenant_usage_pattern(self, tenant: str = "*") -> str:
        """SCAN pattern of the usage hashes of `tenant` (default: of every tenant)."""
        return f"{self.prefix}usage:{tenant}:*"

    @property
    def scheduler_leader(self) -> str:
        """Lock held by the active scheduler (SET NX PX, renewed); standbys wait for it."""
        return f"{self.prefix}scheduler:leader"
