"""Admission in as few Redis round trips as it can: a request's quotas are taken in the
round trip that queues it (all or nothing with the queue's own refusals; a call that writes a
session first takes them before it), the enqueue asks Redis nothing else, and a tenant over its
rate is refused by the gateway alone until its bucket refills."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
import redis

from protos.kvgate.v1 import inference_pb2 as pb
from tests.helpers import wait_for
from tests.integration.gateway_harness import ExecutorPeer, GatewayThread, generate
from tests.integration.test_tenancy import (
    AUTH_ON,
    CALL_TIMEOUT_S,
    KEYS,
    answer,
    make_gateway,
    new_key,
    quota_refusal,
    served,
    set_limits,
)


@pytest.fixture
def gateway_overrides() -> dict:
    return AUTH_ON


def command_calls(client: redis.Redis, *names: str) -> int:
    """How many of these commands Redis has served so far."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in names)


def script_calls(client: redis.Redis) -> int:
    """Lua script runs (EVALSHA and EVAL) and SCRIPT EXISTS asked so far."""
    return command_calls(client, "evalsha", "eval", "script|exists")


def test_a_generate_is_admitted_and_queued_in_one_round_trip(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", requests_per_s=100.0, max_streams=5)
    acme = new_key(redis_client, "acme")
    served(gateway, executor, acme)  # scripts loaded, limits and key cached
    taken_at = redis_client.hget(KEYS.tenant_buckets("acme"), "at_ms")
    before = script_calls(redis_client)
    call = generate(gateway, acme)
    executor.take_request()
    assert script_calls(redis_client) - before == 1, "more than the enqueue script's round trip"
    # That one script took the request and the place among open streams.
    assert redis_client.hget(KEYS.tenant_buckets("acme"), "at_ms") > taken_at
    assert redis_client.zcard(KEYS.tenant_streams("acme")) == 1
    call.cancel()


def test_the_enqueue_script_is_loaded_again_when_redis_lost_it(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", requests_per_s=100.0, max_streams=5)
    acme = new_key(redis_client, "acme")
    served(gateway, executor, acme)
    redis_client.script_flush()  # as a restarted Redis, or a replica promoted
    _, last = served(gateway, executor, acme)
    assert last.finish_reason == pb.FINISH_REASON_STOP, last
    assert redis_client.xlen(KEYS.requests) == 0, "a request was queued twice"


def test_a_request_the_queue_refuses_takes_nothing_from_the_quotas(
    redis_url: str, redis_client: redis.Redis
):
    gateway = make_gateway(redis_url, max_queue_len=1)
    try:
        executor = ExecutorPeer.attached(redis_client, gateway)
        set_limits(redis_client, "acme", requests_per_s=0.5, max_streams=1)
        acme, other = new_key(redis_client, "acme"), new_key(redis_client, "globex")
        waiting = generate(gateway, other)
        wait_for(lambda: redis_client.xlen(KEYS.requests) == 1, "globex's request queued")
        refused = generate(gateway, acme)
        with pytest.raises(grpc.RpcError) as raised:
            list(refused)
        assert "queue is full" in raised.value.details(), raised.value.details()
        answer(executor)
        list(waiting)
        # The bucket holds one request and the tenant one stream: both still free.
        _, last = served(gateway, executor, acme)
        assert last.finish_reason == pb.FINISH_REASON_STOP, last
    finally:
        executor.link.close()
        gateway.stop()


def test_a_refused_generate_opens_no_session(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", requests_per_s=0.5)
    acme = new_key(redis_client, "acme")
    served(gateway, executor, acme)
    details, _ = quota_refusal(generate(gateway, acme, session_id="conv-2"))
    assert "requests per second" in details, details
    assert not redis_client.exists(KEYS.session("acme", "conv-2")), "a refused call opened it"


def test_each_chat_turn_takes_a_request_and_is_refused_over_the_limit(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", requests_per_s=0.5, max_streams=1)
    acme = new_key(redis_client, "acme")
    turns: queue.Queue[pb.ChatRequest | None] = queue.Queue()
    turns.put(pb.ChatRequest(turn=pb.ChatTurn(content="hi")))
    chat = gateway.stub.Chat(iter(turns.get, None), metadata=acme, timeout=CALL_TIMEOUT_S)
    threading.Thread(target=answer, args=(executor,), daemon=True).start()
    first = next(chat)
    assert first.turn_index == 0 and first.session_id, first
    while not first.chunk.finish_reason:
        first = next(chat)
    turns.put(pb.ChatRequest(turn=pb.ChatTurn(content="and then?")))  # its session exists
    details, retry_ms = quota_refusal(chat)
    assert "requests per second" in details and 0 < retry_ms <= 2000, (details, retry_ms)
    turns.put(None)


def test_a_tenant_over_its_rate_is_refused_without_redis_until_its_bucket_refills(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", requests_per_s=0.5)
    acme = new_key(redis_client, "acme")
    served(gateway, executor, acme)
    _, first_retry_ms = quota_refusal(generate(gateway, acme))
    before = script_calls(redis_client)
    # Refused before anything else is looked at (this one sets both prompt fields).
    details, retry_ms = quota_refusal(generate(gateway, acme, prompt_token_ids=[1]))
    assert script_calls(redis_client) == before, "the remembered refusal went to Redis"
    assert "requests per second" in details and 0 < retry_ms <= first_retry_ms, details
    time.sleep(retry_ms / 1000)
    _, last = served(gateway, executor, acme)  # the bucket refilled
    assert last.finish_reason == pb.FINISH_REASON_STOP, last
