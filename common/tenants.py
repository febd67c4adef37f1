"""Tenants, API keys, quotas and usage as stored in Redis: the records that `kvgate admin`
writes and the gateways read (docs/security.md).

An API key is `kvg_<key id>_<secret>`: the key id (12 hex characters) names its record, the
secret is 32 random bytes. Redis keeps the record under RedisKeys.api_key(key id): the tenant,
the SHA-256 of the whole key, and when it was made; never the key itself. A plain SHA-256 is
enough because the key is random: there is no dictionary to try and nothing to salt against,
unlike a password, and a gateway can check a key in a microsecond on every call.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import math
import re
import secrets
from dataclasses import dataclass, fields

KEY_PREFIX = "kvg"
KEY_ID_BYTES = 6
SECRET_BYTES = 32
KEY_PATTERN = re.compile(r"kvg_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
# A tenant name starts with a letter or digit, so that no tenant is named like OTHER_TENANTS.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The tenant of every caller while auth is off.
DEFAULT_TENANT = "default"
# The metric label of the tenants past a gateway's --metrics-max-tenants.
OTHER_TENANTS = "_other"
# Fields of an API key's hash in Redis.
KEY_TENANT_FIELD = "tenant"
KEY_SHA256_FIELD = "sha256"
KEY_CREATED_FIELD = "created_unix_ms"
# Counters of a tenant's usage hash (RedisKeys.tenant_usage), in the order reports show them.
USAGE_FIELDS = ("requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens")
# Days a usage hash is kept.
USAGE_TTL_DAYS = 400
# The largest limit stored: Redis's Lua counts in doubles, exact up to 2**53 (a larger limit
# would be no limit in effect, or lose its units in the buckets' arithmetic).
MAX_LIMIT = 2**53
# max_priority travels in the replies' int32 `priority` field.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def check_tenant(flag: str, tenant: str) -> str:
    """Returns: `tenant` when it is 1-64 characters of A-Z a-z 0-9 . _ -, the first a letter
    or digit.

    Raises:
        ValueError: naming `flag` otherwise.
    """
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(
            f"{flag} must be 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter or "
            f"digit, got {tenant!r}"
        )
    return tenant


def new_api_key() -> tuple[str, str]:
    """Returns: a new key's id and the whole key (shown once, stored only as its hash)."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    return key_id, f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(SECRET_BYTES)}"


def key_id_of(api_key: str) -> str | None:
    """Returns: the id of a well-formed API key, None for anything else."""
    match = KEY_PATTERN.fullmatch(api_key)
    return match.group(1) if match else None


def key_sha256(api_key: str) -> str:
    """Returns: the hex SHA-256 of the whole key, as stored."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_matches(api_key: str, stored_sha256: str) -> bool:
    """Whether `api_key` is the key whose SHA-256 was stored (compared in constant time)."""
    return hmac.compare_digest(key_sha256(api_key), stored_sha256)


def key_record(tenant: str, api_key: str, created_unix_ms: int) -> dict[str, str]:
    """Returns: the fields of a new key's hash."""
    return {
        KEY_TENANT_FIELD: tenant,
        KEY_SHA256_FIELD: key_sha256(api_key),
        KEY_CREATED_FIELD: str(created_unix_ms),
    }


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's quotas; 0 (or None for max_priority) is no limit."""

    requests_per_s: float = 0.0  # Generate calls and Chat turns; bursts of one second's worth
    tokens_per_min: int = 0  # generated tokens; bursts of one minute's worth
    max_streams: int = 0  # Generate and Chat calls open at once, over every gateway
    max_priority: int | None = None  # the most urgent (lowest) priority it may ask for

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_min", "max_streams"):
            value = getattr(self, name)
            if not math.isfinite(value) or not 0 <= value <= MAX_LIMIT:  # NaN meant no limit
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} must be a finite number from 0 to {MAX_LIMIT}, got {value}"
                )
        low, high = PRIORITY_RANGE
        if self.max_priority is not None and not low <= self.max_priority <= high:
            raise ValueError(
                f"--max-priority must be from {low} to {high} (a reply's int32 priority), "
                f"got {self.max_priority}"
            )

    @property
    def rated(self) -> bool:
        """Whether a token bucket applies (the quota script has work to do)."""
        return self.requests_per_s > 0 or self.tokens_per_min > 0

    @property
    def unlimited(self) -> bool:
        return not self.rated and self.max_streams == 0 and self.max_priority is None

    def set_limits(self) -> dict[str, float | int]:
        """Returns: the limits that are set, by field name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unset = {name: 0 for name in values} | {"max_priority": None}
        return {name: value for name, value in values.items() if value != unset[name]}

    def to_redis(self) -> dict[str, str]:
        """Returns: the fields of the limits hash (no field for an unset limit)."""
        return {name: str(value) for name, value in self.set_limits().items()}

    @classmethod
    def from_redis(cls, stored: dict[bytes, bytes]) -> TenantLimits:
        """The limits of a hash as read from Redis (unknown fields are ignored)."""
        values = {k.decode(): v.decode() for k, v in stored.items()}
        return cls(
            requests_per_s=float(values.get("requests_per_s", 0)),
            tokens_per_min=int(values.get("tokens_per_min", 0)),
            max_streams=int(values.get("max_streams", 0)),
            max_priority=int(values["max_priority"]) if "max_priority" in values else None,
        )


def utc_day(unix_s: float) -> str:
    """Returns: the UTC day (YYYY-MM-DD) of a Unix time, the suffix of usage keys."""
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%d")
