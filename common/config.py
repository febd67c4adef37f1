"""Helpers for the per-process config dataclasses: env defaults, common flags, validation.

Each process declares one `@dataclass(slots=True)` config, fills it from
argparse flags whose defaults come from `KVGATE_*` environment variables, and
validates it in `__post_init__` with the helpers here (a ValueError naming the
flag and the allowed values).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from urllib.parse import urlparse

from common.model_files import default_model
from common.redis_url import check_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# --model of gateway and executor: SmolLM2 (GGUF) when `make setup` has cached it, else
# stories260K; read once, when the process starts.
DEFAULT_MODEL = default_model()
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def env_str(name: str, default: str) -> str:
    """The environment variable `name`, or `default` when unset."""
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    """The environment variable `name` as an int, or `default` when unset.

    Raises:
        ValueError: naming the variable when it is set but not an integer.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    """The environment variable `name` as a float, or `default` when unset.

    Raises:
        ValueError: naming the variable when it is set but not a number.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be a number, got {raw!r}") from None


def env_bool(name: str, default: bool) -> bool:
    """The environment variable `name` as a bool (1/true/yes/on, 0/false/no/off), or `default`."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"environment variable {name} must be true or false, got {raw!r}")


def check_range(
    flag: str, value: float, *, min_value: float | None = None, max_value: float | None = None
) -> None:
    """Raise a ValueError naming `flag` unless value is finite and min_value <= value <=
    max_value (NaN passes every comparison's negation, and would turn a bound off)."""
    check_finite(flag, value)
    if (min_value is not None and value < min_value) or (
        max_value is not None and value > max_value
    ):
        low = "-inf" if min_value is None else min_value
        high = "inf" if max_value is None else max_value
        raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")


def check_finite(flag: str, value: float) -> None:
    """Raise a ValueError naming `flag` unless value is a finite number (not NaN or inf)."""
    if not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, got {value}")


def check_positive(flag: str, value: float) -> None:
    """Raise a ValueError naming `flag` unless value is finite and > 0."""
    check_finite(flag, value)
    if value <= 0:
        raise ValueError(f"{flag} must be > 0, got {value}")


def check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming `flag` unless value is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


def redacted_url(url: str) -> str:
    """`url` with its password (in the address or a password= query) replaced by ***, fit
    for a log line or a message."""
    parsed = urlparse(url)
    netloc = parsed.netloc
    if parsed.password is not None:
        netloc = f"{parsed.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = re.sub(r"(^|&)password=[^&]*", r"\1password=***", parsed.query)
    if (netloc, query) == (parsed.netloc, parsed.query):
        return url
    return parsed._replace(netloc=netloc, query=query).geturl()


def check_redis_url(flag: str, url: str) -> None:
    """Raise a ValueError naming `flag` unless `url` is a redis://, rediss://, unix:// or
    redis+sentinel:// URL (common.redis_conn; the message shows the URL without its
    password)."""
    try:
        check_url(url)
    except ValueError as error:
        raise ValueError(f"{flag} {error}".replace(url, redacted_url(url))) from None


def check_host_port(flag: str, address: str) -> None:
    """Raise a ValueError naming `flag` unless `address` is HOST:PORT with a valid port."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags every process shares: Redis URL and key prefix, log level and format."""
    parser.add_argument(
        "--redis-url",
        default=env_str("KVGATE_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL: redis://, rediss://, unix://, or "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB] (env KVGATE_REDIS_URL)",
    )
    parser.add_argument(
        "--redis-prefix",
        default=env_str("KVGATE_REDIS_PREFIX", "kvgate:"),
        help="prefix of every Redis key (env KVGATE_REDIS_PREFIX)",
    )
    parser.add_argument(
        "--log-level",
        default=env_str("KVGATE_LOG_LEVEL", "info"),
        help=f"one of {', '.join(LOG_LEVELS)} (env KVGATE_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        default=env_str("KVGATE_LOG_FORMAT", "json"),
        help="json lines (default) or text for people (env KVGATE_LOG_FORMAT)",
    )


def check_common_fields(redis_url: str, log_level: str, log_format: str) -> None:
    """Validate the values of the flags added by add_common_flags."""
    check_redis_url("--redis-url", redis_url)
    check_choice("--log-level", log_level, LOG_LEVELS)
    check_choice("--log-format", log_format, LOG_FORMATS)
