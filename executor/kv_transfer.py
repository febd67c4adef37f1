"""KV transfer between executors: the KvTransfer service that takes a peer's blocks
(docs/operations.md, "Drains"). The client a draining executor pushes its sequences' blocks
with is executor/kv_sender.py; the peers it chooses from, executor/kv_peers.py.

One Push stream moves one sequence: a KvHeader (the sender's cache layout, the tenant, the
session or request, the token ids the blocks hold), then KvChunk messages of whole blocks with
a CRC-32 each. The receiver takes blocks for all of it first (or refuses: another layout,
named, or no room), writes each chunk as it arrives, and once every block is there publishes
the full blocks in its prefix cache, pins them to the session when there is one, and answers
with a PushResponse. A stream that breaks, stalls past its deadline or carries a chunk that
fails its checksum gives its blocks back on the receiver; the sender's copy stays
authoritative and the sequence is recomputed wherever it runs next.

The engine is the step loop's: a transfer touches it through the loop's `EngineGate`
(executor/engine_gate.py), one chunk (at most CHUNK_BYTES) at a time, written between two
steps while requests run. The receiver takes its blocks with its first chunk and adopts them
once the sender has ended the stream.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from common.tls import SINK_SECRET_KEY, check_key_pair, read_file, secret_matches
from engine.engine import Engine
from engine.kv_move import (
    KVLayout,
    KVRefused,
    engine_layout,
    movable_engine,
    take_blocks,
    write_taken,
)
from executor.config import ExecutorConfig
from executor.engine_gate import EngineGate
from executor.metrics import ExecutorMetrics
from protos.kvgate.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # a chunk holds as many whole blocks as fit, at least one
# A chunk holds at least one block: gRPC's default 4 MiB message limit would refuse every
# chunk of a model whose block is larger (an 8B model's float32 block is 4 MiB).
MAX_MESSAGE_BYTES = 1 << 30


def header_layout(header: internal_pb2.KvHeader) -> KVLayout:
    return KVLayout(
        header.model_id,
        header.block_size,
        header.kv_cache_dtype,
        header.num_layers,
        header.token_bytes,
        header.weights_fingerprint,
    )


@dataclass(slots=True)
class Incoming:
    """One sequence's KV coming in: the blocks it took, written chunk by chunk on the step
    loop's turn."""

    engine: Engine
    header: internal_pb2.KvHeader
    taking_work: Callable[[], bool]
    block_ids: list[int] = field(default_factory=list)
    adopted: bool = False

    @property
    def layout(self) -> KVLayout:
        return header_layout(self.header)

    def write(self, first: int, data: bytes) -> None:
        """Write blocks from `first` (taking every block first).

        Raises: KVRefused once this executor drains (it would exit holding them)."""
        self._check_taking_work()
        if not self.block_ids:
            self.block_ids = take_blocks(self.engine, self.layout, len(self.header.token_ids))
        count = len(data) // self.layout.block_bytes
        write_taken(self.engine, self.block_ids[first : first + count], data)

    def adopt(self) -> None:
        """Every block is written and the sender ended its stream: take the blocks in.

        Raises: KVRefused once this executor drains."""
        self._check_taking_work()
        header = self.header
        session_id, salt = header.session_id or None, header.tenant or None
        self.engine.kv_cache.adopt(self.block_ids, list(header.token_ids), salt, session_id)
        self.adopted = True

    def give_back(self) -> None:
        self.engine.kv_cache.release(self.block_ids)

    def _check_taking_work(self) -> None:
        if not self.taking_work():
            raise KVRefused("this executor is draining")


class KvReceiver(internal_pb2_grpc.KvTransferServicer):
    """Takes the KV peers push (the KvTransfer service)."""

    def __init__(
        self,
        engine: Engine,
        gate: EngineGate,
        metrics: ExecutorMetrics,
        taking_work: Callable[[], bool],
        secret: str | None = None,
        allowed_names: frozenset[str] = frozenset(),
    ) -> None:
        self._engine = engine
        self._allowed_names = allowed_names
        self._gate = gate
        self._metrics = metrics
        self._taking_work = taking_work
        self._secret = secret
        self._layout = engine_layout(engine)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> internal_pb2.PushResponse:  # noqa: N802
        self._check_secret(context)
        self._check_peer_name(context)
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Push starts with a KvHeader")
        header = first.header
        if not self._taking_work():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this executor is draining")
        expected_blocks = -(-len(header.token_ids) // max(1, header.block_size))
        if header.num_blocks != expected_blocks or not header.token_ids:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_blocks {header.num_blocks}: {len(header.token_ids)} token ids take "
                f"{expected_blocks} blocks",
            )
        incoming = Incoming(self._engine, header, self._taking_work)
        why = movable_engine(self._engine) or self._layout.difference(incoming.layout)
        if why is not None:
            log.warning("KV from %s refused: %s", header.executor_id, why)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        try:
            self._take_chunks(request_iterator, context, incoming)
        except KVRefused as refused:
            log.warning("KV from %s refused: %s", header.executor_id, refused)
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if refused.no_room
                else (grpc.StatusCode.FAILED_PRECONDITION)
            )
            context.abort(code, str(refused))
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the step loop did not take it")
        finally:
            if not incoming.adopted and incoming.block_ids:
                # no deadline: given up, the blocks would stay taken for good (a step loop
                # that never comes back has lost its executor anyway)
                self._gate.run(incoming.give_back, 0, None)
        layout = incoming.layout
        self._metrics.kv_moved_blocks.labels("in").inc(len(incoming.block_ids))
        self._metrics.kv_moved_bytes.labels("in").inc(len(incoming.block_ids) * layout.block_bytes)
        log.info(
            "KV taken from %s: %d tokens in %d blocks (%s %s)",
            header.executor_id,
            len(header.token_ids),
            len(incoming.block_ids),
            "session" if header.session_id else "request",
            header.session_id or header.request_id,
        )
        return internal_pb2.PushResponse(num_tokens=len(header.token_ids))

    def _take_chunks(self, messages, context: grpc.ServicerContext, incoming: Incoming) -> None:
        """Checks each chunk and has the step loop write it (taking the blocks with the
        first), and adopts the blocks once the sender ended the stream with all of them."""
        layout, num_blocks = incoming.layout, incoming.header.num_blocks
        written = 0
        for message in messages:
            chunk = message.chunk
            if not message.HasField("chunk") or chunk.first_block != written:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunk at block {chunk.first_block}: expected block {written}",
                )
            if zlib.crc32(chunk.data) != chunk.crc32:
                log.warning("KV chunk at block %d failed its CRC-32: transfer refused", written)
                context.abort(
                    grpc.StatusCode.DATA_LOSS, f"chunk at block {written} failed its CRC-32"
                )
            count, rest = divmod(len(chunk.data), layout.block_bytes)
            if rest or not count or written + count > num_blocks:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunk at block {written}: {len(chunk.data)} bytes are not whole blocks "
                    f"of {layout.block_bytes} within the {num_blocks} announced",
                )
            work = functools.partial(incoming.write, written, chunk.data)
            self._gate.run(work, len(chunk.data), context.time_remaining())
            written += count
        if written != num_blocks:
            context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"the stream ended after {written} of {num_blocks} blocks",
            )
        self._gate.run(incoming.adopt, 0, context.time_remaining())

    def _check_peer_name(self, context: grpc.ServicerContext) -> None:
        """With allowed names (mutual TLS), refuse a peer whose certificate names none."""
        if not self._allowed_names:
            return
        auth = context.auth_context()
        names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
        if not self._allowed_names.intersection(name.decode() for name in names):
            log.warning("KV transfer refused %s: its certificate names no executor", context.peer())
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the peer certificate names none of --kv-tls-allowed-names",
            )

    def _check_secret(self, context: grpc.ServicerContext) -> None:
        if self._secret is None:
            return
        presented = dict(context.invocation_metadata()).get(SINK_SECRET_KEY, "")
        if not secret_matches(presented.removeprefix("Bearer "), self._secret):
            log.warning("KV transfer refused %s: no or a wrong shared secret", context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "KvTransfer needs the shared secret")


@dataclass(frozen=True, slots=True)
class KvTransferConfig:
    """Where the KvTransfer service listens and how peers are dialled (executor flags)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port; -1: no service (a drain then waits for its streams)
    advertise_host: str = ""  # the host peers dial; empty: `host`
    tls_cert: str = ""  # the service's certificate; with tls_ca peers must present theirs
    tls_key: str = ""
    tls_ca: str = ""  # verifies peers' service certificates and their client certificates
    tls_server_name: str = ""  # the name in peers' certificates; empty: the host dialled
    client_cert: str = ""  # this executor's client certificate (--sink-tls-cert)
    client_key: str = ""
    secret: str | None = None  # the TokenSink's shared secret
    timeout_s: float = 10.0  # one sequence's whole transfer

    @classmethod
    def of(cls, config: ExecutorConfig, secret: str | None) -> KvTransferConfig:
        """The executor's --kv-* flags, with its --sink-tls-cert as the client certificate
        and the TokenSink's `secret`."""
        return cls(
            host=config.kv_transfer_host,
            port=config.kv_transfer_port,
            advertise_host=config.kv_transfer_advertise_host,
            tls_cert=config.kv_tls_cert,
            tls_key=config.kv_tls_key,
            tls_ca=config.kv_tls_ca,
            tls_server_name=config.kv_tls_server_name,
            client_cert=config.sink_tls_cert,
            client_key=config.sink_tls_key,
            secret=secret,
            timeout_s=config.kv_transfer_timeout_s,
        )


def start_kv_server(config: KvTransferConfig, receiver: KvReceiver) -> tuple[grpc.Server, str]:
    """Serve KvTransfer. Returns: the server and the address peers dial.

    Raises:
        OSError: the port cannot be bound.
        common.tls.TLSFileError: a certificate file cannot be read (naming its flag).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-in"),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    internal_pb2_grpc.add_KvTransferServicer_to_server(receiver, server)
    bind = f"{config.host}:{config.port}"
    if config.tls_cert:
        check_key_pair("--kv-tls", config.tls_cert, config.tls_key)
        pair = (
            read_file("--kv-tls-key", config.tls_key),
            read_file("--kv-tls-cert", config.tls_cert),
        )
        root = read_file("--kv-tls-ca", config.tls_ca) if config.tls_ca else None
        credentials = grpc.ssl_server_credentials([pair], root, require_client_auth=bool(root))
        port = server.add_secure_port(bind, credentials)
    else:
        port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"--kv-transfer-port: cannot listen on {bind}")
    server.start()
    return server, f"{config.advertise_host or config.host}:{port}"
