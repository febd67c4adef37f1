"""One request's life on the gateway: queue it, stream its tokens as text, finish it.

A Generation queues its QueuedRequest, then turns the events of its inbox
(TokenSink output, a lost executor, a client cancel) into chunks: new tokens
are de-duplicated by offset, detokenized incrementally and checked for stop
strings. If its executor goes away it is re-queued with the tokens already
streamed, so the client's stream goes on without a gap or a repeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from common.logs import request_fields
from common.sampling_pb import sampling_params_to_pb
from gateway.accounting import Accounting
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import DeadlineExceeded, Unavailable
from gateway.metrics import GatewayMetrics
from gateway.model_text import ModelText
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
# with UNAVAILABLE once none has been for NO_EXECUTOR_GRACE_S (a heartbeat lives 2 s).
LIVENESS_CHECK_S = 0.5
NO_EXECUTOR_GRACE_S = 1.0


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
    accounting: Accounting | None = None  # None: usage is not recorded


class Generation:
    """Streams one validated request."""

    def __init__(
        self, spec: GenerationSpec, deps: GenerationDeps, tenant: str, session_executor_id: str = ""
    ) -> None:
        self.spec = spec
        self.deps = deps
        self.tenant = tenant
        self.session_executor_id = session_executor_id
        self.tokens: list[int] = []
        self.detokenizer = IncrementalDetokenizer(deps.model_text.tokenizer, spec.prompt_token_ids)
        self.stops = StopStringMatcher(spec.stop)
        self.arrival = time.monotonic()
        self.arrival_unix_ms = int(time.time() * 1000)
        self.queue_deadline = self.arrival + deps.queue_timeout_s
        self.accepted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_cached_tokens = 0
        self.attempt = 0
        self.executor_id = ""  # the executor that last reported this request
        self.waiting_for_executor = True
        self.no_executor_since: float | None = None  # first seen with no executor alive
        self.finished = False
        self.log_fields = request_fields(spec.request_id, spec.session_id)

    def queued_request(self) -> internal_pb2.QueuedRequest:
        """The QueuedRequest of the current attempt."""
        deadline_unix_ms = int(time.time() * 1000 + (self.queue_deadline - time.monotonic()) * 1000)
        return internal_pb2.QueuedRequest(
            request_id=self.spec.request_id,
            reply_to=self.deps.reply_to,
            tenant=self.tenant,
            session_id=self.spec.session_id,
            session_executor_id=self.session_executor_id,
            priority=self.spec.priority,
            prompt_token_ids=self.spec.prompt_token_ids,
            resume_token_ids=self.tokens,
            params=sampling_params_to_pb(self.spec.sampling),
            arrival_unix_ms=self.arrival_unix_ms,
            queue_deadline_unix_ms=deadline_unix_ms,
            attempt=self.attempt,
        )

    async def stream(self) -> AsyncIterator[Chunk]:
        """Queue the request and yield its chunks until the last one.

        Raises:
            Unavailable, ResourceExhausted: it could not be queued.
            DeadlineExceeded: no executor accepted it within queue_timeout_s.
        """
        router = self.deps.router
        inbox = router.track(self.spec.request_id)
        try:
            await self.deps.queue.enqueue(self.queued_request())
            self._log_queued()
            while not self.finished:
                chunk = await self._handle(await self._next_event(inbox))
                if chunk is not None:
                    yield chunk
        finally:
            if not self.finished:
                log.info(
                    "request stopped before its last chunk (client gone or call failed)",
                    extra=self.log_fields,
                )
                self._cancel(internal_pb2.ABORT_REASON_CLIENT_CANCELLED)
            router.untrack(self.spec.request_id)

    def _log_queued(self) -> None:
        num_prompt_tokens = len(self.spec.prompt_token_ids)
        self.deps.metrics.prompt_tokens.inc(num_prompt_tokens)
        log.info("request queued: %d prompt tokens", num_prompt_tokens, extra=self.log_fields)

    async def _next_event(self, inbox: asyncio.Queue[RequestEvent]) -> RequestEvent:
        """The next event; while no executor runs the request, it fails once
        queue_timeout_s passes, or once no executor has been alive for NO_EXECUTOR_GRACE_S
        (a re-queued request skips enqueue's check, and the last executor may leave)."""
        while self.waiting_for_executor:
            wait_s = min(self.queue_deadline - time.monotonic(), LIVENESS_CHECK_S)
            try:
                return await asyncio.wait_for(inbox.get(), max(0.0, wait_s))
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
        if alive is not False:  # alive, or Redis cannot tell now: keep waiting
            self.no_executor_since = None
            return
        now = time.monotonic()
        if self.no_executor_since is None:
            self.no_executor_since = now
        elif now - self.no_executor_since >= NO_EXECUTOR_GRACE_S:
            self._stop_waiting(internal_pb2.ABORT_REASON_NO_EXECUTOR, "no executor is alive")
            raise Unavailable("no executor is alive; try again later")

    def _stop_waiting(self, reason: internal_pb2.AbortReason, why: str) -> None:
        self._cancel(reason)
        self.finished = True
        log.info("request stopped in the queue: %s", why, extra=self.log_fields)

    def _cancel(self, reason: internal_pb2.AbortReason) -> None:
        """Stop the request wherever it is: on its executor, or still in the queue."""
        self.deps.router.abort(self.spec.request_id, reason)
        if self.waiting_for_executor:
            self.deps.background.spawn(
                self.deps.queue.mark_cancelled(self.spec.request_id), "marking a request cancelled"
            )

    async def _handle(self, event: RequestEvent) -> Chunk | None:
        if isinstance(event, ExecutorLost):
            await self._requeue(event.executor_id)
            return None
        if isinstance(event, ClientCancelled):
            self._cancel(internal_pb2.ABORT_REASON_CLIENT_CANCELLED)
            return self._last_chunk(Chunk(self.stops.flush(), []), FinishReason.ABORT)
        return self._apply(event)

    async def _requeue(self, executor_id: str) -> None:
        self.attempt += 1
        self.waiting_for_executor = True
        self.no_executor_since = None  # the grace starts anew for this attempt
        self.queue_deadline = time.monotonic() + self.deps.queue_timeout_s
        self.session_executor_id = ""
        self.deps.metrics.requeues.inc()
        log.warning(
            "request %s lost its executor %s after %d tokens; re-queued (attempt %d)",
            self.spec.request_id,
            executor_id,
            len(self.tokens),
            self.attempt,
            extra=self.log_fields,
        )
        await self.deps.queue.requeue(self.queued_request())

    def _apply(self, update: TokenUpdate) -> Chunk | None:
        now = time.monotonic()
        if update.accepted and self.accepted_at is None:
            self.accepted_at = now
        self.waiting_for_executor = False
        self.executor_id = update.executor_id
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        new_ids, new_logprobs = self._unseen(update)
        chunk = self._text_of(new_ids, new_logprobs, now)
        if chunk.finish_reason is not None:
            if not update.finished:
                self.deps.router.abort(self.spec.request_id, internal_pb2.ABORT_REASON_STOP_STRING)
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
                "request %s: tokens from offset %d but only %d streamed; dropped",
                self.spec.request_id,
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
        metrics.output_tokens.inc(num_tokens)
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft_seconds.observe(now - self.arrival)
        else:
            metrics.itl_seconds.observe(now - self.last_token_at)
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
        chunk.usage = Usage(
            prompt_tokens=len(self.spec.prompt_token_ids),
            completion_tokens=len(self.tokens),
            cached_prompt_tokens=self.num_cached_tokens,
        )
        chunk.timings = Timings(
            queue_ms=_ms_since(self.arrival, self.accepted_at or now),
            ttft_ms=_ms_since(self.arrival, self.first_token_at or now),
            total_ms=_ms_since(self.arrival, now),
        )
        chunk.priority = self.spec.priority
        chunk.priority_clamped = self.spec.priority_clamped
        self._record_finish(chunk)
        return chunk

    def _record_finish(self, chunk: Chunk) -> None:
        accounting = self.deps.accounting
        if accounting is not None:
            accounting.count(self.tenant, chunk.usage)
            self.deps.background.spawn(
                accounting.record(self.tenant, chunk.usage), "recording a tenant's usage"
            )
        metrics = self.deps.metrics
        metrics.finished_requests.labels(chunk.finish_reason).inc()
        metrics.e2e_seconds.observe(chunk.timings.total_ms / 1000.0)
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
