"""The security flags' checks, API key helpers, tenant limits and bounded tenant labels."""

from __future__ import annotations

import pytest

from client import admin
from client.api import TLSFiles
from common.tenants import (
    OTHER_TENANTS,
    TenantLimits,
    check_tenant,
    key_id_of,
    key_matches,
    key_record,
    new_api_key,
)
from common.tls import TLSFileError
from deploy.certs import CertificateAuthority
from engine.config import EngineConfig
from executor.config import ExecutorConfig
from executor.gateway_link import SinkCredentials
from gateway.accounting import TenantLabels
from gateway.config import GatewayConfig
from gateway.server import ListenError, PortSecurity
from tests.helpers import STORIES_260K


def gateway(**fields) -> GatewayConfig:
    return GatewayConfig(model=str(STORIES_260K), **fields)


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"auth": "maybe"}, "--auth"),
        ({"auth": "cert"}, "--auth cert needs --tls-client-ca"),
        ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key"),
        ({"tls_client_ca": "ca.pem"}, "--tls-client-ca needs --tls-cert"),
        ({"internal_tls_cert": "c.pem", "internal_tls_key": "k.pem"}, "--internal-tls-client-ca"),
        ({"internal_tls_allowed_names": "executor"}, "--internal-tls-allowed-names needs"),
        (
            {
                "internal_tls_allowed_names": " , ",
                "internal_tls_cert": "c.pem",
                "internal_tls_key": "k.pem",
                "internal_tls_client_ca": "ca.pem",
            },
            "--internal-tls-allowed-names: no name in",
        ),  # fmt: skip
        ({"auth_cache_s": 0}, "--auth-cache-s"),
        ({"metrics_max_tenants": -1}, "--metrics-max-tenants"),
    ],
)
def test_bad_security_flags_are_refused_naming_them(fields: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        gateway(**fields)


def test_an_executor_needs_the_ca_for_its_sink_certificate() -> None:
    engine = EngineConfig(model=str(STORIES_260K))
    with pytest.raises(ValueError, match="--sink-tls-ca"):
        ExecutorConfig(engine, sink_tls_cert="c.pem", sink_tls_key="k.pem")
    with pytest.raises(ValueError, match="--sink-tls-cert and --sink-tls-key"):
        ExecutorConfig(engine, sink_tls_ca="ca.pem", sink_tls_cert="c.pem")


def test_an_unreadable_certificate_stops_the_gateway_naming_its_flag(tmp_path) -> None:
    config = gateway(tls_cert=str(tmp_path / "none.pem"), tls_key=str(tmp_path / "none.key"))
    with pytest.raises(ListenError, match="--tls-key: cannot read"):
        PortSecurity.from_config(config)
    empty = tmp_path / "secret"
    empty.write_text("\n")
    with pytest.raises(ListenError, match="--sink-secret-file: .* is empty"):
        PortSecurity.from_config(gateway(sink_secret_file=str(empty)))


def test_a_key_that_is_not_the_certificates_stops_the_gateway_naming_both_flags(tmp_path):
    """A mismatched pair was reported by gRPC core as '--host/--port: cannot listen'."""
    ca = CertificateAuthority(tmp_path / "ca")
    server, other = ca.server(), ca.client("acme")
    config = gateway(tls_cert=server.cert, tls_key=other.key)
    with pytest.raises(ListenError, match="--tls-cert .* and --tls-key .* are not a certificate"):
        PortSecurity.from_config(config)
    with pytest.raises(TLSFileError, match="--sink-tls-cert .* and --sink-tls-key"):
        SinkCredentials.from_files(ca.ca, other.cert, server.key, "", "")
    assert SinkCredentials.from_files(ca.ca, other.cert, other.key, "", "").tls is not None


def test_api_keys_carry_their_id_and_match_only_their_hash() -> None:
    key_id, api_key = new_api_key()
    assert key_id_of(api_key) == key_id and len(api_key) == len("kvg__") + 12 + 43
    record = key_record("acme", api_key, 0)
    assert api_key not in record.values() and key_matches(api_key, record["sha256"])
    _, other = new_api_key()
    assert not key_matches(other, record["sha256"])
    for malformed in ("", "kvg_", f"{api_key}x", api_key.replace("kvg_", "sk_"), "Bearer x"):
        assert key_id_of(malformed) is None, malformed


def test_tenant_names_and_limits_round_trip() -> None:
    assert check_tenant("--tenant", "team-a.prod_1") == "team-a.prod_1"
    for bad in ("", "_other", "a:b", "a b", "x" * 65):
        with pytest.raises(ValueError, match="--tenant"):
            check_tenant("--tenant", bad)
    limits = TenantLimits(requests_per_s=2.5, tokens_per_min=600, max_streams=3, max_priority=0)
    stored = {k.encode(): v.encode() for k, v in limits.to_redis().items()}
    assert TenantLimits.from_redis(stored) == limits
    assert TenantLimits().unlimited and TenantLimits().to_redis() == {}
    with pytest.raises(ValueError, match="--tokens-per-min"):
        TenantLimits(tokens_per_min=-1)
    for value in (float("nan"), float("inf")):  # NaN was stored, and read as no limit at all
        with pytest.raises(ValueError, match="--requests-per-s must be a finite number"):
            TenantLimits(requests_per_s=value)


def test_tenant_labels_are_bounded() -> None:
    label = TenantLabels(max_tenants=2)
    assert [label(t) for t in ("a", "b", "c", "a", "d")] == [
        "a",
        "b",
        OTHER_TENANTS,
        "a",
        OTHER_TENANTS,
    ]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["usage", "--days", "0"], "--days"),
        (["usage", "--days", "-3"], "--days"),
        (["usage", "--days", "nan"], "--days"),
        (["usage", "--days", "401"], "--days"),
        (["usage", "--days", "99999999999999999999"], "--days"),
        (["limits", "set", "--tenant", "a", "--requests-per-s", "x"], "--requests-per-s"),
        (["limits", "set", "--tenant", "a", "--tokens-per-min", "1e3"], "--tokens-per-min"),
        (["limits", "set", "--tenant", "a", "--max-priority", "nan"], "--max-priority"),
        (["keys", "create", "--tenant", "_x"], "--tenant"),
        (["keys", "revoke", ""], "key"),
        (["keys", "revoke", "kvg_0123456789ab_short"], "key"),
    ],
)
def test_admin_refuses_a_bad_flag_naming_it(argv: list[str], flag: str, capsys) -> None:
    # Refused while parsing, before Redis is reached: the URL below has no server behind it.
    with pytest.raises(SystemExit) as exited:
        admin.main(["--redis-url", "redis://127.0.0.1:1/0", *argv])
    assert exited.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_tenant_limits_refuse_what_redis_or_a_reply_cannot_hold() -> None:
    for name, value in [
        ("requests_per_s", 1e300),  # finite, but beyond what the buckets count exactly
        ("tokens_per_min", 2**53 + 1),
        ("max_streams", 10**30),
    ]:
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be"):
            TenantLimits(**{name: value})
    for priority in (2**31, -(2**31) - 1):  # a reply's priority is int32: every call would fail
        with pytest.raises(ValueError, match="--max-priority must be"):
            TenantLimits(max_priority=priority)
    assert TenantLimits(max_streams=2**53, max_priority=-(2**31)).max_streams == 2**53
    assert admin.build_parser().parse_args(["usage", "--days", "400"]).days == 400


def test_a_client_names_the_flag_of_a_bad_certificate_file(tmp_path) -> None:
    """gRPC core reported these as UNAVAILABLE 'Failed to create security handshaker'."""
    ca = CertificateAuthority(tmp_path / "ca")
    mine, other = ca.client("acme"), ca.client("globex")
    with pytest.raises(ValueError, match="--tls-cert .* and --tls-key .* are not a certificate"):
        TLSFiles(ca=ca.ca, cert=mine.cert, key=other.key).credentials()
    with pytest.raises(ValueError, match="--tls-ca .* holds no PEM certificate"):
        TLSFiles(ca=mine.key, cert=mine.cert, key=mine.key).credentials()
    with pytest.raises(ValueError, match="--tls-ca: cannot read"):
        TLSFiles(ca=str(tmp_path / "none.pem")).credentials()
    assert TLSFiles(ca=ca.ca, cert=mine.cert, key=mine.key).credentials() is not None
