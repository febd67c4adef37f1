"""Builds and runs a gateway: the public Inference server and the internal TokenSink server."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import redis.asyncio as aioredis
from grpc import aio
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from common.constraints import ConstraintLimits
from common.health import HEALTH_DISABLED
from common.keys import RedisKeys
from common.model_text import ModelText
from common.redis_conn import connect
from common.tls import ReloadableServerCredentials, ServerTLSFiles, TLSFileError, read_secret
from gateway.accounting import Accounting
from gateway.auth import ApiKeys, Authenticator, AuthInterceptor
from gateway.config import HTTP_DISABLED, GatewayConfig
from gateway.errors import ErrorInterceptor
from gateway.generation import BackgroundTasks, GenerationDeps
from gateway.health import GatewayHealth
from gateway.http_server import HttpServer, HttpTLS, bind_http
from gateway.limits import StreamLimitInterceptor, public_server_options, receive_limit
from gateway.metrics import GatewayMetrics, MetricsInterceptor, api_of_method
from gateway.openai_http import JSON_BYTES_FACTOR, OpenAIFront, OpenAIFrontConfig
from gateway.quotas import Quotas
from gateway.request_queue import RequestQueue
from gateway.service import InferenceServicer
from gateway.sessions import SessionStore
from gateway.text_work import TextWork
from gateway.token_sink import TokenRouter, TokenSinkServicer
from gateway.validation import StopLimits
from gateway.vllm_engine import VLLM_SERVICE, VllmEngineServicer
from gateway.wire import RequestParsingInterceptor
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc, internal_pb2_grpc

log = logging.getLogger(__name__)
INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
# The services of the public port: kvgate's own and vLLM's engine API (gateway/vllm_engine.py).
PUBLIC_SERVICES = (INFERENCE_SERVICE, VLLM_SERVICE)


@dataclass(slots=True)
class RunningGateway:
    """A started gateway and the addresses it listens on."""

    public: aio.Server
    internal: aio.Server
    health: health.aio.HealthServicer
    health_watch: GatewayHealth
    health_server: aio.Server | None  # --health-port's, when one is given
    redis: aioredis.Redis
    address: str  # host:port of the public Inference service
    reply_to: str  # host:port of the TokenSink service
    grace_s: float
    quotas: Quotas
    tls: list[ReloadableServerCredentials]  # of the public and internal ports that use TLS
    text_work: TextWork | None = None
    accounting: Accounting | None = None  # its usage not yet written is written at stop
    http: HttpServer | None = None  # the OpenAI-compatible front, when --http-port is set

    def reload_tls(self) -> None:
        """Read every TLS port's certificate files again (SIGHUP): new connections get them."""
        for credentials in self.tls:
            credentials.reload()
        if self.http is not None and self.http.tls is not None:
            self.http.tls.reload()

    async def stop(self) -> None:
        """Stop taking calls, let running ones finish within grace_s, then close.

        The token sink stays up while public calls finish (they need its tokens);
        then the executors' streams, idle by now, are closed at once.
        """
        await self.health_watch.stop()
        await self.health.enter_graceful_shutdown()
        stopping = [self.public.stop(self.grace_s)]
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        await self.internal.stop(0)
        if self.health_server is not None:
            await self.health_server.stop(0)
        await self.quotas.stop()
        if self.accounting is not None:
            await self.accounting.flush()
        if self.text_work is not None:
            self.text_work.close()
        await self.redis.aclose()


# The token sink pings idle executor streams so that a vanished executor host (no TCP
# reset) still breaks its stream, and its requests are re-queued.
SINK_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# How long a Redis call waits for a connection of the gateway's budget when all are busy;
# then the call is refused (RESOURCE_EXHAUSTED naming --redis-max-connections).
REDIS_POOL_WAIT_S = 0.1
# gRPC binds with SO_REUSEPORT by default: a second gateway (or anything else that sets it)
# on a taken port would start and silently take half of its connections.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


class ListenError(Exception):
    """A server could not listen on its address, or read its certificates; the message names
    the flags."""


def _listen(
    server: aio.Server,
    host: str,
    port: int,
    flags: str,
    tls: ReloadableServerCredentials | None = None,
) -> int:
    try:
        if tls is not None:
            return server.add_secure_port(f"{host}:{port}", tls.credentials)
        return server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as error:
        raise ListenError(f"{flags}: cannot listen on {host}:{port} ({error})") from None


@dataclass(slots=True)
class PortSecurity:
    """The TLS credentials of the public and internal ports (None: plain) and the TokenSink's
    shared secret (None: none asked)."""

    public: ReloadableServerCredentials | None
    internal: ReloadableServerCredentials | None
    sink_secret: str | None

    @classmethod
    def from_config(cls, config: GatewayConfig) -> PortSecurity:
        """Reads the files. Raises: ListenError naming the flag of a file it cannot read."""
        c = config
        try:
            public = internal = secret = None
            if c.tls_cert:
                files = ServerTLSFiles("--tls", c.tls_cert, c.tls_key, c.tls_client_ca)
                public = ReloadableServerCredentials(files)
            if c.internal_tls_cert:
                files = ServerTLSFiles(
                    "--internal-tls",
                    c.internal_tls_cert,
                    c.internal_tls_key,
                    c.internal_tls_client_ca,
                )
                internal = ReloadableServerCredentials(files)
            if c.sink_secret_file:
                secret = read_secret("--sink-secret-file", c.sink_secret_file)
        except TLSFileError as error:
            raise ListenError(str(error)) from None
        return cls(public, internal, secret)

    @property
    def reloadable(self) -> list[ReloadableServerCredentials]:
        return [tls for tls in (self.public, self.internal) if tls is not None]


def _internal_server(
    config: GatewayConfig, router: TokenRouter, security: PortSecurity
) -> tuple[aio.Server, str]:
    server = aio.server(
        interceptors=[ErrorInterceptor()], options=SINK_KEEPALIVE_OPTIONS + EXCLUSIVE_PORT
    )
    servicer = TokenSinkServicer(router, security.sink_secret, config.sink_peer_names)
    internal_pb2_grpc.add_TokenSinkServicer_to_server(servicer, server)
    port = _listen(
        server,
        config.internal_host,
        config.internal_port,
        "--internal-host/--internal-port",
        security.internal,
    )
    return server, f"{config.reply_host}:{port}"


def _health_server(config: GatewayConfig, servicer: health.aio.HealthServicer) -> aio.Server | None:
    if config.health_port == HEALTH_DISABLED:
        return None
    server = aio.server(options=EXCLUSIVE_PORT)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    _listen(server, config.health_host, config.health_port, "--health-host/--health-port")
    return server


def _max_message_bytes(config: GatewayConfig, servicer: InferenceServicer) -> int:
    return config.max_receive_message_bytes or receive_limit(
        servicer.text.model_text,
        config.max_stop_strings,
        config.max_stop_len,
        config.max_constraint_chars,
    )


def _public_server(
    config: GatewayConfig,
    servicer: InferenceServicer,
    metrics: GatewayMetrics,
    authenticator: Authenticator,
    tls: ReloadableServerCredentials | None,
    vllm_engine: VllmEngineServicer,
) -> tuple[aio.Server, health.aio.HealthServicer, str]:
    def refused(limit: str, method: str) -> None:
        metrics.refused.labels(limit, api_of_method(method)).inc()

    max_message_bytes = _max_message_bytes(config, servicer)
    log.info(
        "request messages up to %d bytes (--max-receive-message-bytes%s)",
        max_message_bytes,
        "" if config.max_receive_message_bytes else ": 0, derived from the model's budget",
    )
    limits = public_server_options(config.max_concurrent_streams, max_message_bytes)
    server = aio.server(
        interceptors=[
            MetricsInterceptor(metrics),
            StreamLimitInterceptor(PUBLIC_SERVICES, config.max_concurrent_streams, refused),
            ErrorInterceptor(refused),
            AuthInterceptor(authenticator),
            RequestParsingInterceptor(max_message_bytes),
        ],
        options=EXCLUSIVE_PORT + limits,
    )
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm_engine, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*PUBLIC_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = _listen(server, config.host, config.port, "--host/--port", tls)
    return server, health_servicer, f"{config.host}:{port}"


async def start_gateway(
    config: GatewayConfig, metrics: GatewayMetrics | None = None
) -> RunningGateway:
    """Start both servers (and --health-port's); health is evaluated once they listen.

    Args:
        config: the gateway's configuration.
        metrics: where to record metrics (None: a registry nobody serves).

    Returns:
        The running gateway (call its stop()).
    """
    model_text = ModelText(config.model)
    security = PortSecurity.from_config(config)
    client = _redis_client(config)
    keys = RedisKeys(config.redis_prefix)
    router = TokenRouter()
    internal, reply_to = _internal_server(config, router, security)
    metrics = metrics or GatewayMetrics()
    inference = _inference(config, client, keys, router, reply_to, model_text, metrics)
    servicer, queue, quotas = inference
    api_keys = ApiKeys(client, keys, config.auth_cache_s) if config.auth == "keys" else None
    authenticator = Authenticator(config.auth, api_keys)
    bound = [internal]
    try:
        public, health_servicer, address = _public_server(
            config,
            servicer,
            metrics,
            authenticator,
            security.public,
            VllmEngineServicer(servicer, config.model),
        )
        bound.append(public)
        health_server = _health_server(config, health_servicer)
    except ListenError:
        for server in bound:
            await server.stop(None)  # frees its port (bound, not started)
        await client.aclose()
        raise
    servers = (internal, public, health_server)
    health_watch = await _start_serving(servers, health_servicer, queue, metrics, router)
    quotas.start()
    _log_security(config, address, reply_to, model_text.model_id)
    gateway = RunningGateway(
        public, internal, health_servicer, health_watch, health_server, client, address,
        reply_to, config.grace_s, quotas, security.reloadable, servicer.text,
        servicer.deps.accounting,
    )  # fmt: skip
    try:
        gateway.http = await _start_http(config, servicer, authenticator, health_watch, metrics)
    except ListenError:
        await gateway.stop()
        raise
    return gateway


def _redis_client(config: GatewayConfig) -> aioredis.Redis:
    """The gateway's Redis client, within its --redis-max-connections budget."""
    return connect(
        config.redis_url,
        timeout_s=config.redis_timeout_s,
        max_connections=config.redis_max_connections,
        pool_wait_s=REDIS_POOL_WAIT_S,
    )


async def _start_serving(
    servers: tuple[aio.Server | None, ...],
    health_servicer: health.aio.HealthServicer,
    queue: RequestQueue,
    metrics: GatewayMetrics,
    router: TokenRouter,
) -> GatewayHealth:
    """Start the bound servers (None: not asked for), then the watch that sets their health."""
    for server in servers:
        if server is not None:
            await server.start()
    services = ("", *PUBLIC_SERVICES)
    health_watch = GatewayHealth(
        health_servicer, queue, services, metrics.registry, router.observe_heartbeats
    )
    await health_watch.start()
    return health_watch


async def _start_http(
    config: GatewayConfig,
    servicer: InferenceServicer,
    authenticator: Authenticator,
    health_watch: GatewayHealth,
    metrics: GatewayMetrics,
) -> HttpServer | None:
    """The OpenAI-compatible HTTP front on --http-port (None when it is -1), started."""
    if config.http_port == HTTP_DISABLED:
        return None
    host, port = config.http_host, config.http_port
    try:
        tls = (
            HttpTLS(config.tls_cert, config.tls_key, config.tls_client_ca)
            if config.tls_cert
            else None
        )
        sock = bind_http(host, port)
    except OSError as error:  # ssl.SSLError is one
        message = f"--http-host/--http-port: cannot listen on {host}:{port} ({error})"
        raise ListenError(message) from None
    front_config = OpenAIFrontConfig(
        max_body_bytes=JSON_BYTES_FACTOR * _max_message_bytes(config, servicer),
        max_concurrent_streams=config.max_concurrent_streams,
    )
    front = OpenAIFront(front_config, servicer, authenticator, health_watch, metrics)
    server = HttpServer(front.app(), sock, tls, config.grace_s)
    await server.start()
    log.info(
        "OpenAI-compatible HTTP on %s://%s:%d/v1",
        "https" if tls else "http", host, server.port,
    )  # fmt: skip
    return server


def _inference(
    config: GatewayConfig,
    client,
    keys: RedisKeys,
    router: TokenRouter,
    reply_to: str,
    model_text: ModelText,
    metrics: GatewayMetrics,
) -> tuple[InferenceServicer, RequestQueue, Quotas]:
    """The public Inference service and the queue and quotas it shares with the gateway."""
    queue = RequestQueue(client, keys, config.max_queue_len, config.queue_timeout_s)
    quotas = Quotas(client, keys, config.auth_cache_s)
    accounting = Accounting(client, keys, quotas, metrics, config.metrics_max_tenants)
    deps = GenerationDeps(
        router,
        queue,
        model_text,
        BackgroundTasks(),
        reply_to,
        config.queue_timeout_s,
        metrics,
        config.max_attempts,
        accounting,
    )
    servicer = InferenceServicer(
        deps,
        SessionStore(client, keys, config.session_ttl_s),
        quotas,
        config.default_max_tokens,
        StopLimits(config.max_stop_strings, config.max_stop_len, config.max_stop_token_ids),
        TextWork(
            model_text,
            config.tokenizer_threads,
            ConstraintLimits(config.max_constraint_chars, config.constraint_timeout_s),
        ),
        config.max_queued_turns,
    )
    return servicer, queue, quotas


def _log_security(config: GatewayConfig, address: str, reply_to: str, model_id: str) -> None:
    log.info("gateway serving on %s (token sink %s, model %s)", address, reply_to, model_id)
    public = "TLS" + (" with client certificates" if config.tls_client_ca else "")
    sink = "mutual TLS" if config.internal_tls_cert else "plaintext"
    if config.sink_secret_file:
        sink += " with a shared secret"
    log.info(
        "public port: %s, auth %s; token sink: %s",
        public if config.tls_cert else "plaintext",
        config.auth,
        sink,
    )
    if config.auth == "off":
        log.warning("auth is off: every caller is tenant 'default' (--auth keys turns it on)")


async def serve(config: GatewayConfig, metrics: GatewayMetrics) -> None:
    """Run a gateway until SIGTERM or SIGINT, then stop gracefully."""
    gateway = await start_gateway(config, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, gateway.reload_tls)
    await stop.wait()
    log.info("gateway stopping: running calls get %.1f s", config.grace_s)
    await gateway.stop()
    log.info("gateway stopped")
