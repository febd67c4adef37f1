"""The gateway's side of the Redis queue: enqueue with a limit, cancel, re-queue, registry.

Every call is bounded by the client's socket timeout (config.redis_timeout_s),
so a Redis outage surfaces as a redis.RedisError (UNAVAILABLE) quickly.
"""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from common.keys import PAYLOAD_FIELD, QUEUED_AT_FIELD, RedisKeys
from common.requeue import stream_fields
from gateway.errors import Refused, Unavailable
from gateway.quotas import TAKE_QUOTA, Admission
from protos.kvgate.v1 import internal_pb2

# KEYS: requests stream, executors set[, the tenant's quota buckets and streams].
# ARGV: payload, max_queue_len, status key head, tail, payload field, queued-at field[, then
# take_quota's args]. With the quota keys, the request's quotas are taken in the same step
# (gateway/quotas.py Admission). The entry also holds the server's time now (unix
# microseconds), where the scheduler's window for the request starts. Returns -2 when no
# executor is alive, -1 when the queue is full, take_quota's refusal {limit, retry after ms}
# (nothing is taken or queued in each of those cases), else the new length.
ENQUEUE_SCRIPT = (
    TAKE_QUOTA
    + """
local alive = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[3] .. id .. ARGV[4]) == 1 then
    alive = alive + 1
    break
  end
end
if alive == 0 then return -2 end
local queued = redis.call('XLEN', KEYS[1])
if queued >= tonumber(ARGV[2]) then return -1 end
if #KEYS == 4 then
  local quota = take_quota(KEYS[3], KEYS[4], {unpack(ARGV, 7)})
  if quota[1] ~= 0 then return quota end
end
local now = redis.call('TIME')
local queued_us = now[1] .. string.format('%06d', now[2])
redis.call('XADD', KEYS[1], '*', ARGV[5], ARGV[1], ARGV[6], queued_us)
return queued + 1
"""
)
NO_EXECUTOR = -2
QUEUE_FULL = -1
LIVENESS_MAX_AGE_S = 0.25


class RequestQueue:
    """Puts requests on the requests stream and talks to executors through Redis.

    Requests are queued in groups: the requests (new, or queued again) that arrive while one
    group is on its way to Redis go together in the next, as one pipeline (one connection,
    one round trip), so a burst of thousands of calls needs a handful of connections, not
    one each.
    """

    def __init__(
        self, client: aioredis.Redis, keys: RedisKeys, max_queue_len: int, cancel_ttl_s: float
    ) -> None:
        """
        Args:
            client: a fail-fast client (common.redis_conn.connect).
            keys: key names.
            max_queue_len: requests waiting for placement beyond which enqueue refuses.
            cancel_ttl_s: how long a cancel marker lives (the queue timeout).
        """
        self.client = client
        self.keys = keys
        self.max_queue_len = max_queue_len
        self.cancel_ttl_ms = max(1, int(cancel_ttl_s * 1000))
        self._enqueue_sha = client.register_script(ENQUEUE_SCRIPT).sha
        self._status_head, self._status_tail = keys.executor_status("\0").split("\0")
        self._liveness: bool | None = True
        self._liveness_read_at = -LIVENESS_MAX_AGE_S
        self._liveness_read: asyncio.Future[None] | None = None
        # (request, whether it is new: checked against the limits, the admission it takes,
        # the future of its result)
        self._to_enqueue: list[
            tuple[internal_pb2.QueuedRequest, bool, Admission | None, asyncio.Future]
        ] = []
        self._enqueuing: asyncio.Task[None] | None = None

    async def enqueue(
        self, request: internal_pb2.QueuedRequest, admission: Admission | None = None
    ) -> None:
        """Queue a new request, taking `admission` (not taken yet) in the same step.

        Raises:
            Unavailable: no executor is alive.
            Refused: max_queue_len requests already wait.
            QuotaExceeded: the admission was refused.
            redis.RedisError: Redis failed (the request may or may not be queued).
        """
        result = await self._send(request, True, admission)
        if isinstance(result, list):
            raise admission.refusal(*result)
        if admission is not None and result in (NO_EXECUTOR, QUEUE_FULL):
            admission.refused = True
        if result == NO_EXECUTOR:
            raise Unavailable("no executor is alive; try again later")
        if result == QUEUE_FULL:
            raise Refused(
                "max_queue_len",
                f"the queue is full: {self.max_queue_len} requests wait (--max-queue-len); "
                "try again later",
            )

    async def requeue(self, request: internal_pb2.QueuedRequest) -> None:
        """Queue a request again (its executor was lost, or Redis may have lost its entry):
        no queue limit, it was admitted already.

        Raises:
            redis.RedisError: Redis failed (the request may or may not be queued).
        """
        await self._send(request, is_new=False)

    async def _send(
        self, request: internal_pb2.QueuedRequest, is_new: bool, admission: Admission | None = None
    ) -> object:
        """Queues the request with the next group. Returns: its pipeline reply."""
        done = asyncio.get_running_loop().create_future()
        self._to_enqueue.append((request, is_new, admission, done))
        if self._enqueuing is None or self._enqueuing.done():
            self._enqueuing = asyncio.create_task(self._enqueue_groups())
        return await done

    async def _enqueue_groups(self) -> None:
        """Sends what waits to be queued, one group at a time, until nothing waits."""
        while self._to_enqueue:
            group, self._to_enqueue = self._to_enqueue, []
            try:
                results = await self._enqueue_group([entry[:3] for entry in group])
            except redis.RedisError as error:
                results = [error] * len(group)
            for (*_, done), result in zip(group, results, strict=True):
                if done.done():
                    continue  # its caller went away
                if isinstance(result, Exception):
                    done.set_exception(result)
                else:
                    done.set_result(result)

    async def _enqueue_group(
        self, requests: list[tuple[internal_pb2.QueuedRequest, bool, Admission | None]]
    ) -> list:
        """One enqueue script call per new request, one XADD per request queued again,
        pipelined. Returns: each one's result or error.

        The calls are plain EVALSHAs: redis-py's pipelined Script asks SCRIPT EXISTS first,
        a round trip of its own on every group. A Redis without the script (restarted, or a
        replica promoted) answers NOSCRIPT to each call, which then did nothing: the script
        is loaded and those calls sent again.
        """
        calls = [
            self._enqueue_call(request, admission) if is_new else stream_fields(request)
            for request, is_new, admission in requests
        ]
        results = await self._evalsha_pipelined(calls)
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:
            await self.client.script_load(ENQUEUE_SCRIPT)
            again = await self._evalsha_pipelined([calls[i] for i in missing])
            for index, result in zip(missing, again, strict=True):
                results[index] = result
        return results

    def _enqueue_call(
        self, request: internal_pb2.QueuedRequest, admission: Admission | None
    ) -> list[object]:
        """The enqueue script's keys and args, after their number."""
        keys: list[object] = [self.keys.requests, self.keys.executors]
        args = [
            request.SerializeToString(),
            self.max_queue_len,
            self._status_head,
            self._status_tail,
            PAYLOAD_FIELD,
            QUEUED_AT_FIELD,
        ]
        if admission is not None:
            admission.sent = True
            keys.extend(admission.keys)
            args.extend(admission.args)
        return [len(keys), *keys, *args]

    async def _evalsha_pipelined(self, calls: list[list[object] | dict]) -> list:
        async with self.client.pipeline(transaction=False) as pipe:
            for call in calls:
                if isinstance(call, dict):  # a request queued again
                    pipe.xadd(self.keys.requests, call)
                else:
                    pipe.evalsha(self._enqueue_sha, *call)
            return await pipe.execute(raise_on_error=False)

    async def mark_cancelled(self, request_id: str) -> None:
        """Tell the scheduler to drop this request if it is still queued."""
        await self.client.set(self.keys.cancelled(request_id), b"1", px=self.cancel_ttl_ms)

    async def release_session(self, executor_ids: set[str], session_id: str, tenant: str) -> None:
        """Ask executors to unpin a session's KV cache (and to let its turns still running
        there free their blocks when they finish), in one round trip."""
        message = internal_pb2.InboxMessage(
            release_session=internal_pb2.ReleaseSession(session_id=session_id, tenant=tenant)
        )
        fields = {PAYLOAD_FIELD: message.SerializeToString()}
        async with self.client.pipeline(transaction=False) as pipe:
            for executor_id in sorted(executor_ids):
                pipe.xadd(self.keys.executor_inbox(executor_id), fields)
            await pipe.execute()

    async def any_executor_alive(self) -> bool | None:
        """Whether an executor's heartbeat is live, as read at most LIVENESS_MAX_AGE_S ago;
        None when Redis could not tell. Every waiting request shares one read: callers that
        come while it runs await it, and its answer (None too) serves until it is stale."""
        if time.monotonic() - self._liveness_read_at > LIVENESS_MAX_AGE_S:
            if self._liveness_read is None or self._liveness_read.done():
                self._liveness_read = asyncio.ensure_future(self._read_liveness())
            await asyncio.shield(self._liveness_read)
        return self._liveness

    async def _read_liveness(self) -> None:
        try:
            self._liveness = bool(await self.live_executor_ids())
        except redis.RedisError:
            self._liveness = None
        self._liveness_read_at = time.monotonic()

    async def executor_statuses(self) -> list[internal_pb2.ExecutorStatus]:
        """The status each live executor's heartbeat last wrote (its limits and load)."""
        executor_ids = await self.live_executor_ids()
        if not executor_ids:
            return []
        raw = await self.client.mget([self.keys.executor_status(e) for e in executor_ids])
        return [internal_pb2.ExecutorStatus.FromString(r) for r in raw if r is not None]

    async def live_executor_ids(self) -> list[str]:
        """Ids of the executors whose heartbeat has not expired."""
        members = sorted(m.decode() for m in await self.client.smembers(self.keys.executors))
        if not members:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for executor_id in members:
                pipe.exists(self.keys.executor_status(executor_id))
            alive = await pipe.execute()
        return [m for m, is_alive in zip(members, alive, strict=True) if is_alive]
