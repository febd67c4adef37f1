"""The start every process shares: validated config, logging, and its /metrics server."""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from common.logs import setup_logging
from common.metrics import ProcessMetrics, start_metrics_server


class ProcessConfig(Protocol):
    log_level: str
    log_format: str
    metrics_host: str
    metrics_port: int


C = TypeVar("C", bound=ProcessConfig)
M = TypeVar("M", bound=ProcessMetrics)


def start_process(
    name: str, parse_config: Callable[[], C], make_metrics: Callable[[], M]
) -> tuple[C, M] | None:
    """Parse and validate the config, set up logging and stack dumps on SIGUSR1, serve /metrics.

    Args:
        name: the process name, for log lines and error messages.
        parse_config: builds the validated config from the command line (ValueError naming
            the flag on bad input).
        make_metrics: builds the process's metrics, with their own registry.

    Returns:
        The config and metrics, or None after printing why the process cannot start (the
        caller exits with status 2).
    """
    try:
        config = parse_config()
    except ValueError as error:
        print(f"{name}: {error}", file=sys.stderr)
        return None
    setup_logging(name, config.log_level, config.log_format)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a stuck process is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    metrics = make_metrics()
    try:
        start_metrics_server(metrics.scrapes, config.metrics_host, config.metrics_port)
    except OSError as error:
        print(f"{name}: {error}", file=sys.stderr)
        return None
    return config, metrics


def stop_on_signals(stop: threading.Event, signums=(signal.SIGTERM, signal.SIGINT)) -> None:
    """Set `stop` when one of `signums` arrives, from a short thread.

    A handler runs on the main thread between two of its bytecodes. Event.wait holds the
    event's lock around its check, so a handler calling stop.set() while the main thread was
    inside stop.wait() would wait for a lock its own thread holds, forever; the thread's set
    waits only until wait lets go of it.
    """

    def handler(*_) -> None:
        threading.Thread(target=stop.set, name="stop-signal", daemon=True).start()

    for signum in signums:
        signal.signal(signum, handler)
