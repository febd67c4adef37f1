"""KV transfer between executors: the KvTransfer service that takes a peer's blocks, and the
client a draining executor pushes its sequences' blocks with (docs/operations.md, "Drains").

One Push stream moves one sequence: a KvHeader (the sender's cache layout, the tenant, the
session or request, the token ids the blocks hold), then KvChunk messages of whole blocks with
a CRC-32 each. The receiver takes blocks for all of it first (or refuses: another layout,
named, or no room), writes each chunk as it arrives, and once every block is there publishes
the full blocks in its prefix cache, pins them to the session when there is one, and answers
with a PushResponse. A stream that breaks, stalls past its deadline or carries a chunk that
fails its checksum gives its blocks back on the receiver; the sender's copy stays
authoritative and the sequence is recomputed wherever it runs next.

The engine is the step loop's: a transfer touches it under the loop's `EngineGate` lock, one
chunk (at most CHUNK_BYTES) at a time. While the engine has requests running, the chunks of
every transfer wait for the step loop, which writes them between two steps up to
STEP_BUDGET_BYTES in all (a copy of a few ms), so transfers never starve decoding; an idle
engine takes each chunk as it arrives. The receiver takes its blocks with its first chunk and
adopts them once the sender has ended the stream.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import redis

from common.keys import RedisKeys
from common.tls import (
    SINK_SECRET_KEY,
    channel_credentials,
    check_key_pair,
    read_file,
    secret_matches,
    sink_metadata,
)
from engine.engine import Engine
from engine.faults import Faults
from engine.kv_move import (
    KVLayout,
    KVRefused,
    MovableKV,
    engine_layout,
    movable_engine,
    read_moved,
    take_blocks,
    write_taken,
)
from executor.config import ExecutorConfig
from executor.metrics import ExecutorMetrics
from protos.kvgate.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK_BYTES = 1 << 20  # a chunk holds as many whole blocks as fit, at least one
# While requests run, KV coming in is written between steps, up to this many bytes per step
# (a memory copy of a few ms at most).
STEP_BUDGET_BYTES = 4 << 20
MAX_PARALLEL_PUSHES = 16  # sequences a drain pushes at once
# A chunk holds at least one block: gRPC's default 4 MiB message limit would refuse every
# chunk of a model whose block is larger (an 8B model's float32 block is 4 MiB).
MAX_MESSAGE_BYTES = 1 << 30
MAX_REPOINT_TRIES = 16  # check-and-set attempts of a session's affinity update


class EngineGate:
    """The step loop's hold on the engine: `lock` around everything that touches it, and the
    work transfers queue for it while requests run (`run`), done between steps within a
    budget of bytes (`run_pending`), so that KV coming in never starves decoding and never
    holds the step loop for more than a few ms per step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy = False  # the engine has requests (set by the step loop)
        self._pending: collections.deque[tuple[int, Callable[[], object], futures.Future]] = (
            collections.deque()
        )
        self._pending_lock = threading.Lock()

    def run(self, work: Callable[[], T], num_bytes: int, timeout_s: float | None) -> T:
        """`work()` with the engine to itself: at once while the engine is idle, else
        between two steps.

        Raises:
            TimeoutError: the step loop did not get to it within `timeout_s`.
        """
        if not self.busy:
            with self.lock:
                return work()
        done: futures.Future = futures.Future()
        with self._pending_lock:
            self._pending.append((num_bytes, work, done))
        try:
            return done.result(timeout=timeout_s)
        except TimeoutError:
            if done.cancel():  # never runs now
                raise
            return done.result()  # running already: its outcome stands

    def waiting(self) -> int:
        """Pieces of work queued and still wanted (a transfer that gave up cancelled its)."""
        with self._pending_lock:
            return sum(not done.cancelled() for _, _, done in self._pending)

    def run_pending(self, budget_bytes: int = STEP_BUDGET_BYTES) -> None:
        """Do queued work (the step loop, holding `lock`, after a step) until `budget_bytes`
        are spent; at least one piece when any waits."""
        spent = 0
        while spent < budget_bytes:
            with self._pending_lock:
                if not self._pending:
                    return
                num_bytes, work, done = self._pending.popleft()
            spent += max(1, num_bytes)
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(work())
            except BaseException as error:  # noqa: BLE001 (the transfer's thread raises it)
                done.set_exception(error)


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


@dataclass(slots=True)
class KvSender:
    """Pushes a draining executor's sequences to its peers."""

    engine: Engine
    config: KvTransferConfig
    metrics: ExecutorMetrics
    executor_id: str
    faults: Faults = field(default_factory=Faults)  # none unless a test sets KVGATE_FAULTS
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)
    _channels_lock: threading.Lock = field(default_factory=threading.Lock)  # pushes run at once

    def push(self, moved: MovableKV, address: str, tenant: str) -> bool:
        """Send `moved`'s KV to the peer at `address`. Returns: whether the peer holds it."""
        layout = engine_layout(self.engine)
        header = internal_pb2.KvHeader(
            executor_id=self.executor_id,
            model_id=layout.model_id,
            block_size=layout.block_size,
            kv_cache_dtype=layout.kv_cache_dtype,
            num_layers=layout.num_layers,
            token_bytes=layout.token_bytes,
            tenant=tenant,
            session_id=moved.session_id or "",
            request_id=moved.request_id,
            token_ids=moved.token_ids,
            num_blocks=len(moved.block_ids),
            weights_fingerprint=layout.weights_fingerprint,
        )
        per_chunk = max(1, CHUNK_BYTES // layout.block_bytes)
        stub = internal_pb2_grpc.KvTransferStub(self._channel(address))
        metadata = sink_metadata(self.config.secret)  # the TokenSink's secret, sent alike
        started = time.perf_counter()
        try:
            stub.Push(
                self._messages(header, moved, per_chunk),
                timeout=self.config.timeout_s,
                metadata=metadata,
            )
        except grpc.RpcError as error:
            log.warning(
                "KV of %s not moved to %s (%s: %s): it is recomputed instead",
                moved.session_id or moved.request_id,
                address,
                error.code().name,
                error.details(),
            )
            return False
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - started)
        self.metrics.kv_moved_blocks.labels("out").inc(len(moved.block_ids))
        self.metrics.kv_moved_bytes.labels("out").inc(len(moved.block_ids) * layout.block_bytes)
        return True

    def _messages(
        self, header: internal_pb2.KvHeader, moved: MovableKV, per_chunk: int
    ) -> Iterator[internal_pb2.PushRequest]:
        yield internal_pb2.PushRequest(header=header)
        for first in range(0, len(moved.block_ids), per_chunk):
            data = read_moved(self.engine, moved, first, per_chunk)
            crc32 = zlib.crc32(data)
            chunk = internal_pb2.KvChunk(
                first_block=first, data=self.faults.kv_chunk(data), crc32=crc32
            )
            yield internal_pb2.PushRequest(chunk=chunk)
        self.faults.hold_kv_push()

    def _channel(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            return self._channels.get(address) or self._dial(address)

    def _dial(self, address: str) -> grpc.Channel:
        """A channel to the peer at `address`, kept for this sender's later pushes."""
        config = self.config
        if config.tls_ca:
            credentials = channel_credentials(
                config.tls_ca, config.client_cert, config.client_key, "--kv-tls"
            )
            name = config.tls_server_name
            options = [("grpc.ssl_target_name_override", name)] if name else []
            channel = grpc.secure_channel(address, credentials, options)
        else:
            channel = grpc.insecure_channel(address)
        self._channels[address] = channel
        return channel

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


@dataclass(slots=True)
class Peers:
    """The executors a drain can move KV to, and the blocks it has sent each so far."""

    statuses: list[internal_pb2.ExecutorStatus]
    sent_blocks: dict[str, int] = field(default_factory=dict)

    def choose(self, num_blocks: int) -> internal_pb2.ExecutorStatus | None:
        """The peer with the most blocks left after what this drain sent it, if one has
        room for `num_blocks` (fewest running and waiting requests between equals)."""

        def room(status: internal_pb2.ExecutorStatus) -> int:
            return status.num_free_blocks - self.sent_blocks.get(status.executor_id, 0)

        fitting = [s for s in self.statuses if room(s) >= num_blocks]
        if not fitting:
            return None
        chosen = max(fitting, key=lambda s: (room(s), -(s.num_running + s.num_waiting)))
        return chosen

    def sent(self, executor_id: str, num_blocks: int) -> None:
        self.sent_blocks[executor_id] = self.sent_blocks.get(executor_id, 0) + num_blocks


def read_peers(client: redis.Redis, keys: RedisKeys, executor_id: str, layout: KVLayout) -> Peers:
    """The live executors other than this one that take KV of this layout and are not
    draining, as their heartbeats say (none when Redis does not answer)."""
    try:
        members = sorted(m.decode() for m in client.smembers(keys.executors))
        raw = client.mget([keys.executor_status(m) for m in members]) if members else []
    except redis.RedisError as error:
        log.warning("draining: cannot read the peers from redis (%s): nothing moves", error)
        return Peers([])
    statuses = [internal_pb2.ExecutorStatus.FromString(r) for r in raw if r is not None]
    return Peers(
        [
            s
            for s in statuses
            if s.executor_id != executor_id
            and s.kv_transfer_address
            and not s.draining
            and s.model_id == layout.model_id
            and s.block_size == layout.block_size
            and s.kv_cache_dtype == layout.kv_cache_dtype
        ]
    )


def repoint_session(
    client: redis.Redis, keys: RedisKeys, tenant: str, session_id: str, old: str, new: str
) -> bool:
    """Make `new` the executor of a session whose affinity is `old`, atomically (a turn that
    ran elsewhere meanwhile keeps its own). Returns: whether the session now names `new`."""
    key = keys.session(tenant, session_id)
    try:
        with client.pipeline() as pipe:
            for _ in range(MAX_REPOINT_TRIES):
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        return False
                    state = internal_pb2.SessionState.FromString(raw)
                    if state.executor_id != old:
                        return False
                    state.executor_id = new
                    pipe.multi()
                    pipe.set(key, state.SerializeToString(), keepttl=True)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
    except redis.RedisError as error:
        log.warning("session %s: affinity not moved to %s (%s)", session_id, new, error)
    return False
