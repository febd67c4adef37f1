"""Redis URLs, read without redis-py: redis://, rediss://, unix:// (redis-py's own forms) and,
for Redis Sentinel,

    redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]

(the sentinels' addresses and the name they know the master by; the password is the
master's). Flags are checked with these at start by every process, the engine's too, which
imports no Redis (common/redis_conn.py builds the clients).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

SENTINEL_SCHEME = "redis+sentinel"
URL_SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A parsed redis+sentinel:// URL."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Raises: ValueError saying what is wrong with the URL."""
    form = f"{SENTINEL_SCHEME}://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]"
    prefix = f"{SENTINEL_SCHEME}://"
    if not url.startswith(prefix):
        raise ValueError(f"expected {form}, got {url!r}")
    netloc, _, path = url[len(prefix) :].partition("/")
    auth, _, hosts = netloc.rpartition("@")
    username, _, password = auth.partition(":") if ":" in auth else ("", "", auth)
    sentinels = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel address {address!r} is not HOST:PORT; expected {form}")
        sentinels.append((host.strip("[]"), int(port)))
    master_name, _, db = path.partition("/")
    if not master_name:
        raise ValueError(f"no master name in {url!r}; expected {form}")
    if db and not db.isdigit():
        raise ValueError(f"database {db!r} of {url!r} is not a number; expected {form}")
    return SentinelUrl(
        tuple(sentinels),
        unquote(master_name),
        int(db or 0),
        unquote(username) or None,
        unquote(password) or None,
    )


def check_url(url: str) -> None:
    """Raises: ValueError unless `url` is one of URL_SCHEMES' forms."""
    scheme = url.partition("://")[0]
    if scheme not in URL_SCHEMES:
        raise ValueError(
            f"must be a redis://, rediss://, unix:// or {SENTINEL_SCHEME}:// URL, got {url!r}"
        )
    if scheme == SENTINEL_SCHEME:
        parse_sentinel_url(url)
