"""grpc.health.v1 that tells the truth, for every process and for an orchestrator's probes.

Two services are answered:
- "" (the whole process, readiness): SERVING only while the process can do its work. Each
  process names the conditions that make it NOT_SERVING (Redis unreachable, draining, the
  model still loading, no executor alive); `HealthConditions` holds them and logs each change.
- LIVENESS_SERVICE: SERVING while the process runs. A liveness probe restarts a process only
  when it no longer answers at all, never because Redis or an executor is down.

The scheduler and executors serve both on `--health-host/--health-port` with `HealthServer`
(a small gRPC server of its own); the gateway serves them on its public port, and also on
`--health-port` when one is given.

    python -m common.health [--service NAME] [--until STATUS] [HOST:PORT]

exits 0 when the address answers SERVING, 1 otherwise: the containers' health check. With
--until it waits for that status instead (an executor's preStop hook waits for its drain).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Protocol

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from common.config import check_range, env_int, env_str
from common.metrics import build_metric
from common.redis_conn import connect_sync, describe

log = logging.getLogger(__name__)
LIVENESS_SERVICE = "liveness"
# --health-port that serves no separate health port.
HEALTH_DISABLED = -1
# How often a process re-checks its conditions, in seconds.
CHECK_INTERVAL_S = 0.5
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A check returns None while its condition holds, else why the process cannot serve.
Check = Callable[[], str | None]
# The condition every process has; kvgate_redis_up follows it.
REDIS_CONDITION = "redis"


def add_health_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Add --health-host and --health-port (env KVGATE_HEALTH_HOST, KVGATE_HEALTH_PORT)."""
    parser.add_argument(
        "--health-host",
        default=env_str("KVGATE_HEALTH_HOST", "127.0.0.1"),
        help="address grpc.health.v1 listens on for probes (env KVGATE_HEALTH_HOST)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=env_int("KVGATE_HEALTH_PORT", default_port),
        help=f"port of grpc.health.v1 for probes; 0: a free port, {HEALTH_DISABLED}: none "
        "(env KVGATE_HEALTH_PORT)",
    )


def check_health_port(port: int) -> None:
    """Raise a ValueError naming --health-port unless it is a port, 0 or HEALTH_DISABLED."""
    check_range("--health-port", port, min_value=HEALTH_DISABLED, max_value=65535)


class HealthConditions:
    """The reasons a process cannot serve now, by condition name; logs each change between
    SERVING and NOT_SERVING."""

    def __init__(self, process: str, registry: CollectorRegistry | None = None) -> None:
        self._process = process
        self._failing: dict[str, str] = {}
        self._lock = threading.Lock()
        self._redis_up = None
        if registry is not None:
            self._redis_up = build_metric(registry, "kvgate_redis_up")

    def update(self, condition: str, failing: str | None) -> bool:
        """Records one condition (None: it holds). Returns: whether SERVING changed."""
        with self._lock:
            was_serving = not self._failing
            if failing is None:
                self._failing.pop(condition, None)
            else:
                self._failing[condition] = failing
            serving = not self._failing
        if condition == REDIS_CONDITION and self._redis_up is not None:
            self._redis_up.set(0 if failing else 1)
        if serving != was_serving:
            if serving:
                log.info("%s health: SERVING", self._process)
            else:
                log.warning("%s health: NOT_SERVING (%s)", self._process, self.reason)
        return serving != was_serving

    @property
    def serving(self) -> bool:
        with self._lock:
            return not self._failing

    @property
    def reason(self) -> str:
        """Why the process is NOT_SERVING; empty while it serves."""
        with self._lock:
            return "; ".join(self._failing.values())


def redis_check(client: redis.Redis) -> Check:
    """A check that fails while `client` gets no PONG (down, or any error reply)."""

    def check() -> str | None:
        try:
            client.ping()
        except redis.RedisError as error:
            return f"redis unreachable: {describe(error)}"
        return None

    return check


class HealthServer:
    """grpc.health.v1 on a port of its own, re-evaluating named checks on a thread.

    "" is SERVING while every check holds; LIVENESS_SERVICE while the process runs.
    """

    def __init__(
        self, process: str, checks: dict[str, Check], registry: CollectorRegistry | None = None
    ) -> None:
        self.conditions = HealthConditions(process, registry)
        self._checks = dict(checks)
        self._servicer = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._servicer.set("", NOT_SERVING)
        self._servicer.set(LIVENESS_SERVICE, SERVING)

    def start(self, host: str, port: int) -> int | None:
        """Listens on host:port (HEALTH_DISABLED: nowhere) and starts checking.

        Returns: the port bound, None when disabled.

        Raises:
            OSError: the port cannot be bound (the message names --health-port).
        """
        bound = None
        if port != HEALTH_DISABLED:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
            try:
                bound = server.add_insecure_port(f"{host}:{port}")
            except RuntimeError as error:
                raise OSError(f"--health-port {port}: cannot listen on {host}: {error}") from None
            server.start()
            self._server = server
            log.info("grpc.health.v1 on %s:%d", host, bound)
        self.evaluate()
        self._thread.start()
        return bound

    def add_check(self, name: str, check: Check) -> None:
        """Adds a condition, evaluated from the next round on."""
        self._checks[name] = check
        self.recheck()

    def remove_check(self, name: str) -> None:
        """Drops a condition: it no longer keeps the process from serving."""
        self._checks.pop(name, None)
        self.conditions.update(name, None)
        self.recheck()

    def recheck(self) -> None:
        """Re-evaluates the checks now rather than at the next interval; safe from a signal
        handler (it only sets an event)."""
        self._wake.set()

    def evaluate(self) -> None:
        """Runs every check once and publishes the result."""
        for name, check in list(self._checks.items()):
            self.conditions.update(name, check())
        self._servicer.set("", SERVING if self.conditions.serving else NOT_SERVING)

    def stop(self) -> None:
        """NOT_SERVING to every service, then stops the server."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join()
        self._servicer.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(0.5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(CHECK_INTERVAL_S)
            self._wake.clear()
            if not self._stop.is_set():
                self.evaluate()


class HealthConfig(Protocol):
    redis_url: str
    health_host: str
    health_port: int


def start_health(
    process: str,
    config: HealthConfig,
    registry: CollectorRegistry,
    failing_at_start: dict[str, str] | None = None,
) -> HealthServer | None:
    """Serves grpc.health.v1 on --health-host/--health-port with a Redis check.

    Args:
        process: the process name, for log lines and error messages.
        config: the process's config.
        registry: its metrics, where kvgate_redis_up goes.
        failing_at_start: conditions NOT_SERVING until the caller clears them with
            `add_check`, with their reasons (such as the model still loading).

    Returns:
        The running server, or None after printing why it cannot listen (exit with 2).
    """
    checks: dict[str, Check] = {REDIS_CONDITION: redis_check(connect_sync(config.redis_url))}
    for name, reason in (failing_at_start or {}).items():
        checks[name] = functools.partial(str, reason)
    health = HealthServer(process, checks, registry)
    try:
        health.start(config.health_host, config.health_port)
    except OSError as error:
        print(f"{process}: {error}", file=sys.stderr)
        return None
    return health


def probe(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    """Returns: the status name a grpc.health.v1 server at `address` gives for `service`
    (UNREACHABLE when it does not answer)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            return f"UNREACHABLE ({error.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def default_probe_address() -> str:
    """127.0.0.1 and KVGATE_HEALTH_PORT, else the gateway's KVGATE_PORT (default 50051)."""
    port = os.environ.get("KVGATE_HEALTH_PORT") or os.environ.get("KVGATE_PORT") or "50051"
    return f"127.0.0.1:{port}"


def build_parser() -> argparse.ArgumentParser:
    """Flags of `python -m common.health`."""
    parser = argparse.ArgumentParser(prog="python -m common.health", description=__doc__)
    parser.add_argument("address", nargs="?", default=default_probe_address())
    parser.add_argument("--service", default="", help=f"'' (default) or {LIVENESS_SERVICE}")
    parser.add_argument("--until", default="", help="wait for this status (NOT_SERVING, ...)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="how long --until waits")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m common.health [--service NAME] [--until STATUS] [HOST:PORT]`.

    Returns: 0 when the status is SERVING (or STATUS, within --timeout-s), else 1. A process
    that stops answering while waited on for NOT_SERVING has gone past it (an idle executor
    drains and exits at once): that counts as reached.
    """
    args = build_parser().parse_args(argv)
    wanted = args.until or "SERVING"
    deadline = time.monotonic() + (args.timeout_s if args.until else 0.0)
    while True:
        status = probe(args.address, args.service)
        if status == wanted or time.monotonic() >= deadline:
            break
        if wanted == "NOT_SERVING" and status.startswith("UNREACHABLE"):
            print(f"{args.address} {args.service or '(all)'}: {status}: exited, so drained")
            return 0
        time.sleep(0.2)
    print(f"{args.address} {args.service or '(all)'}: {status}")
    return 0 if status == wanted else 1


if __name__ == "__main__":
    sys.exit(main())
