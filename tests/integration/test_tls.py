"""TLS on the gateway's ports, with certificates the tests make: the public port (and its
reload on SIGHUP), mutual TLS naming the tenant, and the TokenSink, which takes tokens only
from executors that prove who they are (mutual TLS or the shared secret)."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import admin, cli
from common.keys import RedisKeys
from common.tls import sink_metadata
from deploy.certs import CertificateAuthority, Pem
from executor.gateway_link import GatewayGone, GatewayLink, SinkCredentials
from protos.kvgate.v1 import inference_pb2 as pb
from protos.kvgate.v1 import internal_pb2
from tests.helpers import STORIES_260K, wait_for
from tests.integration.gateway_harness import ExecutorPeer, GatewayThread, gateway_config

CALL_TIMEOUT_S = 20
KEYS = RedisKeys()


def read(path: str) -> bytes:
    return Path(path).read_bytes()


def client_credentials(ca: str, client: Pem | None = None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(read(ca))
    return grpc.ssl_channel_credentials(read(ca), read(client.key), read(client.cert))


def health_status(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """The public port's health over TLS with `credentials` (None: plaintext), or the code
    of the failure."""
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    """Another CA: its certificates prove nothing to the gateway."""
    return CertificateAuthority(tmp_path_factory.mktemp("stranger"), "someone else")


def test_the_public_port_serves_tls_and_mutual_tls_names_the_tenant(
    redis_url: str, redis_client: redis.Redis, ca: CertificateAuthority, stranger
):
    server = ca.server()
    config = gateway_config(
        redis_url, auth="cert", tls_cert=server.cert, tls_key=server.key, tls_client_ca=ca.ca
    )
    acme = ca.client("acme")
    gateway = GatewayThread(config, client_credentials(ca.ca, acme))
    peer = ExecutorPeer.attached(redis_client, gateway)
    try:
        address = gateway.gateway.address
        assert health_status(address, None) == "UNAVAILABLE", "plaintext was served"
        assert health_status(address, client_credentials(ca.ca)) == "UNAVAILABLE", (
            "a client without a certificate was served"
        )
        foreign = client_credentials(ca.ca, stranger.client("acme"))
        assert health_status(address, foreign) == "UNAVAILABLE", "another CA's client served"
        assert health_status(address, client_credentials(stranger.ca, acme)) == "UNAVAILABLE", (
            "the client trusted a server its CA did not sign"
        )
        call = gateway.stub.Generate(pb.GenerateRequest(prompt="Hi"), timeout=CALL_TIMEOUT_S)
        queued = peer.take_request()
        peer.send(queued.request_id, 0, [2], finished=True, finish_reason=pb.FINISH_REASON_STOP)
        assert list(call)[-1].finish_reason == pb.FINISH_REASON_STOP
        assert queued.tenant == "acme", f"the certificate's CN was not the tenant: {queued}"
        # The CLI presents a client certificate from --tls-cert/--tls-key.
        tenants = answer_in_background(peer)
        flags = ["--target", address, "--tls-ca", ca.ca, "--tls-cert", acme.cert]
        assert cli.main(["generate", "Hi", "--max-tokens", "1", *flags, "--tls-key", acme.key]) == 0
        assert tenants.get(timeout=5) == "acme"
    finally:
        peer.link.close()
        gateway.stop()


def answer_in_background(peer: ExecutorPeer) -> queue.Queue[str]:
    """Answers the next queued request with one token from a thread of its own; the
    returned queue gets its tenant."""
    tenants: queue.Queue[str] = queue.Queue()

    def answer_one() -> None:
        queued = peer.take_request()
        peer.send(queued.request_id, 0, [2], finished=True, finish_reason=1)
        tenants.put(queued.tenant)

    threading.Thread(target=answer_one, daemon=True).start()
    return tenants


def test_the_cli_talks_tls_with_an_api_key(
    redis_url: str, redis_client: redis.Redis, ca: CertificateAuthority, capsys
):
    server = ca.server()
    gateway = GatewayThread(
        gateway_config(redis_url, auth="keys", tls_cert=server.cert, tls_key=server.key),
        client_credentials(ca.ca),
    )
    peer = ExecutorPeer.attached(redis_client, gateway)
    try:
        api_key = admin.create_key(redis_client, KEYS, "acme", lambda _: None)
        flags = ["--target", gateway.gateway.address, "--tls-ca", ca.ca, "--api-key", api_key]
        replies = answer_in_background(peer)
        assert cli.main(["generate", "Hi", "--max-tokens", "1", *flags]) == 0
        assert replies.get(timeout=5) == "acme"
        assert cli.main(["generate", "Hi", "--target", gateway.gateway.address, "--api-key",
                         api_key]) == 1  # fmt: skip
        assert cli.main(["generate", "Hi", *flags[:4]]) == 1  # no key
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        peer.link.close()
        gateway.stop()


def test_sighup_reloads_the_certificate_files(
    redis_url: str, ca: CertificateAuthority, tmp_path: Path
):
    first = ca.server()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(read(first.cert))
    key.write_bytes(read(first.key))
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(STORIES_260K), "--redis-url", redis_url,
         "--port", "0", "--metrics-port", "-1", "--tls-cert", str(cert), "--tls-key", str(key),
         "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        address = read_log_until(process, "gateway serving on").split()[3]
        assert health_status(address, client_credentials(ca.ca)) == "SERVING"
        renewed = CertificateAuthority(tmp_path / "renewed", "renewed CA")
        second = renewed.server()
        cert.write_bytes(read(second.cert))
        key.write_bytes(read(second.key))
        process.send_signal(signal.SIGHUP)
        read_log_until(process, "reloaded")
        assert health_status(address, client_credentials(renewed.ca)) == "SERVING"
        assert health_status(address, client_credentials(ca.ca)) == "UNAVAILABLE"
    finally:
        process.terminate()
        process.wait(30)


def read_log_until(process: subprocess.Popen, text: str) -> str:
    """The message of the first log line holding `text`."""
    for line in process.stderr:
        if text in line:
            return json.loads(line)["msg"]
    raise AssertionError(f"the process exited before logging {text!r}")


class Injector:
    """A peer of the TokenSink that sends tokens for a request it does not run."""

    def __init__(self, reply_to: str, credentials: SinkCredentials) -> None:
        self.events: queue.Queue = queue.Queue()
        self.link = GatewayLink(reply_to, "intruder", self.events.put, credentials)

    def inject(self, request_id: str) -> None:
        """Sends tokens as the start of a run (accepted), which the gateway takes from any
        authenticated peer while no executor runs the request."""
        entry = internal_pb2.RequestTokens(
            request_id=request_id,
            offset=0,
            token_ids=[7, 7, 7],
            accepted=True,
            finished=True,
            finish_reason=1,
        )
        self.link.send(internal_pb2.TokenBatch(requests=[entry]))

    def refused(self) -> bool:
        """Whether the gateway ended this peer's stream."""
        while not self.events.empty():
            if isinstance(self.events.get(), GatewayGone):
                return True
        return False


def sink_case(ca, stranger, tmp_path: Path, mode: str) -> tuple[dict, SinkCredentials, list]:
    """The gateway's TokenSink fields for `mode`, the real executor's credentials, and the
    intruders' credentials."""
    if mode == "mutual TLS":
        server, executor = ca.server("sink"), ca.client("executor-1")
        fields = {
            "internal_tls_cert": server.cert,
            "internal_tls_key": server.key,
            "internal_tls_client_ca": ca.ca,
            "internal_tls_allowed_names": "executor-0, executor-1",
        }
        tls = client_credentials(ca.ca, executor)
        intruders = [
            SinkCredentials(),
            SinkCredentials(client_credentials(ca.ca)),
            SinkCredentials(client_credentials(ca.ca, stranger.client("executor-1"))),
            # a client of the same CA that is not an executor (a tenant's, say)
            SinkCredentials(client_credentials(ca.ca, ca.client("acme"))),
        ]
        return fields, SinkCredentials(tls), intruders
    secret = tmp_path / "sink.secret"
    secret.write_text("a shared secret of the cluster\n")
    intruders = [SinkCredentials(), SinkCredentials(metadata=sink_metadata("a guess"))]
    fields = {"sink_secret_file": str(secret)}
    return (
        fields,
        SinkCredentials(metadata=sink_metadata("a shared secret of the cluster")),
        intruders,
    )


@pytest.mark.parametrize("mode", ["mutual TLS", "shared secret"])
def test_tokens_from_an_unauthenticated_peer_never_reach_a_client(
    redis_url: str, redis_client: redis.Redis, ca, stranger, tmp_path: Path, mode: str
):
    fields, executor_credentials, intruder_credentials = sink_case(ca, stranger, tmp_path, mode)
    gateway = GatewayThread(gateway_config(redis_url, **fields))
    peer = ExecutorPeer(redis_client, KEYS)
    peer.register()
    reply_to = gateway.gateway.reply_to
    try:
        call = gateway.stub.Generate(pb.GenerateRequest(prompt="Hi"), timeout=CALL_TIMEOUT_S)
        queued = peer.take_request()
        intruders = [Injector(reply_to, credentials) for credentials in intruder_credentials]
        for intruder in intruders:
            intruder.inject(queued.request_id)
        for index, intruder in enumerate(intruders):
            wait_for(intruder.refused, f"intruder {index} ({mode}) to be refused")
        peer.link = GatewayLink(reply_to, "e1", peer.events.put, executor_credentials)
        peer.send(queued.request_id, 0, [2, 3], finished=True, finish_reason=1)
        tokens = [t for chunk in call for t in chunk.token_ids]
        assert tokens == [2, 3], f"the client got {tokens}; intruders sent [7, 7, 7]"
    finally:
        if peer.link is not None:
            peer.link.close()
        gateway.stop()
