"""One request's life on the gateway: queue it, stream its tokens as text, finish it.

A Generation queues its QueuedRequest, then turns the events of its inbox
(TokenSink output, a lost executor, a client cancel) into chunks: new tokens
are de-duplicated by offset, detokenized incrementally and checked for stop
strings. If its executor goes away it is re-queued with the tokens already
streamed, so the client's stream goes on without a gap or a repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, field

import redis

from common.choices import choice_request_id
from common.finish_reason import FinishReason
from common.logs import request_fields
from common.model_text import ModelText
from common.requeue import attempts_used_up
from common.sampling_pb import sampling_params_to_pb
from gateway.accounting import Accounting
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import DeadlineExceeded, QuotaExceeded, ServiceError, Unavailable
from gateway.metrics import GatewayMetrics
from gateway.quotas import Admission
from gateway.request_queue import RequestQueue
from gateway.stops import StopStringMatcher
from gateway.token_sink import (
    ClientCancelled,
    ExecutorLost,
    RequestEvent,
    TokenRouter,
    TokenUpdate,
)
from gateway.validation import GenerationSpec
from protos.kvgate.v1 import inference_pb2, internal_pb2

log = logging.getLogger(__name__)

# A request no executor runs yet checks every LIVENESS_CHECK_S that one is alive, and fails
# with UNAVAILABLE once none has been for NO_EXECUTOR_GRACE_S (a heartbeat lives 2 s), or
# once Redis has not answered for REDIS_DOWN_GRACE_S.
LIVENESS_CHECK_S = 0.5
NO_EXECUTOR_GRACE_S = 1.0
REDIS_DOWN_GRACE_S = 4.0


def internal_request_id(tenant: str, request_id: str) -> str:
    """The id a call's request has between the processes: the client's id scoped to its
    tenant and made unique to this call, so that no two clients (and no retry and the
    attempt it replaces) ever share one. "/" is in no client id (validation.ID_PATTERN)."""
    return f"{tenant}/{request_id}/{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ms: float  # arrival to an executor accepting the request
    ttft_ms: float  # arrival to the first token
    total_ms: float  # arrival to the last chunk


@dataclass(slots=True)
class Chunk:
    """A piece of the streamed completion; the last one has finish_reason, usage and timings."""

    text: str
    token_ids: list[int]
    logprobs: list[inference_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set on the last chunk
    usage: Usage | None = None
    timings: Timings | None = None
    error_message: str = ""
    priority: int = 0  # set on the last chunk: the priority the request ran at
    priority_clamped: bool = False
    index: int = 0  # the choice it belongs to (SamplingParams.n, best_of)
    # SamplingParams.prompt_logprobs, on the first chunk: entry i is prompt token i + 1's
    prompt_logprobs: list[inference_pb2.TokenLogprob] | None = None


class BackgroundTasks:
    """Fire-and-forget coroutines that must outlive a cancelled call (kept referenced, logged)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coroutine: Coroutine[object, object, None], what: str) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, what))

    def _done(self, task: asyncio.Task[None], what: str) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %s", what, task.exception())


@dataclass(slots=True)
class GenerationDeps:
    """What every Generation of a gateway shares."""

    router: TokenRouter
    queue: RequestQueue
    model_text: ModelText
    background: BackgroundTasks
    reply_to: str  # this gateway's TokenSink address
    queue_timeout_s: float
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    max_attempts: int = 3  # runs of a request whose executor was lost, before it fails
    accounting: Accounting | None = None  # None: usage is not recorded

    def count_refusal(self, tenant: str, refusal: QuotaExceeded) -> None:
        if self.accounting is not None:
            self.accounting.refused(tenant, refusal.limit)


class Generation:
    """Streams one validated request."""

    def __init__(
        self,
        spec: GenerationSpec,
        deps: GenerationDeps,
        tenant: str,
        session_executor_id: str = "",
        admission: Admission | None = None,
        choice: tuple[str, int] | None = None,
        params: internal_pb2.SamplingParams | None = None,
    ) -> None:
        """
        Args:
            admission: what the call takes from its tenant's quotas, when not taken yet: it
                is taken in the round trip that queues the request.
            choice: (the request's internal id, the choice's index) of one choice of a
                request of several sequences (gateway/choices.py); None: a request of one.
            params: with `choice`, the choices' shared sampling parameters (n 1, no best_of).
        """
        self.spec = spec
        self.admission = admission
        self.deps = deps
        self.tenant = tenant
        if choice is None:
            self.request_id = internal_request_id(tenant, spec.request_id)
            self.index = 0
            self.queued_id = self.request_id  # the id it is queued under now
            params = sampling_params_to_pb(spec.sampling)
        else:
            self.queued_id, self.index = choice
            self.request_id = choice_request_id(*choice)
        self.params = params  # built once, sent on each attempt
        self.session_executor_id = session_executor_id
        self.moved_to = ""  # the executor a drain moved its KV to: its next attempt runs there
        # attempts handed on by drains or replaced on their executor (not counted against
        # max_attempts)
        self.num_moves = 0
        self.tokens: list[int] = []
        self.sent_prompt_logprobs = False
        sampling = spec.sampling
        self.detokenizer = IncrementalDetokenizer(
            deps.model_text.tokenizer, spec.prompt_token_ids, sampling.skip_special_tokens
        )
        self.stops = StopStringMatcher(spec.stop, sampling.include_stop_str_in_output)
        self.arrival = time.monotonic()
        self.arrival_unix_ms = int(time.time() * 1000)
        self.queue_deadline = self.arrival + deps.queue_timeout_s
        self.accepted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_cached_tokens = 0
        self.attempt = 0  # of the QueuedRequest now queued or running
        self.executor_id = ""  # the executor that last reported this request
        self.waiting_for_executor = True
        self.no_executor_since: float | None = None  # first seen with no executor alive
        self.redis_down_since: float | None = None  # first seen with Redis not answering
        self.maybe_queued = False  # false until enqueue, and after a refusal by it
        self.admitted = False  # enqueue took it: its tenant is charged for it once it ends
        self.accounted = False
        self.finished = False
        self.log_fields = request_fields(self.request_id, spec.session_id)

    @property
    def client_key(self) -> tuple[str, str]:
        """(tenant, the id the client knows it by; a choice's own past choice 0)."""
        client_id = self.spec.request_id
        return (self.tenant, choice_request_id(client_id, self.index) if self.index else client_id)

    def queued_request(self) -> internal_pb2.QueuedRequest:
        """The QueuedRequest of the current attempt. Of a request's choices only choice 0
        names the session: its executor keeps the session's blocks (engine.add_request)."""
        deadline_unix_ms = int(time.time() * 1000 + (self.queue_deadline - time.monotonic()) * 1000)
        in_session = self.index == 0
        return internal_pb2.QueuedRequest(
            request_id=self.request_id,
            reply_to=self.deps.reply_to,
            tenant=self.tenant,
            session_id=self.spec.session_id if in_session else "",
            session_executor_id=self.moved_to or (self.session_executor_id if in_session else ""),
            priority=self.spec.priority,
            prompt_token_ids=self.spec.prompt_token_ids,
            resume_token_ids=self.tokens,
            params=self.params,
            arrival_unix_ms=self.arrival_unix_ms,
            queue_deadline_unix_ms=deadline_unix_ms,
            attempt=self.attempt,
            max_attempts=self.deps.max_attempts + self.num_moves,
            choice_index=self.index,
        )

    async def stream(self) -> AsyncIterator[Chunk]:
        """Queue the request and yield its chunks until the last one.

        Raises:
            Unavailable, ResourceExhausted: it could not be queued.
            DeadlineExceeded: no executor accepted it within queue_timeout_s.
        """
        inbox = self.track()
        async with contextlib.aclosing(self.run(inbox, self.enqueue())) as chunks:
            async for chunk in chunks:
                yield chunk

    def track(self) -> asyncio.Queue[RequestEvent]:
        """Start receiving its events (before it is queued: output may come at once)."""
        return self.deps.router.track(self.request_id, self.client_key)

    async def run(
        self, inbox: asyncio.Queue[RequestEvent], queuing: Awaitable[None] | None
    ) -> AsyncIterator[Chunk]:
        """Yield its chunks until the last one, after `queuing` (None: queued already, as
        one choice of a request queued by gateway/choices.py); it stops tracking at the end."""
        try:
            if queuing is not None:
                await queuing
            self.maybe_queued = True
            self.admitted = True
            self._log_queued()
            while not self.finished:
                chunk = await self._handle(await self._next_event(inbox))
                if chunk is not None:
                    chunk.index = self.index
                    yield chunk
        finally:
            if not self.finished:
                log.info(
                    "request stopped before its last chunk (client gone or call failed)",
                    extra=self.log_fields,
                )
                self._cancel(internal_pb2.ABORT_REASON_CLIENT_CANCELLED)
            self.deps.router.untrack(self.request_id)
            self._account()

    async def enqueue(self, queued: internal_pb2.QueuedRequest | None = None) -> None:
        """Queues the request (or `queued`, a request of several choices); a refusal (no
        executor, queue full) leaves nothing to cancel, so nothing outlives the call, and
        the client may retry under the same request_id."""
        self.maybe_queued = True
        try:
            await self.deps.queue.enqueue(queued or self.queued_request(), self.admission)
        except QuotaExceeded as refusal:
            self.maybe_queued = False
            self.deps.count_refusal(self.tenant, refusal)
            raise
        except ServiceError:
            self.maybe_queued = False
            raise

    def _log_queued(self) -> None:
        num_prompt_tokens = len(self.spec.prompt_token_ids) if self.index == 0 else 0
        self.deps.metrics.prompt_tokens.labels(self.spec.api).inc(num_prompt_tokens)
        log.info("request queued: %d prompt tokens", num_prompt_tokens, extra=self.log_fields)

    async def _next_event(self, inbox: asyncio.Queue[RequestEvent]) -> RequestEvent:
        """The next event; while no executor runs the request, it fails once
        queue_timeout_s passes, or once no executor has been alive for NO_EXECUTOR_GRACE_S
        (a re-queued request skips enqueue's check, and the last executor may leave)."""
        while self.waiting_for_executor:
            wait_s = min(self.queue_deadline - time.monotonic(), LIVENESS_CHECK_S)
            try:
                # a timer, not wait_for: that wraps every wait in a task of its own, and
                # thousands of waiting requests wake twice a second
                async with asyncio.timeout(max(0.0, wait_s)):
                    return await inbox.get()
            except TimeoutError:
                pass
            if time.monotonic() >= self.queue_deadline:
                self._stop_waiting(
                    internal_pb2.ABORT_REASON_DEADLINE, "no executor took it in time"
                )
                raise DeadlineExceeded(
                    f"no executor took the request within queue_timeout_s "
                    f"({self.deps.queue_timeout_s:g} s)"
                )
            await self._check_an_executor_is_alive()
        return await inbox.get()

    async def _check_an_executor_is_alive(self) -> None:
        alive = await self.deps.queue.any_executor_alive()
        now = time.monotonic()
        if alive is None:
            self._redis_did_not_answer(now)
            return
        if self.redis_down_since is not None:
            await self._queue_again_after_outage()
        if alive:
            self.no_executor_since = None
            return
        if self.no_executor_since is None:
            self.no_executor_since = now
        elif now - self.no_executor_since >= NO_EXECUTOR_GRACE_S:
            self._stop_waiting(internal_pb2.ABORT_REASON_NO_EXECUTOR, "no executor is alive")
            raise Unavailable("no executor is alive; try again later")

    def _redis_did_not_answer(self, now: float) -> None:
        """Keeps waiting through a Redis outage (a failover, a restart) for a while: the
        executors go on without Redis, and the request is queued again once it answers."""
        self.no_executor_since = None
        if self.redis_down_since is None:
            self.redis_down_since = now
        elif now - self.redis_down_since >= REDIS_DOWN_GRACE_S:
            self._stop_waiting(internal_pb2.ABORT_REASON_NO_EXECUTOR, "redis unreachable")
            raise Unavailable(
                f"redis has not answered for {REDIS_DOWN_GRACE_S:g} s while the request "
                "waited for an executor; try again later"
            )

    async def _queue_again_after_outage(self) -> None:
        """Queues the waiting request again once Redis answers after an outage: a failover
        may have lost its entry (replication lag), or a restart without persistence. A copy
        that survived is harmless: processes are idempotent by request_id (the scheduler
        keeps one, an executor runs an id once, and this gateway takes tokens from one)."""
        try:
            await self.deps.queue.requeue(self.queued_request())
        except redis.RedisError as error:
            log.warning("could not queue the request again: %s", error, extra=self.log_fields)
            return
        self.redis_down_since = None
        self.queued_id = self.request_id  # a choice of a group is queued again alone
        log.info("request queued again after a redis outage", extra=self.log_fields)

    def _stop_waiting(self, reason: internal_pb2.AbortReason, why: str) -> None:
        self._cancel(reason)
        self.finished = True
        log.info("request stopped in the queue: %s", why, extra=self.log_fields)

    def _cancel(self, reason: internal_pb2.AbortReason) -> None:
        """Stop the request wherever it is: on its executor, or still in the queue."""
        self.deps.router.abort(self.request_id, reason)
        if self.waiting_for_executor and self.maybe_queued:
            self.deps.background.spawn(
                self.deps.queue.mark_cancelled(self.queued_id), "marking a request cancelled"
            )

    async def _handle(self, event: RequestEvent) -> Chunk | None:
        if isinstance(event, ExecutorLost):
            return await self._requeue(event)
        if isinstance(event, ClientCancelled):
            self._cancel(internal_pb2.ABORT_REASON_CLIENT_CANCELLED)
            return self._last_chunk(Chunk(self.stops.flush(), []), FinishReason.ABORT)
        return self._apply(event)

    async def _requeue(self, lost: ExecutorLost) -> Chunk | None:
        """Runs the request again, from the tokens already streamed, after its executor was
        lost (the last chunk, FINISH_REASON_ERROR, once it was lost max_attempts times),
        handed it on while draining (on the executor that took its KV, when one did), or
        replaced its run with one that started over."""
        executor_id = lost.executor_id
        self.attempt = lost.attempt
        self.num_moves += lost.moved or lost.replaced
        self.moved_to = lost.moved_to
        used_up = attempts_used_up(self.queued_request())
        if used_up is not None:
            log.warning("%s (last %s)", used_up, executor_id, extra=self.log_fields)
            chunk = Chunk(self._flush_text()[0], [], error_message=used_up)
            return self._last_chunk(chunk, FinishReason.ERROR)
        self.deps.router.resume_from(self.request_id, len(self.tokens))
        self.queued_id = self.request_id  # a choice runs again alone, under its own id
        self.waiting_for_executor = True
        self.no_executor_since = None  # the grace starts anew for this attempt
        self.queue_deadline = time.monotonic() + self.deps.queue_timeout_s
        self.session_executor_id = ""
        self.deps.metrics.requeues.labels(self.spec.api).inc()
        if lost.replaced:
            log.info(
                "request's run on %s was replaced by one that started over behind its %d "
                "tokens; re-queued from them (attempt %d)",
                executor_id,
                len(self.tokens),
                self.attempt,
                extra=self.log_fields,
            )
        elif lost.moved:
            kv = "moved" if lost.moved_to else "recomputed"
            self.deps.metrics.drain_hand_ons.labels(kv).inc()
            log.info(
                "request handed on by draining executor %s after %d tokens; re-queued for %s "
                "(attempt %d)",
                executor_id,
                len(self.tokens),
                lost.moved_to or "any executor",
                self.attempt,
                extra=self.log_fields,
            )
        else:
            log.warning(
                "request lost its executor %s after %d tokens; re-queued (attempt %d)",
                executor_id,
                len(self.tokens),
                self.attempt,
                extra=self.log_fields,
            )
        try:
            await self.deps.queue.requeue(self.queued_request())
        except redis.RedisError as error:  # queued again once Redis answers
            log.warning("could not re-queue the request: %s", error, extra=self.log_fields)
            self.redis_down_since = time.monotonic()
        return None

    def _apply(self, update: TokenUpdate) -> Chunk | None:
        now = time.monotonic()
        if update.accepted and self.accepted_at is None:
            self.accepted_at = now
        self.waiting_for_executor = False
        self.executor_id = update.executor_id
        self.attempt = max(self.attempt, update.attempt)
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        new_ids, new_logprobs = self._unseen(update)
        chunk = self._text_of(new_ids, new_logprobs, now)
        if update.prompt_logprobs and not self.sent_prompt_logprobs:
            chunk.prompt_logprobs = update.prompt_logprobs  # a resumed run sends them again
            self.sent_prompt_logprobs = True
        if chunk.finish_reason is not None:
            if not update.finished:
                self.deps.router.abort(self.request_id, internal_pb2.ABORT_REASON_STOP_STRING)
            return self._last_chunk(chunk, chunk.finish_reason)
        if update.finished:
            tail, stopped = self._flush_text()
            chunk.text += tail
            chunk.error_message = update.error_message
            reason = FinishReason.STOP if stopped else update.finish_reason or FinishReason.STOP
            return self._last_chunk(chunk, reason)
        return chunk if new_ids else None

    def _unseen(self, update: TokenUpdate) -> tuple[list[int], list[inference_pb2.TokenLogprob]]:
        """The update's tokens past those already streamed (re-sends are dropped by offset)."""
        skip = len(self.tokens) - update.offset
        if skip < 0:
            log.warning(
                "tokens from offset %d but only %d streamed; dropped",
                update.offset,
                len(self.tokens),
                extra=self.log_fields,
            )
            return [], []
        return update.token_ids[skip:], update.logprobs[skip:]

    def _text_of(
        self, new_ids: list[int], new_logprobs: list[inference_pb2.TokenLogprob], now: float
    ) -> Chunk:
        """A chunk for the new tokens; finish_reason STOP when a stop string matched."""
        if not new_ids:
            return Chunk("", [], [])
        self._observe_tokens(len(new_ids), now)
        self.tokens.extend(new_ids)
        result = self.stops.feed(self.detokenizer.add(new_ids))
        return Chunk(
            result.text, new_ids, new_logprobs, FinishReason.STOP if result.stopped else None
        )

    def _observe_tokens(self, num_tokens: int, now: float) -> None:
        metrics = self.deps.metrics
        metrics.output_tokens.labels(self.spec.api).inc(num_tokens)
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft_seconds.labels(self.spec.api).observe(now - self.arrival)
        else:
            metrics.itl_seconds.labels(self.spec.api).observe(now - self.last_token_at)
        self.last_token_at = now

    def _flush_text(self) -> tuple[str, bool]:
        """The text held back at the end, and whether it completed a stop string."""
        result = self.stops.feed(self.detokenizer.flush())
        if result.stopped:
            return result.text, True
        return result.text + self.stops.flush(), False

    def _last_chunk(self, chunk: Chunk, finish_reason: FinishReason) -> Chunk:
        self.finished = True
        now = time.monotonic()
        chunk.finish_reason = finish_reason
        chunk.usage = self._usage()
        chunk.timings = Timings(
            queue_ms=_ms_since(self.arrival, self.accepted_at or now),
            ttft_ms=_ms_since(self.arrival, self.first_token_at or now),
            total_ms=_ms_since(self.arrival, now),
        )
        chunk.priority = self.spec.priority
        chunk.priority_clamped = self.spec.priority_clamped
        self._record_finish(chunk)
        return chunk

    def _usage(self) -> Usage:
        """Its tokens; the prompt counts on choice 0 only (once per request)."""
        first = self.index == 0
        return Usage(
            prompt_tokens=len(self.spec.prompt_token_ids) if first else 0,
            completion_tokens=len(self.tokens),
            cached_prompt_tokens=self.num_cached_tokens if first else 0,
        )

    def _account(self) -> None:
        """Counts the request in its tenant's usage and charges the tokens streamed so far,
        once, however its stream ends: its last chunk, or a cancel, a deadline or an error
        before one (tokens a client read and then hung up on are charged like any)."""
        accounting = self.deps.accounting
        if self.accounted or not self.admitted or accounting is None:
            return
        self.accounted = True
        usage = self._usage()
        accounting.count(self.tenant, usage)
        accounting.record(self.tenant, usage)

    def _record_finish(self, chunk: Chunk) -> None:
        self._account()
        metrics = self.deps.metrics
        metrics.finished_requests.labels(chunk.finish_reason, self.spec.api).inc()
        metrics.e2e_seconds.labels(self.spec.api).observe(chunk.timings.total_ms / 1000.0)
        log.info(
            "request finished: %s, %d tokens, queue %.1f ms, ttft %.1f ms, total %.1f ms",
            chunk.finish_reason,
            len(self.tokens),
            chunk.timings.queue_ms,
            chunk.timings.ttft_ms,
            chunk.timings.total_ms,
            extra={**self.log_fields, "executor_id": self.executor_id},
        )


def _ms_since(start: float, end: float) -> float:
    return (end - start) * 1000.0
