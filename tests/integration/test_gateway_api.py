"""The gateway through its gRPC API, against a real redis-server and the executor's side
of the wire protocol (requests stream + TokenSink stream) driven by the test."""

from __future__ import annotations

import asyncio
import io
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import cli
from client.api import KvgateClient
from common.keys import RedisKeys
from common.redis_conn import connect
from gateway import errors
from gateway.model_text import ModelText
from gateway.request_queue import RequestQueue
from gateway.sessions import MAX_TURN_WRITES, Session, SessionStore
from gateway.templates import Message
from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import internal_pb2
from tests.helpers import STORIES_260K, wait_for
from tests.integration.gateway_harness import ExecutorPeer, GatewayThread, gateway_config

PROMPT = "Once upon a time"
STORY = ", there was a little girl named Lily. She loved to play."
CALL_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def model_text() -> ModelText:
    return ModelText(STORIES_260K)


def make_gateway(redis_url: str, **overrides) -> GatewayThread:
    return GatewayThread(gateway_config(redis_url, **overrides))


@pytest.fixture
def gateway(redis_url: str, redis_client: redis.Redis):
    running = make_gateway(redis_url)
    yield running
    running.stop()


@pytest.fixture
def executor(redis_client: redis.Redis, gateway: GatewayThread):
    peer = ExecutorPeer.attached(redis_client, gateway)
    yield peer
    peer.link.close()


def story_ids(model_text: ModelText) -> list[int]:
    prompt = model_text.encode(PROMPT)
    return model_text.encode(PROMPT + STORY)[len(prompt) :]


def generate(gateway: GatewayThread, **fields) -> grpc.Future:
    request = pb.GenerateRequest(prompt=PROMPT, **fields)
    return gateway.stub.Generate(request, timeout=CALL_TIMEOUT_S)


def collect(call) -> tuple[str, list[pb.GenerateResponse]]:
    chunks = list(call)
    return "".join(c.text for c in chunks), chunks


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    return raised.value.code(), raised.value.details()


def test_health_is_serving(gateway: GatewayThread):
    stub = health_pb2_grpc.HealthStub(gateway.channel)
    for service in ("", "kvgate.v1.Inference"):
        response = stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service


def test_without_a_live_executor_generate_is_unavailable(gateway: GatewayThread):
    code, details = status_of(generate(gateway))
    assert code == grpc.StatusCode.UNAVAILABLE, details


def test_redis_down_is_unavailable_before_the_clients_deadline(tmp_path: Path):
    gateway = make_gateway(f"unix://{tmp_path}/no-redis.sock")
    try:
        call = gateway.stub.Generate(pb.GenerateRequest(prompt=PROMPT), timeout=2.0)
        code, details = status_of(call)
        assert code == grpc.StatusCode.UNAVAILABLE, f"{code}: {details}"
    finally:
        gateway.stop()


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": [1, 9999], "prompt": ""}, "prompt_token_ids"),
        ({"prompt": "x" * 3000}, "prompt"),
        ({"params": pb.SamplingParams(max_tokens=0)}, "params.max_tokens"),
        ({"params": pb.SamplingParams(max_tokens=100000)}, "params.max_tokens"),
        ({"params": pb.SamplingParams(temperature=-0.5)}, "params.temperature"),
        ({"params": pb.SamplingParams(temperature=float("nan"))}, "params.temperature"),
        ({"params": pb.SamplingParams(top_p=0.0)}, "params.top_p"),
        ({"params": pb.SamplingParams(top_p=1.5)}, "params.top_p"),
        ({"params": pb.SamplingParams(min_p=2.0)}, "params.min_p"),
        ({"params": pb.SamplingParams(repetition_penalty=0.0)}, "params.repetition_penalty"),
        ({"params": pb.SamplingParams(presence_penalty=3.0)}, "params.presence_penalty"),
        ({"params": pb.SamplingParams(frequency_penalty=-3.0)}, "params.frequency_penalty"),
        ({"params": pb.SamplingParams(max_tokens=4, min_tokens=5)}, "params.min_tokens"),
        ({"params": pb.SamplingParams(stop_token_ids=[512])}, "params.stop_token_ids"),
        ({"params": pb.SamplingParams(stop_token_ids=[7] * 65)}, "params.stop_token_ids"),
        ({"params": pb.SamplingParams(stop=["ok", ""])}, "params.stop[1]"),
        ({"params": pb.SamplingParams(stop=["s"] * 17)}, "params.stop"),
        ({"params": pb.SamplingParams(logprobs=21)}, "params.logprobs"),
        ({"request_id": "has space"}, "request_id"),
        ({"session_id": "x" * 200}, "session_id"),
        # echoed whole, these passed gRPC's 8 KiB trailer limit: the client got RESOURCE_EXHAUSTED
        ({"session_id": "x" * 100_000}, "session_id"),
        ({"request_id": "\u00e9" * 50_000}, "request_id"),
    ],
)
def test_each_bad_field_is_invalid_argument_naming_it(
    gateway: GatewayThread, request_fields: dict, field: str
):
    fields = {"prompt": PROMPT} | request_fields
    call = gateway.stub.Generate(pb.GenerateRequest(**fields), timeout=CALL_TIMEOUT_S)
    code, details = status_of(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert details.startswith(f"{field}:"), f"expected the message to name {field}: {details!r}"
    info = gateway.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.model_id == "stories260K", "the service must still answer after a bad request"


def test_any_status_message_is_cut_below_the_trailer_limit():
    error = errors.InvalidArgument("messages", "unknown role " + "\u00e9" * 100_000)
    code, details = errors.status_of(error)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("messages: unknown role ")
    assert len(details.encode()) * 3 < 8192, (
        f"{len(details)} characters, percent-encoded past 8 KiB"
    )
    assert details.endswith("(100023 characters)"), details[-40:]


def test_a_full_queue_is_resource_exhausted(redis_url: str, redis_client: redis.Redis):
    gateway = make_gateway(redis_url, max_queue_len=1)
    ExecutorPeer(redis_client, RedisKeys()).register()
    try:
        waiting = generate(gateway)
        wait_for(lambda: redis_client.xlen("kvgate:requests"), "the first request queued")
        code, details = status_of(generate(gateway))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code}: {details}"
        waiting.cancel()
    finally:
        gateway.stop()


def test_a_queued_request_is_unavailable_once_no_executor_is_alive(
    redis_url: str, redis_client: redis.Redis
):
    """The last executor leaves after the request was queued (the enqueue check passed):
    the request fails with UNAVAILABLE instead of waiting out queue_timeout_s."""
    gateway = make_gateway(redis_url, queue_timeout_s=60.0)
    peer = ExecutorPeer(redis_client, RedisKeys())
    peer.register()
    try:
        call = generate(gateway, request_id="orphan-1")
        peer.take_request()  # placed by nobody: it waits for an executor
        redis_client.delete(RedisKeys().executor_status(peer.executor_id))  # heartbeat expired
        code, details = status_of(call)
        assert code == grpc.StatusCode.UNAVAILABLE, f"{code}: {details}"
        assert "no executor is alive" in details, details
        wait_for(lambda: cancel_markers(redis_client, "orphan-1"), "the cancel marker")
    finally:
        gateway.stop()


def test_a_request_queued_past_queue_timeout_is_deadline_exceeded(
    redis_url: str, redis_client: redis.Redis
):
    gateway = make_gateway(redis_url, queue_timeout_s=0.3)
    ExecutorPeer(redis_client, RedisKeys()).register()
    try:
        code, details = status_of(generate(gateway, request_id="slow-1"))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, f"{code}: {details}"
        wait_for(lambda: cancel_markers(redis_client, "slow-1"), "the cancel marker")
    finally:
        gateway.stop()


def test_a_retry_under_a_just_cancelled_request_id_runs(
    redis_url: str, redis_client: redis.Redis, model_text: ModelText
):
    """Ids are scoped to the tenant and the call: the first call's cancel marker (kept while a
    re-queued copy of it may follow) is not the retry's, so the retry is queued and runs."""
    gateway = make_gateway(redis_url, queue_timeout_s=0.3)
    peer = ExecutorPeer(redis_client, RedisKeys())
    peer.register()
    try:
        code, _ = status_of(generate(gateway, request_id="reused-1"))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: cancel_markers(redis_client, "reused-1"), "the marker")
        peer.take_request()  # the first call's entry, left by the scheduler nobody runs
        retry = gateway.stub.Generate(pb.GenerateRequest(prompt=PROMPT, request_id="reused-1"))
        assert_streams_a_story(peer, retry, model_text, "the retry under the same id")
    finally:
        peer.link and peer.link.close()
        gateway.stop()


def test_a_request_refused_before_queueing_leaves_no_marker_and_its_retry_runs(
    redis_url: str, redis_client: redis.Redis, model_text: ModelText
):
    """UNAVAILABLE (no executor) at enqueue, then a retry under the same request_id once an
    executor is there: the retry runs (it used to get FAILED_PRECONDITION for
    queue_timeout_s, the life of a marker the refused call left)."""
    gateway = make_gateway(redis_url, queue_timeout_s=30.0)
    try:
        code, details = status_of(generate(gateway, request_id="retried-1"))
        assert code == grpc.StatusCode.UNAVAILABLE, f"{code}: {details}"
        time.sleep(0.2)  # the marker was written in the background, when there was one
        assert not cancel_markers(redis_client, "retried-1"), "a refused call left a marker"
        peer = ExecutorPeer(redis_client, RedisKeys())
        peer.register()
        retry = generate(gateway, request_id="retried-1")
        assert_streams_a_story(peer, retry, model_text, "the retry")
    finally:
        gateway.stop()


def test_the_client_retries_unavailable_and_the_retry_runs(
    redis_url: str, redis_client: redis.Redis, model_text: ModelText
):
    """KvgateClient retries UNAVAILABLE: refused while no executor is alive, the call is sent
    again (same request_id) once one is, and streams its completion."""
    gateway = make_gateway(redis_url, queue_timeout_s=30.0)
    peer = ExecutorPeer(redis_client, RedisKeys())
    try:
        with ThreadPoolExecutor(1) as pool, KvgateClient(gateway.gateway.address, 30.0) as client:
            stream = client.generate_stream(PROMPT, request_id="retried-by-the-client")
            call = pool.submit(lambda: collect(stream))
            wait_for(lambda: gateway.calls("Generate", "UNAVAILABLE") >= 1, "a first refusal")
            peer.register()
            queued = peer.take_request()
            peer.connect(queued.reply_to)
            peer.send(queued.request_id, 0, story_ids(model_text), finished=True,
                      finish_reason=pb.FINISH_REASON_LENGTH)  # fmt: skip
            text, chunks = call.result(timeout=30)
        assert text == STORY and chunks[-1].request_id == "retried-by-the-client", text
        assert gateway.calls("Generate", "OK") == 1
    finally:
        if peer.link is not None:
            peer.link.close()
        gateway.stop()


def test_without_retries_the_client_sees_each_refusal(gateway: GatewayThread):
    with KvgateClient(gateway.gateway.address, 10.0, retry=False) as client:
        with pytest.raises(grpc.RpcError) as raised:
            client.generate(PROMPT)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
    # The gateway counts a call once its status is sent: the client may read it first.
    wait_for(lambda: gateway.calls("Generate", "UNAVAILABLE") >= 1, "the refusal counted")
    assert gateway.calls("Generate", "UNAVAILABLE") == 1, "one call, not retried"


def cancel_markers(client: redis.Redis, request_id: str) -> list[bytes]:
    """The cancel markers of the calls made under the client's `request_id` (tenant default)."""
    return client.keys(f"kvgate:cancel:default/{request_id}/*")


def assert_streams_a_story(peer: ExecutorPeer, call, model_text: ModelText, what: str) -> None:
    """Plays the executor of the next queued request, and checks `call` streams its text."""
    queued = peer.take_request()
    if peer.link is None:
        peer.connect(queued.reply_to)
    peer.send(queued.request_id, 0, [], accepted=True)
    story = story_ids(model_text)
    peer.send(queued.request_id, 0, story, finished=True, finish_reason=pb.FINISH_REASON_LENGTH)
    text, _ = collect(call)
    assert text == STORY, f"{what}: expected {STORY!r}, got {text!r}"


def test_tokens_stream_as_text_with_usage_and_timings(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    call = generate(gateway, params=pb.SamplingParams(max_tokens=64, temperature=0.0))
    queued = executor.take_request()
    assert queued.reply_to == gateway.gateway.reply_to
    assert queued.params.max_tokens == 64 and queued.params.HasField("temperature")
    assert queued.prompt_token_ids == model_text.encode(PROMPT)
    executor.send(queued.request_id, 0, [], accepted=True, num_cached_tokens=3)
    tokens = story_ids(model_text)
    for offset, token in enumerate(tokens[:-1]):
        executor.send(queued.request_id, offset, [token])
    last = len(tokens) - 1
    executor.send(
        queued.request_id, last, tokens[last:], finished=True,
        finish_reason=pb.FINISH_REASON_LENGTH, num_cached_tokens=3,
    )  # fmt: skip
    text, chunks = collect(call)
    assert text == STORY
    assert [t for c in chunks for t in c.token_ids] == tokens
    final = chunks[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (5, len(tokens))
    assert final.usage.cached_prompt_tokens == 3
    assert final.timings.ttft_ms >= final.timings.queue_ms >= 0


def test_a_stop_string_trims_the_text_and_aborts_the_executor(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    call = generate(gateway, params=pb.SamplingParams(stop=["girl"]))
    queued = executor.take_request()
    for offset, token in enumerate(story_ids(model_text)):
        executor.send(queued.request_id, offset, [token])
    text, chunks = collect(call)
    assert text == ", there was a little "
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    wait_for(lambda: queued.request_id in executor.aborted_ids(), "an abort")


def test_tokens_sent_twice_are_streamed_once(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    call = generate(gateway)
    queued = executor.take_request()
    tokens = story_ids(model_text)[:6]
    executor.send(queued.request_id, 0, tokens[:3])
    executor.send(queued.request_id, 1, tokens[1:5])
    executor.send(
        queued.request_id, 4, tokens[4:], finished=True, finish_reason=pb.FINISH_REASON_STOP
    )
    text, chunks = collect(call)
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert text == model_text.tokenizer.decode(model_text.encode(PROMPT) + tokens)[len(PROMPT) :]


def test_a_broken_executor_stream_requeues_with_the_streamed_tokens(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    call = generate(gateway, request_id="survivor")
    first = executor.take_request()
    tokens = story_ids(model_text)
    executor.send(first.request_id, 0, tokens[:4])
    executor.link.close()
    second = executor.take_request()
    assert (second.request_id, second.attempt) == (first.request_id, 1)
    assert list(second.resume_token_ids) == tokens[:4]
    assert second.prompt_token_ids == first.prompt_token_ids
    executor.connect(gateway.gateway.reply_to)
    executor.send(
        second.request_id, 4, tokens[4:], attempt=1, finished=True,
        finish_reason=pb.FINISH_REASON_STOP,
    )  # fmt: skip
    text, _ = collect(call)
    assert text == STORY, "the stream must go on without a gap or a repeat"


def test_client_cancel_aborts_the_executors_work(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    call = generate(gateway, request_id="cancel-me")
    queued = executor.take_request()
    executor.send(queued.request_id, 0, story_ids(model_text)[:2])
    next(call)
    call.cancel()
    wait_for(lambda: queued.request_id in executor.aborted_ids(), "an abort after cancel")


def test_chat_opens_a_session_and_routes_later_turns_to_its_executor(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText, redis_client
):
    turns = ChatTurns(["hi", "tell me more"])
    responses = gateway.stub.Chat(turns.requests(), timeout=CALL_TIMEOUT_S)
    first = executor.take_request()
    reply = story_ids(model_text)[:5]
    executor.send(first.request_id, 0, reply, finished=True, finish_reason=pb.FINISH_REASON_STOP)
    first_chunks = read_turn(responses)
    session_id = first_chunks[0].session_id
    assert session_id and first.session_id == session_id
    turns.next()
    second = executor.take_request()
    assert second.session_executor_id == "e1", "the session's next turn must prefer its executor"
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    executor.send(second.request_id, 0, reply, finished=True, finish_reason=pb.FINISH_REASON_STOP)
    second_chunks = read_turn(responses)
    assert second_chunks[-1].turn_index == 1
    turns.close()
    stored = redis_client.get(f"kvgate:session:default:{session_id}")
    state = internal_pb2.SessionState.FromString(stored)
    assert [m.role for m in state.messages] == ["user", "assistant", "user", "assistant"]
    assert state.executor_id == "e1" and state.tenant == "default"


def test_chat_cancel_ends_the_turn_with_abort_and_keeps_the_stream(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    turns = ChatTurns(["hi", "again"])
    responses = gateway.stub.Chat(turns.requests(), timeout=CALL_TIMEOUT_S)
    first = executor.take_request()
    executor.send(first.request_id, 0, story_ids(model_text)[:2])
    next(responses)
    turns.outgoing.put(pb.ChatRequest(cancel=pb.CancelTurn()))
    assert read_turn(responses)[-1].chunk.finish_reason == pb.FINISH_REASON_ABORT
    wait_for(lambda: first.request_id in executor.aborted_ids(), "an abort")
    turns.next()
    second = executor.take_request()
    executor.send(second.request_id, 0, [2], finished=True, finish_reason=pb.FINISH_REASON_STOP)
    assert read_turn(responses)[-1].turn_index == 1
    turns.close()


def test_chat_turns_sent_past_max_queued_turns_are_refused_naming_it(
    gateway: GatewayThread, executor: ExecutorPeer
):
    """Six turns sent at once: one runs, at most --max-queued-turns (4) wait behind it, and
    the call ends RESOURCE_EXHAUSTED naming the flag once the running turn is done."""
    turn = pb.ChatTurn(content="hi", params=pb.SamplingParams(max_tokens=8))
    requests = iter([pb.ChatRequest(turn=turn)] * 6)
    responses = gateway.stub.Chat(requests, timeout=CALL_TIMEOUT_S)
    first = executor.take_request()
    executor.send(first.request_id, 0, [2], finished=True, finish_reason=pb.FINISH_REASON_STOP)
    assert read_turn(responses)[-1].turn_index == 0
    code, details = status_of(responses)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code}: {details}"
    assert "--max-queued-turns" in details, details
    refused = gateway.metrics.registry.get_sample_value(
        "kvgate_gateway_refused_total", {"limit": "max_queued_turns"}
    )
    assert refused == 1.0, f"the refusal must be counted: {refused}"


def test_a_bad_first_chat_turn_leaves_no_session_behind(
    gateway: GatewayThread, redis_client: redis.Redis
):
    turn = pb.ChatTurn(content="hi", params=pb.SamplingParams(temperature=-1.0))
    responses = gateway.stub.Chat(iter([pb.ChatRequest(turn=turn)]), timeout=CALL_TIMEOUT_S)
    code, details = status_of(responses)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert "params.temperature" in details, f"expected the message to name the field: {details!r}"
    orphans = redis_client.keys("kvgate:session:*")
    assert orphans == [], f"a rejected first turn left sessions in redis: {orphans}"


def test_end_session_releases_it_on_its_executor(gateway: GatewayThread, redis_client):
    state = internal_pb2.SessionState(session_id="mine", tenant="default", executor_id="e7")
    redis_client.set("kvgate:session:default:mine", state.SerializeToString())
    ended = gateway.stub.EndSession(pb.EndSessionRequest(session_id="mine"))
    assert ended.ended and not redis_client.exists("kvgate:session:default:mine")
    (_, fields), *_ = redis_client.xrange("kvgate:exec:e7:inbox")
    message = internal_pb2.InboxMessage.FromString(fields[b"pb"])
    assert message.release_session.session_id == "mine"
    again = gateway.stub.EndSession(pb.EndSessionRequest(session_id="mine"))
    assert not again.ended


class ChatTurns:
    """Feeds a Chat stream one turn at a time."""

    def __init__(self, contents: list[str]) -> None:
        self.contents = list(contents)
        self.outgoing: queue.Queue = queue.Queue()
        self.next()

    def next(self) -> None:
        turn = pb.ChatTurn(content=self.contents.pop(0), params=pb.SamplingParams(max_tokens=8))
        self.outgoing.put(pb.ChatRequest(turn=turn))

    def close(self) -> None:
        self.outgoing.put(None)

    def requests(self):
        return iter(self.outgoing.get, None)


def read_turn(responses) -> list[pb.ChatResponse]:
    chunks = []
    for response in responses:
        chunks.append(response)
        if response.chunk.finish_reason:
            return chunks
    raise AssertionError(f"the turn ended without a last chunk: {chunks}")


def test_sigterm_stops_the_gateway_process_with_an_executor_connected(
    redis_url: str, redis_client: redis.Redis
):
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(STORIES_260K), "--redis-url", redis_url,
         "--port", "0", "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    serving = read_log_until(process, "gateway serving on")
    peer = ExecutorPeer(redis_client, RedisKeys())
    peer.connect(serving.split("token sink ")[1].split(",")[0])
    read_log_until(process, "connected its token stream")
    process.send_signal(signal.SIGTERM)
    remaining_log = process.stderr.read()
    assert process.wait(timeout=30) == 0, remaining_log
    assert "gateway stopped" in remaining_log, remaining_log
    peer.link.close()


def read_log_until(process: subprocess.Popen, text: str) -> str:
    """The message of the first JSON log line holding `text`."""
    for line in process.stderr:
        if text in line:
            return json.loads(line)["msg"]
    raise AssertionError(f"the process exited before logging {text!r}")


def answer_in_background(executor: ExecutorPeer, token_ids: list[int], turns: int = 1):
    """Answer the next `turns` queued requests with `token_ids`, from a thread."""

    def answer() -> None:
        for _ in range(turns):
            queued = executor.take_request()
            executor.send(
                queued.request_id, 0, token_ids, finished=True,
                finish_reason=pb.FINISH_REASON_STOP,
            )  # fmt: skip

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_kvgate_generate_prints_the_completion(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText, capsys
):
    answering = answer_in_background(executor, story_ids(model_text))
    exit_code = cli.main(
        ["generate", PROMPT, "--max-tokens", "20", "--temperature", "0",
         "--target", gateway.gateway.address],
    )  # fmt: skip
    answering.join()
    assert exit_code == 0
    assert capsys.readouterr().out == STORY + "\n"


@pytest.mark.parametrize(("flag", "value"), [("--max-tokens", "-1"), ("--seed", "-3")])
def test_kvgate_generate_names_an_out_of_range_flag_without_a_traceback(
    flag: str, value: str, capsys
):
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", PROMPT, flag, value, "--target", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, f"expected exit status 2, got {exited.value.code}: {err}"
    assert flag in err and value in err, f"the error must name {flag} and {value}: {err!r}"
    assert "Traceback" not in err, err


def test_kvgate_chat_streams_replies_and_ends_its_session(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText, capsys, monkeypatch
):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nmore\n"))
    answering = answer_in_background(executor, story_ids(model_text), turns=2)
    exit_code = cli.main(["chat", "--target", gateway.gateway.address])
    answering.join()
    assert exit_code == 0
    assert capsys.readouterr().out.count(STORY) == 2
    assert executor.client.keys("kvgate:session:*") == [], "the REPL must end its session"


def test_a_gateway_on_a_taken_port_exits_naming_the_flag(redis_url: str):
    """gRPC servers share a port by default (SO_REUSEPORT): a second gateway on a taken
    port used to start and take half of the first one's connections."""
    holder = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "--model", str(STORIES_260K),
             "--redis-url", redis_url, "--port", str(port), "--metrics-port", "-1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        holder.stop(grace=None)
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert f"--host/--port: cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_turns_recorded_by_two_streams_on_one_session_are_all_kept(redis_url: str, redis_client):
    """Two Chat streams hold copies of one session; each records a turn. The second must not
    overwrite the first's turn (each used to save its whole copy)."""
    store_a = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    store_b = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)

    async def two_streams() -> tuple[Session, Session, Session]:
        opened = await store_a.create("default")
        copy_a = await store_a.load(opened.session_id, "default")
        copy_b = await store_b.load(opened.session_id, "default")
        apple = [Message("user", "apple"), Message("assistant", "red")]
        banana = [Message("user", "banana"), Message("assistant", "yellow")]
        await store_a.record_turn(copy_a, apple, "e1")
        await store_b.record_turn(copy_b, banana, "")
        return copy_a, copy_b, await store_a.load(opened.session_id, "default")

    copy_a, copy_b, stored = asyncio.run(two_streams())
    assert [m.content for m in stored.messages] == ["apple", "red", "banana", "yellow"]
    assert (stored.num_turns, stored.executor_id) == (2, "e1"), stored
    assert copy_b.messages == stored.messages, "the recording copy is brought up to date"
    assert [m.content for m in copy_a.messages] == ["apple", "red"]


def test_a_turn_whose_write_races_another_is_retried_on_the_new_state(
    redis_url: str, redis_client, monkeypatch
):
    """Another stream writes the session between this turn's read and its write: the write
    is tried again on top of the other one's, and nothing is doubled."""
    store = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    session = Session("s-race", "default", [Message("user", "hi"), Message("assistant", "yo")])
    key = RedisKeys().session("default", "s-race")
    other = Session("s-race", "default", [Message("user", "other")], "e9", num_turns=4)
    redis_client.set(key, session.to_pb().SerializeToString())
    original_to_pb = Session.to_pb
    writes = []

    def to_pb_racing(self):
        if not writes:  # the first attempt: the other stream writes just before our EXEC
            writes.append(other)
            redis_client.set(key, original_to_pb(other).SerializeToString())
        return original_to_pb(self)

    monkeypatch.setattr(Session, "to_pb", to_pb_racing)
    turn = [Message("user", "again"), Message("assistant", "sure")]
    asyncio.run(store.record_turn(session, turn, ""))
    stored = Session.from_pb(internal_pb2.SessionState.FromString(redis_client.get(key)))
    assert [m.content for m in stored.messages] == ["other", "again", "sure"], stored
    assert (stored.num_turns, stored.executor_id) == (5, "e9"), stored
    assert session.messages == stored.messages and session.num_turns == 5


def test_a_turn_whose_session_is_ended_under_it_does_not_bring_it_back(
    redis_url: str, redis_client, monkeypatch
):
    store = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    key = RedisKeys().session("default", "s-gone")
    stored_before = Session("s-gone", "default", [Message("user", "hi")], "e1", num_turns=1)
    redis_client.set(key, stored_before.to_pb().SerializeToString())
    session = Session("s-gone", "default", [Message("user", "hi")], "e1", num_turns=1)
    original_to_pb = Session.to_pb
    deleted = []

    def to_pb_racing(self):
        if not deleted:  # EndSession on another stream, just before our EXEC
            deleted.append(redis_client.delete(key))
        return original_to_pb(self)

    monkeypatch.setattr(Session, "to_pb", to_pb_racing)
    asyncio.run(store.record_turn(session, [Message("assistant", "yo")], ""))
    assert deleted == [1], "the session was deleted between the read and the write"
    assert redis_client.get(key) is None, "an ended session must stay ended"
    assert [m.content for m in session.messages] == ["hi"], session


def test_a_turn_that_keeps_losing_the_race_gives_up_with_aborted(
    redis_url: str, redis_client, monkeypatch
):
    """Another stream writes the session before every one of this turn's writes: after
    MAX_TURN_WRITES tries the turn gives up with ABORTED instead of trying forever."""
    store = SessionStore(connect(redis_url, timeout_s=2.0), RedisKeys(), ttl_s=60.0)
    key = RedisKeys().session("default", "s-busy")
    session = Session("s-busy", "default", [Message("user", "hi")])
    redis_client.set(key, session.to_pb().SerializeToString())
    original_to_pb = Session.to_pb
    tries = []

    def to_pb_always_racing(self):
        tries.append(1)
        redis_client.set(key, original_to_pb(session).SerializeToString())
        return original_to_pb(self)

    monkeypatch.setattr(Session, "to_pb", to_pb_always_racing)
    with pytest.raises(errors.Aborted, match="kept changing"):
        asyncio.run(store.record_turn(session, [Message("assistant", "yo")], ""))
    assert len(tries) == MAX_TURN_WRITES, f"{len(tries)} writes tried"
    assert [m.content for m in session.messages] == ["hi"], session


def test_waiting_requests_share_one_liveness_read(redis_url: str, monkeypatch):
    queue = RequestQueue(connect(redis_url, timeout_s=2.0), RedisKeys(), 8, cancel_ttl_s=1.0)
    reads = []

    async def slow_read() -> list[str]:
        reads.append(1)
        await asyncio.sleep(0.05)
        return ["e1"]

    monkeypatch.setattr(queue, "live_executor_ids", slow_read)

    async def many_waiting() -> list[bool | None]:
        return await asyncio.gather(*(queue.any_executor_alive() for _ in range(50)))

    assert asyncio.run(many_waiting()) == [True] * 50
    assert len(reads) == 1, f"{len(reads)} reads for 50 waiting requests at once"
