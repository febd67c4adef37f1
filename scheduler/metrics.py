"""The scheduler's Prometheus metrics."""

from __future__ import annotations

from common.metrics import ProcessMetrics
from scheduler.queue import RELEASE_REASONS

# Why a queued request is dropped without an executor.
DROP_REASONS = ("cancelled", "expired")


class SchedulerMetrics(ProcessMetrics):
    """Every kvgate_scheduler_ metric of common.metrics.METRICS, on a registry of its own;
    every release and drop reason is exposed from the start, at 0."""

    def __init__(self) -> None:
        super().__init__("kvgate_scheduler_")
        for reason in RELEASE_REASONS:
            self.window_releases.labels(reason)
        for reason in DROP_REASONS:
            self.dropped_requests.labels(reason)
