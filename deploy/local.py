"""`make run`: start a local kvgate stack and keep it up until Ctrl-C.

python -m deploy.local [--host H] [--port P] [--http-port P] [--executors N] [--metrics-port M]
[--log-format json|text] [--log-dir DIR] [--auth off|keys] (KVGATE_HOST, KVGATE_PORT,
KVGATE_HTTP_PORT, KVGATE_MODEL, KVGATE_METRICS_PORT, KVGATE_LOG_FORMAT as defaults). Prints
the gRPC address, the OpenAI-compatible HTTP URL, the
/metrics ports and whether API keys are asked for once every process serves. A process that dies is
started again with backoff (deploy/supervise.py), and said so; Ctrl-C or SIGTERM stops
them all.
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from common.config import (
    LOG_FORMATS,
    check_choice,
    check_range,
    env_int,
    env_str,
    redacted_url,
)
from common.startup import stop_on_signals
from deploy.models import choose_model
from deploy.stack import DEFAULT_LOG_DIR, Stack, StackConfig
from deploy.supervise import Supervisor

# /metrics of the gateway; the scheduler's is the next port, executor i's is 2 + i further
# (the targets of deploy/prometheus.yml).
DEFAULT_METRICS_PORT = 9400
MAX_EXECUTORS = 16
AUTH_CHOICES = ("off", "keys")
DEFAULT_HTTP_PORT = 8000


def metrics_ports(first_port: int, num_executors: int) -> dict[str, int]:
    """Returns: the fixed /metrics port of each process of the stack, by process name."""
    ports = {"gateway": first_port, "scheduler": first_port + 1}
    ports.update({f"executor-{i}": first_port + 2 + i for i in range(num_executors)})
    return ports


@dataclass(slots=True)
class LauncherConfig:
    """Flags of the local launcher; validated in `__post_init__`."""

    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = DEFAULT_HTTP_PORT  # the OpenAI-compatible HTTP front; -1: none
    executors: int = 1
    redis_port: int = 0
    metrics_port: int = DEFAULT_METRICS_PORT
    log_format: str = "json"  # of every process: json lines or text
    log_dir: str = str(DEFAULT_LOG_DIR)  # each process logs to DIR/NAME.log
    auth: str = "off"  # the gateway's --auth: off (tenant "default") or keys

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host must be a host name or address, got ''")
        check_range("--port", self.port, min_value=1, max_value=65535)
        check_range("--http-port", self.http_port, min_value=-1, max_value=65535)
        check_range("--executors", self.executors, min_value=1, max_value=MAX_EXECUTORS)
        check_range("--redis-port", self.redis_port, min_value=0, max_value=65535)
        last_port = 65535 - 2 - MAX_EXECUTORS
        check_range("--metrics-port", self.metrics_port, min_value=1, max_value=last_port)
        check_choice("--log-format", self.log_format, LOG_FORMATS)
        check_choice("--auth", self.auth, AUTH_CHOICES)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> LauncherConfig:
        """Args: command-line flags (None: sys.argv). Returns: the validated config."""
        parser = argparse.ArgumentParser(prog="python -m deploy.local", description=__doc__)
        parser.add_argument("--host", default=env_str("KVGATE_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=env_int("KVGATE_PORT", 50051))
        parser.add_argument(
            "--http-port",
            type=int,
            default=env_int("KVGATE_HTTP_PORT", DEFAULT_HTTP_PORT),
            help="OpenAI-compatible HTTP port of the gateway; -1: none (env KVGATE_HTTP_PORT)",
        )
        parser.add_argument("--executors", type=int, default=1)
        parser.add_argument(
            "--redis-port", type=int, default=env_int("KVGATE_REDIS_PORT", 0), help="0: a free port"
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=env_int("KVGATE_METRICS_PORT", DEFAULT_METRICS_PORT),
            help="/metrics port of the gateway; scheduler: +1, executor i: +2+i",
        )
        parser.add_argument(
            "--log-format",
            default=env_str("KVGATE_LOG_FORMAT", "json"),
            help="json lines (default) or text, for every process (env KVGATE_LOG_FORMAT)",
        )
        parser.add_argument("--log-dir", default=str(DEFAULT_LOG_DIR), help="DIR/NAME.log each")
        parser.add_argument(
            "--auth",
            default="off",
            help="off: every caller is tenant 'default'; keys: API keys (kvgate admin keys)",
        )
        return cls(**vars(parser.parse_args(argv)))


def _auth_line(auth: str, redis_url: str) -> str:
    if auth == "off":
        return (
            "  auth is off: every caller is tenant 'default' (ARGS='--auth keys' asks for API "
            "keys; docs/security.md)"
        )
    return (
        "  auth: API keys; make one with\n"
        f"  .venv/bin/kvgate admin --redis-url {redacted_url(redis_url)} keys create --tenant NAME"
    )


def main(argv: list[str] | None = None) -> int:
    """Args: command-line flags (None: sys.argv). Returns: the exit status."""
    try:
        config = LauncherConfig.from_args(argv)
    except ValueError as error:
        print(f"deploy.local: {error}", file=sys.stderr)
        return 2
    model = choose_model()
    stack = Stack(
        StackConfig(
            model=str(model),
            host=config.host,
            port=config.port,
            http_port=config.http_port,
            redis_port=config.redis_port,
            metrics_ports=metrics_ports(config.metrics_port, config.executors),
            log_format=config.log_format,
            log_dir=Path(config.log_dir),
            auth=config.auth,
        )
    )
    stopped = threading.Event()
    stop_on_signals(stopped)
    try:
        print(f"starting kvgate on model {model} (logs in {stack.config.log_dir})", flush=True)
        try:
            stack.start_all(num_executors=config.executors)
        except (RuntimeError, TimeoutError) as error:  # a process exited or never got ready
            print(f"kvgate could not start: {error}", file=sys.stderr, flush=True)
            _print_log_tail(stack.log_path(str(error).split(":")[0]))
            return 2
        print(f"kvgate serving on {stack.address}  (Ctrl-C stops it)", flush=True)
        if config.http_port != -1:
            print(f"  OpenAI-compatible HTTP: {stack.http_url}", flush=True)
        print(_auth_line(config.auth, stack.redis_url), flush=True)
        for name, port in sorted(stack.metrics_ports.items(), key=lambda item: item[1]):
            print(f"  {name} metrics: http://127.0.0.1:{port}/metrics", flush=True)
        supervisor = Supervisor(stack, say=lambda line: print(line, flush=True))
        while not stopped.wait(0.5):
            supervisor.poll()
    finally:
        print("stopping kvgate", flush=True)
        stack.stop_all()
    return 0


def _print_log_tail(log: Path, lines: int = 5) -> None:
    """The last lines of a process's log (where it says why it stopped), on stderr."""
    if log.is_file():
        print(f"last lines of {log}:", file=sys.stderr)
        for line in log.read_text(errors="replace").splitlines()[-lines:]:
            print(f"  {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
