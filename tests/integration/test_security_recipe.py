"""docs/security.md's certificate recipe, run as the page has it (with `sh`, in an empty
folder), and a stack served with the files it makes: mutual TLS on the public port (the
tenant named by the client's certificate), on the TokenSink (executors only) and to Redis."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis

from client.api import KvgateClient, TLSFiles
from deploy.certs import Pem
from deploy.stack import RedisSecurity, free_port
from executor.gateway_link import GatewayGone, GatewayLink, SinkCredentials
from tests.helpers import wait_for
from tests.integration.conftest import start_stack, tls_flags

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
REDIS_PASSWORD = "recipe-pass-51c0"  # noqa: S105 (a test's own Redis)


def certificate_recipe() -> str:
    """The page's one `sh` block that makes a CA (`openssl req -x509`)."""
    blocks = re.findall(r"^```sh\n(.*?)^```", DOC.read_text(), re.S | re.M)
    recipes = [block for block in blocks if "openssl req -x509" in block]
    assert len(recipes) == 1, f"{DOC.name} should have one certificate recipe, has {len(recipes)}"
    return recipes[0]


def assert_the_sink_refuses(sink: str, ca: str, client: Pem) -> None:
    """The TokenSink at `sink` ends the stream of a peer presenting `client`."""
    events: list = []
    credentials = grpc.ssl_channel_credentials(
        Path(ca).read_bytes(), Path(client.key).read_bytes(), Path(client.cert).read_bytes()
    )
    link = GatewayLink(sink, "intruder", events.append, SinkCredentials(credentials))
    try:
        gone = lambda: any(isinstance(event, GatewayGone) for event in events)  # noqa: E731
        wait_for(gone, f"the TokenSink to refuse {Path(client.cert).name}")
    finally:
        link.close()


def test_the_certificate_recipe_serves_mutual_tls_on_every_hop(tmp_path: Path) -> None:
    folder = tmp_path / "recipe"
    folder.mkdir()
    made = subprocess.run(
        ["sh", "-eu"], input=certificate_recipe(), cwd=folder, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, f"the recipe failed:\n{made.stderr[-3000:]}"

    def pem(name: str) -> str:
        return str(folder / name)

    def pair(name: str) -> Pem:
        return Pem(pem(f"{name}.pem"), pem(f"{name}.key"))

    redis_tls, processes = pair("redis"), pair("kvgate")
    security = RedisSecurity(
        pem("kvgate-ca.pem"), redis_tls.cert, redis_tls.key, password=REDIS_PASSWORD,
        acl_file=str(tmp_path / "users.acl"), client_cert=processes.cert,
        client_key=processes.key,
    )  # fmt: skip
    flags = tls_flags(pem("kvgate-ca.pem"), pair("gateway"), pair("sink"), pair("executor"))
    sink = f"127.0.0.1:{free_port()}"
    flags["gateway_flags"] += [
        "--tls-client-ca", pem("tenants-ca.pem"), "--internal-tls-allowed-names", "executor",
        "--internal-host", "127.0.0.1", "--internal-port", sink.split(":")[1],
    ]  # fmt: skip
    stack = start_stack(tmp_path / "logs", auth="cert", redis_security=security, **flags)
    try:
        acme = TLSFiles(pem("kvgate-ca.pem"), pem("acme.pem"), pem("acme.key"))
        with KvgateClient(stack.address, 60.0, tls=acme) as client:
            completion = client.generate("Once upon a time", max_tokens=3, temperature=0)
        assert completion.finish_reason == "length" and len(completion.token_ids) == 3
        port = stack.metrics_ports["gateway"]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b'tenant="acme"' in metrics, "the client certificate's CN did not name the tenant"

        for name in ("acme", "gateway", "kvgate"):  # a tenant's, a server's, Redis's client
            assert_the_sink_refuses(sink, pem("kvgate-ca.pem"), pair(name))
        with KvgateClient(stack.address, 10.0, tls=TLSFiles(pem("kvgate-ca.pem"))) as client:
            with pytest.raises(grpc.RpcError):  # the public port asks for a certificate
                client.model_info()
        without_certificate = stack.redis_url.split("&ssl_certfile=")[0]
        with pytest.raises(redis.ConnectionError):  # and so does Redis
            redis.Redis.from_url(without_certificate, socket_timeout=5).ping()
    finally:
        stack.stop_all()
