"""A real router of vLLM's gRPC engine API in front of kvgate: sgl-model-gateway's `smg`
(the PyPI package, a Rust binary) takes OpenAI chat requests over HTTP and routes them to
kvgate gateways through vllm.grpc.engine.VllmEngine, with the tokenizer it fetched from them
(GetTokenizer)."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.api import KvgateClient
from common.model_text import ModelText
from deploy.stack import free_port
from tests.helpers import STORIES_260K, wait_for
from tests.integration.conftest import scrape
from tests.integration.gateway_harness import ExecutorPeer, make_gateway

SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
if SMG is None:
    pytest.skip("needs the router `smg` (pip install smg; the dev extra)", allow_module_level=True)

CALL_TIMEOUT_S = 60.0
VLLM = "vllm.grpc.engine.VllmEngine"
MESSAGES = [{"role": "user", "content": "Tell me a story about Lily"}]


class Router:
    """An `smg launch` process routing to `worker_addresses` (gRPC, vLLM's engine API)."""

    def __init__(self, worker_addresses: list[str], log_path: Path) -> None:
        self.port = free_port()
        argv = [
            SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", "round_robin",
            "--worker-urls", *(f"grpc://{address}" for address in worker_addresses),
        ]  # fmt: skip
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.num_workers = len(worker_addresses)
        wait_for(self._ready, f"smg ready with {self.num_workers} workers (log {log_path})")

    def _get(self, path: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            if self.proc.poll() is not None:
                pytest.fail(f"smg exited with {self.proc.returncode}")
            return None

    def _ready(self) -> bool:
        """Every worker registered, and the tokenizer fetched from them (GetTokenizer)."""
        workers = self._get("/workers") or {}
        tokenizers = self._get("/v1/tokenizers") or {}
        names = {tokenizer["name"] for tokenizer in tokenizers.get("tokenizers", [])}
        return len(workers.get("workers", [])) == self.num_workers and STORIES_260K.name in names

    def chat(self, **fields) -> dict:
        body = json.dumps({"model": STORIES_260K.name, "messages": MESSAGES, **fields}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            body,
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def two_gateways(stack_factory):
    """A stack (one executor) with a second gateway beside the first."""
    stack = stack_factory()
    stack.start_gateway("gateway-2", free_port())
    return stack


@pytest.fixture(scope="module")
def router(two_gateways, tmp_path_factory) -> Iterator[Router]:
    addresses = [f"127.0.0.1:{port}" for port in two_gateways.gateway_ports.values()]
    running = Router(addresses, tmp_path_factory.mktemp("smg") / "smg.log")
    yield running
    running.stop()


def total(families, name: str, **labels: str) -> float:
    """The sum of metric `name`'s samples that carry `labels` (and any others)."""
    return sum(
        sample.value
        for family in families
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def vllm_generates(stack, name: str) -> float:
    """VllmEngine Generate calls gateway `name` ended OK, by its /metrics."""
    families = text_string_to_metric_families(scrape(stack, name))
    counted = {"service": VLLM, "method": "Generate", "code": "OK"}
    return total(families, "kvgate_gateway_requests_total", **counted)


def test_openai_chat_through_smg_reaches_both_gateways_and_answers_as_kvgate(
    router: Router, two_gateways
):
    with KvgateClient(two_gateways.address, CALL_TIMEOUT_S, retry=False) as client:
        expected = client.generate(messages=MESSAGES, max_tokens=12, temperature=0.0)
    for _ in range(4):
        answer = router.chat(max_tokens=12, temperature=0)
        choice = answer["choices"][0]
        # smg drops the reply's leading whitespace (" Anna" after "Assistant:").
        assert choice["message"]["content"] == expected.text.lstrip(), (choice, expected.text)
        assert choice["finish_reason"] == expected.finish_reason == "length", choice
        usage = answer["usage"]
        assert usage["prompt_tokens"] == expected.usage.prompt_tokens, usage
        assert usage["completion_tokens"] == 12, usage
    served = {name: vllm_generates(two_gateways, name) for name in ("gateway", "gateway-2")}
    assert all(count >= 1 for count in served.values()), f"round robin served {served}"


def _first_content_event(response: http.client.HTTPResponse) -> dict:
    """Reads server-sent events until one carries content; returns it."""
    while line := response.readline():
        if line.startswith(b"data: {"):
            event = json.loads(line[len(b"data: ") :])
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                return event
    pytest.fail("the stream ended before any content")


def test_a_client_that_disconnects_mid_stream_aborts_the_request(
    redis_url, redis_client, tmp_path: Path
):
    """The executor's side is played by the test, so the request is still running, token by
    token, when the client goes: the gateway must tell the executor to abort it."""
    gateway = make_gateway(redis_url)
    executor = ExecutorPeer.attached(redis_client, gateway)
    router = Router([gateway.gateway.address], tmp_path / "smg.log")
    connection = http.client.HTTPConnection("127.0.0.1", router.port, timeout=CALL_TIMEOUT_S)
    try:
        body = {"model": STORIES_260K.name, "messages": MESSAGES, "stream": True}
        body |= {"max_tokens": 200}
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        queued = executor.take_request()
        words = ModelText(STORIES_260K).encode(" Lily was happy", add_special_tokens=False)
        executor.send(queued.request_id, 0, words)
        response = connection.getresponse()
        assert response.status == 200, response.read()
        assert _first_content_event(response)["choices"][0]["delta"]["content"].strip()
        connection.close()
        # The router learns that its client left when it next writes to it: the executor goes
        # on sending tokens, one per look, until it is told to abort.
        offset = len(words)

        def aborted() -> bool:
            nonlocal offset
            executor.send(queued.request_id, offset, words[:1])
            offset += 1
            return queued.request_id in executor.aborted_ids()

        wait_for(aborted, "the gateway to abort the request on the executor after the client left")
        registry = gateway.metrics.registry
        abort_calls = {"service": VLLM, "method": "Abort", "code": "OK"}
        wait_for(
            lambda: total(registry.collect(), "kvgate_gateway_requests_total", **abort_calls),
            "the router's Abort call (smg aborts on a client's disconnect)",
        )
        finished = total(
            registry.collect(), "kvgate_gateway_finished_requests_total", finish_reason="abort"
        )
        assert finished == 1, f"{finished} requests finished as aborted"
    finally:
        connection.close()
        router.stop()
        executor.link.close()
        gateway.stop()
