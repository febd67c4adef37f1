"""Configuration of the scheduler process: flags, with environment variables as defaults."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from common.config import (
    DEFAULT_REDIS_URL,
    add_common_flags,
    check_choice,
    check_common_fields,
    check_range,
    env_float,
    env_int,
    env_str,
)
from common.health import add_health_flags, check_health_port
from common.metrics import add_metrics_flags, check_metrics_port

POLICIES = ("fcfs", "priority", "lpm")


@dataclass(slots=True)
class SchedulerConfig:
    """What the scheduler needs; every field is validated in `__post_init__`."""

    redis_url: str = DEFAULT_REDIS_URL
    redis_prefix: str = "kvgate:"
    log_level: str = "info"
    log_format: str = "json"
    batch_window_ms: float = 2.0  # the oldest request waits at most this long for a batch
    max_batch_size: int = 64  # release early when this many requests wait
    max_batch_tokens: int = 8192  # release early when this many prompt tokens wait
    policy: str = "fcfs"  # fcfs | priority | lpm
    priority_aging_ms: float = 1000.0  # a waiting request gains one priority level per period
    lpm_aging_ms: float = 1000.0  # lpm: a request waiting this long goes before younger ones
    load_cost_blocks: float = 2.0  # placement cost of one running or waiting request, in blocks
    lock_ttl_ms: int = 2000  # a dead leader's lock expires after this long
    registry_poll_ms: float = 100.0  # how often executor heartbeats are read
    scheduler_id: str = ""  # consumer and lock holder name; empty: host-pid
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: a free port, -1: no metrics
    health_host: str = "127.0.0.1"
    health_port: int = 0  # grpc.health.v1 for probes; 0: a free port, -1: none

    def __post_init__(self) -> None:
        check_common_fields(self.redis_url, self.log_level, self.log_format)
        check_range("--batch-window-ms", self.batch_window_ms, min_value=0, max_value=60_000)
        check_range("--max-batch-size", self.max_batch_size, min_value=1)
        check_range("--max-batch-tokens", self.max_batch_tokens, min_value=1)
        check_choice("--policy", self.policy, POLICIES)
        check_range("--priority-aging-ms", self.priority_aging_ms, min_value=1)
        check_range("--lpm-aging-ms", self.lpm_aging_ms, min_value=0)
        check_range("--load-cost-blocks", self.load_cost_blocks, min_value=0)
        check_range("--lock-ttl-ms", self.lock_ttl_ms, min_value=100)
        check_range("--registry-poll-ms", self.registry_poll_ms, min_value=1, max_value=1000)
        check_metrics_port(self.metrics_port)
        check_health_port(self.health_port)
        if not self.scheduler_id:
            self.scheduler_id = f"{socket.gethostname()}-{os.getpid()}"

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> SchedulerConfig:
        """Args: command-line flags (None: sys.argv). Returns: the validated config."""
        return cls(**vars(build_parser().parse_args(argv)))


def build_parser() -> argparse.ArgumentParser:
    """Flags of `python -m scheduler`, with KVGATE_* environment variables as defaults."""
    parser = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__)
    add_common_flags(parser)
    add = parser.add_argument
    add("--batch-window-ms", type=float, default=env_float("KVGATE_BATCH_WINDOW_MS", 2.0))
    add("--max-batch-size", type=int, default=env_int("KVGATE_MAX_BATCH_SIZE", 64))
    add("--max-batch-tokens", type=int, default=env_int("KVGATE_MAX_BATCH_TOKENS", 8192))
    add(
        "--policy",
        default=env_str("KVGATE_POLICY", "fcfs"),
        help="fcfs, priority, or lpm (longest cached prefix first)",
    )
    add("--priority-aging-ms", type=float, default=env_float("KVGATE_PRIORITY_AGING_MS", 1000.0))
    add("--lpm-aging-ms", type=float, default=env_float("KVGATE_LPM_AGING_MS", 1000.0))
    add("--load-cost-blocks", type=float, default=env_float("KVGATE_LOAD_COST_BLOCKS", 2.0))
    add("--lock-ttl-ms", type=int, default=env_int("KVGATE_LOCK_TTL_MS", 2000))
    add("--registry-poll-ms", type=float, default=env_float("KVGATE_REGISTRY_POLL_MS", 100.0))
    add("--scheduler-id", default=env_str("KVGATE_SCHEDULER_ID", ""))
    add_metrics_flags(parser, "KVGATE_SCHEDULER_METRICS_PORT")
    add_health_flags(parser, default_port=0)
    return parser
