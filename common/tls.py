"""TLS for kvgate's gRPC ports: server credentials reloaded from their files on demand
(SIGHUP), client credentials, and the TokenSink's shared secret.

Files are read when a server starts or reloads; a missing or unreadable file is a
TLSFileError naming its flag. A reload that fails keeps the certificates in use and says why.
"""

from __future__ import annotations

import hmac
import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


class TLSFileError(Exception):
    """A certificate, key or secret file cannot be read; the message names its flag."""


def read_file(flag: str, path: str) -> bytes:
    """Returns: the bytes of `path`. Raises: TLSFileError naming `flag`."""
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TLSFileError(f"{flag}: cannot read {path} ({error.strerror})") from None


def check_key_pair(flag_prefix: str, cert: str, key: str) -> None:
    """Raise TLSFileError naming both flags unless `cert` is a PEM certificate (chain) and
    `key` its private key. gRPC core only finds out when a port binds or a handshake runs, and
    reports it as something else (a server that "cannot listen", a client that never connects)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # an encrypted key: refused
    except ssl.SSLError as error:
        raise TLSFileError(
            f"{flag_prefix}-cert {cert} and {flag_prefix}-key {key} are not a certificate and "
            f"its private key ({error.reason or error})"
        ) from None


def check_ca(flag: str, path: str) -> None:
    """Raise TLSFileError naming `flag` unless `path` holds PEM certificates to verify peers
    with (gRPC core would only fail every handshake, saying nothing of the file)."""
    read_file(flag, path)  # a missing file is named as such first
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as error:
        raise TLSFileError(
            f"{flag} {path} holds no PEM certificate to verify with ({error.reason or error})"
        ) from None


def check_tls_flags(prefix: str, cert: str, key: str, client_ca: str = "") -> None:
    """Raise a ValueError naming the flags unless cert and key come together (and a client
    CA only with them). `prefix` is the flags' common start: "--tls" or "--internal-tls"."""
    if bool(cert) != bool(key):
        raise ValueError(f"{prefix}-cert and {prefix}-key must be given together")
    if client_ca and not cert:
        raise ValueError(f"{prefix}-client-ca needs {prefix}-cert and {prefix}-key")


@dataclass(frozen=True, slots=True)
class ServerTLSFiles:
    """The files of a TLS server port; client_ca set: clients must present a certificate."""

    flag_prefix: str  # "--tls" or "--internal-tls", for messages
    cert: str
    key: str
    client_ca: str = ""

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """Reads the files. Raises: TLSFileError naming the flag of a file it cannot read."""
        p = self.flag_prefix
        pair = (read_file(f"{p}-key", self.key), read_file(f"{p}-cert", self.cert))
        check_key_pair(p, self.cert, self.key)
        root = read_file(f"{p}-client-ca", self.client_ca) if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([pair], root)


class ReloadableServerCredentials:
    """Server credentials whose certificates are read again by `reload()`: connections made
    after it get the new ones; connections already open keep theirs."""

    def __init__(self, files: ServerTLSFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        initial = files.configuration()
        self.credentials = grpc.dynamic_ssl_server_credentials(
            initial, self._fetch, require_client_authentication=bool(files.client_ca)
        )

    def reload(self) -> bool:
        """Read the files again. Returns: whether they were read (else the old ones stay)."""
        try:
            configuration = self.files.configuration()
        except TLSFileError as error:
            log.error("TLS reload failed, the certificates in use stay: %s", error)
            return False
        with self._lock:
            self._pending = configuration
        log.info("TLS certificates of %s-cert reloaded", self.files.flag_prefix)
        return True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks before each handshake: the new configuration once, else None (keep)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending


def channel_credentials(
    ca: str, cert: str = "", key: str = "", flag_prefix: str = "--tls"
) -> grpc.ChannelCredentials:
    """Client TLS credentials: `ca` verifies the server (empty: the system's roots); cert and
    key, when given, are the client's certificate for mutual TLS."""
    if ca:
        check_ca(f"{flag_prefix}-ca", ca)
    if cert and key:
        read_file(f"{flag_prefix}-cert", cert)  # a missing file is named as such first
        read_file(f"{flag_prefix}-key", key)
        check_key_pair(flag_prefix, cert, key)
    return grpc.ssl_channel_credentials(
        read_file(f"{flag_prefix}-ca", ca) if ca else None,
        read_file(f"{flag_prefix}-key", key) if key else None,
        read_file(f"{flag_prefix}-cert", cert) if cert else None,
    )


def read_secret(flag: str, path: str) -> str:
    """The shared secret in `path` (surrounding whitespace dropped). Raises: TLSFileError
    naming `flag` when it cannot be read or is empty."""
    secret = read_file(flag, path).decode(errors="replace").strip()
    if not secret:
        raise TLSFileError(f"{flag}: {path} is empty")
    return secret


# Metadata of a TokenSink call that carries the shared secret: "Bearer <secret>".
SINK_SECRET_KEY = "authorization"


def sink_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata an executor sends on its TokenSink calls (none without a secret)."""
    return ((SINK_SECRET_KEY, f"Bearer {secret}"),) if secret else ()


def secret_matches(presented: str, secret: str) -> bool:
    """Whether `presented` is the secret, compared in constant time."""
    return hmac.compare_digest(presented.encode(), secret.encode())
