"""The client side of KV transfer: a draining (or rebalancing) executor pushes a sequence's
blocks to a peer's KvTransfer service (the protocol: executor/kv_transfer.py), one Push
stream per sequence, and falls back to recomputing it wherever it runs next when the push
fails."""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from common.tls import channel_credentials, sink_metadata
from engine.engine import Engine
from engine.faults import Faults
from engine.kv_move import MovableKV, engine_layout, read_moved
from executor.kv_transfer import CHUNK_BYTES, KvTransferConfig
from executor.metrics import ExecutorMetrics
from protos.kvgate.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)

MAX_PARALLEL_PUSHES = 16  # sequences a drain pushes at once


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

    def push(
        self,
        moved: MovableKV,
        address: str,
        tenant: str,
        otherwise: str = "it is recomputed instead",
    ) -> bool:
        """Send `moved`'s KV to the peer at `address`. Returns: whether the peer holds it.

        Args:
            otherwise: what becomes of the sequence when the push fails, for the log line.
        """
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
                "KV of %s not moved to %s (%s: %s): %s",
                moved.session_id or moved.request_id,
                address,
                error.code().name,
                error.details(),
                otherwise,
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
