"""The flags of a connection to a gateway (--target, --api-key, the TLS files), shared by the
`kvgate` command and the benchmarks that load a gateway (bench/ imports these, never the
command module, which loads bench.cli by name: no circle at run time)."""

from __future__ import annotations

import argparse
import os

from client.api import Credentials, KvgateClient, TLSFiles, default_target


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """--target, the API key and the TLS files: how to reach a gateway."""
    parser.add_argument("--target", default=default_target(), help="gateway HOST:PORT")
    add_credential_flags(parser)


def add_credential_flags(parser: argparse.ArgumentParser) -> None:
    """--api-key and the TLS files."""
    add = parser.add_argument
    add(
        "--api-key",
        default=os.environ.get("KVGATE_API_KEY", ""),
        help="API key (env KVGATE_API_KEY, which keeps it out of the process list)",
    )
    add("--tls", action="store_true", help="TLS, the gateway verified by the system's roots")
    add("--tls-ca", default="", help="TLS, the gateway's certificate signed by this CA")
    add("--tls-cert", default="", help="this client's certificate (mutual TLS)")
    add("--tls-key", default="", help="the key of --tls-cert")


def credentials_from_args(args: argparse.Namespace) -> Credentials:
    """The credentials the flags of add_credential_flags ask for."""
    use_tls = args.tls or args.tls_ca or args.tls_cert
    tls = TLSFiles(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None
    return Credentials(args.api_key, tls)


def client_from_args(args: argparse.Namespace, timeout_s: float | None = None) -> KvgateClient:
    """The client the connection flags ask for. Raises: ValueError naming a flag."""
    return credentials_from_args(args).client(args.target, timeout_s)
