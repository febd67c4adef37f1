"""A local stack with every defence on, for the benchmarks that weigh them: API keys and
quotas on the gateway, TLS on its public port, mutual TLS on the TokenSink, and Redis
serving TLS only to an ACL user. Certificates are made for the run (tests/certs.py) in its
scratch folder.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc

from client.admin import create_key, set_limits
from deploy.stack import RedisSecurity, Stack, StackConfig
from tests.certs import CertificateAuthority

# Limits far above what a benchmark sends: the quota script runs on every request, and
# never refuses one.
GENEROUS = {"requests_per_s": 10_000.0, "tokens_per_min": 100_000_000, "max_streams": 10_000}


@dataclass(frozen=True, slots=True)
class SecureAccess:
    """What a client of the secured stack needs."""

    ca: str  # the CA of the gateway's certificate

    def channel(self, address: str) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(Path(self.ca).read_bytes())
        return grpc.secure_channel(address, credentials)


def secure_config(config: StackConfig, folder: Path) -> tuple[StackConfig, SecureAccess]:
    """`config` with keys, TLS and mutual TLS on, its Redis on TLS with an ACL user."""
    ca = CertificateAuthority(folder / "ca")
    server, sink, executor, redis_server = (
        ca.server(),
        ca.server("sink"),
        ca.client("executor"),
        ca.server("redis"),
    )
    config.auth = "keys"
    config.redis_security = RedisSecurity(
        ca.ca,
        redis_server.cert,
        redis_server.key,
        password=secrets.token_urlsafe(16),
        acl_file=str(folder / "users.acl"),
    )
    config.gateway_flags = [
        *config.gateway_flags,
        *("--tls-cert", server.cert, "--tls-key", server.key),
        *("--internal-tls-cert", sink.cert, "--internal-tls-key", sink.key),
        *("--internal-tls-client-ca", ca.ca),
    ]
    config.executor_flags = [
        *config.executor_flags,
        *("--sink-tls-ca", ca.ca, "--sink-tls-cert", executor.cert),
        *("--sink-tls-key", executor.key),
    ]
    return config, SecureAccess(ca.ca)


def tenant_key(stack: Stack, tenant: str, limits: dict[str, object] | None = None) -> str:
    """A new API key of `tenant` on the stack's Redis, with `limits` (default GENEROUS)."""
    client = stack.redis()
    set_limits(client, stack.keys, tenant, GENEROUS if limits is None else limits, print_nothing)
    return create_key(client, stack.keys, tenant, print_nothing)


def key_metadata(api_key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {api_key}"),)


def print_nothing(_: str) -> None:
    """A `say` for kvgate admin's functions that keeps the new key off the output."""
