"""Rebalancing idle sessions (`--rebalance-sessions`, off by default; docs/operations.md).

An executor whose KV cache is nearly full would soon evict its least recently used idle
sessions (to the host tier or for good), and their next turns would prefill their history
again. With rebalancing on, it moves such a session to a peer with room instead: while fewer
than LOW_FREE_SHARE of its blocks are free and it holds idle sessions, it pushes its least
recently used one (executor/kv_transfer.py) to the live peer, serving the same model in the
same layout and not draining, that keeps at least PEER_FREE_SHARE of its blocks free after
taking it (the one with the most free blocks), and points the session at that peer in Redis.
One session moves at a time, at most one per REBALANCE_INTERVAL_S, and the push runs beside
the step loop: the session's blocks are held meanwhile, so a turn that arrives for it then
simply recomputes the last partial block (its full blocks are shared read-only).

The executor decides, not the scheduler: it alone knows its sessions' sizes and their order
of use, and the peers' free blocks are in the heartbeats both read. The watermarks keep a
session from moving back: a peer takes it only with far more room than the sender has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from common.keys import RedisKeys
from engine.engine import Engine
from engine.kv_move import MovableKV, engine_layout
from executor.kv_peers import read_peers, repoint_session
from executor.kv_sender import KvSender
from executor.metrics import ExecutorMetrics

log = logging.getLogger(__name__)

LOW_FREE_SHARE = 0.1  # the sender rebalances while fewer of its blocks are free
PEER_FREE_SHARE = 0.5  # a peer takes a session only if this share stays free after it
REBALANCE_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class SessionMoved:
    """A rebalancing push ended (an event for the step loop): the peer that holds the
    session now, or "" when it did not move."""

    moved: MovableKV
    target: str
    pushed: bool  # a peer with room was found and the push was tried


class SessionRebalancer:
    """Moves idle sessions off a nearly full cache, one at a time."""

    def __init__(
        self,
        engine: Engine,
        client: redis.Redis,
        keys: RedisKeys,
        executor_id: str,
        sender: KvSender,
        metrics: ExecutorMetrics,
        post: Callable[[SessionMoved], None],
    ) -> None:
        self._engine = engine
        self._client = client
        self._keys = keys
        self._executor_id = executor_id
        self._sender = sender
        self._metrics = metrics
        self._post = post
        self._in_flight: MovableKV | None = None
        self._next_check_s = 0.0

    def tick(self) -> None:
        """On the step loop (holding the engine): start a move when the cache is nearly full."""
        now = time.monotonic()
        if self._in_flight is not None or now < self._next_check_s:
            return
        self._next_check_s = now + REBALANCE_INTERVAL_S
        kv = self._engine.kv_cache
        if kv.num_free_blocks >= LOW_FREE_SHARE * kv.num_blocks or not kv.sessions:
            return
        session = next(iter(kv.sessions.values()))  # least recently used
        num_blocks = -(-len(session.token_ids) // kv.block_size)
        moved = MovableKV(
            list(session.token_ids), session.block_ids[:num_blocks], session.cache_salt,
            session.session_id,
        )  # fmt: skip
        kv.retain(moved.block_ids)  # readable until the push ends, whatever happens here
        self._in_flight = moved
        threading.Thread(target=self._push, args=(moved,), name="kv-rebalance", daemon=True).start()

    def _push(self, moved: MovableKV) -> None:
        layout = engine_layout(self._engine)
        peers = read_peers(self._client, self._keys, self._executor_id, layout)
        fitting = [
            s
            for s in peers.statuses
            if s.num_free_blocks - len(moved.block_ids) >= PEER_FREE_SHARE * s.num_total_blocks
        ]
        target, pushed = "", bool(fitting)
        if fitting:
            peer = max(fitting, key=lambda s: s.num_free_blocks)
            tenant = moved.cache_salt or ""
            stays = "the session stays here with its KV"
            if self._sender.push(moved, peer.kv_transfer_address, tenant, stays):
                target = peer.executor_id
                session_id = moved.session_id or ""
                old = self._executor_id
                repoint_session(self._client, self._keys, tenant, session_id, old, target)
        self._post(SessionMoved(moved, target, pushed))

    def finish(self, event: SessionMoved) -> None:
        """On the step loop: let go of the pushed session's blocks, and of the session itself
        when it moved and no turn replaced it meanwhile."""
        moved, kv = event.moved, self._engine.kv_cache
        kv.release(moved.block_ids)
        self._in_flight = None
        if event.pushed:
            result = "moved" if event.target else "fallback"
            self._metrics.kv_moves.labels("rebalance", result).inc()
        if not event.target:
            return
        session = kv.sessions.get((moved.cache_salt, moved.session_id or ""))
        if session is not None and session.token_ids == moved.token_ids:
            kv.release_session(moved.session_id or "", moved.cache_salt)
        log.info(
            "rebalance: session %s moved to %s (%d tokens of KV)",
            moved.session_id,
            event.target,
            len(moved.token_ids),
        )
