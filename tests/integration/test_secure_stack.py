"""The whole stack with every defence on, as real processes: Redis serving TLS only to an ACL
user with a password, a gateway asking for API keys over TLS, executors sending tokens over
mutual TLS; what each tenant sees of the others, and what the logs and metrics hold."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import redis

from client import admin
from client.api import KvgateClient, TLSFiles, sampling_params
from deploy.certs import CertificateAuthority
from deploy.stack import RedisSecurity, Stack
from protos.kvgate.v1 import inference_pb2 as pb
from tests.helpers import wait_for
from tests.integration.conftest import start_stack, tls_flags

REDIS_PASSWORD = "redis-pass-7f3a9c"  # noqa: S105 (a test's own Redis)
PROMPT_IDS = [(i * 7) % 400 + 20 for i in range(64)]  # 64 tokens: four full KV blocks
SHARED_ID = "one-id-for-both"  # the request_id (and session_id) both tenants choose


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory):
    """The secured stack, the CA of its certificates, and one API key per tenant."""
    folder = tmp_path_factory.mktemp("secure")
    ca = CertificateAuthority(folder / "ca")
    server, sink, executor = ca.server(), ca.server("sink"), ca.client("executor-0")
    redis_server = ca.server("redis")
    security = RedisSecurity(
        ca.ca, redis_server.cert, redis_server.key, password=REDIS_PASSWORD,
        acl_file=str(folder / "users.acl"),
    )  # fmt: skip
    stack = start_stack(
        folder / "logs",
        auth="keys",
        redis_security=security,
        **tls_flags(ca.ca, server, sink, executor),
    )
    try:
        client = stack.redis()
        keys = {t: admin.create_key(client, stack.keys, t, lambda _: None) for t in ("a", "b")}
        yield stack, ca, keys
    finally:
        stack.stop_all()


def completion(stack: Stack, ca: CertificateAuthority, api_key: str) -> pb.GenerateResponse:
    """The last chunk of a greedy Generate of PROMPT_IDS as the key's tenant."""
    with KvgateClient(stack.address, 60.0, api_key=api_key, tls=TLSFiles(ca.ca)) as client:
        request = pb.GenerateRequest(
            prompt_token_ids=PROMPT_IDS, params=sampling_params(max_tokens=2, temperature=0)
        )
        return list(client.stub.Generate(request, **client._call_options(60.0)))[-1]


def test_the_stack_serves_through_tls_redis_as_an_acl_user(secure) -> None:
    stack, ca, keys = secure
    last = completion(stack, ca, keys["a"])
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 2
    plain = redis.Redis(port=stack.redis_port, socket_timeout=2)
    with pytest.raises(redis.ConnectionError):
        plain.ping()  # the TLS port does not speak plaintext
    no_password = redis.Redis.from_url(stack.redis_url.replace(f"kvgate:{REDIS_PASSWORD}@", ""))
    with pytest.raises(redis.AuthenticationError):
        no_password.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        stack.redis().set("not-kvgate", 1)  # the ACL user reaches kvgate's keys only


def test_tenants_do_not_share_the_prefix_cache(secure) -> None:
    stack, ca, keys = secure
    first = completion(stack, ca, keys["a"])
    again = completion(stack, ca, keys["a"])
    other = completion(stack, ca, keys["b"])
    assert again.usage.cached_prompt_tokens > 0, f"a's repeat reused nothing: {again.usage}"
    assert other.usage.cached_prompt_tokens == 0, f"b read a's cached prefix: {other.usage}"
    assert first.usage.prompt_tokens == other.usage.prompt_tokens == 64


def test_admin_usage_reads_the_tls_redis(secure, capsys) -> None:
    stack, ca, keys = secure
    completion(stack, ca, keys["b"])

    def counted() -> dict | None:
        # The gateway writes usage in batches (gateway/accounting.py USAGE_WRITE_DELAY_S).
        report = admin.usage_report(stack.redis(), stack.keys, "b", days=1)
        return report if report and all(d["requests"] >= 1 for d in report["b"].values()) else None

    wait_for(counted, "tenant b's request in the usage report")
    assert admin.main(["--redis-url", stack.redis_url, "usage", "--tenant", "b"]) == 0
    assert "total" in capsys.readouterr().out


def test_no_secret_reaches_a_log_or_the_metrics(secure) -> None:
    stack, ca, keys = secure
    with KvgateClient(stack.address, 10.0, api_key="kvg_0123456789ab_" + "x" * 43,
                      tls=TLSFiles(ca.ca)) as client:  # fmt: skip
        with pytest.raises(grpc.RpcError):
            client.model_info()
    completion(stack, ca, keys["a"])

    def scrape(port: int) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    # the gateway counts a generation once its stream has ended, after the client's last chunk
    gateway_port = stack.metrics_ports["gateway"]
    wait_for(lambda: 'tenant="a"' in scrape(gateway_port), "the gateway's tenant label")
    secrets = [
        REDIS_PASSWORD,
        "x" * 43,
        *keys.values(),
        *(k.split("_", 2)[2] for k in keys.values()),
    ]
    logs = {name: stack.log_path(name).read_text() for name in stack.procs}
    metrics = {name: scrape(port) for name, port in stack.metrics_ports.items()}
    for where, text in {**logs, **metrics}.items():
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{where} holds a secret"


@contextmanager
def tenant_client(stack: Stack, ca: CertificateAuthority, api_key: str) -> Iterator[KvgateClient]:
    with KvgateClient(stack.address, 60.0, api_key=api_key, tls=TLSFiles(ca.ca)) as client:
        yield client


def start_greedy(client: KvgateClient, prompt_ids: list[int], max_tokens: int, **fields):
    """A greedy Generate that runs to max_tokens, started (its chunks not read yet)."""
    params = sampling_params(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=prompt_ids, params=params, **fields)
    return client.stub.Generate(request, **client._call_options(60.0))


def token_ids(chunks) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def test_two_tenants_under_one_request_id_never_touch_each_other(secure) -> None:
    """Both tenants stream at once under one request_id: each gets its own tokens (those of
    its run alone), and one's cancel or EndSession leaves the other's request and session."""
    stack, ca, keys = secure
    prompts = {"a": PROMPT_IDS[:16], "b": PROMPT_IDS[40:56]}
    with tenant_client(stack, ca, keys["a"]) as a, tenant_client(stack, ca, keys["b"]) as b:
        clients = {"a": a, "b": b}
        alone = {t: token_ids(start_greedy(c, prompts[t], 300)) for t, c in clients.items()}
        assert alone["a"] != alone["b"] and len(alone["b"]) == 300

        calls = {
            t: start_greedy(c, prompts[t], 300, request_id=SHARED_ID) for t, c in clients.items()
        }
        assert {t: token_ids(call) for t, call in calls.items()} == alone

        cancelled = start_greedy(a, prompts["a"], 300, request_id=SHARED_ID)
        other = start_greedy(b, prompts["b"], 300, request_id=SHARED_ID)
        first_chunks = [next(cancelled), next(other)]  # both are streaming
        cancelled.cancel()
        assert token_ids([first_chunks[1], *other]) == alone["b"]
        assert other.code() == grpc.StatusCode.OK
        assert cancelled.code() == grpc.StatusCode.CANCELLED

        def second_turn_of_b(session_id: str) -> list:
            """b's second turn; in SHARED_ID, a opens its own session of that id beside b's
            first turn, under the same request_id, and ends it before b's second."""
            shared = session_id == SHARED_ID
            ids = {"session_id": session_id, "request_id": SHARED_ID if shared else ""}
            first = [start_greedy(b, prompts["b"], 8, **ids)]
            first += [start_greedy(a, prompts["a"], 8, **ids)] if shared else []
            assert all(len(token_ids(call)) == 8 for call in first)
            assert not shared or a.end_session(SHARED_ID), "a's own session was not ended"
            return list(start_greedy(b, prompts["b"], 8, session_id=session_id))

        solo, shared = second_turn_of_b("b-alone"), second_turn_of_b(SHARED_ID)
        assert token_ids(shared) == token_ids(solo)
        assert b.end_session(SHARED_ID), "a's EndSession ended b's session"
        assert not a.end_session(SHARED_ID)
