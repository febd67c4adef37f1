"""`python -m scheduler`: run one scheduler (the leader, or a standby until the lock frees)."""

from __future__ import annotations

import signal
import sys

from common.logs import setup_logging
from common.metrics import start_metrics_server
from common.redis_conn import connect_sync
from scheduler.config import SchedulerConfig
from scheduler.metrics import SchedulerMetrics
from scheduler.service import Scheduler


def main(argv: list[str] | None = None) -> int:
    """Args: command-line flags (None: sys.argv). Returns: the exit status."""
    try:
        config = SchedulerConfig.from_args(argv)
    except ValueError as error:
        print(f"scheduler: {error}", file=sys.stderr)
        return 2
    setup_logging("scheduler", config.log_level, config.log_format)
    metrics = SchedulerMetrics()
    try:
        start_metrics_server(metrics.registry, config.metrics_host, config.metrics_port)
    except OSError as error:
        print(f"scheduler: {error}", file=sys.stderr)
        return 2
    scheduler = Scheduler(config, connect_sync(config.redis_url, timeout_s=2.0), metrics)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: scheduler.stop())
    scheduler.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
