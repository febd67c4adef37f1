"""Per-tenant quotas, shared by every gateway through Redis.

A tenant's limits (common/tenants.py TenantLimits, set with `kvgate admin limits set`) are
cached for --auth-cache-s. Two token buckets live in one Redis hash per tenant and are
updated by one atomic script, QUOTA_SCRIPT, on Redis's clock:
- requests per second: each Generate call and Chat turn takes one, a request of n choices
  (or best_of sequences) n; it holds one second's worth (at least one), and a request of more
  than it holds needs it full (it goes below zero then).
- generated tokens per minute: a request is admitted while the bucket is above zero, and its
  tokens are taken when it finishes (the bucket may go below zero: later requests wait until
  it has refilled above it); it holds one minute's worth.
Open streams (Generate and Chat calls; a request of n choices counts n, and one of more than
the limit opens only when the tenant has none open) hold a lease each in a sorted set per
tenant, renewed every STREAM_LEASE_S / 3 by the gateway that holds them, so a dead gateway's
streams free their places within STREAM_LEASE_S. A request asking for a more urgent priority
than the tenant's max_priority runs at max_priority, and its last chunk says so.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from common.keys import RedisKeys
from common.sampling_params import MAX_N
from common.tenants import TenantLimits
from gateway.errors import QuotaExceeded

log = logging.getLogger(__name__)
STREAM_LEASE_S = 30.0
# Retry hint of a refusal for open streams: a stream's end cannot be foreseen.
STREAMS_RETRY_MS = 1000

# take_quota(buckets hash key, streams sorted set key, args): args are requests_per_s,
# tokens_per_min, max_streams, requests to take (0: none), stream places to take, lease ms,
# generated tokens to take, then the stream members to add (one per place). Returns {0, 0}
# when admitted (and everything taken), else {limit, retry after ms} with limit 1 = requests
# per second, 2 = tokens per minute, 3 = open streams; nothing is taken then. A Lua function,
# so that the enqueue script can run it too.
TAKE_QUOTA = """
local function take_quota(buckets, streams, a)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local rps, tpm, max_streams = tonumber(a[1]), tonumber(a[2]), tonumber(a[3])
  local take, places = tonumber(a[4]), tonumber(a[5])
  local lease_ms, charge = tonumber(a[6]), tonumber(a[7])
  local b = redis.call('HMGET', buckets, 'requests', 'tokens', 'at_ms')
  local elapsed = math.max(0, now - (tonumber(b[3]) or now))
  local req_cap = math.max(1, rps)
  local requests = math.min(req_cap, (tonumber(b[1]) or req_cap) + elapsed * rps / 1000)
  local tokens = math.min(tpm, (tonumber(b[2]) or tpm) + elapsed * tpm / 60000)
  local needed = math.min(take, req_cap)
  if take > 0 and rps > 0 and requests < needed then
    return {1, math.ceil((needed - requests) * 1000 / rps)}
  end
  if take > 0 and tpm > 0 and tokens <= 0 then
    return {2, math.ceil((1 - tokens) * 60000 / tpm)}
  end
  if places > 0 then
    redis.call('ZREMRANGEBYSCORE', streams, '-inf', now)
    local open = redis.call('ZCARD', streams)
    if open > 0 and open + places > max_streams then return {3, 0} end
    for i = 1, places do redis.call('ZADD', streams, now + lease_ms, a[7 + i]) end
    redis.call('PEXPIRE', streams, lease_ms)
  end
  if rps > 0 then requests = requests - take end
  if tpm > 0 then tokens = tokens - charge end
  local full_ms = 0
  if rps > 0 then full_ms = (req_cap - requests) * 1000 / rps end
  if tpm > 0 then full_ms = math.max(full_ms, (tpm - tokens) * 60000 / tpm) end
  redis.call('HSET', buckets, 'requests', tostring(requests), 'tokens', tostring(tokens),
    'at_ms', now)
  redis.call('PEXPIRE', buckets, math.ceil(full_ms) + 1000)
  return {0, 0}
end
"""
# KEYS: the tenant's buckets hash, its streams sorted set. ARGV: take_quota's args.
QUOTA_SCRIPT = TAKE_QUOTA + "return take_quota(KEYS[1], KEYS[2], ARGV)\n"
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
BUCKET_LIMITS = (1, 2)


@dataclass(frozen=True, slots=True)
class StreamSlot:
    """A place among a tenant's open streams, held by this gateway."""

    tenant: str
    members: tuple[str, ...]  # one per sequence of its request (n, best_of)


@dataclass(slots=True)
class Admission:
    """What one call takes from its tenant's quotas, all of it or nothing, in one run of
    take_quota: QUOTA_SCRIPT's (Quotas.take), or the enqueue script's, in the round trip
    that queues the request (gateway/request_queue.py)."""

    tenant: str
    limits: TenantLimits
    keys: list[str]  # the tenant's buckets hash, its streams sorted set
    args: list[object]  # take_quota's
    slot: StreamSlot | None  # the place among open streams it takes, if any
    memory: RefusalMemory
    sent: bool = False  # to Redis (its answer may not have come back)
    refused: bool = False  # Redis answered that nothing was taken

    def refusal(self, limit: int, retry_ms: int) -> QuotaExceeded:
        """Marks it refused, and remembers a bucket's refusal. Returns: the error of
        take_quota's refusal {limit, retry_ms}."""
        self.refused = True
        if limit in BUCKET_LIMITS:
            self.memory.remember(self.tenant, self.limits, LIMIT_NAMES[limit], retry_ms)
        return _exceeded(self.tenant, self.limits, LIMIT_NAMES[limit], retry_ms or STREAMS_RETRY_MS)


class RefusalMemory:
    """Each tenant's last refusal by a token bucket, kept until the bucket will have refilled
    enough (its retry-after: buckets refill on the clock alone, other gateways only take
    from them), at most max_s (the limits' cache time) and while the tenant's limits read
    stay those it was refused under. A tenant sending over its rate is refused here
    meanwhile: before its prompt is tokenized, and without a round trip to Redis."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        # tenant -> (until, retry at, its limits then, the limit's name)
        self._until: dict[str, tuple[float, float, TenantLimits, str]] = {}

    def remember(self, tenant: str, limits: TenantLimits, limit: str, retry_ms: int) -> None:
        now = time.monotonic()
        retry_at = now + retry_ms / 1000
        self._until[tenant] = (min(retry_at, now + self.max_s), retry_at, limits, limit)

    def check(self, tenant: str, limits: TenantLimits) -> None:
        """Raises: QuotaExceeded, with the time left to the remembered retry, while a
        refusal of the tenant is remembered."""
        remembered = self._until.get(tenant)
        if remembered is None:
            return
        until, retry_at, refused_under, limit = remembered
        now = time.monotonic()
        if now >= until or limits != refused_under:
            del self._until[tenant]
            return
        raise _exceeded(tenant, limits, limit, max(1, math.ceil((retry_at - now) * 1000)))


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
        self._refusals = RefusalMemory(cache_s)
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

    def admission(
        self,
        tenant: str,
        limits: TenantLimits,
        *,
        take_request: bool,
        open_stream: bool,
        num_sequences: int = 1,
    ) -> Admission | None:
        """What to take: `num_sequences` requests (take_request) and as many places among
        the tenant's open streams (open_stream); None when the tenant has no such limit.
        Nothing is taken yet. `num_sequences` is n or best_of as asked, not checked yet: out
        of range, it counts one (validation refuses the request).

        Raises:
            QuotaExceeded: take_request, and a refusal by a bucket of the tenant is remembered.
        """
        if not 1 <= num_sequences <= MAX_N:
            num_sequences = 1
        if take_request:
            self._refusals.check(tenant, limits)
        slot = None
        if open_stream and limits.max_streams > 0:
            stream = f"{self._gateway_id}/{uuid.uuid4().hex}"
            slot = StreamSlot(tenant, tuple(f"{stream}#{i}" for i in range(num_sequences)))
            # Renewed from now on: a renewal only updates members in Redis (ZADD XX).
            self._held.setdefault(tenant, set()).update(slot.members)
        if slot is None and not (take_request and limits.rated):
            return None
        num_requests = num_sequences if take_request else 0
        args = self._args(limits, num_requests, slot.members if slot else (), 0)
        return Admission(tenant, limits, self._tenant_keys(tenant), args, slot, self._refusals)

    def _tenant_keys(self, tenant: str) -> list[str]:
        return [self.keys.tenant_buckets(tenant), self.keys.tenant_streams(tenant)]

    def _args(
        self, limits: TenantLimits, num_requests: int, members: tuple[str, ...], charge: int
    ) -> list:
        """take_quota's args."""
        return [
            repr(float(limits.requests_per_s)),
            limits.tokens_per_min,
            limits.max_streams,
            num_requests,
            len(members),
            self.lease_ms,
            charge,
            *members,
        ]

    async def take(self, admission: Admission) -> None:
        """Take the admission now, in a round trip of its own.

        Raises:
            QuotaExceeded: over a limit, with the time after which to try again.
        """
        admission.sent = True
        limit, retry_ms = await self._script(keys=admission.keys, args=admission.args)
        if limit != ADMITTED:
            raise admission.refusal(limit, retry_ms)

    def forget(self, slot: StreamSlot) -> None:
        """Stop renewing the place's lease."""
        held = self._held.get(slot.tenant)
        if held is not None:
            held.difference_update(slot.members)
            if not held:
                del self._held[slot.tenant]

    async def close_stream(self, slot: StreamSlot) -> None:
        """Give the place back (forget it first). Called for a place taken, or that may have
        been (the answer lost to a cancelled call), never for one refused."""
        self.forget(slot)
        await self.client.zrem(self.keys.tenant_streams(slot.tenant), *slot.members)

    async def charge_tokens(self, tenant: str, num_tokens: int) -> None:
        """Take a finished request's generated tokens from the tenant's bucket (if it has one)."""
        limits = self.cached_limits(tenant)
        if limits.tokens_per_min > 0 and num_tokens > 0:
            args = self._args(limits, 0, (), num_tokens)
            await self._script(keys=self._tenant_keys(tenant), args=args)  # never refused

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
