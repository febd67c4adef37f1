"""Per-tenant accounting: Prometheus counters (bounded labels) and daily usage in Redis.

Each generation, once it ends (its last chunk, or a cancel, deadline or error before one),
adds to its tenant's counters (requests, prompt, cached prompt and generated tokens: those
streamed) in Prometheus and in the tenant's usage hash of the day, which `kvgate admin usage`
reports; its generated tokens are taken from the tenant's tokens-per-minute bucket. The
Redis writes run after the stream ended: the usage of all generations that ended within
USAGE_WRITE_DELAY_S goes in one pipeline, summed per tenant, not one round trip each (under
thousands of streams those would take the gateway's Redis connections from the calls that
need them). A failed write keeps its counts for the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import redis
import redis.asyncio as aioredis

from common.keys import RedisKeys
from common.redis_conn import OutageLog
from common.tenants import OTHER_TENANTS, USAGE_FIELDS, USAGE_TTL_DAYS, utc_day
from gateway.metrics import GatewayMetrics
from gateway.quotas import Quotas

log = logging.getLogger(__name__)
USAGE_WRITE_DELAY_S = 0.25


class Usage(Protocol):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


class TenantLabels:
    """The metric label of a tenant: its name for the first `max_tenants` seen, then
    OTHER_TENANTS, so that a gateway's series stay bounded whoever calls it."""

    def __init__(self, max_tenants: int) -> None:
        self.max_tenants = max_tenants
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.max_tenants:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


class Accounting:
    """Counts what each tenant used."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        quotas: Quotas,
        metrics: GatewayMetrics,
        max_tenants: int,
    ) -> None:
        self.client = client
        self.keys = keys
        self.quotas = quotas
        self.metrics = metrics
        self.label = TenantLabels(max_tenants)
        self._unwritten: dict[str, list[int]] = {}  # tenant -> counts, USAGE_FIELDS order
        self._writer: asyncio.Task[None] | None = None
        self._outage = OutageLog(log, "usage accounting")

    def count(self, tenant: str, usage: Usage) -> None:
        """Add an ended generation to the tenant's Prometheus counters."""
        label = self.label(tenant)
        metrics = self.metrics
        metrics.tenant_requests.labels(label).inc()
        metrics.tenant_prompt_tokens.labels(label).inc(usage.prompt_tokens)
        metrics.tenant_cached_prompt_tokens.labels(label).inc(usage.cached_prompt_tokens)
        metrics.tenant_generated_tokens.labels(label).inc(usage.completion_tokens)

    def refused(self, tenant: str, limit: str) -> None:
        """Count a call refused over one of the tenant's limits."""
        self.metrics.tenant_refused.labels(self.label(tenant), limit).inc()

    def record(self, tenant: str, usage: Usage) -> None:
        """Add an ended generation to the tenant's usage of the day and take its tokens
        from the tenant's bucket, in Redis within USAGE_WRITE_DELAY_S."""
        counts = (1, usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens)
        self._add(tenant, counts)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_soon())

    def _add(self, tenant: str, counts: tuple[int, ...] | list[int]) -> None:
        total = self._unwritten.setdefault(tenant, [0] * len(USAGE_FIELDS))
        for index, count in enumerate(counts):
            total[index] += count

    async def _write_soon(self) -> None:
        await asyncio.sleep(USAGE_WRITE_DELAY_S)
        await self.flush()

    async def flush(self) -> None:
        """Write the usage recorded so far (in one pipeline) and charge its tokens."""
        unwritten, self._unwritten = self._unwritten, {}
        if not unwritten:
            return
        day = utc_day(time.time())
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for tenant, counts in unwritten.items():
                    key = self.keys.tenant_usage(tenant, day)
                    for name, count in zip(USAGE_FIELDS, counts, strict=True):
                        pipe.hincrby(key, name, count)
                    pipe.expire(key, USAGE_TTL_DAYS * 86400)
                await pipe.execute()
        except redis.RedisError as error:
            self._outage.failed(error)
            for tenant, counts in unwritten.items():
                self._add(tenant, counts)
            return
        self._outage.succeeded()
        try:
            for tenant, counts in unwritten.items():
                await self.quotas.charge_tokens(tenant, counts[-1])
        except redis.RedisError as error:  # the tokens go uncharged, the usage is written
            self._outage.failed(error)
