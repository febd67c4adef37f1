"""TokenSink: executors stream tokens in; the router hands them to the waiting requests.

Each request being streamed by this gateway has an inbox (an asyncio.Queue of
events). An executor's TokenSink stream delivers TokenBatch entries into those
inboxes and carries aborts back; when the stream breaks, every unfinished
request it owned gets an ExecutorLost event (the request is then re-queued).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from grpc import aio

from common.finish_reason import FinishReason
from common.finish_reason_pb import finish_reason_from_pb
from common.tls import SINK_SECRET_KEY, secret_matches
from gateway.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from protos.kvgate.v1 import inference_pb2, internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenUpdate:
    """One RequestTokens entry from an executor."""

    executor_id: str
    offset: int  # position in the completion of token_ids[0]
    token_ids: list[int]
    logprobs: list[inference_pb2.TokenLogprob]  # one per token id, when the request asked
    accepted: bool  # the executor admitted this attempt with this entry
    finished: bool
    finish_reason: FinishReason | None  # set when finished
    num_cached_tokens: int
    error_message: str = ""
    attempt: int = 0
    # SamplingParams.prompt_logprobs, with the first token: entry i is prompt token i + 1's
    prompt_logprobs: list[inference_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ExecutorLost:
    """The executor running the request went away before finishing it, or (`moved`) handed
    it on while draining."""

    executor_id: str
    attempt: int  # the attempt to run next: output of earlier ones is refused from now on
    moved: bool = False  # handed on by a drain: the move does not count as a lost attempt
    moved_to: str = ""  # the executor that holds its KV now (empty: none)
    # The executor replaced the run the client streams from with one that started over
    # behind the client's tokens (its refused output is aborted): not a lost attempt either.
    replaced: bool = False


@dataclass(frozen=True, slots=True)
class ClientCancelled:
    """The client cancelled the request (a Chat CancelTurn)."""


RequestEvent = TokenUpdate | ExecutorLost | ClientCancelled


@dataclass(eq=False, slots=True)
class ExecutorConnection:
    """One open TokenSink stream from an executor."""

    executor_id: str
    outbox: asyncio.Queue[internal_pb2.ConnectResponse] = field(default_factory=asyncio.Queue)
    heartbeat_gone_since: float | None = None  # monotonic time its heartbeat was first missed

    def send_abort(
        self, request_ids: list[str], reason: internal_pb2.AbortReason, **only: list[int]
    ) -> None:
        """Asks the executor to stop these requests; `only` (Abort's `attempts`, `runs`:
        one per id) narrows it to the runs the gateway refused output of."""
        abort = internal_pb2.Abort(request_ids=request_ids, reason=reason, **only)
        self.outbox.put_nowait(internal_pb2.ConnectResponse(abort=abort))


@dataclass(slots=True)
class TrackedRequest:
    """A request this gateway streams: its event inbox and the stream that owns it."""

    client_key: tuple[str, str]  # (tenant, the client's request_id)
    inbox: asyncio.Queue[RequestEvent] = field(default_factory=asyncio.Queue)
    owner: ExecutorConnection | None = None
    run: int = 0  # the owner's number of the run it takes output of (RequestTokens.run)
    num_taken: int = 0  # tokens taken so far (the end of the last entry taken)
    attempt: int = 0  # the attempt whose output it takes (or a later one: a hand-back)
    resume_offset: int = 0  # tokens streamed when its executor was lost: a run resumes there

    def takes(self, connection: ExecutorConnection, entry: internal_pb2.RequestTokens) -> bool:
        """Whether `entry` from `connection` is this request's output.

        It is when it comes from the run that the request's executor runs (or from a run
        there that replaced it and starts where the taken tokens end), or, while no executor
        runs it, when it starts a run (its accepted entry) of the current attempt or a later
        one (an inbox hand-back) from the tokens already streamed, or when it refuses the
        request. Not taken, and aborted: output of an attempt taken from a lost executor, a
        run that starts over instead of resuming, and a second run of one attempt (a request
        queued twice across a failover, or assigned twice by a scheduler that lost its lock).
        """
        if entry.attempt < self.attempt:
            return False
        if self.owner is not None:
            if self.owner is not connection:
                return False
            return entry.run == self.run or (entry.accepted and entry.offset == self.num_taken)
        if entry.accepted:
            return entry.offset >= self.resume_offset
        return entry.finished and not entry.token_ids

    def replaced_by(
        self, connection: ExecutorConnection, entry: internal_pb2.RequestTokens
    ) -> bool:
        """Whether `entry` (not taken) starts a run that replaced the one taken: its executor
        runs the id only once, so the run taken is over there (a choice queued again alone
        replaces its group's restart; behind the client's tokens, an unseeded one would not
        continue them)."""
        return self.owner is connection and entry.accepted and entry.run != self.run


def update_from_pb(executor_id: str, entry: internal_pb2.RequestTokens) -> TokenUpdate:
    """Convert one RequestTokens entry at the edge."""
    return TokenUpdate(
        executor_id=executor_id,
        offset=entry.offset,
        token_ids=list(entry.token_ids),
        logprobs=list(entry.logprobs),
        accepted=entry.accepted,
        finished=entry.finished,
        finish_reason=finish_reason_from_pb(entry.finish_reason) if entry.finished else None,
        num_cached_tokens=entry.num_cached_tokens,
        error_message=entry.error_message,
        attempt=entry.attempt,
        prompt_logprobs=list(entry.prompt_logprobs),
    )


# An executor whose heartbeat stays gone this long while Redis answers is lost (crashed,
# wedged, or cut off): its requests are re-queued (a heartbeat lives 2 s; the grace covers a
# Redis restart, after which heartbeats come back within their 0.5 s interval).
HEARTBEAT_GONE_GRACE_S = 1.0


class TokenRouter:
    """Routes executor output to requests and aborts to executors."""

    def __init__(self) -> None:
        self._requests: dict[str, TrackedRequest] = {}
        self._client_ids: set[tuple[str, str]] = set()
        self._connections: set[ExecutorConnection] = set()

    def track(self, request_id: str, client_key: tuple[str, str]) -> asyncio.Queue[RequestEvent]:
        """Start receiving events for `request_id` (the internal id).

        Args:
            client_key: (tenant, the client's request_id): one call at a time per key.

        Raises:
            FailedPrecondition: the client's request id is already streaming here.
        """
        if client_key in self._client_ids:
            raise FailedPrecondition(f"request_id: {client_key[1]!r} is already running")
        tracked = TrackedRequest(client_key)
        self._requests[request_id] = tracked
        self._client_ids.add(client_key)
        return tracked.inbox

    def untrack(self, request_id: str) -> None:
        """Stop receiving events; later output for the id is answered with an abort."""
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self._client_ids.discard(tracked.client_key)

    def post(self, request_id: str, event: RequestEvent) -> None:
        """Put an event in a tracked request's inbox (ignored for unknown ids)."""
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.inbox.put_nowait(event)

    def cancel_client_request(self, client_key: tuple[str, str]) -> bool:
        """Cancel the request a client knows as `client_key` (tenant, its request_id), every
        choice of it (gateway/choices.py), as if the client had cancelled its call.
        Returns: whether one was streaming here."""
        tenant, client_id = client_key
        cancelled = False
        for tracked in self._requests.values():
            key_tenant, key_id = tracked.client_key
            if key_tenant == tenant and key_id.partition("#")[0] == client_id:
                tracked.inbox.put_nowait(ClientCancelled())
                cancelled = True
        return cancelled

    @property
    def num_requests(self) -> int:
        """Requests streaming through this gateway now."""
        return len(self._requests)

    def abort(self, request_id: str, reason: internal_pb2.AbortReason) -> None:
        """Send an abort to the executor running the request, or to all when none is known yet."""
        tracked = self._requests.get(request_id)
        owner = tracked.owner if tracked is not None else None
        for connection in [owner] if owner is not None else list(self._connections):
            connection.send_abort([request_id], reason)

    def connect(self, executor_id: str) -> ExecutorConnection:
        """Register a new TokenSink stream."""
        connection = ExecutorConnection(executor_id)
        self._connections.add(connection)
        log.info("executor %s connected its token stream", executor_id)
        return connection

    def disconnect(self, connection: ExecutorConnection) -> None:
        """The stream ended: its unfinished requests get ExecutorLost."""
        self._connections.discard(connection)
        lost = self._take_requests_of(connection)
        log.info(
            "executor %s token stream closed; %d requests lost", connection.executor_id, len(lost)
        )

    def _take_requests_of(self, connection: ExecutorConnection) -> list[str]:
        """Every request `connection` owns gets ExecutorLost, and no more of its output.

        Returns: their ids.
        """
        lost = [rid for rid, t in self._requests.items() if t.owner is connection]
        for request_id in lost:
            self._lose(request_id, connection)
        return lost

    def _lose(
        self, request_id: str, connection: ExecutorConnection, replaced: bool = False
    ) -> None:
        """The request's run on `connection` is over: no more of its output, and the request
        gets ExecutorLost (it is re-queued from the tokens it has)."""
        tracked = self._requests[request_id]
        tracked.owner = None
        tracked.attempt += 1
        lost = ExecutorLost(connection.executor_id, tracked.attempt, replaced=replaced)
        tracked.inbox.put_nowait(lost)

    def resume_from(self, request_id: str, offset: int) -> None:
        """The request's next run must resume after `offset` tokens (those streamed)."""
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.resume_offset = offset

    def observe_heartbeats(self, live_executor_ids: set[str], now: float) -> None:
        """Takes the requests away from an executor whose heartbeat has been gone for
        HEARTBEAT_GONE_GRACE_S (its process hung, its step loop is stuck, or its host is cut
        off, while its token stream stays open); they are re-queued, and it is told to abort
        them. Called with what Redis says now, only when Redis answers."""
        for connection in list(self._connections):
            if connection.executor_id in live_executor_ids:
                connection.heartbeat_gone_since = None
                continue
            if connection.heartbeat_gone_since is None:
                connection.heartbeat_gone_since = now
                continue
            if now - connection.heartbeat_gone_since < HEARTBEAT_GONE_GRACE_S:
                continue
            lost = self._take_requests_of(connection)
            if lost:
                connection.send_abort(lost, internal_pb2.ABORT_REASON_UNKNOWN_REQUEST)
                log.warning(
                    "executor %s: no heartbeat for %.1f s; its %d requests are re-queued",
                    connection.executor_id,
                    now - connection.heartbeat_gone_since,
                    len(lost),
                )

    def deliver(self, connection: ExecutorConnection, batch: internal_pb2.TokenBatch) -> None:
        """Hand a TokenBatch's entries to their requests; abort entries nobody waits for."""
        unknown: list[internal_pb2.RequestTokens] = []
        for entry in batch.requests:
            tracked = self._requests.get(entry.request_id)
            if tracked is None or not tracked.takes(connection, entry):
                if not entry.finished:
                    unknown.append(entry)
                if tracked is not None and tracked.replaced_by(connection, entry):
                    self._lose(entry.request_id, connection, replaced=True)
                continue
            tracked.owner = None if entry.finished or entry.moved else connection
            tracked.run = entry.run
            tracked.num_taken = max(tracked.num_taken, entry.offset + len(entry.token_ids))
            tracked.attempt = entry.attempt
            tracked.inbox.put_nowait(update_from_pb(connection.executor_id, entry))
            if entry.moved and not entry.finished:  # a drain handed it on: it runs again
                tracked.attempt += 1
                moved = ExecutorLost(connection.executor_id, tracked.attempt, True, entry.moved_to)
                tracked.inbox.put_nowait(moved)
        if unknown:  # aborted run by run: another run of an id may be there, to be kept
            connection.send_abort(
                [e.request_id for e in unknown],
                internal_pb2.ABORT_REASON_UNKNOWN_REQUEST,
                attempts=[e.attempt for e in unknown],
                runs=[e.run for e in unknown],
            )


def _log_read_error(connection: ExecutorConnection, reader: asyncio.Task[None]) -> None:
    if reader.done() and not reader.cancelled() and reader.exception() is not None:
        log.warning("token stream of %s broke: %s", connection.executor_id, reader.exception())


class TokenSinkServicer(internal_pb2_grpc.TokenSinkServicer):
    """The gateway's internal service executors connect to. With a shared secret, a stream
    that does not send it is refused before any of its messages is read; with allowed names,
    so is a stream whose peer certificate names none of them (mutual TLS has checked that
    the certificate is the client CA's)."""

    def __init__(
        self,
        router: TokenRouter,
        secret: str | None = None,
        allowed_names: frozenset[str] = frozenset(),
    ) -> None:
        self.router = router
        self.secret = secret
        self.allowed_names = allowed_names

    def _check_peer_name(self, context: aio.ServicerContext) -> None:
        if not self.allowed_names:
            return
        auth = context.auth_context()
        names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
        if not self.allowed_names.intersection(name.decode() for name in names):
            log.warning("token sink refused %s: its certificate names no executor", context.peer())
            raise Unauthenticated(
                "the token sink's peer certificate names none of --internal-tls-allowed-names"
            )

    def _check_secret(self, context: aio.ServicerContext) -> None:
        if self.secret is None:
            return
        sent = dict(context.invocation_metadata() or ()).get(SINK_SECRET_KEY, "")
        if not secret_matches(sent.removeprefix("Bearer "), self.secret):
            log.warning("token sink refused %s: no or a wrong shared secret", context.peer())
            raise Unauthenticated("the token sink's shared secret is missing or wrong")

    async def Connect(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[internal_pb2.ConnectRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[internal_pb2.ConnectResponse]:
        self._check_secret(context)
        self._check_peer_name(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("hello") or not first.hello.executor_id:
            raise InvalidArgument("hello", "the first message must be an ExecutorHello with an id")
        connection = self.router.connect(first.hello.executor_id)
        reader = asyncio.create_task(self._read_batches(request_iterator, connection))
        try:
            async for response in self._responses(connection, reader):
                yield response
        finally:
            reader.cancel()
            self.router.disconnect(connection)
            _log_read_error(connection, reader)

    async def _read_batches(
        self,
        request_iterator: AsyncIterator[internal_pb2.ConnectRequest],
        connection: ExecutorConnection,
    ) -> None:
        async for message in request_iterator:
            if message.HasField("token_batch"):
                self.router.deliver(connection, message.token_batch)

    async def _responses(
        self, connection: ExecutorConnection, reader: asyncio.Task[None]
    ) -> AsyncIterator[internal_pb2.ConnectResponse]:
        while True:
            next_response = asyncio.ensure_future(connection.outbox.get())
            done, _ = await asyncio.wait(
                {next_response, reader}, return_when=asyncio.FIRST_COMPLETED
            )
            if next_response not in done:
                next_response.cancel()
                return
            yield next_response.result()
