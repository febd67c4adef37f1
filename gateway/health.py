"""The gateway's grpc.health.v1: NOT_SERVING while it cannot get a request served.

That is while Redis is unreachable (nothing can be queued), or while no executor has been
alive for NO_EXECUTOR_HEALTH_S (nothing would run it); the grace counts from the gateway's
start too, so a stack whose executors are still loading is not reported down at once.
LIVENESS_SERVICE stays SERVING while the process runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from common.health import (
    CHECK_INTERVAL_S,
    LIVENESS_SERVICE,
    NOT_SERVING,
    REDIS_CONDITION,
    SERVING,
    HealthConditions,
)
from common.redis_conn import describe
from gateway.request_queue import RequestQueue

log = logging.getLogger(__name__)
NO_EXECUTOR_HEALTH_S = 5.0


class GatewayHealth:
    """Re-evaluates the gateway's health every CHECK_INTERVAL_S and publishes it."""

    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        queue: RequestQueue,
        services: tuple[str, ...],
        registry: CollectorRegistry | None = None,
        on_live_executors: Callable[[set[str], float], None] = lambda ids, now: None,
    ) -> None:
        """
        Args:
            on_live_executors: called with the live executors' ids and the monotonic time
                at each check Redis answers (the token router follows heartbeats with it).
        """
        self.conditions = HealthConditions("gateway", registry)
        self._on_live_executors = on_live_executors
        self._servicer = servicer
        self._queue = queue
        self._services = services
        self._last_executor_s = time.monotonic()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Evaluates once, then keeps evaluating on a task until `stop`."""
        await self._servicer.set(LIVENESS_SERVICE, SERVING)
        await self.check_once()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check_once(self) -> None:
        """Reads Redis once and sets every service's status from what it saw."""
        try:
            live = set(await self._queue.live_executor_ids())
        except redis.RedisError as error:
            self.conditions.update(REDIS_CONDITION, f"redis unreachable: {describe(error)}")
        else:
            self.conditions.update(REDIS_CONDITION, None)
            self.conditions.update("executors", self._executor_condition(bool(live)))
            self._on_live_executors(live, time.monotonic())
        status = SERVING if self.conditions.serving else NOT_SERVING
        for service in self._services:
            await self._servicer.set(service, status)

    def _executor_condition(self, alive: bool) -> str | None:
        now = time.monotonic()
        if alive:
            self._last_executor_s = now
            return None
        if now - self._last_executor_s >= NO_EXECUTOR_HEALTH_S:
            return f"no executor has been alive for {NO_EXECUTOR_HEALTH_S:g} s"
        return None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check_once()
