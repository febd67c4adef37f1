"""The public Inference servicer: protobuf in, validated specs to Generation, protobuf out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from grpc import aio

from common.choices import num_sequences as num_sequences_of
from common.finish_reason import FinishReason
from common.finish_reason_pb import finish_reason_to_pb
from common.sampling_params import SamplingParams
from common.templates import ROLES, ChatTemplateError, Message
from common.tenants import TenantLimits
from gateway.auth import tenant_of
from gateway.choices import ChoiceGroup
from gateway.errors import InvalidArgument, NotFound, QuotaExceeded, Refused, ServiceError
from gateway.generation import Chunk, Generation, GenerationDeps
from gateway.quotas import Admission, Quotas, clamp_priority
from gateway.request_queue import RequestQueue
from gateway.sessions import Session, SessionStore
from gateway.text_work import TextWork
from gateway.token_sink import ClientCancelled
from gateway.validation import (
    GenerationSpec,
    StopLimits,
    check_id,
    check_num_sequences,
    check_prompt_len,
    check_stop,
    check_token_ids,
    checked_sampling_params,
    resolve_request_id,
)
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

# GenerateRequest's ways to give the prompt; a request sets exactly one.
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


def chunk_to_pb(request_id: str, chunk: Chunk) -> inference_pb2.GenerateResponse:
    """A Chunk as the public GenerateResponse."""
    response = inference_pb2.GenerateResponse(
        request_id=request_id,
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        error_message=chunk.error_message,
        index=chunk.index,
        prompt_logprobs=chunk.prompt_logprobs,
    )
    if chunk.finish_reason is not None:
        response.finish_reason = finish_reason_to_pb(chunk.finish_reason)
    if chunk.usage is not None:
        response.usage.CopyFrom(inference_pb2.Usage(**_fields(chunk.usage)))
    if chunk.timings is not None:
        response.timings.CopyFrom(inference_pb2.Timings(**_fields(chunk.timings)))
    if chunk.finish_reason is not None:
        response.priority = chunk.priority
        response.priority_clamped = chunk.priority_clamped
    return response


def _fields(record: object) -> dict[str, object]:
    return {name: getattr(record, name) for name in record.__slots__}


def messages_from_pb(field_name: str, messages: list[inference_pb2.ChatMessage]) -> list[Message]:
    """Convert chat messages, checking their roles."""
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"{field_name}[{index}].role", f"must be one of {', '.join(ROLES)}"
            )
    return [Message(m.role, m.content) for m in messages]


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Generate, Chat, Tokenize, GetModelInfo and EndSession."""

    def __init__(
        self,
        deps: GenerationDeps,
        sessions: SessionStore,
        quotas: Quotas,
        default_max_tokens: int,
        stop_limits: StopLimits,
        text: TextWork,
        max_queued_turns: int = 4,
    ) -> None:
        self.deps = deps
        self.quotas = quotas
        self.model_text = deps.model_text
        self.queue: RequestQueue = deps.queue
        self.sessions = sessions
        self.default_max_tokens = default_max_tokens
        self.stop_limits = stop_limits
        self.text = text
        self.max_queued_turns = max_queued_turns

    async def _spec(
        self,
        prompt_token_ids: list[int],
        params: inference_pb2.SamplingParams,
        priority: int,
        session_id: str,
        request_id: str,
        tenant_limits: TenantLimits,
    ) -> GenerationSpec:
        limits = self.model_text.limits
        priority, clamped = clamp_priority(priority, tenant_limits)
        spec = GenerationSpec(
            request_id=resolve_request_id("request_id", request_id),
            prompt_token_ids=prompt_token_ids,
            sampling=checked_sampling_params(
                params, len(prompt_token_ids), limits, self.default_max_tokens
            ),
            stop=check_stop(list(params.stop), list(params.stop_token_ids), self.stop_limits),
            priority=priority,
            session_id=session_id,
            priority_clamped=clamped,
        )
        await self.text.check_constraint(spec.sampling.constraint)
        await self.check_num_sequences(spec.sampling)
        return spec

    async def check_num_sequences(self, sampling: SamplingParams) -> None:
        """Refuses a request of more sequences (n, best_of) than an executor runs at once
        (a group runs in one batch of one executor), by the executors' heartbeats.

        Raises:
            InvalidArgument: naming `params.n` or `params.best_of`.
        """
        if sampling.num_sequences > 1:
            check_num_sequences(sampling, await self.queue.executor_statuses())

    def _admission(
        self, tenant: str, limits: TenantLimits, **wanted: bool | int
    ) -> Admission | None:
        """The quotas' admission of what is `wanted` (Quotas.admission's keywords), not taken
        yet; refusals counted."""
        try:
            return self.quotas.admission(tenant, limits, **wanted)
        except QuotaExceeded as refusal:
            self.deps.count_refusal(tenant, refusal)
            raise

    def call_admission(
        self, tenant: str, limits: TenantLimits, num_sequences: int
    ) -> Admission | None:
        """The admission of another front's one-request call (a request and a stream per
        sequence, taken as the request is queued), refusals counted."""
        return self._admission(
            tenant, limits, take_request=True, open_stream=True, num_sequences=num_sequences
        )

    def end_call(self, admission: Admission | None) -> None:
        """Releases what a call's admission holds (its stream's lease)."""
        self._close(admission)

    async def _admit(self, admission: Admission | None) -> None:
        """Takes the admission now (a round trip of its own), refusals counted."""
        if admission is None:
            return
        try:
            await self.quotas.take(admission)
        except QuotaExceeded as refusal:
            self.deps.count_refusal(admission.tenant, refusal)
            raise

    def _close(self, admission: Admission | None) -> None:
        if admission is not None and admission.slot is not None:
            self.quotas.forget(admission.slot)
            if admission.sent and not admission.refused:
                spawn = self.deps.background.spawn
                spawn(self.quotas.close_stream(admission.slot), "closing a stream's lease")

    async def _prompt_of(self, request: inference_pb2.GenerateRequest) -> list[int]:
        given = [name for name in PROMPT_FIELDS if getattr(request, name)]
        if len(given) != 1:
            raise InvalidArgument(
                given[-1] if given else "prompt",
                f"set exactly one of {', '.join(PROMPT_FIELDS)}"
                + (f"; got {' and '.join(given)}" if given else ""),
            )
        if request.messages:
            messages = messages_from_pb("messages", list(request.messages))
            return await self._chat_prompt(messages, "messages")
        if request.prompt:
            token_ids = await self.text.encode("prompt", request.prompt)
            check_prompt_len("prompt", len(token_ids), self.model_text.limits.max_model_len)
            return token_ids
        token_ids = list(request.prompt_token_ids)
        check_token_ids("prompt_token_ids", token_ids, self.model_text.limits.vocab_size)
        check_prompt_len("prompt_token_ids", len(token_ids), self.model_text.limits.max_model_len)
        return token_ids

    async def generate(
        self,
        tenant: str,
        prompt: Callable[[], Awaitable[list[int]]],
        params: inference_pb2.SamplingParams,
        priority: int,
        session_id: str,
        request_id: str,
        api: str = "kvgate",
    ) -> AsyncIterator[tuple[str, Chunk]]:
        """One generation, whatever front asked for it: its quotas, session and chunks.

        Args:
            prompt: reads (tokenizes, checks) the prompt's token ids once quotas allow.
            api: the front the request came through (kvgate, openai, vllm), for metrics.

        Yields:
            (the request id, a chunk) until the last chunk.
        """
        limits = await self.quotas.limits(tenant)
        admission = self._admission(
            tenant, limits, take_request=True, open_stream=True,
            num_sequences=num_sequences_of(params),
        )  # fmt: skip
        try:
            if session_id:
                # Opening a session writes it: the quotas are taken first, so that a refused
                # call opens none. Otherwise as the request is queued (one round trip).
                await self._admit(admission)
                check_id("session_id", session_id)
            spec = await self._spec(
                await prompt(), params, priority, session_id, request_id, limits
            )
            spec.api = api
            session = (
                await self.sessions.open_or_load(spec.session_id, tenant)
                if spec.session_id
                else None
            )
            executor_id = session.executor_id if session else ""
            several = spec.sampling.num_sequences > 1
            kind = ChoiceGroup if several else Generation
            generation = kind(spec, self.deps, tenant, executor_id, _untaken(admission))
            # choice 0's executor keeps the session's blocks (engine.add_request)
            first = generation.choices[0] if several else generation
            async for chunk in generation.stream():
                if chunk.finish_reason is not None and chunk.index == 0 and session is not None:
                    await self._record_turn(session, first, [])
                yield spec.request_id, chunk
        finally:
            self._close(admission)

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        chunks = self.generate(
            tenant_of(context),
            lambda: self._prompt_of(request),
            request.params,
            request.priority,
            request.session_id,
            request.request_id,
        )
        async with contextlib.aclosing(chunks):
            async for request_id, chunk in chunks:
                yield chunk_to_pb(request_id, chunk)

    async def _record_turn(
        self, session: Session, generation: Generation, new_messages: list[Message]
    ) -> None:
        """Record a finished turn; if its session ended meanwhile, the executor that ran the
        turn may have pinned it after the end's release: release it there again."""
        executor_id = generation.executor_id
        if not await self.sessions.record_turn(session, new_messages, executor_id) and executor_id:
            self.deps.background.spawn(
                self.queue.release_session({executor_id}, session.session_id, session.tenant),
                "releasing an ended session's last turn",
            )

    async def _end_session(self, session_id: str, tenant: str) -> bool:
        """Delete the session and release its KV cache on every live executor, not only the
        one it names, and also when the session is gone from Redis already: a turn whose
        call ended before the turn was recorded (the client hung up as it finished) may
        have left it pinned anywhere, after an earlier end too.

        Returns:
            False when the tenant had no such session.
        """
        try:
            session = await self.sessions.end(session_id, tenant)
        except NotFound:
            session = None
        executor_ids = set(await self.queue.live_executor_ids())
        if session is not None and session.executor_id:
            executor_ids.add(session.executor_id)
        await self.queue.release_session(executor_ids, session_id, tenant)
        return session is not None

    def _end_unused_session(self, conversation: ChatConversation) -> None:
        """Ends the session a failed Chat call opened, if no turn completed in it: the client
        may never have been told its id, and nobody else would end it before its TTL."""
        session = conversation.session
        if session is None or not conversation.opened_session or session.num_turns > 0:
            return
        self.deps.background.spawn(
            self._end_session(session.session_id, conversation.tenant),
            "ending the unused session of a failed Chat call",
        )

    async def Chat(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[inference_pb2.ChatRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[inference_pb2.ChatResponse]:
        tenant = tenant_of(context)
        limits = await self.quotas.limits(tenant)
        admission = self._admission(tenant, limits, take_request=False, open_stream=True)
        conversation = ChatConversation(tenant, self.max_queued_turns)
        reader = None
        ended_cleanly = False
        try:
            await self._admit(admission)
            reader = asyncio.create_task(conversation.read(request_iterator, self.deps))
            while (turn := await conversation.next_turn()) is not None:
                async for response in self._chat_turn(conversation, turn):
                    yield response
            ended_cleanly = True
        finally:
            if reader is not None:
                reader.cancel()
            self._close(admission)
            if not ended_cleanly:
                self._end_unused_session(conversation)

    async def _resume_session(
        self, conversation: ChatConversation, turn: inference_pb2.ChatTurn
    ) -> None:
        """Loads the session a first turn names (a new one is created once the turn is valid)."""
        if conversation.session is None and turn.session_id:
            check_id("turn.session_id", turn.session_id)
            conversation.session = await self.sessions.load(turn.session_id, conversation.tenant)

    async def _new_session(self, tenant: str, messages: list[Message]) -> Session:
        session = await self.sessions.create(tenant)
        session.messages.extend(messages)
        return session

    async def _chat_prompt(
        self, messages: list[Message], field_name: str = "turn.content"
    ) -> list[int]:
        try:
            token_ids = await self.text.encode_chat(field_name, messages)
        except ChatTemplateError as error:
            raise InvalidArgument(field_name, str(error)) from error
        check_prompt_len(field_name, len(token_ids), self.model_text.limits.max_model_len)
        return token_ids

    async def _chat_turn(
        self, conversation: ChatConversation, turn: inference_pb2.ChatTurn
    ) -> AsyncIterator[inference_pb2.ChatResponse]:
        if not turn.content:
            raise InvalidArgument("turn.content", "must not be empty")
        await self._resume_session(conversation, turn)
        system = [Message("system", turn.system_prompt)] if turn.system_prompt else []
        history = conversation.session.messages if conversation.session else system
        user = Message("user", turn.content)
        limits = await self.quotas.limits(conversation.tenant)
        admission = self._admission(
            conversation.tenant, limits, take_request=True, open_stream=False
        )
        if conversation.session is None:  # a new session is written before the turn is queued
            await self._admit(admission)
        prompt = await self._chat_prompt([*history, user])
        spec = await self._spec(prompt, turn.params, turn.priority, "", turn.request_id, limits)
        if spec.sampling.num_sequences > 1:
            name = "best_of" if spec.sampling.best_of else "n"
            raise InvalidArgument(
                f"turn.params.{name}", "must be 1: a chat turn has one reply (Generate has n)"
            )
        if conversation.session is None:
            conversation.session = await self._new_session(conversation.tenant, system)
            conversation.opened_session = True
        session = conversation.session
        spec.session_id = session.session_id
        generation = Generation(
            spec, self.deps, conversation.tenant, session.executor_id, _untaken(admission)
        )
        reply: list[str] = []
        turn_index = session.num_turns
        conversation.running_request_id = generation.request_id
        async for chunk in generation.stream():
            reply.append(chunk.text)
            if chunk.finish_reason is not None and chunk.finish_reason != FinishReason.ERROR:
                assistant = Message("assistant", "".join(reply).strip())
                await self._record_turn(session, generation, [user, assistant])
            yield inference_pb2.ChatResponse(
                session_id=session.session_id,
                turn_index=turn_index,
                chunk=chunk_to_pb(spec.request_id, chunk),
            )
        conversation.running_request_id = None

    async def Tokenize(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.TokenizeRequest, context: aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        if request.text and request.messages:
            raise InvalidArgument("messages", "set text or messages, not both")
        if request.messages:
            messages = messages_from_pb("messages", list(request.messages))
            try:
                text = await self.text.render_chat("messages", messages)
                token_ids = await self.text.encode_chat("messages", messages)
            except ChatTemplateError as error:
                raise InvalidArgument("messages", str(error)) from error
        else:
            text = request.text
            token_ids = await self.text.encode("text", text, request.add_special_tokens)
        return inference_pb2.TokenizeResponse(
            token_ids=token_ids,
            tokens=self.model_text.token_strings(token_ids),
            rendered_text=text,
        )

    async def GetModelInfo(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.GetModelInfoRequest, context: aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        limits = self.model_text.limits
        return inference_pb2.GetModelInfoResponse(
            model_id=self.model_text.model_id,
            vocab_size=limits.vocab_size,
            max_model_len=limits.max_model_len,
            bos_token_id=limits.bos_token_id,
            eos_token_ids=limits.eos_token_ids,
            has_chat_template=not self.model_text.chat_template.is_default,
            num_executors=len(await self.queue.live_executor_ids()),
        )

    async def EndSession(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.EndSessionRequest, context: aio.ServicerContext
    ) -> inference_pb2.EndSessionResponse:
        check_id("session_id", request.session_id)
        if not await self._end_session(request.session_id, tenant_of(context)):
            # Another tenant's session is, to this caller, one that does not exist: the same
            # answer, so that nobody learns another tenant's ids.
            raise NotFound(f"session_id: no session {request.session_id!r} (ended or expired)")
        return inference_pb2.EndSessionResponse(ended=True)


class ChatConversation:
    """The state of one Chat stream: its session, the turns to run, the running turn."""

    def __init__(self, tenant: str, max_queued_turns: int = 4) -> None:
        self.tenant = tenant
        self.session: Session | None = None
        self.opened_session = False  # the session was created by this call
        self.running_request_id: str | None = None
        self.max_queued_turns = max_queued_turns
        self.too_many_turns = False  # more than max_queued_turns waited: the call ends
        self.error: ServiceError | None = None  # a bad message: the call ends with it
        self._turns: asyncio.Queue[inference_pb2.ChatTurn | None] = asyncio.Queue()

    async def read(
        self, request_iterator: AsyncIterator[inference_pb2.ChatRequest], deps: GenerationDeps
    ) -> None:
        """Read the client's messages: queue turns, cancel the running turn on CancelTurn."""
        try:
            async for request in request_iterator:
                if request.HasField("turn"):
                    if self._turns.qsize() >= self.max_queued_turns:
                        self.too_many_turns = True  # read no more: the client waits on us
                        log.info(
                            "Chat of tenant %s: a turn came while %d waited "
                            "(--max-queued-turns); the call ends after the running turn",
                            self.tenant, self.max_queued_turns,
                        )  # fmt: skip
                        return
                    self._turns.put_nowait(request.turn)
                elif request.HasField("cancel") and self.running_request_id is not None:
                    deps.router.post(self.running_request_id, ClientCancelled())
        except ServiceError as error:  # a message that does not parse
            self.error = error
        finally:
            self._turns.put_nowait(None)

    async def next_turn(self) -> inference_pb2.ChatTurn | None:
        """The next turn, or None when the client has closed its side.

        Raises:
            Refused: the client sent more than max_queued_turns turns ahead.
        """
        turn = await self._turns.get()
        if self.error is not None:
            raise self.error
        if self.too_many_turns:
            raise Refused(
                "max_queued_turns",
                f"turn: more than {self.max_queued_turns} turns were sent while one ran "
                "(--max-queued-turns); send the next turn once a reply has ended",
            )
        return turn


def _untaken(admission: Admission | None) -> Admission | None:
    """The admission, when it is still to be taken (as the request is queued)."""
    return admission if admission is not None and not admission.sent else None
