"""The scheduler's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import LATENCY_BUCKETS_S, SIZE_BUCKETS
from scheduler.queue import RELEASE_REASONS

# Why a queued request is dropped without an executor.
DROP_REASONS = ("cancelled", "expired")


class SchedulerMetrics:
    """Every metric of one scheduler, on its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.is_leader = Gauge(
            "kvgate_scheduler_is_leader",
            "1 while this scheduler holds the leader lock, 0 as a standby",
            registry=registry,
        )
        self.queue_length = Gauge(
            "kvgate_scheduler_queue_length",
            "requests waiting in the scheduler's queue for a batch or an executor",
            registry=registry,
        )
        self.queue_wait = Histogram(
            "kvgate_scheduler_queue_wait_seconds",
            "time from a request being queued (its XADD, on Redis's clock) to its assignment",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.batch_size = Histogram(
            "kvgate_scheduler_batch_size",
            "requests in a released batch",
            buckets=SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "kvgate_scheduler_batch_tokens",
            "prompt tokens in a released batch",
            buckets=SIZE_BUCKETS,
            registry=registry,
        )
        self.window_releases = Counter(
            "kvgate_scheduler_window_releases",
            "batches released, by reason: window, max_batch_size or max_batch_tokens",
            ["reason"],
            registry=registry,
        )
        for reason in RELEASE_REASONS:
            self.window_releases.labels(reason)
        self.assigned = Counter(
            "kvgate_scheduler_assigned_requests",
            "requests assigned to an executor",
            registry=registry,
        )
        self.dropped = Counter(
            "kvgate_scheduler_dropped_requests",
            "queued requests dropped, by reason: cancelled or expired",
            ["reason"],
            registry=registry,
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        self.executors_alive = Gauge(
            "kvgate_scheduler_executors_alive",
            "executors with a live heartbeat",
            registry=registry,
        )
