"""The gateway's configuration: flags with KVGATE_* environment defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from common.config import (
    DEFAULT_MODEL,
    add_common_flags,
    check_choice,
    check_common_fields,
    check_positive,
    check_range,
    env_float,
    env_int,
    env_str,
)
from common.health import HEALTH_DISABLED, add_health_flags, check_health_port
from common.metrics import add_metrics_flags, check_metrics_port
from common.model_files import MODEL_HELP, check_model_path
from common.tls import check_tls_flags
from gateway.auth import AUTH_MODES

HTTP_DISABLED = -1  # --http-port that serves no HTTP front
# gRPC core takes its channel arguments as C ints.
MAX_GRPC_INT = 2**31 - 1


@dataclass(slots=True)
class GatewayConfig:
    """Everything a gateway process needs; validated when built."""

    # checkpoint folder or GGUF file (its tokenizer is read, never the weights)
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"  # public Inference address
    port: int = 50051
    http_host: str = "127.0.0.1"  # the OpenAI-compatible HTTP front's address
    http_port: int = HTTP_DISABLED  # 0: a free port; -1: no HTTP front
    internal_host: str = "127.0.0.1"  # TokenSink address executors connect to
    internal_port: int = 0  # 0: a free port
    advertise_host: str = ""  # host put in reply_to; empty: internal_host
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvgate:"
    redis_timeout_s: float = 1.5  # a Redis call fails after this: UNAVAILABLE within 2 s
    # Redis connections this gateway may hold; a call that finds them all busy for
    # REDIS_POOL_WAIT_S is refused with RESOURCE_EXHAUSTED
    redis_max_connections: int = 128
    max_queue_len: int = 4096  # queued (not yet placed) requests before RESOURCE_EXHAUSTED
    # Generate and Chat calls open at once; one more is refused with RESOURCE_EXHAUSTED
    max_concurrent_streams: int = 4096
    # a bigger request message: RESOURCE_EXHAUSTED from gRPC core; 0: derived from the
    # model's character budget (gateway.limits.receive_limit)
    max_receive_message_bytes: int = 0
    tokenizer_threads: int = 2  # threads that tokenize and template long inputs
    max_stop_token_ids: int = 64  # params.stop_token_ids per request
    max_queued_turns: int = 4  # Chat turns sent while one runs, waiting their turn
    max_attempts: int = 3  # runs of a request whose executor was lost, before it fails
    queue_timeout_s: float = 30.0  # not accepted by an executor by then: DEADLINE_EXCEEDED
    session_ttl_s: float = 600.0  # idle sessions expire after this
    default_max_tokens: int = 256  # max_tokens when a request sets none
    max_stop_strings: int = 16
    max_stop_len: int = 256  # characters per stop string
    # structured output: characters of a constraint (schema, regex, grammar, choices together)
    max_constraint_chars: int = 65_536
    # a constraint whose compile takes longer is refused (INVALID_ARGUMENT naming its field);
    # one that waits this long for a compile thread: RESOURCE_EXHAUSTED, retryable
    constraint_timeout_s: float = 5.0
    grace_s: float = 5.0  # running calls get this long to finish on SIGTERM
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: a free port, -1: no metrics
    health_host: str = "127.0.0.1"
    health_port: int = HEALTH_DISABLED  # grpc.health.v1 also here; -1: on the public port only
    log_level: str = "info"
    log_format: str = "json"
    auth: str = "keys"  # keys, cert (the client certificate's CN) or off (tenant "default")
    auth_cache_s: float = 2.0  # API key records and tenant limits are read again after this
    tls_cert: str = ""  # public port: PEM certificate chain; empty: no TLS
    tls_key: str = ""
    tls_client_ca: str = ""  # set: clients must present a certificate this CA signed
    internal_tls_cert: str = ""  # TokenSink port: executors must present a certificate
    internal_tls_key: str = ""
    internal_tls_client_ca: str = ""  # the CA of the executors' certificates
    # set: an executor's certificate must also name one of these (comma-separated) in its CN
    # or a DNS subjectAltName, so that other clients of the same CA are refused
    internal_tls_allowed_names: str = ""
    sink_secret_file: str = ""  # executors must send this file's secret first
    metrics_max_tenants: int = 32  # tenants with labels of their own; the rest are "other"

    def __post_init__(self) -> None:
        check_model_path("--model", self.model, "tokenizer.json")
        check_range("--port", self.port, min_value=0, max_value=65535)
        check_range("--internal-port", self.internal_port, min_value=0, max_value=65535)
        check_range("--http-port", self.http_port, min_value=HTTP_DISABLED, max_value=65535)
        check_positive("--redis-timeout-s", self.redis_timeout_s)
        check_range("--redis-max-connections", self.redis_max_connections, min_value=1)
        check_range("--max-queue-len", self.max_queue_len, min_value=1)
        check_range("--max-concurrent-streams", self.max_concurrent_streams, min_value=1)
        if self.max_receive_message_bytes != 0:  # 0: derived from the model's budget
            flag = "--max-receive-message-bytes (0: derived from the model)"
            bytes_ = self.max_receive_message_bytes
            check_range(flag, bytes_, min_value=1024, max_value=MAX_GRPC_INT)
        check_range("--tokenizer-threads", self.tokenizer_threads, min_value=1, max_value=64)
        check_range("--max-stop-token-ids", self.max_stop_token_ids, min_value=0)
        check_range("--max-constraint-chars", self.max_constraint_chars, min_value=1)
        check_positive("--constraint-timeout-s", self.constraint_timeout_s)
        check_range("--max-queued-turns", self.max_queued_turns, min_value=0)
        check_range("--max-attempts", self.max_attempts, min_value=1)
        check_positive("--queue-timeout-s", self.queue_timeout_s)
        check_positive("--session-ttl-s", self.session_ttl_s)
        check_range("--default-max-tokens", self.default_max_tokens, min_value=1)
        check_range("--max-stop-strings", self.max_stop_strings, min_value=0)
        check_range("--max-stop-len", self.max_stop_len, min_value=1)
        check_range("--grace-s", self.grace_s, min_value=0)
        check_metrics_port(self.metrics_port)
        check_health_port(self.health_port)
        check_common_fields(self.redis_url, self.log_level, self.log_format)
        if self.reply_host in WILDCARD_HOSTS:
            raise ValueError(
                f"--advertise-host is needed when --internal-host is {self.internal_host!r}: "
                "executors dial the advertised host, and a wildcard address is not one they "
                "can reach (give this gateway's own address, e.g. its pod IP)"
            )
        self._check_security()

    def _check_security(self) -> None:
        """The auth, TLS and tenant-label flags."""
        check_choice("--auth", self.auth, AUTH_MODES)
        if self.auth == "cert" and not self.tls_client_ca:
            raise ValueError("--auth cert needs --tls-client-ca (the CA of client certificates)")
        check_positive("--auth-cache-s", self.auth_cache_s)
        if self.auth == "cert" and self.http_port != HTTP_DISABLED:
            raise ValueError(
                "--auth cert is not served on --http-port yet: use --auth keys (the same API "
                "keys on both ports) or leave --http-port at -1"
            )
        check_tls_flags("--tls", self.tls_cert, self.tls_key, self.tls_client_ca)
        check_tls_flags(
            "--internal-tls",
            self.internal_tls_cert,
            self.internal_tls_key,
            self.internal_tls_client_ca,
        )
        if self.internal_tls_cert and not self.internal_tls_client_ca:
            raise ValueError(
                "--internal-tls-cert needs --internal-tls-client-ca: executors must present "
                "a certificate"
            )
        if self.internal_tls_allowed_names and not self.internal_tls_cert:
            raise ValueError(
                "--internal-tls-allowed-names needs --internal-tls-cert and "
                "--internal-tls-client-ca: the names are read from executors' certificates"
            )
        if self.internal_tls_allowed_names and not self.sink_peer_names:
            # an empty list would let in any certificate the CA signed: say so, do not do it
            raise ValueError(
                "--internal-tls-allowed-names: no name in "
                f"{self.internal_tls_allowed_names!r} (give comma-separated certificate names)"
            )
        check_range("--metrics-max-tenants", self.metrics_max_tenants, min_value=0)

    @property
    def sink_peer_names(self) -> frozenset[str]:
        """The names an executor's certificate may carry (empty: any the CA signed)."""
        names = self.internal_tls_allowed_names.split(",")
        return frozenset(name.strip() for name in names if name.strip())

    @property
    def reply_host(self) -> str:
        """The host executors dial for this gateway's TokenSink."""
        return self.advertise_host or self.internal_host


# Addresses a server may listen on but a client cannot dial.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


def build_parser() -> argparse.ArgumentParser:
    """Flags of `python -m gateway`, with KVGATE_* environment variables as defaults."""
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_address_flags(parser)
    add_capacity_flags(parser)
    add_request_flags(parser)
    add_metrics_flags(parser, "KVGATE_GATEWAY_METRICS_PORT")
    add_health_flags(parser, default_port=HEALTH_DISABLED)
    add_common_flags(parser)
    add_security_flags(parser)
    return parser


def add_address_flags(parser: argparse.ArgumentParser) -> None:
    """The model and the addresses: public gRPC, the HTTP front, the TokenSink."""
    add = parser.add_argument
    add("--model", default=env_str("KVGATE_MODEL", DEFAULT_MODEL), help=MODEL_HELP)
    add("--host", default=env_str("KVGATE_HOST", "127.0.0.1"), help="public host")
    add("--port", type=int, default=env_int("KVGATE_PORT", 50051), help="public port")
    add(
        "--http-host",
        default=env_str("KVGATE_HTTP_HOST", "127.0.0.1"),
        help="address of the OpenAI-compatible HTTP front (env KVGATE_HTTP_HOST)",
    )
    add(
        "--http-port",
        type=int,
        default=env_int("KVGATE_HTTP_PORT", HTTP_DISABLED),
        help="port of the OpenAI-compatible HTTP front (same keys and TLS as --port); "
        f"0: a free port, {HTTP_DISABLED}: none (env KVGATE_HTTP_PORT)",
    )
    add("--internal-host", default=env_str("KVGATE_INTERNAL_HOST", "127.0.0.1"))
    add("--internal-port", type=int, default=env_int("KVGATE_INTERNAL_PORT", 0))
    add("--advertise-host", default=env_str("KVGATE_ADVERTISE_HOST", ""))


def add_capacity_flags(parser: argparse.ArgumentParser) -> None:
    """What this gateway holds at once: Redis connections, queued requests, open calls."""
    add = parser.add_argument
    add("--redis-timeout-s", type=float, default=env_float("KVGATE_REDIS_TIMEOUT_S", 1.5))
    add(
        "--redis-max-connections",
        type=int,
        default=env_int("KVGATE_REDIS_MAX_CONNECTIONS", 128),
        help="Redis connections this gateway may hold (its budget)",
    )
    add("--max-queue-len", type=int, default=env_int("KVGATE_MAX_QUEUE_LEN", 4096))
    add(
        "--max-concurrent-streams",
        type=int,
        default=env_int("KVGATE_MAX_CONCURRENT_STREAMS", 4096),
        help="Generate and Chat calls open at once; more are refused (RESOURCE_EXHAUSTED)",
    )
    add(
        "--max-receive-message-bytes",
        type=int,
        default=env_int("KVGATE_MAX_RECEIVE_MESSAGE_BYTES", 0),
        help="largest request message accepted; 0: what the model can take (4 bytes per "
        "character of its budget, plus token ids and stop strings)",
    )
    add("--tokenizer-threads", type=int, default=env_int("KVGATE_TOKENIZER_THREADS", 2))


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """What one request may ask for and how long it may wait, and the SIGTERM grace."""
    add = parser.add_argument
    add("--max-stop-token-ids", type=int, default=64)
    add("--max-queued-turns", type=int, default=4, help="Chat turns waiting behind a running one")
    add(
        "--max-attempts",
        type=int,
        default=env_int("KVGATE_MAX_ATTEMPTS", 3),
        help="runs of a request whose executor was lost, before it fails",
    )
    add("--queue-timeout-s", type=float, default=env_float("KVGATE_QUEUE_TIMEOUT_S", 30.0))
    add("--session-ttl-s", type=float, default=env_float("KVGATE_SESSION_TTL_S", 600.0))
    add("--default-max-tokens", type=int, default=env_int("KVGATE_DEFAULT_MAX_TOKENS", 256))
    add("--max-stop-strings", type=int, default=16)
    add("--max-stop-len", type=int, default=256)
    add(
        "--max-constraint-chars",
        type=int,
        default=env_int("KVGATE_MAX_CONSTRAINT_CHARS", 65_536),
        help="longest structured-output constraint (JSON schema, regex, grammar, choices)",
    )
    add(
        "--constraint-timeout-s",
        type=float,
        default=env_float("KVGATE_CONSTRAINT_TIMEOUT_S", 5.0),
        help="a constraint that takes longer to compile, or to get a compile thread, is refused",
    )
    add("--grace-s", type=float, default=env_float("KVGATE_GRACE_S", 5.0))


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of API keys, TLS on both ports and the TokenSink's secret (docs/security.md)."""
    add = parser.add_argument
    add(
        "--auth",
        default=env_str("KVGATE_AUTH", "keys"),
        help="keys: an API key per call; cert: the client certificate's CN; off: every caller "
        "is tenant 'default' (env KVGATE_AUTH)",
    )
    add("--auth-cache-s", type=float, default=env_float("KVGATE_AUTH_CACHE_S", 2.0))
    add("--tls-cert", default=env_str("KVGATE_TLS_CERT", ""), help="public port's certificate")
    add("--tls-key", default=env_str("KVGATE_TLS_KEY", ""))
    add(
        "--tls-client-ca",
        default=env_str("KVGATE_TLS_CLIENT_CA", ""),
        help="require client certificates signed by this CA (mutual TLS)",
    )
    add("--internal-tls-cert", default=env_str("KVGATE_INTERNAL_TLS_CERT", ""))
    add("--internal-tls-key", default=env_str("KVGATE_INTERNAL_TLS_KEY", ""))
    add("--internal-tls-client-ca", default=env_str("KVGATE_INTERNAL_TLS_CLIENT_CA", ""))
    add(
        "--internal-tls-allowed-names",
        default=env_str("KVGATE_INTERNAL_TLS_ALLOWED_NAMES", ""),
        help="comma-separated: an executor's certificate must name one in its CN or a DNS "
        "subjectAltName",
    )
    add(
        "--sink-secret-file",
        default=env_str("KVGATE_SINK_SECRET_FILE", ""),
        help="executors must send this file's secret on the TokenSink",
    )
    add(
        "--metrics-max-tenants",
        type=int,
        default=env_int("KVGATE_METRICS_MAX_TENANTS", 32),
        help="tenants with metric labels of their own; the others count as 'other'",
    )


def config_from_args(argv: list[str] | None = None) -> GatewayConfig:
    """Parse flags into a validated GatewayConfig.

    Raises:
        ValueError: naming the flag with a bad value.
    """
    args = vars(build_parser().parse_args(argv))
    return GatewayConfig(**{f.name: args[f.name] for f in fields(GatewayConfig)})
