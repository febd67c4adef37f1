"""Prometheus metrics shared by the processes: bucket layouts, the --metrics-* flags, the server.

Each process defines its metrics in its own module (gateway/metrics.py,
scheduler/metrics.py, executor/metrics.py) on a `CollectorRegistry` of its own,
and serves it on `--metrics-port` with `start_metrics_server`. Every metric
name starts with `kvgate_`; durations are in seconds.
"""

from __future__ import annotations

import argparse
import logging

from prometheus_client import CollectorRegistry, start_http_server

from common.config import check_range, env_int, env_str

log = logging.getLogger(__name__)

# The one bucket layout of every latency histogram, in seconds: 1 ms to 2 min.
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# The one bucket layout of every size histogram (requests or tokens per batch or step).
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# --metrics-port value that serves no metrics.
METRICS_DISABLED = -1


def add_metrics_flags(parser: argparse.ArgumentParser, port_env: str) -> None:
    """Add --metrics-host and --metrics-port (env KVGATE_METRICS_HOST and `port_env`).

    The port defaults to 0 (a free one, logged) so that processes started side by side
    never collide; launchers and manifests give each process its fixed port.
    """
    parser.add_argument(
        "--metrics-host",
        default=env_str("KVGATE_METRICS_HOST", "127.0.0.1"),
        help="address /metrics listens on (env KVGATE_METRICS_HOST)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=env_int(port_env, 0),
        help=f"port of /metrics; 0: a free port, {METRICS_DISABLED}: no metrics (env {port_env})",
    )


def check_metrics_port(port: int) -> None:
    """Raise a ValueError naming --metrics-port unless it is a port, 0 or METRICS_DISABLED."""
    check_range("--metrics-port", port, min_value=METRICS_DISABLED, max_value=65535)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int | None:
    """Serve `registry` as /metrics over HTTP on a daemon thread, and log the address.

    Args:
        registry: the process's metrics.
        host: address to listen on.
        port: TCP port; 0 picks a free one; METRICS_DISABLED serves nothing.

    Returns:
        The port bound, None when disabled.

    Raises:
        OSError: the port cannot be bound (the message names --metrics-port).
    """
    if port == METRICS_DISABLED:
        log.info("metrics disabled (--metrics-port %d)", METRICS_DISABLED)
        return None
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise OSError(f"--metrics-port {port}: cannot listen on {host}: {error}") from error
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
