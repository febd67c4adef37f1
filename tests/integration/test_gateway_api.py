"""The gateway through its gRPC API, against a real redis-server and the executor's side
of the wire protocol (requests stream + TokenSink stream) driven by the test: errors and
statuses, and a request's tokens streamed back."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.api import KvgateClient
from common.keys import RedisKeys
from common.model_text import ModelText
from common.redis_conn import connect
from gateway import errors
from gateway.request_queue import RequestQueue
from protos.kvgate.v1 import inference_pb2 as pb
from tests.helpers import wait_for
from tests.integration.gateway_harness import (
    CALL_TIMEOUT_S,
    PROMPT,
    STORY,
    ExecutorPeer,
    GatewayThread,
    collect,
    generate,
    make_gateway,
    status_of,
    story_ids,
)


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
        # (40 KB each: under the receive limit, 55,360 bytes for stories260K)
        ({"session_id": "x" * 40_000}, "session_id"),
        ({"request_id": "\u00e9" * 20_000}, "request_id"),
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


def logprobs_of(tokens: list[int], vocab_size: int) -> list[pb.TokenLogprob]:
    """A distinct TokenLogprob per position, with two alternatives each."""
    return [
        pb.TokenLogprob(
            token_id=token,
            logprob=-(i + 1) / 8,
            top=[
                pb.TopLogprob(token_id=token, logprob=-(i + 1) / 8),
                pb.TopLogprob(token_id=(token + 1) % vocab_size, logprob=-(i + 2)),
            ],
        )
        for i, token in enumerate(tokens)
    ]


def test_logprobs_stream_once_each_in_order_when_the_executor_resends(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    call = generate(gateway, params=pb.SamplingParams(max_tokens=20, logprobs=2))
    queued = executor.take_request()
    assert queued.params.logprobs == 2, "the request's logprobs must reach the executor"
    tokens = story_ids(model_text)[:7]
    logprobs = logprobs_of(tokens, model_text.limits.vocab_size)
    rid = queued.request_id
    executor.send(rid, 0, tokens[:3], logprobs=logprobs[:3])
    executor.send(rid, 1, tokens[1:5], logprobs=logprobs[1:5])  # re-sends 1 and 2
    executor.send(rid, 3, tokens[3:6], logprobs=logprobs[3:6])  # re-sends 3 and 4
    executor.send(
        rid, 6, tokens[6:], logprobs=logprobs[6:],
        finished=True, finish_reason=pb.FINISH_REASON_STOP,
    )  # fmt: skip
    _, chunks = collect(call)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks), chunks
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert [lp for c in chunks for lp in c.logprobs] == logprobs


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


def test_a_run_that_replaced_the_streaming_one_behind_its_tokens_is_not_joined_to_them(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    """The executor streaming a request starts a second run of it over from token 0 (it
    replaced the first: a choice queued again alone beside its group's restart); the
    gateway takes none of it, aborts that run, and queues the request again from the tokens
    its client has, without counting an attempt; the client's text has no seam."""
    call = generate(gateway, request_id="replaced", params=pb.SamplingParams(temperature=1.0))
    first = executor.take_request()
    tokens = story_ids(model_text)
    executor.send(first.request_id, 0, tokens[:4], run=1)
    executor.send(first.request_id, 0, tokens[10:16], run=2, accepted=True)
    second = executor.take_request()
    assert (second.attempt, list(second.resume_token_ids)) == (1, tokens[:4])
    assert second.max_attempts == first.max_attempts + 1, "a replaced run counted as lost"
    assert first.request_id in wait_for(executor.aborted_ids, "the second run aborted")
    executor.send(
        second.request_id, 4, tokens[4:], attempt=1, run=3, finished=True,
        finish_reason=pb.FINISH_REASON_STOP,
    )  # fmt: skip
    text, _ = collect(call)
    assert text == STORY, "the second run's tokens joined the first's"


def test_choices_requeued_alone_carry_the_session_on_choice_0_only(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    """Choice 0 alone keeps a session's blocks (engine.add_request): a choice k > 0 run again
    alone must not bring its own tokens into the session's cache."""
    params = pb.SamplingParams(max_tokens=8, temperature=0.0, n=2)
    call = generate(gateway, request_id="two", session_id="s-two", params=params)
    group = executor.take_request()
    assert group.session_id == "s-two", group
    tokens = story_ids(model_text)
    for index in (0, 1):
        executor.send(f"{group.request_id}#{index}", 0, tokens[:2], index=index)
    executor.link.close()
    requeued = {r.choice_index: r for r in (executor.take_request(), executor.take_request())}
    assert requeued[0].session_id == "s-two", requeued[0]
    assert (requeued[1].session_id, requeued[1].session_executor_id) == ("", ""), requeued[1]
    call.cancel()


def test_client_cancel_aborts_the_executors_work(
    gateway: GatewayThread, executor: ExecutorPeer, model_text: ModelText
):
    call = generate(gateway, request_id="cancel-me")
    queued = executor.take_request()
    executor.send(queued.request_id, 0, story_ids(model_text)[:2])
    next(call)
    call.cancel()
    wait_for(lambda: queued.request_id in executor.aborted_ids(), "an abort after cancel")


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
