"""The scheduler process: leader lock, request intake, window batching and placement."""

from __future__ import annotations

import logging
import threading
import time

import redis

from common.keys import RedisKeys
from common.logs import request_fields
from common.redis_conn import Backoff, OutageLog
from scheduler.clock import RedisClock
from scheduler.config import SchedulerConfig
from scheduler.intake import RequestIntake
from scheduler.leader import LeaderLock
from scheduler.metrics import SchedulerMetrics
from scheduler.placement import Placer
from scheduler.queue import PendingRequest, WindowBatcher, WindowLimits, make_policy
from scheduler.registry import ExecutorRegistry
from scheduler.streams import DEFAULT_BLOCK_SIZE, ExecutorDirectory, NotLeader, RequestStream

log = logging.getLogger(__name__)
# The longest a session's turn waits for a draining executor to move the session's KV to a
# peer (docs/operations.md, "Drains"); past it the turn is placed as any and prefills again.
SESSION_MOVE_WAIT_S = 5.0


class Scheduler:
    """Holds the global waiting queue and places batches of it on executors."""

    def __init__(
        self, config: SchedulerConfig, client: redis.Redis, metrics: SchedulerMetrics | None = None
    ) -> None:
        keys = RedisKeys(config.redis_prefix)
        self._config = config
        self._metrics = metrics or SchedulerMetrics()
        self._stream = RequestStream(client, keys, config.scheduler_id)
        self._directory = ExecutorDirectory(client, keys, config.scheduler_id)
        self._clock = RedisClock(client)
        self._lock = LeaderLock(
            client, keys.scheduler_leader, config.scheduler_id, config.lock_ttl_ms
        )
        self._placer = Placer(load_cost_blocks=config.load_cost_blocks)
        self._registry = ExecutorRegistry(self._placer)
        self._stop = threading.Event()
        limits = WindowLimits(
            config.batch_window_ms, config.max_batch_size, config.max_batch_tokens
        )
        policy = make_policy(
            config.policy,
            config.priority_aging_ms,
            config.lpm_aging_ms,
            self._placer.cached_blocks,
        )
        self._batcher = WindowBatcher(limits, policy)
        self._intake = RequestIntake(self._stream, self._clock, self._batcher)
        self._next_poll_s = 0.0
        self._next_renew_s = 0.0
        self._next_reclaim_s = 0.0
        self._stalled = False  # nothing could be placed: wait for the next heartbeats
        self._outage = OutageLog(log, "scheduler")

    def stop(self) -> None:
        """Asks `run` to return (from a signal handler: stop_on_signals(stop_event))."""
        self._stop.set()

    @property
    def stop_event(self) -> threading.Event:
        """Set: `run` returns."""
        return self._stop

    def run(self) -> None:
        """Waits for the leader lock, then schedules until stopped; a lost lock: wait again.

        Any Redis error (down, READONLY during a failover, LOADING, BUSY, ...) ends the turn:
        the window is forgotten (its entries stay pending in the stream, and are reclaimed),
        and the scheduler tries again after a backoff delay, logging once per outage.
        """
        delays = Backoff().delays()
        while not self._stop.is_set():
            try:
                self._serve_once()
            except redis.RedisError as error:
                if not self._outage.down:  # a new outage: back off from the shortest delay
                    delays = Backoff().delays()
                self._outage.failed(error)
                self._batcher.clear()
                self._stop.wait(next(delays))
        self._release_lock()

    def _serve_once(self) -> None:
        poll_s = self._config.lock_ttl_ms / 4000.0
        if not self._lock.wait(poll_s, self._stop.is_set):
            return
        self._outage.succeeded()
        log.info(
            "scheduler %s is the leader (batch_window_ms=%g, policy %s)",
            self._config.scheduler_id,
            self._config.batch_window_ms,
            self._config.policy,
        )
        self._metrics.is_leader.set(1)
        self._clock.sync()
        self._stream.ensure_group()
        reclaimed = self._stream.reclaim()
        if reclaimed:
            log.info("reclaimed %d queued requests of an earlier scheduler", len(reclaimed))
        self._intake.admit(reclaimed, time.monotonic(), self._block_size())
        self._next_reclaim_s = time.monotonic() + self._config.lock_ttl_ms / 1000.0
        try:
            while not self._stop.is_set() and self._keep_lock():
                self.tick()
        except NotLeader:
            log.warning("another scheduler took the leader lock: waiting as a standby")
        finally:
            self._metrics.is_leader.set(0)
            self._metrics.queue_length.set(0)
        self._batcher.clear()

    def _release_lock(self) -> None:
        try:
            self._lock.release()
        except redis.RedisError as error:
            log.warning("could not release the leader lock: %s", error)

    def _keep_lock(self) -> bool:
        now = time.monotonic()
        if now < self._next_renew_s:
            return True
        if not self._lock.renew():
            log.warning("lost the leader lock: waiting as a standby")
            return False
        self._next_renew_s = now + self._config.lock_ttl_ms / 3000.0
        return True

    def tick(self) -> None:
        """One turn: heartbeats when due, new requests, then a batch when the window allows."""
        now = time.monotonic()
        if now >= self._next_poll_s:
            self._poll_executors(now)
        if now >= self._next_reclaim_s:
            self._reclaim_idle(now)
        self._drop_expired(now)
        entries = self._intake.read(self._next_poll_s, self._stalled)
        self._intake.admit(entries, time.monotonic(), self._block_size())
        now = time.monotonic()
        reason = None if self._stalled else self._batcher.release_reason(now)
        if reason is not None:
            self._dispatch(now, reason)
        self._metrics.queue_length.set(len(self._batcher))

    def _poll_executors(self, now: float) -> None:
        self._next_poll_s = now + self._config.registry_poll_ms / 1000.0
        self._clock.sync()
        reports, dead = self._directory.read()
        change = self._registry.refresh(reports)
        for executor_id in change.joined:
            log.info("executor %s joined", executor_id)
        for executor_id in sorted(set(dead) | set(change.left)):
            requeued = self._directory.requeue_inbox(executor_id)
            log.info("executor %s left; re-queued %d of its assignments", executor_id, requeued)
        self._metrics.executors_alive.set(len(self._registry.live_ids()))
        self._stalled = False
        self._drop_cancelled([r.request_id for r in self._batcher.requests()])

    def _reclaim_idle(self, now: float) -> None:
        """Takes over the entries a former leader read after losing the lock: it cannot
        assign them (fenced), and they would stay pending under its name."""
        lock_ttl_ms = self._config.lock_ttl_ms
        self._next_reclaim_s = now + lock_ttl_ms / 1000.0
        reclaimed = self._stream.reclaim(min_idle_ms=lock_ttl_ms)
        fresh = [e for e in reclaimed if e.entry_id not in self._batcher.entry_ids()]
        if fresh:
            log.info("reclaimed %d requests another scheduler had read", len(fresh))
            self._intake.admit(fresh, time.monotonic(), self._block_size())

    def _block_size(self) -> int:
        views = list(self._placer.executors.values())
        return views[0].block_size if views else DEFAULT_BLOCK_SIZE

    def _drop_expired(self, now: float) -> None:
        expired = self._batcher.expired(now)
        for request in expired:
            log.info(
                "request %s waited past its queue deadline: dropped",
                request.request_id,
                extra=request_fields(request.request_id, request.session_id),
            )
        self._metrics.dropped_requests.labels("expired").inc(len(expired))
        self._stream.drop([r.entry_id for r in expired])

    def _drop_cancelled(self, request_ids: list[str]) -> None:
        removed = [self._batcher.remove(rid) for rid in self._stream.cancelled(request_ids)]
        self._drop_as_cancelled([r for r in removed if r is not None])

    def _drop_as_cancelled(self, requests: list[PendingRequest]) -> None:
        self._count_cancelled(requests)
        self._stream.drop([r.entry_id for r in requests])

    def _count_cancelled(self, requests: list[PendingRequest]) -> None:
        for request in requests:
            log.info(
                "request cancelled while queued: dropped",
                extra=request_fields(request.request_id, request.session_id),
            )
        self._metrics.dropped_requests.labels("cancelled").inc(len(requests))

    def _dispatch(self, now: float, reason: str) -> None:
        batch = self._batcher.release(now)
        self._metrics.window_releases.labels(reason).inc()
        self._metrics.batch_size.observe(len(batch))
        self._metrics.batch_tokens.observe(sum(r.num_prompt_tokens for r in batch))
        unplaced = [r for r in batch if not self._place(r)]
        for request in unplaced:
            self._batcher.add(request)
        self._stalled = len(unplaced) == len(batch) and bool(unplaced)

    def _waits_for_session_move(self, request: PendingRequest, owner: str | None) -> bool:
        """Whether a session's turn waits: the executor holding its KV drains and is moving
        the session to a peer (placed now, the turn would prefill its history again). It
        waits until a peer reports the session, the drain ends, or SESSION_MOVE_WAIT_S."""
        if owner is None or not self._registry.moving_kv_from(owner):
            return False
        return request.waited_ms(time.monotonic()) < SESSION_MOVE_WAIT_S * 1000.0

    def _place(self, request: PendingRequest) -> bool:
        """Assigns the request, or drops it if it was cancelled (the assignment checks).

        Returns: False when no executor can take it now.
        """
        owner = request.session_executor_id
        if request.session_id is not None:
            holder = self._registry.session_holder(request.session_id)
            if owner is None or (self._registry.moving_kv_from(owner) and holder != owner):
                owner = holder  # a drain moved the session's KV to a peer, which reports it
            if self._waits_for_session_move(request, owner):
                return False
        placement = self._placer.choose(
            request.num_prompt_tokens, request.block_hashes, owner, request.num_sequences
        )
        if placement is None:
            return False
        if not self._stream.assign(request, placement.executor_id, self._config.scheduler_id):
            self._count_cancelled([request])
            return True
        self._placer.book(placement, request.block_hashes)
        waited_s = request.waited_ms(time.monotonic()) / 1000.0
        self._metrics.queue_wait_seconds.observe(waited_s)
        self._metrics.assigned_requests.inc()
        log.info(
            "request assigned to %s after %.1f ms in the queue (%d cached blocks)",
            placement.executor_id,
            waited_s * 1000.0,
            placement.cached_blocks,
            extra={
                **request_fields(request.request_id, request.session_id),
                "executor_id": placement.executor_id,
            },
        )
        return True
