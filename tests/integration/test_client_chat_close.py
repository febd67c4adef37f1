"""ChatSession.close against a real gRPC server: it ends the call with OK when the server
finishes after the half-close, cancels it when the server does not, and can be repeated."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from client import api
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc


class ChatServer(inference_pb2_grpc.InferenceServicer):
    """Reads the client's stream to its end; then ends the call, or hangs when told to."""

    def __init__(self, hang_after_half_close: bool) -> None:
        self.hang_after_half_close = hang_after_half_close
        self.released = threading.Event()

    def Chat(  # noqa: N802 (gRPC method name)
        self, request_iterator: Iterator[inference_pb2.ChatRequest], context: grpc.ServicerContext
    ) -> Iterator[inference_pb2.ChatResponse]:
        for _ in request_iterator:
            pass
        if self.hang_after_half_close:
            self.released.wait(30)
        return
        yield


@pytest.fixture
def serve():
    servers = []

    def start(servicer: ChatServer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, servicer))
        return f"127.0.0.1:{port}"

    yield start
    for server, servicer in servers:
        servicer.released.set()
        server.stop(grace=None)


def test_close_between_turns_ends_the_call_with_ok(serve):
    with api.KvgateClient(serve(ChatServer(hang_after_half_close=False))) as client:
        session = client.chat()
        session.close()
        assert session._responses.code() == grpc.StatusCode.OK
        session.close()


def test_close_cancels_a_call_the_server_does_not_end(serve, monkeypatch):
    monkeypatch.setattr(api, "CLOSE_WAIT_S", 0.2)
    with api.KvgateClient(serve(ChatServer(hang_after_half_close=True))) as client:
        session = client.chat()
        session.close()
        assert session._responses.code() == grpc.StatusCode.CANCELLED
        session.close()  # again: no error (a cancelled call's exception() would raise)
