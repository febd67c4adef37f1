"""Harness of the gateway tests: a real redis-server, a real gateway, and the executor's
side of the wire protocol driven by the test (Redis stream + executor.gateway_link)."""

from __future__ import annotations

import asyncio
import queue
import threading

import grpc
import pytest
import redis

from common.keys import PAYLOAD_FIELD, RedisKeys
from common.model_text import ModelText
from executor.gateway_link import GatewayEvent, GatewayLink
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.server import RunningGateway, start_gateway
from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import inference_pb2_grpc, internal_pb2
from tests.helpers import STORIES_260K, WAIT_S, wait_for

PROMPT = "Once upon a time"
STORY = ", there was a little girl named Lily. She loved to play."
CALL_TIMEOUT_S = 20


def gateway_config(redis_url: str, **overrides) -> GatewayConfig:
    """A gateway on stories260K's tokenizer, a free port and `redis_url`; auth off unless
    `overrides` say otherwise."""
    fields = {
        "model": str(STORIES_260K),
        "redis_url": redis_url,
        "port": 0,
        "queue_timeout_s": 20.0,
        "auth": "off",
    }
    return GatewayConfig(**(fields | overrides))


class GatewayThread:
    """A gateway running on its own event loop in a thread."""

    def __init__(
        self, config: GatewayConfig, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        """Starts the gateway; `credentials` (None: plaintext) are the test's channel's."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.metrics = GatewayMetrics()
        self.gateway: RunningGateway = self._run(start_gateway(config, self.metrics))
        if credentials is None:
            self.channel = grpc.insecure_channel(self.gateway.address)
        else:
            self.channel = grpc.secure_channel(self.gateway.address, credentials)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(WAIT_S)

    def calls(self, method: str, code: str) -> float:
        """How many `method` calls ended with status `code`, by the gateway's metrics."""
        value = self.metrics.registry.get_sample_value(
            "kvgate_gateway_requests_total",
            {"service": "kvgate.v1.Inference", "method": method, "code": code, "api": "kvgate"},
        )
        return value or 0.0

    def stop(self) -> None:
        self.channel.close()
        self._run(self.gateway.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)


class ExecutorPeer:
    """Plays the scheduler and one executor at the wire: takes queued requests from the
    requests stream and answers on a real TokenSink stream (executor.gateway_link)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, executor_id: str = "e1") -> None:
        self.client = client
        self.keys = keys
        self.executor_id = executor_id
        self.events: queue.Queue[GatewayEvent] = queue.Queue()
        self.link: GatewayLink | None = None
        self._started: set[tuple[str, int]] = set()  # (request id, attempt) sent to so far

    @classmethod
    def attached(cls, client: redis.Redis, gateway: GatewayThread) -> ExecutorPeer:
        """A registered peer with its TokenSink stream to `gateway` open (plaintext)."""
        peer = cls(client, RedisKeys())
        peer.register()
        peer.connect(gateway.gateway.reply_to)
        return peer

    def register(self) -> None:
        """Announce a live executor (a status key that outlives the test)."""
        status = internal_pb2.ExecutorStatus(executor_id=self.executor_id)
        self.client.set(self.keys.executor_status(self.executor_id), status.SerializeToString())
        self.client.sadd(self.keys.executors, self.executor_id)

    def take_request(self) -> internal_pb2.QueuedRequest:
        """The oldest queued request, removed from the stream as a scheduler would."""
        entry_id, fields = wait_for(self._oldest, "a queued request")
        self.client.xdel(self.keys.requests, entry_id)
        return internal_pb2.QueuedRequest.FromString(fields[PAYLOAD_FIELD.encode()])

    def _oldest(self):
        entries = self.client.xrange(self.keys.requests, count=1)
        return entries[0] if entries else None

    def connect(self, reply_to: str) -> GatewayLink:
        self.link = GatewayLink(reply_to, self.executor_id, self.events.put)
        return self.link

    def send(self, request_id: str, offset: int, token_ids: list[int], **fields) -> None:
        """Sends one RequestTokens entry; the first of each attempt is marked accepted, as a
        real executor's is."""
        run = (request_id, fields.get("attempt", 0))
        if run not in self._started:
            self._started.add(run)
            fields.setdefault("accepted", True)
        entry = internal_pb2.RequestTokens(
            request_id=request_id, offset=offset, token_ids=token_ids, **fields
        )
        self.link.send(internal_pb2.TokenBatch(requests=[entry]))

    def aborted_ids(self) -> set[str]:
        """Ids of every abort received so far."""
        ids: set[str] = set()
        while not self.events.empty():
            event = self.events.get()
            ids.update(getattr(event, "request_ids", []))
        return ids


def make_gateway(redis_url: str, **overrides) -> GatewayThread:
    return GatewayThread(gateway_config(redis_url, **overrides))


def story_ids(model_text: ModelText) -> list[int]:
    prompt = model_text.encode(PROMPT)
    return model_text.encode(PROMPT + STORY)[len(prompt) :]


def generate(gateway: GatewayThread, metadata=(), **fields) -> grpc.Future:
    """A Generate call of PROMPT and `fields`, with `metadata` (a tenant's key)."""
    request = pb.GenerateRequest(prompt=PROMPT, **fields)
    return gateway.stub.Generate(request, timeout=CALL_TIMEOUT_S, metadata=metadata)


def collect(call) -> tuple[str, list[pb.GenerateResponse]]:
    chunks = list(call)
    return "".join(c.text for c in chunks), chunks


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    return raised.value.code(), raised.value.details()
