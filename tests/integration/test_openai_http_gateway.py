"""The OpenAI-compatible HTTP front of a gateway whose executor side the test plays (real
Redis, a real TokenSink stream, real HTTP): cancels on disconnect, refusals by overload and
by no executor, TLS with the gRPC port's certificate flags, a taken port."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis

from common.keys import RedisKeys
from deploy.certs import CertificateAuthority
from gateway.server import ListenError
from protos.kvgate.v1 import inference_pb2 as pb
from tests.helpers import wait_for
from tests.integration.gateway_harness import (
    PROMPT,
    ExecutorPeer,
    GatewayThread,
    gateway_config,
    make_gateway,
    story_ids,
)

MODEL_ID = "stories260K"
BODY = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 40, "stream": True}


def url(gateway: GatewayThread, path: str, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{gateway.gateway.http.port}{path}"


def open_stream(gateway: GatewayThread, body: dict = BODY) -> socket.socket:
    """Sends a POST /v1/completions on a raw connection and returns it unread: the answer's
    status line comes with its first chunk, so an HTTP client would wait for it here."""
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    connection = socket.create_connection(("127.0.0.1", gateway.gateway.http.port), timeout=20)
    connection.sendall(head.encode() + payload)
    return connection


def read_until(connection: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        piece = connection.recv(65536)
        assert piece, f"the connection closed before {marker!r}: {received!r}"
        received += piece
    return received


@pytest.fixture
def http_gateway(redis_url: str, redis_client: redis.Redis) -> Iterator[GatewayThread]:
    running = make_gateway(redis_url, http_port=0)
    yield running
    running.stop()


@pytest.fixture
def peer(redis_client: redis.Redis, http_gateway: GatewayThread) -> Iterator[ExecutorPeer]:
    executor = ExecutorPeer.attached(redis_client, http_gateway)
    yield executor
    executor.link.close()


def test_a_disconnect_mid_stream_aborts_the_executors_work(
    http_gateway: GatewayThread, peer: ExecutorPeer, model_text
):
    with open_stream(http_gateway) as connection:
        queued = peer.take_request()
        peer.send(queued.request_id, 0, story_ids(model_text)[:2])
        answer = read_until(connection, b"\n\n")
        assert answer.startswith(b"HTTP/1.1 200") and b"data: {" in answer, answer
    wait_for(lambda: queued.request_id in peer.aborted_ids(), "an abort after the disconnect")


def test_a_disconnect_before_the_first_token_cancels_the_queued_request(
    http_gateway: GatewayThread, peer: ExecutorPeer, redis_client: redis.Redis
):
    with open_stream(http_gateway):
        queued = peer.take_request()  # taken, never answered: no status line sent yet
    wait_for(
        lambda: redis_client.keys("kvgate:cancel:default/*"), "the queued request's cancel marker"
    )
    assert queued.request_id.startswith("default/"), queued.request_id


def test_the_answer_streams_the_executors_tokens(
    http_gateway: GatewayThread, peer: ExecutorPeer, model_text
):
    tokens = story_ids(model_text)

    def read_stream() -> list:
        with openai.OpenAI(base_url=url(http_gateway, "/v1"), api_key="x", max_retries=0) as sdk:
            return list(
                sdk.completions.create(
                    model=MODEL_ID, prompt=PROMPT, max_tokens=len(tokens), stream=True
                )
            )

    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read_stream)  # the SDK waits for the first chunk's status line
        queued = peer.take_request()
        peer.send(
            queued.request_id, 0, tokens, finished=True, finish_reason=pb.FINISH_REASON_LENGTH
        )
        chunks = reading.result(timeout=20)
    text = "".join(c.choices[0].text for c in chunks)
    assert PROMPT + text == model_text.hf_tokenizer.decode(
        model_text.encode(PROMPT) + tokens, skip_special_tokens=True
    ), text
    assert chunks[-1].choices[0].finish_reason == "length", chunks[-1]


def sdk_call(gateway: GatewayThread, stream: bool):
    """A completions call through the SDK in a thread: it waits for the executor's answer."""

    def call() -> list:
        with openai.OpenAI(base_url=url(gateway, "/v1"), api_key="x", max_retries=0) as sdk:
            answer = sdk.completions.create(
                model=MODEL_ID, prompt=PROMPT, max_tokens=40, stream=stream
            )
            return list(answer) if stream else [answer]

    return ThreadPoolExecutor(1).submit(call)


def send_error(peer: ExecutorPeer, request_id: str, offset: int) -> None:
    peer.send(
        request_id,
        offset,
        [],
        finished=True,
        finish_reason=pb.FINISH_REASON_ERROR,
        error_message="model step raised: boom",
    )


def test_a_generation_that_fails_is_a_500_with_the_executors_reason(
    http_gateway: GatewayThread, peer: ExecutorPeer
):
    answer = sdk_call(http_gateway, stream=False)
    send_error(peer, peer.take_request().request_id, 0)
    with pytest.raises(openai.InternalServerError) as raised:
        answer.result(timeout=20)
    assert raised.value.status_code == 500, raised.value.body
    assert "boom" in raised.value.body["message"], raised.value.body


def test_a_stream_that_fails_after_its_first_chunk_ends_with_the_reason(
    http_gateway: GatewayThread, peer: ExecutorPeer, model_text
):
    answer = sdk_call(http_gateway, stream=True)
    queued = peer.take_request()
    peer.send(queued.request_id, 0, story_ids(model_text)[:2])
    send_error(peer, queued.request_id, 2)
    with pytest.raises(openai.APIError, match="boom"):
        answer.result(timeout=20)


def test_without_an_executor_the_answer_is_503_and_not_ready(
    redis_url: str, redis_client: redis.Redis
):
    gateway = make_gateway(redis_url, http_port=0)
    try:
        with openai.OpenAI(base_url=url(gateway, "/v1"), api_key="x", max_retries=0) as sdk:
            with pytest.raises(openai.InternalServerError) as raised:
                sdk.completions.create(model=MODEL_ID, prompt=PROMPT)
        assert raised.value.status_code == 503, raised.value.body
        assert "no executor" in raised.value.body["message"], raised.value.body
        assert raised.value.response.headers["retry-after-ms"], raised.value.response.headers
        wait_for(
            lambda: httpx.get(url(gateway, "/ready"), timeout=5).status_code == 503,
            "/ready to say not ready",
        )
        assert httpx.get(url(gateway, "/health"), timeout=5).status_code == 200
    finally:
        gateway.stop()


def test_a_full_queue_is_a_rate_limit_error_naming_the_limit(
    redis_url: str, redis_client: redis.Redis
):
    gateway = make_gateway(redis_url, http_port=0, max_queue_len=1)
    ExecutorPeer(redis_client, RedisKeys()).register()
    try:
        with open_stream(gateway):
            wait_for(lambda: redis_client.xlen("kvgate:requests"), "the first request queued")
            with openai.OpenAI(base_url=url(gateway, "/v1"), api_key="x", max_retries=0) as sdk:
                with pytest.raises(openai.RateLimitError) as raised:
                    sdk.completions.create(model=MODEL_ID, prompt=PROMPT)
        assert raised.value.body["code"] == "max_queue_len", raised.value.body
        assert int(raised.value.response.headers["retry-after-ms"]) > 0
        refused = gateway.metrics.registry.get_sample_value(
            "kvgate_gateway_refused_total", {"limit": "max_queue_len", "api": "openai"}
        )
        assert refused == 1.0, f"the refusal must be counted: {refused}"
    finally:
        gateway.stop()


@pytest.mark.parametrize(
    ("limit", "prompts"),
    [(1, PROMPT), (2, [PROMPT, PROMPT])],  # a list of prompts counts one per prompt
)
def test_more_generations_than_max_concurrent_streams_are_refused(
    redis_url: str, redis_client: redis.Redis, limit: int, prompts
):
    gateway = make_gateway(redis_url, http_port=0, max_concurrent_streams=limit)
    peer = ExecutorPeer.attached(redis_client, gateway)
    try:
        with open_stream(gateway):
            peer.take_request()
            body = BODY | {"prompt": prompts}
            second = httpx.post(url(gateway, "/v1/completions"), json=body, timeout=20)
        assert second.status_code == 429, second.text
        error = second.json()["error"]
        assert error["code"] == "max_concurrent_streams", second.text
        assert "--max-concurrent-streams" in error["message"], second.text
    finally:
        peer.link.close()
        gateway.stop()


def test_tls_uses_the_grpc_ports_certificate_flags(redis_url: str, tmp_path: Path):
    ca = CertificateAuthority(tmp_path)
    server = ca.server()
    config = gateway_config(redis_url, http_port=0, tls_cert=server.cert, tls_key=server.key)
    gateway = GatewayThread(config)
    try:
        trusted = ssl.create_default_context(cafile=ca.ca)
        live = httpx.get(url(gateway, "/health", "https"), verify=trusted, timeout=5)
        assert live.status_code == 200, live.text
        with pytest.raises(httpx.HTTPError):
            httpx.get(url(gateway, "/health"), timeout=5)  # plaintext to a TLS port
    finally:
        gateway.stop()


def test_a_taken_http_port_names_the_flag(redis_url: str):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match="--http-port"):
            make_gateway(redis_url, http_port=port)
