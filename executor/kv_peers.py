"""The peers a drain or a rebalance moves KV to, read from their heartbeats in Redis, and the
check-and-set that points a moved session at its new executor."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from common.keys import RedisKeys
from engine.kv_move import KVLayout
from protos.kvgate.v1 import internal_pb2

log = logging.getLogger(__name__)

MAX_REPOINT_TRIES = 16  # check-and-set attempts of a session's affinity update


@dataclass(slots=True)
class Peers:
    """The executors a drain can move KV to, and the blocks it has sent each so far."""

    statuses: list[internal_pb2.ExecutorStatus]
    sent_blocks: dict[str, int] = field(default_factory=dict)

    def choose(self, num_blocks: int) -> internal_pb2.ExecutorStatus | None:
        """The peer with the most blocks left after what this drain sent it, if one has
        room for `num_blocks` (fewest running and waiting requests between equals)."""

        def room(status: internal_pb2.ExecutorStatus) -> int:
            return status.num_free_blocks - self.sent_blocks.get(status.executor_id, 0)

        fitting = [s for s in self.statuses if room(s) >= num_blocks]
        if not fitting:
            return None
        chosen = max(fitting, key=lambda s: (room(s), -(s.num_running + s.num_waiting)))
        return chosen

    def sent(self, executor_id: str, num_blocks: int) -> None:
        self.sent_blocks[executor_id] = self.sent_blocks.get(executor_id, 0) + num_blocks


def read_peers(client: redis.Redis, keys: RedisKeys, executor_id: str, layout: KVLayout) -> Peers:
    """The live executors other than this one that take KV of this layout and are not
    draining, as their heartbeats say (none when Redis does not answer)."""
    try:
        members = sorted(m.decode() for m in client.smembers(keys.executors))
        raw = client.mget([keys.executor_status(m) for m in members]) if members else []
    except redis.RedisError as error:
        log.warning("draining: cannot read the peers from redis (%s): nothing moves", error)
        return Peers([])
    statuses = [internal_pb2.ExecutorStatus.FromString(r) for r in raw if r is not None]
    return Peers(
        [
            s
            for s in statuses
            if s.executor_id != executor_id
            and s.kv_transfer_address
            and not s.draining
            and s.model_id == layout.model_id
            and s.block_size == layout.block_size
            and s.kv_cache_dtype == layout.kv_cache_dtype
        ]
    )


def repoint_session(
    client: redis.Redis, keys: RedisKeys, tenant: str, session_id: str, old: str, new: str
) -> bool:
    """Make `new` the executor of a session whose affinity is `old`, atomically (a turn that
    ran elsewhere meanwhile keeps its own). Returns: whether the session now names `new`."""
    key = keys.session(tenant, session_id)
    try:
        with client.pipeline() as pipe:
            for _ in range(MAX_REPOINT_TRIES):
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        return False
                    state = internal_pb2.SessionState.FromString(raw)
                    if state.executor_id != old:
                        return False
                    state.executor_id = new
                    pipe.multi()
                    pipe.set(key, state.SerializeToString(), keepttl=True)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
    except redis.RedisError as error:
        log.warning("session %s: affinity not moved to %s (%s)", session_id, new, error)
    return False
