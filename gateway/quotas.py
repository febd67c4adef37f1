"""Per-tenant quotas, shared by every gateway through Redis.

A tenant's limits (common/tenants.py TenantLimits, set with `kvgate admin limits set`) are
cached for --auth-cache-s. Two token buckets live in one Redis hash per tenant and are
updated by one atomic script, QUOTA_SCRIPT, on Redis's clock:
- requests per second: each Generate call and Chat turn takes one; it holds one second's
  worth (at least one).
- generated tokens per minute: a request is admitted while the bucket is above zero, and its
  tokens are taken when it finishes (the bucket may go below zero: later requests wait until
  it has refilled above it); it holds one minute's worth.
Open streams (Generate and Chat calls) hold a lease each in a sorted set per tenant, renewed
every STREAM_LEASE_S / 3 by the gateway that holds them, so a dead gateway's streams free
their places within STREAM_LEASE_S. A request asking for a more urgent priority than the
tenant's max_priority runs at max_priority, and its last chunk says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from common.keys import RedisKeys
from common.tenants import TenantLimits
from gateway.errors import QuotaExceeded

log = logging.getLogger(__name__)
STREAM_LEASE_S = 30.0
# Retry hint of a refusal for open streams: a stream's end cannot be foreseen.
STREAMS_RETRY_MS = 1000

# KEYS: the tenant's buckets hash, its streams sorted set.
# ARGV: requests_per_s, tokens_per_min, max_streams, take a request (1/0), stream member to
# add ('' none), lease ms, generated tokens to take.
# Returns {0, 0} when admitted (and everything taken), else {limit, retry after ms} with limit
# 1 = requests per second, 2 = tokens per minute, 3 = open streams; nothing is taken then.
QUOTA_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rps, tpm, max_streams = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local take, member = ARGV[4] == '1', ARGV[5]
local lease_ms, charge = tonumber(ARGV[6]), tonumber(ARGV[7])
local b = redis.call('HMGET', KEYS[1], 'requests', 'tokens', 'at_ms')
local elapsed = math.max(0, now - (tonumber(b[3]) or now))
local req_cap = math.max(1, rps)
local requests = math.min(req_cap, (tonumber(b[1]) or req_cap) + elapsed * rps / 1000)
local tokens = math.min(tpm, (tonumber(b[2]) or tpm) + elapsed * tpm / 60000)
if take and rps > 0 and requests < 1 then
  return {1, math.ceil((1 - requests) * 1000 / rps)}
end
if take and tpm > 0 and tokens <= 0 then
  return {2, math.ceil((1 - tokens) * 60000 / tpm)}
end
if member ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_streams then return {3, 0} end
  redis.call('ZADD', KEYS[2], now + lease_ms, member)
  redis.call('PEXPIRE', KEYS[2], lease_ms)
end
if take and rps > 0 then requests = requests - 1 end
if tpm > 0 then tokens = tokens - charge end
local full_ms = 0
if rps > 0 then full_ms = (req_cap - requests) * 1000 / rps end
if tpm > 0 then full_ms = math.max(full_ms, (tpm - tokens) * 60000 / tpm) end
redis.call('HSET', KEYS[1], 'requests', tostring(requests), 'tokens', tostring(tokens),
  'at_ms', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(full_ms) + 1000)
return {0, 0}
"""
# KEYS: a tenant's streams sorted set. ARGV: lease ms, then the members to renew.
RENEW_SCRIPT = """
local t = redis.call('TIME')
local lease_end = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', lease_end, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 0
"""
ADMITTED = 0
LIMIT_NAMES = {1: "requests_per_s", 2: "tokens_per_min", 3: "max_streams"}


@dataclass(frozen=True, slots=True)
class StreamSlot:
    """A place among a tenant's open streams, held by this gateway."""

    tenant: str
    member: str


def clamp_priority(priority: int, limits: TenantLimits) -> tuple[int, bool]:
    """Returns: the priority a request runs at, and whether it was clamped to max_priority."""
    if limits.max_priority is not None and priority < limits.max_priority:
        return limits.max_priority, True
    return priority, False


class Quotas:
    """The tenants' limits, buckets and stream leases, as one gateway sees and takes them."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, cache_s: float) -> None:
        self.client = client
        self.keys = keys
        self.cache_s = cache_s
        self.lease_ms = int(STREAM_LEASE_S * 1000)
        self._script = client.register_script(QUOTA_SCRIPT)
        self._renew = client.register_script(RENEW_SCRIPT)
        self._limits: dict[str, tuple[TenantLimits, float]] = {}
        self._reads: dict[str, asyncio.Future[TenantLimits]] = {}  # reads under way
        self._held: dict[str, set[str]] = {}  # tenant -> members of its streams held here
        self._gateway_id = uuid.uuid4().hex[:12]
        self._renewer: asyncio.Task[None] | None = None

    async def limits(self, tenant: str) -> TenantLimits:
        """The tenant's limits, read at most cache_s ago. The calls that find them stale
        together share one read (thousands arriving at once cost one round trip)."""
        cached = self._limits.get(tenant)
        if cached is not None and time.monotonic() - cached[1] <= self.cache_s:
            return cached[0]
        reading = self._reads.get(tenant)
        if reading is None:
            reading = asyncio.ensure_future(self._read_limits(tenant))
            self._reads[tenant] = reading
            reading.add_done_callback(lambda _: self._reads.pop(tenant, None))
        return await asyncio.shield(reading)

    async def _read_limits(self, tenant: str) -> TenantLimits:
        limits = TenantLimits.from_redis(await self.client.hgetall(self.keys.tenant_limits(tenant)))
        self._limits[tenant] = (limits, time.monotonic())
        return limits

    def cached_limits(self, tenant: str) -> TenantLimits:
        """The limits last read for the tenant (none read yet: no limits)."""
        cached = self._limits.get(tenant)
        return cached[0] if cached is not None else TenantLimits()

    async def admit(
        self, tenant: str, limits: TenantLimits, *, take_request: bool, open_stream: bool
    ) -> StreamSlot | None:
        """Take one request (take_request) and a place among the tenant's open streams
        (open_stream), both or neither.

        Returns:
            The place taken, None when none was asked for or the tenant has no such limit.

        Raises:
            QuotaExceeded: over a limit, with the time after which to try again.
        """
        slot = None
        if open_stream and limits.max_streams > 0:
            slot = StreamSlot(tenant, f"{self._gateway_id}/{uuid.uuid4().hex}")
        if slot is None and not (take_request and limits.rated):
            return None
        await self._run(tenant, limits, take_request, slot.member if slot else "", 0)
        if slot is not None:
            self._held.setdefault(tenant, set()).add(slot.member)
        return slot

    async def _run(
        self, tenant: str, limits: TenantLimits, take_request: bool, member: str, charge: int
    ) -> None:
        limit, retry_ms = await self._script(
            keys=[self.keys.tenant_buckets(tenant), self.keys.tenant_streams(tenant)],
            args=[
                repr(float(limits.requests_per_s)),
                limits.tokens_per_min,
                limits.max_streams,
                int(take_request),
                member,
                self.lease_ms,
                charge,
            ],
        )
        if limit != ADMITTED:
            raise _exceeded(tenant, limits, LIMIT_NAMES[limit], retry_ms or STREAMS_RETRY_MS)

    async def close_stream(self, slot: StreamSlot) -> None:
        """Give the place back."""
        held = self._held.get(slot.tenant)
        if held is not None:
            held.discard(slot.member)
            if not held:
                del self._held[slot.tenant]
        await self.client.zrem(self.keys.tenant_streams(slot.tenant), slot.member)

    async def charge_tokens(self, tenant: str, num_tokens: int) -> None:
        """Take a finished request's generated tokens from the tenant's bucket (if it has one)."""
        limits = self.cached_limits(tenant)
        if limits.tokens_per_min > 0 and num_tokens > 0:
            await self._run(tenant, limits, False, "", num_tokens)

    def start(self) -> None:
        """Start renewing this gateway's stream leases."""
        self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(STREAM_LEASE_S / 3)
            try:
                for tenant, members in list(self._held.items()):
                    keys = [self.keys.tenant_streams(tenant)]
                    await self._renew(keys=keys, args=[self.lease_ms, *members])
            except redis.RedisError as error:  # an outage, a failover's READONLY, ...
                log.warning("stream leases not renewed (Redis unavailable): %s", error)


def _exceeded(tenant: str, limits: TenantLimits, limit: str, retry_ms: int) -> QuotaExceeded:
    value = getattr(limits, limit)
    what = {
        "requests_per_s": f"{value:g} requests per second",
        "tokens_per_min": f"{value} generated tokens per minute",
        "max_streams": f"{value} open streams",
    }[limit]
    return QuotaExceeded(
        f"tenant {tenant!r} is over its limit of {what}; retry in {retry_ms} ms", limit, retry_ms
    )
