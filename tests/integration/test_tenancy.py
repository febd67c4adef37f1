"""API keys, tenant isolation, quotas and accounting, through a real gateway (--auth keys),
a real redis-server and the executor's side of the wire driven by the test."""

from __future__ import annotations

import threading

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client import admin
from common.keys import RedisKeys
from common.tenants import OTHER_TENANTS, TenantLimits
from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import internal_pb2
from tests.helpers import wait_for
from tests.integration.gateway_harness import (
    ExecutorPeer,
    GatewayThread,
    gateway_config,
    generate,
)

CALL_TIMEOUT_S = 20
KEYS = RedisKeys()


AUTH_ON = {"auth": "keys"}


def make_gateway(redis_url: str, **overrides) -> GatewayThread:
    return GatewayThread(gateway_config(redis_url, **(AUTH_ON | overrides)))


@pytest.fixture
def gateway_overrides() -> dict:
    return AUTH_ON


def new_key(client: redis.Redis, tenant: str) -> tuple[tuple[str, str]]:
    """A new API key of `tenant`, as call metadata."""
    api_key = admin.create_key(client, KEYS, tenant, lambda _: None)
    return (("authorization", f"Bearer {api_key}"),)


def set_limits(client: redis.Redis, tenant: str, **limits) -> None:
    admin.set_limits(client, KEYS, tenant, limits, lambda _: None)


def answer(executor: ExecutorPeer, token_ids: list[int] = (2,)) -> internal_pb2.QueuedRequest:
    """Take the next queued request and finish it with `token_ids`."""
    queued = executor.take_request()
    executor.send(
        queued.request_id, 0, list(token_ids), finished=True, finish_reason=pb.FINISH_REASON_STOP
    )
    return queued


def served(gateway: GatewayThread, executor: ExecutorPeer, metadata, **fields):
    """A Generate answered by the executor: (its queued request, its last chunk)."""
    call = generate(gateway, metadata, **fields)
    queued = answer(executor)
    return queued, list(call)[-1]


def quota_refusal(call) -> tuple[str, int]:
    """The details and retry-after-ms of a call refused with RESOURCE_EXHAUSTED."""
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    error = raised.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error.code()}: {error.details()}"
    return error.details(), int(dict(error.trailing_metadata())["retry-after-ms"])


def test_calls_without_a_known_key_are_unauthenticated_and_health_stays_open(
    gateway: GatewayThread, redis_client: redis.Redis
):
    revoked = new_key(redis_client, "acme")
    admin.revoke_key(redis_client, KEYS, revoked[0][1].split()[1], lambda _: None)
    cases = {
        "no key": (),
        "not a bearer": (("authorization", "Basic dXNlcjpwYXNz"),),
        "not a kvgate key": (("authorization", "Bearer sk-123"),),
        "an unknown key": (("authorization", "Bearer kvg_0123456789ab_" + "A" * 43),),
        "a revoked key": revoked,
    }
    stub = gateway.stub
    for case, metadata in cases.items():
        calls = {
            "Generate": lambda m=metadata: list(generate(gateway, m)),
            "Chat": lambda m=metadata: list(stub.Chat(iter([]), metadata=m, timeout=5)),
            "Tokenize": lambda m=metadata: stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=m),
            "GetModelInfo": lambda m=metadata: stub.GetModelInfo(
                pb.GetModelInfoRequest(), metadata=m
            ),
            "EndSession": lambda m=metadata: stub.EndSession(
                pb.EndSessionRequest(session_id="s"), metadata=m
            ),
        }
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as raised:
                call()
            code = raised.value.code()
            assert code == grpc.StatusCode.UNAUTHENTICATED, f"{method} with {case}: {code}"
            if metadata:
                secret = metadata[0][1].split()[-1]
                assert secret not in raised.value.details(), "the error repeats the key"
    health = health_pb2_grpc.HealthStub(gateway.channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    list_services = reflection_pb2.ServerReflectionRequest(list_services="")
    reflection = reflection_pb2_grpc.ServerReflectionStub(gateway.channel)
    answer_ = next(reflection.ServerReflectionInfo(iter([list_services])))
    names = {s.name for s in answer_.list_services_response.service}
    assert "kvgate.v1.Inference" in names, names


def test_a_key_names_its_tenant_and_is_stored_only_as_a_hash(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    metadata = new_key(redis_client, "acme")
    queued, last = served(gateway, executor, metadata)
    assert queued.tenant == "acme", f"queued as tenant {queued.tenant!r}"
    assert last.finish_reason == pb.FINISH_REASON_STOP
    api_key = metadata[0][1].split()[1]
    secret = api_key.split("_", 2)[2].encode()
    for name in redis_client.scan_iter():
        if redis_client.type(name) == b"hash":
            values = b" ".join(redis_client.hgetall(name).values())
            assert secret not in values, f"{name!r} holds the key in clear"


def test_a_revoked_key_stops_working_within_5_s(gateway: GatewayThread, redis_client: redis.Redis):
    metadata = new_key(redis_client, "acme")
    stub = gateway.stub
    stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=metadata)
    assert admin.revoke_key(redis_client, KEYS, metadata[0][1].split()[1], lambda _: None)

    def refused() -> bool:
        try:
            stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=metadata)
        except grpc.RpcError as error:
            return error.code() == grpc.StatusCode.UNAUTHENTICATED
        return False

    wait_for(refused, "the revoked key to be refused", timeout_s=5.0)


def test_admin_keys_list_shows_ids_and_tenants_never_keys(redis_client: redis.Redis, capsys):
    url = redis_client.connection_pool.connection_kwargs["path"]
    assert admin.main(["--redis-url", f"unix://{url}", "keys", "create", "--tenant", "acme"]) == 0
    api_key = capsys.readouterr().out.strip().splitlines()[-1]
    assert admin.main(["--redis-url", f"unix://{url}", "keys", "list"]) == 0
    listing = capsys.readouterr().out
    key_id = api_key.split("_")[1]
    assert key_id in listing and "acme" in listing, listing
    assert api_key not in listing and api_key.split("_", 2)[2] not in listing, listing
    assert admin.main(["--redis-url", f"unix://{url}", "keys", "revoke", key_id]) == 0
    assert admin.main(["--redis-url", f"unix://{url}", "keys", "revoke", key_id]) == 1
    with pytest.raises(SystemExit) as refused:
        admin.main(["--redis-url", f"unix://{url}", "keys", "create", "--tenant", "_x"])
    assert refused.value.code == 2
    assert "argument --tenant: must be 1-64 characters" in capsys.readouterr().err


def test_another_tenants_session_is_not_found_and_stays_untouched(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    acme, other = new_key(redis_client, "acme"), new_key(redis_client, "globex")
    queued, _ = served(gateway, executor, acme, session_id="conv-1")
    executor.client.set(  # acme's session ran on e1: its stored executor
        KEYS.session("acme", "conv-1"),
        internal_pb2.SessionState(session_id="conv-1", tenant="acme", executor_id="e1", num_turns=1)
        .SerializeToString(),
    )  # fmt: skip
    chat = gateway.stub.Chat(
        iter([pb.ChatRequest(turn=pb.ChatTurn(content="hi", session_id="conv-1"))]),
        metadata=other,
        timeout=CALL_TIMEOUT_S,
    )
    with pytest.raises(grpc.RpcError) as raised:
        list(chat)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND, raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        gateway.stub.EndSession(pb.EndSessionRequest(session_id="conv-1"), metadata=other)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND, raised.value.details()
    with pytest.raises(grpc.RpcError) as never_opened:
        gateway.stub.EndSession(pb.EndSessionRequest(session_id="conv-none"), metadata=other)
    assert never_opened.value.details() == raised.value.details().replace("conv-1", "conv-none")
    theirs, _ = served(gateway, executor, other, session_id="conv-1")
    assert theirs.session_executor_id == "", "globex's turn was sent to acme's session's executor"
    stored = internal_pb2.SessionState.FromString(redis_client.get(KEYS.session("acme", "conv-1")))
    assert (stored.tenant, stored.num_turns, stored.executor_id) == ("acme", 1, "e1"), stored
    mine = gateway.stub.EndSession(pb.EndSessionRequest(session_id="conv-1"), metadata=acme)
    assert mine.ended, "acme could not end its own session"


def test_requests_per_second_over_the_limit_are_refused_with_retry_after(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", requests_per_s=0.5)
    acme, other = new_key(redis_client, "acme"), new_key(redis_client, "globex")
    served(gateway, executor, acme)
    details, retry_ms = quota_refusal(generate(gateway, acme))
    assert "requests per second" in details, details
    assert 0 < retry_ms <= 2000, f"retry-after-ms {retry_ms} for a bucket of 0.5 per second"
    served(gateway, executor, other)  # another tenant's bucket is its own


def test_generated_tokens_per_minute_are_charged_and_refused(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", tokens_per_min=10)
    acme = new_key(redis_client, "acme")
    call = generate(gateway, acme)
    answer(executor, [2] * 25)
    list(call)

    def bucket_tokens() -> float:
        return float(redis_client.hget(KEYS.tenant_buckets("acme"), "tokens") or 10)

    wait_for(lambda: bucket_tokens() < 0, "the 25 tokens taken from acme's bucket of 10")
    details, retry_ms = quota_refusal(generate(gateway, acme))
    assert retry_ms > 60_000, f"15 tokens below zero at 10 a minute: {retry_ms} ms"
    assert "generated tokens per minute" in details, details


def test_tokens_streamed_before_a_cancel_are_charged_and_counted(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "globex", tokens_per_min=10)
    globex = new_key(redis_client, "globex")
    call = generate(gateway, globex, params=pb.SamplingParams(max_tokens=500, ignore_eos=True))
    queued = executor.take_request()
    executor.send(queued.request_id, 0, [2] * 100)
    next(call)
    call.cancel()

    def usage() -> dict:
        report = admin.usage_report(redis_client, KEYS, None, 1)
        return report.get("globex", {})

    (day,) = wait_for(usage, "the cancelled call's usage to reach Redis").values()
    assert day["requests"] == 1 and day["generated_tokens"] == 100, day
    sample = gateway.metrics.registry.get_sample_value
    assert sample("kvgate_gateway_tenant_generated_tokens_total", {"tenant": "globex"}) == 100
    assert sample("kvgate_gateway_tenant_requests_total", {"tenant": "globex"}) == 1
    details, retry_ms = quota_refusal(generate(gateway, globex))
    assert "generated tokens per minute" in details, details
    assert retry_ms > 60_000, f"90 tokens below zero at 10 a minute: {retry_ms} ms"


def test_open_streams_over_the_limit_are_refused_until_one_ends(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", max_streams=1)
    acme = new_key(redis_client, "acme")
    first = generate(gateway, acme)
    queued = executor.take_request()
    details, _ = quota_refusal(generate(gateway, acme))
    assert "open streams" in details, details
    executor.send(queued.request_id, 0, [2], finished=True, finish_reason=pb.FINISH_REASON_STOP)
    list(first)
    threading.Thread(target=answer, args=(executor,), daemon=True).start()

    def admitted() -> bool:
        try:
            return bool(list(generate(gateway, acme)))
        except grpc.RpcError as error:  # the first stream's place is given back just after it
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            return False

    wait_for(admitted, "a stream once the first one ended")


def finish_choices(executor: ExecutorPeer, queued: internal_pb2.QueuedRequest, n: int) -> None:
    """Finish each of the queued request's n choices with one token."""
    for index in range(n):
        executor.send(
            f"{queued.request_id}#{index}", 0, [2], index=index, finished=True,
            finish_reason=pb.FINISH_REASON_STOP,
        )  # fmt: skip


def test_a_request_of_n_choices_takes_n_requests_per_second(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", requests_per_s=2)
    acme = new_key(redis_client, "acme")
    call = generate(gateway, acme, params=pb.SamplingParams(max_tokens=4, n=2))
    finish_choices(executor, executor.take_request(), 2)
    assert len([c for c in call if c.finish_reason]) == 2
    details, _ = quota_refusal(generate(gateway, acme))
    assert "requests per second" in details, details


def test_a_request_of_n_choices_holds_n_open_streams(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", max_streams=3)
    acme = new_key(redis_client, "acme")
    first = generate(gateway, acme, params=pb.SamplingParams(max_tokens=4, n=2))
    queued = executor.take_request()
    details, _ = quota_refusal(generate(gateway, acme, params=pb.SamplingParams(n=2)))
    assert "open streams" in details, details
    finish_choices(executor, queued, 2)
    list(first)


def test_a_priority_above_the_tenants_highest_is_clamped_and_said_so(
    gateway: GatewayThread, executor: ExecutorPeer, redis_client: redis.Redis
):
    set_limits(redis_client, "acme", max_priority=5)
    acme = new_key(redis_client, "acme")
    queued, last = served(gateway, executor, acme, priority=-3)
    assert queued.priority == 5 and last.priority == 5 and last.priority_clamped, last
    queued, last = served(gateway, executor, acme, priority=9)
    assert queued.priority == 9 and last.priority == 9 and not last.priority_clamped, last


def test_usage_is_counted_per_tenant_in_metrics_and_the_admin_report(
    redis_url: str, redis_client: redis.Redis, capsys
):
    gateway = make_gateway(redis_url, metrics_max_tenants=1)
    executor = ExecutorPeer.attached(redis_client, gateway)
    try:
        acme, other = new_key(redis_client, "acme"), new_key(redis_client, "globex")
        for metadata in (acme, acme, other):
            served(gateway, executor, metadata)
        sample = gateway.metrics.registry.get_sample_value
        assert sample("kvgate_gateway_tenant_requests_total", {"tenant": "acme"}) == 2
        assert sample("kvgate_gateway_tenant_generated_tokens_total", {"tenant": "acme"}) == 2
        assert sample("kvgate_gateway_tenant_requests_total", {"tenant": OTHER_TENANTS}) == 1
        assert sample("kvgate_gateway_tenant_requests_total", {"tenant": "globex"}) is None

        def usage() -> dict:
            report = admin.usage_report(redis_client, KEYS, None, 1)
            return report if "globex" in report else {}

        report = wait_for(usage, "the usage to reach Redis")
        (acme_day,) = report["acme"].values()
        assert acme_day["requests"] == 2 and acme_day["generated_tokens"] == 2, acme_day
        assert acme_day["prompt_tokens"] > 0, acme_day
    finally:
        executor.link.close()
        gateway.stop()


def test_limits_set_show_and_clear_through_admin(redis_client: redis.Redis, capsys):
    url = f"unix://{redis_client.connection_pool.connection_kwargs['path']}"
    head = ["--redis-url", url, "limits"]
    assert admin.main([*head, "set", "--tenant", "acme", "--requests-per-s", "5"]) == 0
    assert admin.main([*head, "set", "--tenant", "acme", "--max-priority", "2"]) == 0
    limits = admin.read_limits(redis_client, KEYS, "acme")
    assert limits == TenantLimits(requests_per_s=5.0, max_priority=2), limits
    assert admin.main([*head, "set", "--tenant", "acme", "--max-streams", "-1"]) == 2
    assert "--max-streams" in capsys.readouterr().err
    assert admin.main([*head, "clear", "--tenant", "acme"]) == 0
    assert not redis_client.exists(KEYS.tenant_limits("acme"))
