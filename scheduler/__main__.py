"""`python -m scheduler`: run one scheduler (the leader, or a standby until the lock frees)."""

from __future__ import annotations

import functools
import sys

from common.health import start_health
from common.redis_conn import connect_sync
from common.startup import start_process, stop_on_signals
from scheduler.config import SchedulerConfig
from scheduler.metrics import SchedulerMetrics
from scheduler.service import Scheduler


def main(argv: list[str] | None = None) -> int:
    """Args: command-line flags (None: sys.argv). Returns: the exit status."""
    started = start_process(
        "scheduler", functools.partial(SchedulerConfig.from_args, argv), SchedulerMetrics
    )
    if started is None:
        return 2
    config, metrics = started
    # A standby is as healthy as the leader (it is ready to take the lock); both need Redis.
    health = start_health("scheduler", config, metrics.registry)
    if health is None:
        return 2
    scheduler = Scheduler(config, connect_sync(config.redis_url, timeout_s=2.0), metrics)
    stop_on_signals(scheduler.stop_event)
    try:
        scheduler.run()
    finally:
        health.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
