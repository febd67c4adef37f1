"""`kvgate admin`: API keys, tenant limits and usage, read and written in Redis directly.

kvgate admin keys create --tenant acme        prints the new key, once
kvgate admin keys list [--tenant acme]
kvgate admin keys revoke KEY_ID               gateways refuse it within --auth-cache-s
kvgate admin limits set --tenant acme --requests-per-s 5 --tokens-per-min 20000 \\
    --max-streams 8 --max-priority 0
kvgate admin limits show --tenant acme | limits clear --tenant acme
kvgate admin usage [--tenant acme] [--days 30] [--json]
kvgate admin drain EXECUTOR_ID [--wait-s 60]  it moves its streams and sessions to peers, exits

An operator's tool: it needs the Redis URL (and its password) that the gateways use, not a
gateway address. It imports no server code: the records are those of common/tenants.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable

import redis

from common.config import DEFAULT_REDIS_URL, check_redis_url, env_str, redacted_url
from common.keys import PAYLOAD_FIELD, RedisKeys
from common.tenants import (
    KEY_CREATED_FIELD,
    KEY_TENANT_FIELD,
    USAGE_FIELDS,
    USAGE_TTL_DAYS,
    TenantLimits,
    check_tenant,
    key_id_of,
    key_record,
    new_api_key,
    utc_day,
)
from protos.kvgate.v1 import internal_pb2

Say = Callable[[str], None]


def _tenant(text: str) -> str:
    try:
        return check_tenant("--tenant", text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--tenant ")) from None


def _priority(text: str) -> int | None:
    if text == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or none, got {text!r}") from None


def _key_id(text: str) -> str:
    """A key id (12 hex characters), or the id of a whole key (never echoed back)."""
    key_id = key_id_of(text) or text
    if not re.fullmatch(r"[0-9a-f]{12}", key_id):
        raise argparse.ArgumentTypeError(
            "must be a key id (12 hex characters, as `keys list` shows) or a whole key"
        )
    return key_id


def _days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        days = 0
    if not 1 <= days <= USAGE_TTL_DAYS:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of days from 1 to {USAGE_TTL_DAYS} (usage is kept "
            f"{USAGE_TTL_DAYS} days), got {text!r}"
        )
    return days


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate admin", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--redis-url",
        default=env_str("KVGATE_REDIS_URL", DEFAULT_REDIS_URL),
        help="env KVGATE_REDIS_URL",
    )
    parser.add_argument("--redis-prefix", default=env_str("KVGATE_REDIS_PREFIX", "kvgate:"))
    areas = parser.add_subparsers(dest="area", required=True)
    keys = areas.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    keys.add_parser("create", help="make a key (printed once)").add_argument(
        "--tenant", type=_tenant, required=True
    )
    keys.add_parser("list", help="key ids, tenants, creation times").add_argument(
        "--tenant", type=_tenant
    )
    keys.add_parser("revoke", help="delete a key").add_argument(
        "key", type=_key_id, help="key id or the key"
    )
    limits = areas.add_parser("limits", help="a tenant's quotas")
    actions = limits.add_subparsers(dest="action", required=True)
    set_limits = actions.add_parser("set", help="set some limits (0: no limit)")
    set_limits.add_argument("--tenant", type=_tenant, required=True)
    unchanged = argparse.SUPPRESS  # a limit not given keeps its value
    set_limits.add_argument("--requests-per-s", type=float, default=unchanged)
    set_limits.add_argument("--tokens-per-min", type=int, default=unchanged)
    set_limits.add_argument("--max-streams", type=int, default=unchanged)
    set_limits.add_argument(
        "--max-priority", type=_priority, default=unchanged, help="an integer, or none"
    )
    for action in ("show", "clear"):
        actions.add_parser(action).add_argument("--tenant", type=_tenant, required=True)
    usage = areas.add_parser("usage", help="requests and tokens by tenant and day (UTC)")
    usage.add_argument("--tenant", type=_tenant)
    usage.add_argument("--days", type=_days, default=30, help="the last N days, today included")
    usage.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    drain = areas.add_parser("drain", help="drain an executor (as SIGTERM does), by its id")
    drain.add_argument("executor_id", help="the id its heartbeat carries (--executor-id)")
    drain.add_argument(
        "--wait-s", type=float, default=0.0, help="wait this long for it to exit (0: do not)"
    )
    return parser


def drain_executor(
    client: redis.Redis, keys: RedisKeys, executor_id: str, wait_s: float, say: Say
) -> bool:
    """Ask a live executor to drain, through its inbox; with `wait_s`, wait for it to exit.

    Returns: whether it was asked (and, with `wait_s`, has exited)."""
    if client.get(keys.executor_status(executor_id)) is None:
        say(f"no live executor {executor_id!r}: its heartbeat is not in redis")
        return False
    message = internal_pb2.InboxMessage(
        drain=internal_pb2.DrainExecutor(requested_by="kvgate admin drain")
    )
    client.xadd(keys.executor_inbox(executor_id), {PAYLOAD_FIELD: message.SerializeToString()})
    say(f"executor {executor_id}: drain asked for (its streams and sessions move to its peers)")
    if wait_s <= 0:
        return True
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if client.get(keys.executor_status(executor_id)) is None:
            say(f"executor {executor_id}: drained and gone")
            return True
        time.sleep(0.2)
    say(f"executor {executor_id}: still draining after {wait_s:g} s")
    return False


def create_key(client: redis.Redis, keys: RedisKeys, tenant: str, say: Say) -> str:
    """Store a new key of `tenant` (its hash only). Returns: the key."""
    key_id, api_key = new_api_key()
    with client.pipeline() as pipe:
        pipe.hset(
            keys.api_key(key_id), mapping=key_record(tenant, api_key, int(time.time() * 1000))
        )
        pipe.sadd(keys.api_key_ids, key_id)
        pipe.execute()
    say(f"key {key_id} of tenant {tenant} (shown once; store it now):\n{api_key}")
    return api_key


def list_keys(client: redis.Redis, keys: RedisKeys, tenant: str | None, say: Say) -> None:
    key_ids = sorted(k.decode() for k in client.smembers(keys.api_key_ids))
    with client.pipeline(transaction=False) as pipe:
        for key_id in key_ids:
            pipe.hgetall(keys.api_key(key_id))
        records = pipe.execute()
    say(f"{'key id':<14}{'tenant':<24}created (UTC)")
    for key_id, record in zip(key_ids, records, strict=True):
        owner = record.get(KEY_TENANT_FIELD.encode(), b"?").decode()
        if tenant is None or owner == tenant:
            created_s = int(record.get(KEY_CREATED_FIELD.encode(), b"0")) / 1000
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(created_s))
            say(f"{key_id:<14}{owner:<24}{when}")


def revoke_key(client: redis.Redis, keys: RedisKeys, key: str, say: Say) -> bool:
    """Delete a key by its id (or the whole key). Returns: whether it existed."""
    key_id = key_id_of(key) or key
    tenant = client.hget(keys.api_key(key_id), KEY_TENANT_FIELD)
    with client.pipeline() as pipe:
        pipe.delete(keys.api_key(key_id))
        pipe.srem(keys.api_key_ids, key_id)
        pipe.execute()
    if tenant is None:
        say(f"no key {key_id}")
        return False
    say(f"revoked key {key_id} of tenant {tenant.decode()}")
    return True


def read_limits(client: redis.Redis, keys: RedisKeys, tenant: str) -> TenantLimits:
    return TenantLimits.from_redis(client.hgetall(keys.tenant_limits(tenant)))


def set_limits(
    client: redis.Redis, keys: RedisKeys, tenant: str, changes: dict[str, object], say: Say
) -> TenantLimits:
    """Change the given limits of a tenant (the others stay). Returns: its limits now."""
    current = read_limits(client, keys, tenant)
    limits = TenantLimits(**{**_limit_fields(current), **changes})
    with client.pipeline() as pipe:
        pipe.delete(keys.tenant_limits(tenant))
        if not limits.unlimited:
            pipe.hset(keys.tenant_limits(tenant), mapping=limits.to_redis())
        pipe.execute()
    say(f"tenant {tenant}: {_describe(limits)}")
    return limits


def _limit_fields(limits: TenantLimits) -> dict[str, object]:
    return {name: getattr(limits, name) for name in TenantLimits.__slots__}


def _describe(limits: TenantLimits) -> str:
    if limits.unlimited:
        return "no limits"
    return ", ".join(f"{k} {v}" for k, v in limits.set_limits().items())


def usage_report(
    client: redis.Redis, keys: RedisKeys, tenant: str | None, days: int
) -> dict[str, dict[str, dict[str, int]]]:
    """Returns: tenant -> day -> counter -> value, for the last `days` days (UTC)."""
    first_day = utc_day(time.time() - (days - 1) * 86400)
    head = len(keys.tenant_usage_pattern("").removesuffix(":*"))
    report: dict[str, dict[str, dict[str, int]]] = {}
    for name in client.scan_iter(match=keys.tenant_usage_pattern(tenant or "*"), count=1000):
        owner, _, day = name.decode()[head:].rpartition(":")
        if day >= first_day:
            counts = {k.decode(): int(v) for k, v in client.hgetall(name).items()}
            report.setdefault(owner, {})[day] = {f: counts.get(f, 0) for f in USAGE_FIELDS}
    return {owner: dict(sorted(by_day.items())) for owner, by_day in sorted(report.items())}


def print_usage(report: dict[str, dict[str, dict[str, int]]], say: Say) -> None:
    say(f"{'tenant':<24}{'day':<12}" + "".join(f"{f:>22}" for f in USAGE_FIELDS))
    for owner, by_day in report.items():
        totals = dict.fromkeys(USAGE_FIELDS, 0)
        for day, counts in by_day.items():
            say(f"{owner:<24}{day:<12}" + "".join(f"{counts[f]:>22}" for f in USAGE_FIELDS))
            totals = {f: totals[f] + counts[f] for f in USAGE_FIELDS}
        say(f"{owner:<24}{'total':<12}" + "".join(f"{totals[f]:>22}" for f in USAGE_FIELDS))


def run(args: argparse.Namespace, client: redis.Redis, say: Say) -> int:
    keys = RedisKeys(args.redis_prefix)
    if args.area == "keys":
        if args.action == "create":
            create_key(client, keys, args.tenant, say)
        elif args.action == "list":
            list_keys(client, keys, args.tenant, say)
        else:
            return 0 if revoke_key(client, keys, args.key, say) else 1
    elif args.area == "limits":
        if args.action == "set":
            given = {n: getattr(args, n) for n in TenantLimits.__slots__ if hasattr(args, n)}
            set_limits(client, keys, args.tenant, given, say)
        elif args.action == "clear":
            set_limits(client, keys, args.tenant, _limit_fields(TenantLimits()), say)
        else:
            say(f"tenant {args.tenant}: {_describe(read_limits(client, keys, args.tenant))}")
    elif args.area == "drain":
        return 0 if drain_executor(client, keys, args.executor_id, args.wait_s, say) else 1
    else:
        report = usage_report(client, keys, args.tenant, args.days)
        if args.json:
            say(json.dumps(report, indent=2))
        else:
            print_usage(report, say)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Args: the flags after `kvgate admin`. Returns: the exit status."""
    args = build_parser().parse_args(argv)
    try:
        check_redis_url("--redis-url", args.redis_url)
        client = redis.Redis.from_url(args.redis_url, socket_timeout=5.0)
        return run(args, client, print)
    except ValueError as error:
        print(f"kvgate admin: {error}", file=sys.stderr)
        return 2
    except redis.RedisError as error:
        print(f"kvgate admin: --redis-url {redacted_url(args.redis_url)}: {error}", file=sys.stderr)
        return 1
