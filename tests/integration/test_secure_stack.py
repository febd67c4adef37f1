"""The whole stack with every defence on, as real processes: Redis serving TLS only to an ACL
user with a password, a gateway asking for API keys over TLS, executors sending tokens over
mutual TLS; what each tenant sees of the others, and what the logs and metrics hold."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
import redis

from client import admin
from client.api import KvgateClient, TLSFiles, sampling_params
from deploy.stack import RedisSecurity, Stack
from protos.kvgate.v1 import inference_pb2 as pb
from tests.certs import CertificateAuthority
from tests.helpers import wait_for
from tests.integration.conftest import start_stack

REDIS_PASSWORD = "redis-pass-7f3a9c"  # noqa: S105 (a test's own Redis)
PROMPT_IDS = [(i * 7) % 400 + 20 for i in range(64)]  # 64 tokens: four full KV blocks


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
        gateway_flags=[
            "--tls-cert", server.cert, "--tls-key", server.key,
            "--internal-tls-cert", sink.cert, "--internal-tls-key", sink.key,
            "--internal-tls-client-ca", ca.ca,
        ],
        executor_flags=[
            "--sink-tls-ca", ca.ca, "--sink-tls-cert", executor.cert,
            "--sink-tls-key", executor.key,
        ],
    )  # fmt: skip
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
    secrets = [
        REDIS_PASSWORD,
        "x" * 43,
        *keys.values(),
        *(k.rsplit("_", 1)[1] for k in keys.values()),
    ]
    logs = {name: stack.log_path(name).read_text() for name in stack.procs}
    metrics = {
        name: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name, port in stack.metrics_ports.items()
    }
    for where, text in {**logs, **metrics}.items():
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{where} holds a secret"
    assert 'tenant="a"' in metrics["gateway"], "the gateway's metrics have no tenant label"
