"""The executor's side of TokenSink: one long-lived stream to each gateway it serves."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from common.tls import channel_credentials, read_secret, sink_metadata
from protos.kvgate.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)
# Seconds a closing link waits for the gateway to end the stream.
CLOSE_WAIT_S = 2.0


@dataclass(slots=True, frozen=True)
class GatewayAbort:
    """The gateway asked to stop these requests."""

    address: str
    request_ids: list[str]
    # one per request id, or empty: stop only a run of that attempt or an earlier one
    attempts: list[int] = field(default_factory=list)
    # one per request id, or empty: stop only the run of that number (RequestTokens.run)
    runs: list[int] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class GatewayGone:
    """The stream to this gateway broke: its requests have no reader any more."""

    address: str


GatewayEvent = GatewayAbort | GatewayGone


@dataclass(frozen=True, slots=True)
class SinkCredentials:
    """How an executor dials the gateways' TokenSink: TLS (None: plaintext), the name the
    gateways' certificate must carry (empty: the host dialled), and the shared secret (None:
    none; the KvTransfer service checks its peers with it too) with its metadata."""

    tls: grpc.ChannelCredentials | None = None
    server_name: str = ""
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    secret: str | None = field(default=None, repr=False)

    @classmethod
    def from_files(
        cls, ca: str, cert: str, key: str, server_name: str, secret_file: str
    ) -> SinkCredentials:
        """Reads the files (--sink-tls-*, --sink-secret-file; empty: not used).

        Raises:
            common.tls.TLSFileError: naming the flag of a file it cannot read.
        """
        tls = channel_credentials(ca, cert, key, "--sink-tls") if ca else None
        secret = read_secret("--sink-secret-file", secret_file) if secret_file else None
        return cls(tls, server_name, sink_metadata(secret), secret)

    def channel(self, address: str) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(address)
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(address, self.tls, options)


class GatewayLink:
    """A TokenSink.Connect stream to one gateway.

    `send` never blocks: messages go through a queue that gRPC drains on its own
    thread. Aborts and the end of the stream are reported through `on_event`,
    from a reader thread.
    """

    def __init__(
        self,
        address: str,
        executor_id: str,
        on_event: Callable[[GatewayEvent], None],
        credentials: SinkCredentials = SinkCredentials(),  # noqa: B008 (frozen, shared)
    ) -> None:
        self.address = address
        self._outgoing: queue.SimpleQueue[internal_pb2.ConnectRequest | None] = queue.SimpleQueue()
        self._on_event = on_event
        self._channel = credentials.channel(address)
        hello = internal_pb2.ConnectRequest(
            hello=internal_pb2.ExecutorHello(executor_id=executor_id)
        )
        self._outgoing.put(hello)
        stub = internal_pb2_grpc.TokenSinkStub(self._channel)
        self._call = stub.Connect(self._requests(), metadata=credentials.metadata)
        self._closing = False
        self._reader = threading.Thread(target=self._read, name=f"sink-{address}", daemon=True)
        self._reader.start()

    def send(self, batch: internal_pb2.TokenBatch) -> None:
        """Queues one TokenBatch for the gateway."""
        self._outgoing.put(internal_pb2.ConnectRequest(token_batch=batch))

    def close(self) -> None:
        """Ends the stream after every queued batch is sent, then closes the channel."""
        self._closing = True
        self._outgoing.put(None)
        self._reader.join(CLOSE_WAIT_S)
        self._channel.close()

    def _requests(self) -> Iterator[internal_pb2.ConnectRequest]:
        while (message := self._outgoing.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for response in self._call:
                if response.HasField("abort"):
                    abort = response.abort
                    self._on_event(
                        GatewayAbort(
                            self.address,
                            list(abort.request_ids),
                            list(abort.attempts),
                            list(abort.runs),
                        )
                    )
        except grpc.RpcError as error:
            if not self._closing:
                log.warning("token stream to gateway %s broke: %s", self.address, error.code())
        self._on_event(GatewayGone(self.address))
        self._outgoing.put(None)
