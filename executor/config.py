"""Configuration of the executor process (`ExecutorConfig`: flags with KVGATE_* environment
defaults, holding the engine's `EngineConfig`, engine/config.py)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from common.config import (
    DEFAULT_REDIS_URL,
    add_common_flags,
    check_common_fields,
    check_range,
    env_bool,
    env_float,
    env_int,
    env_str,
)
from common.health import add_health_flags, check_health_port
from common.metrics import add_metrics_flags, check_metrics_port
from common.model_files import check_model_path
from engine.config import EngineConfig, add_engine_flags, check_device_present, pop_engine_config


@dataclass(slots=True)
class ExecutorConfig:
    """What the executor process needs: the engine's config and its own; validated in
    `__post_init__` (errors name the flag)."""

    engine: EngineConfig
    redis_url: str = DEFAULT_REDIS_URL
    redis_prefix: str = "kvgate:"
    log_level: str = "info"
    log_format: str = "json"
    executor_id: str = ""  # empty: host-pid
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: a free port, -1: no metrics
    torch_threads: int = 0  # CPU threads for the model; 0: torch's default (all cores)
    health_host: str = "127.0.0.1"
    health_port: int = 0  # grpc.health.v1 for probes; 0: a free port, -1: none
    # A step loop that has not gone round for this long is stuck: the heartbeat is withdrawn
    # (its requests resume elsewhere) and health is NOT_SERVING; must exceed the longest step.
    step_stall_s: float = 5.0
    sink_tls_ca: str = ""  # TokenSink over TLS: the CA of the gateways' certificates
    sink_tls_cert: str = ""  # this executor's client certificate (mutual TLS)
    sink_tls_key: str = ""
    sink_tls_server_name: str = ""  # the name the gateways' certificate holds; empty: the host
    sink_secret_file: str = ""  # the shared secret sent first on each TokenSink stream
    # KvTransfer (executor/kv_transfer.py): a drain moves KV to peers; port -1: no service,
    # and a drain then finishes its streams here
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0  # 0: a free port
    kv_transfer_advertise_host: str = ""  # the host peers dial; empty: --kv-transfer-host
    kv_transfer_timeout_s: float = 10.0  # one sequence's transfer, before it is recomputed
    kv_tls_cert: str = ""  # the service's certificate (peers verify it with their --kv-tls-ca)
    kv_tls_key: str = ""
    kv_tls_ca: str = ""  # verifies peers (their service and, mutual TLS, client certificates)
    kv_tls_server_name: str = ""  # the name in peers' certificates; empty: the host dialled
    kv_tls_allowed_names: str = ""  # comma-separated: a peer's client certificate names one
    rebalance_sessions: bool = False  # move idle sessions off a nearly full cache to peers
    # After a drain, wait up to this long for a /metrics scrape to read its last counts; 0: none
    drain_scrape_wait_s: float = 0.0

    def __post_init__(self) -> None:
        check_common_fields(self.redis_url, self.log_level, self.log_format)
        check_range("--step-stall-s", self.step_stall_s, min_value=0.5)
        check_metrics_port(self.metrics_port)
        check_health_port(self.health_port)
        check_range("--torch-threads", self.torch_threads, min_value=0, max_value=1024)
        check_model_path("--model", self.engine.model, "config.json")
        if any(c.isspace() or c == ":" for c in self.executor_id):
            raise ValueError(f"--executor-id must hold no spaces or ':', got {self.executor_id!r}")
        self.executor_id = self.executor_id or f"{socket.gethostname()}-{os.getpid()}"
        check_device_present(self.engine.device)
        if bool(self.sink_tls_cert) != bool(self.sink_tls_key):
            raise ValueError("--sink-tls-cert and --sink-tls-key must be given together")
        if (self.sink_tls_cert or self.sink_tls_server_name) and not self.sink_tls_ca:
            raise ValueError("--sink-tls-cert and --sink-tls-server-name need --sink-tls-ca")
        check_kv_transfer_fields(self)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> ExecutorConfig:
        """Args: command-line flags (None: sys.argv). Returns: the validated config.

        Raises:
            ValueError: naming the flag with a bad value.
        """
        return cls.from_flags(vars(build_parser().parse_args(argv)))

    @classmethod
    def from_flags(cls, values: dict[str, object]) -> ExecutorConfig:
        """The config of parsed flags' values (`build_parser`'s, by field name).

        Raises:
            ValueError: naming the flag with a bad value.
        """
        values = dict(values)
        engine = pop_engine_config(values)
        return cls(engine=engine, **values)


def build_parser() -> argparse.ArgumentParser:
    """Flags of `python -m executor`, with KVGATE_* environment variables as defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m executor",
        description="Run one executor: the engine's step loop on assignments from its Redis "
        "inbox, tokens streamed to the gateways. SIGTERM drains it.",
    )
    add_common_flags(parser)
    add_engine_flags(parser)
    add = parser.add_argument
    add("--executor-id", default=env_str("KVGATE_EXECUTOR_ID", ""))
    add(
        "--torch-threads",
        type=int,
        default=env_int("KVGATE_TORCH_THREADS", 0),
        help="CPU threads for the model (0: all cores)",
    )
    add(
        "--step-stall-s",
        type=float,
        default=env_float("KVGATE_STEP_STALL_S", 5.0),
        help="a step loop stuck this long withdraws the heartbeat (its requests move)",
    )
    add_metrics_flags(parser, "KVGATE_EXECUTOR_METRICS_PORT")
    add_health_flags(parser, default_port=0)
    add_sink_flags(parser)
    add_kv_transfer_flags(parser)
    return parser


def check_kv_transfer_fields(config: ExecutorConfig) -> None:
    """Raise a ValueError naming the --kv-* flag with a bad value."""
    if config.kv_transfer_port != -1:
        check_range("--kv-transfer-port", config.kv_transfer_port, min_value=0, max_value=65535)
    check_range("--kv-transfer-timeout-s", config.kv_transfer_timeout_s, min_value=0.1)
    check_range("--drain-scrape-wait-s", config.drain_scrape_wait_s, min_value=0.0)
    if bool(config.kv_tls_cert) != bool(config.kv_tls_key):
        raise ValueError("--kv-tls-cert and --kv-tls-key must be given together")
    if config.kv_tls_ca and not (config.kv_tls_cert and config.sink_tls_cert):
        raise ValueError(
            "--kv-tls-ca (mutual TLS between executors) needs --kv-tls-cert and --kv-tls-key "
            "(the service's certificate) and --sink-tls-cert (the client certificate it dials "
            "peers with)"
        )
    if (
        config.kv_transfer_host in ("0.0.0.0", "::", "[::]")
        and not config.kv_transfer_advertise_host
    ):
        raise ValueError(
            f"--kv-transfer-host {config.kv_transfer_host} listens on every address: give "
            "--kv-transfer-advertise-host, the address peers dial (the pod IP)"
        )
    if config.kv_tls_allowed_names and not config.kv_tls_ca:
        raise ValueError("--kv-tls-allowed-names needs --kv-tls-ca (mutual TLS)")
    if config.kv_tls_cert and not config.kv_tls_ca:
        raise ValueError("--kv-tls-cert needs --kv-tls-ca (peers must present a certificate)")


def add_kv_transfer_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the KvTransfer service (docs/operations.md, "Drains")."""
    add = parser.add_argument
    add(
        "--kv-transfer-host",
        default=env_str("KVGATE_KV_TRANSFER_HOST", "127.0.0.1"),
        help="where the KvTransfer service listens (peers push KV to it when they drain)",
    )
    add(
        "--kv-transfer-port",
        type=int,
        default=env_int("KVGATE_KV_TRANSFER_PORT", 0),
        help="its port (0: a free one; -1: no service, and a drain finishes its streams here)",
    )
    add(
        "--kv-transfer-advertise-host",
        default=env_str("KVGATE_KV_TRANSFER_ADVERTISE_HOST", ""),
        help="the host peers dial (default: --kv-transfer-host); the pod IP in Kubernetes",
    )
    add(
        "--kv-transfer-timeout-s",
        type=float,
        default=env_float("KVGATE_KV_TRANSFER_TIMEOUT_S", 10.0),
        help="one sequence's transfer; past it the sequence is recomputed instead",
    )
    add(
        "--drain-scrape-wait-s",
        type=float,
        default=env_float("KVGATE_DRAIN_SCRAPE_WAIT_S", 0.0),
        help="after a drain, wait up to this long for a /metrics scrape to read its last "
        "counts (a Prometheus scrape interval; 0: exit at once)",
    )
    add(
        "--rebalance-sessions",
        action=argparse.BooleanOptionalAction,
        default=env_bool("KVGATE_REBALANCE_SESSIONS", False),
        help="move idle sessions to a peer with room when this cache is nearly full, instead "
        "of evicting them (executor/rebalance.py)",
    )
    add("--kv-tls-cert", default=env_str("KVGATE_KV_TLS_CERT", ""), help="the service's cert")
    add("--kv-tls-key", default=env_str("KVGATE_KV_TLS_KEY", ""))
    add(
        "--kv-tls-ca",
        default=env_str("KVGATE_KV_TLS_CA", ""),
        help="mutual TLS between executors: verifies peers' certificates (with --sink-tls-cert "
        "as this executor's client certificate)",
    )
    add(
        "--kv-tls-allowed-names",
        default=env_str("KVGATE_KV_TLS_ALLOWED_NAMES", ""),
        help="comma-separated: a peer pushing KV must present a client certificate naming one "
        "(its CN or a SAN; default: any certificate of --kv-tls-ca)",
    )
    add(
        "--kv-tls-server-name",
        default=env_str("KVGATE_KV_TLS_SERVER_NAME", ""),
        help="the name in peers' --kv-tls-cert (default: the host dialled)",
    )


def add_sink_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the TokenSink's TLS and shared secret (docs/security.md)."""
    add = parser.add_argument
    add(
        "--sink-tls-ca",
        default=env_str("KVGATE_SINK_TLS_CA", ""),
        help="dial the gateways' TokenSink over TLS, their certificates signed by this CA",
    )
    add("--sink-tls-cert", default=env_str("KVGATE_SINK_TLS_CERT", ""), help="mutual TLS")
    add("--sink-tls-key", default=env_str("KVGATE_SINK_TLS_KEY", ""))
    add(
        "--sink-tls-server-name",
        default=env_str("KVGATE_SINK_TLS_SERVER_NAME", ""),
        help="the name in the gateways' certificate (default: the host dialled)",
    )
    add(
        "--sink-secret-file",
        default=env_str("KVGATE_SINK_SECRET_FILE", ""),
        help="send this file's secret on each TokenSink stream",
    )
