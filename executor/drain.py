"""What a draining executor moves to its peers before it exits (docs/operations.md, "Drains").

Once it takes no more work (SIGTERM, the preStop hook, `kvgate admin drain`), the executor
stops every request it runs and pushes each one's KV to a peer (executor/kv_transfer.py); the
gateway then queues the request again from the tokens its client has, pointed at that peer,
whose prefix cache (or the session's pins, for a turn of a session) holds all but at most the
last block's tokens of it. Then it pushes each idle session, and points the session at the
peer in Redis. A sequence whose push fails is recomputed wherever it runs next, as after a
crash. The drain takes as long as its bytes take to move, not as long as its longest stream.

The peer of each sequence is the live executor, other than this one and not draining, that
serves the same model with the same block size and cache format and has the most free blocks
left after what this drain already sent it (fewest requests between equals).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import redis

from common.keys import RedisKeys
from engine.engine import Engine
from engine.kv_move import (
    MovableKV,
    engine_layout,
    idle_sessions,
    movable_engine,
    release_moved,
    take_sequences,
)
from executor.kv_peers import Peers, read_peers, repoint_session
from executor.kv_sender import MAX_PARALLEL_PUSHES, KvSender
from executor.metrics import ExecutorMetrics
from protos.kvgate.v1 import internal_pb2

log = logging.getLogger(__name__)
PROGRESS_S = 0.5  # how often a drain waiting on its pushes tells the heartbeat it is alive


class DrainMoves:
    """Moves a draining executor's requests and sessions to its peers."""

    def __init__(
        self,
        engine: Engine,
        client: redis.Redis,
        keys: RedisKeys,
        executor_id: str,
        sender: KvSender,
        metrics: ExecutorMetrics,
    ) -> None:
        self._engine = engine
        self._client = client
        self._keys = keys
        self._executor_id = executor_id
        self._sender = sender
        self._metrics = metrics
        self._peers = Peers([])
        self.progress: Callable[[], None] = lambda: None  # the step loop's progress mark

    def find_peers(self) -> bool:
        """Read the peers. Returns: whether any can take KV (else nothing moves: the streams
        finish here, as a drain without transfers does)."""
        why = movable_engine(self._engine)
        if why is not None:
            log.info("draining: %s, so nothing moves: the streams finish here", why)
            return False
        layout = engine_layout(self._engine)
        self._peers = read_peers(self._client, self._keys, self._executor_id, layout)
        if not self._peers.statuses:
            log.info("draining: no peer takes this model's KV; the streams finish here")
            return False
        return True

    def move_requests(self) -> Iterator[tuple[MovableKV, str]]:
        """Stop every request and push each sequence's KV to a peer (several at once).

        Yields: each sequence as its push ends, and the peer that holds its KV now ("" when
        none does).
        """
        for moved, target in self._push_all(take_sequences(self._engine), "request"):
            release_moved(self._engine, moved)
            yield moved, target

    def move_sessions(self) -> None:
        """Push each idle session to a peer and point the session at it in Redis."""
        for moved, target in self._push_all(idle_sessions(self._engine), "session"):
            if target:
                tenant = moved.cache_salt or ""
                old, session_id = self._executor_id, moved.session_id or ""
                repoint_session(self._client, self._keys, tenant, session_id, old, target)
            release_moved(self._engine, moved)

    def _push_all(self, sequences: list[MovableKV], kind: str) -> Iterator[tuple[MovableKV, str]]:
        """Push each sequence to the peer chosen for it, MAX_PARALLEL_PUSHES at once; yields
        each with the peer that took it ("" for none), in the order they end."""
        with ThreadPoolExecutor(MAX_PARALLEL_PUSHES, thread_name_prefix="kv-out") as pool:
            pushes = {}
            for moved in sequences:
                peer = self._peers.choose(len(moved.block_ids)) if moved.block_ids else None
                if peer is not None:
                    self._peers.sent(peer.executor_id, len(moved.block_ids))
                pushes[pool.submit(self._push, moved, peer, kind)] = moved
            pending = set(pushes)
            while pending:
                done, pending = wait(pending, PROGRESS_S, FIRST_COMPLETED)
                self.progress()  # the step loop is moving KV, not stuck: its heartbeat stays
                for push in done:
                    yield pushes[push], push.result()

    def _push(self, moved: MovableKV, peer: internal_pb2.ExecutorStatus | None, kind: str) -> str:
        """Returns: the peer that took the sequence's KV, or "" (it is recomputed)."""
        name = moved.session_id if kind == "session" else moved.request_id
        if not moved.block_ids:
            return ""  # nothing computed yet: nothing to move, nothing lost
        if peer is None:
            log.warning(
                "draining: no peer has room for %d blocks of %s %s: it is recomputed",
                len(moved.block_ids),
                kind,
                name,
            )
        tenant = moved.cache_salt or ""
        if peer is None or not self._sender.push(moved, peer.kv_transfer_address, tenant):
            self._metrics.kv_moves.labels(kind, "fallback").inc()
            return ""
        self._metrics.kv_moves.labels(kind, "moved").inc()
        log.info(
            "draining: %s %s moved to %s (%d tokens of KV)",
            kind,
            name,
            peer.executor_id,
            len(moved.token_ids),
        )
        return peer.executor_id

    def close(self) -> None:
        self._sender.close()
