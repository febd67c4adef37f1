"""A blocking Python client for a kvgate gateway.

with KvgateClient("127.0.0.1:50051") as client:
    print(client.generate("Once upon a time", max_tokens=32, temperature=0).text)
    chat = client.chat()
    for piece in chat.send("Tell me a story"):
        print(piece.chunk.text, end="")

A gateway with API keys and TLS (docs/security.md):

    KvgateClient("gw.example:50051", api_key=os.environ["KVGATE_API_KEY"],
                 tls=TLSFiles(ca="ca.pem"))
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from client.retry import NO_RETRY, RetryPolicy, channel_options, stream_with_retries
from common.finish_reason_pb import finish_reason_from_pb
from common.tls import TLSFileError, channel_credentials
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
CLOSE_WAIT_S = 5.0  # how long ChatSession.close waits for the server to end the stream


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files of a TLS connection: ca verifies the gateway (empty: the system's roots);
    cert and key are this client's certificate, for a gateway that asks for one."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        """Raises: ValueError naming the flag of a file that cannot be read, a CA file with
        no certificate, or a certificate and key that are not a pair."""
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        try:
            return channel_credentials(self.ca, self.cert, self.key)
        except TLSFileError as error:
            raise ValueError(str(error)) from None


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a client presents: an API key (empty: none) and TLS files (None: plaintext)."""

    api_key: str = ""
    tls: TLSFiles | None = None

    def client(self, target: str, timeout_s: float | None = None) -> KvgateClient:
        """A KvgateClient of `target` presenting these."""
        return KvgateClient(target, timeout_s, api_key=self.api_key, tls=self.tls)


@dataclass(slots=True)
class Completion:
    """A whole completion, gathered from its chunks."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # a FinishReason ("stop", "length", "abort", "error") once finished
    usage: inference_pb2.Usage | None = None
    timings: inference_pb2.Timings | None = None
    priority: int = 0  # the priority it ran at, once finished
    priority_clamped: bool = False  # lowered to the tenant's highest allowed

    @classmethod
    def of(cls, chunks: Iterable[inference_pb2.GenerateResponse]) -> Completion:
        """The completion of all `chunks`."""
        completion = cls()
        for chunk in chunks:
            completion.add(chunk)
        return completion

    def add(self, chunk: inference_pb2.GenerateResponse) -> None:
        """Append one streamed chunk."""
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason:
            self.finish_reason = finish_reason_from_pb(chunk.finish_reason) or ""
            self.usage = chunk.usage
            self.timings = chunk.timings
            self.priority = chunk.priority
            self.priority_clamped = chunk.priority_clamped


def default_target() -> str:
    """KVGATE_TARGET, else KVGATE_HOST:KVGATE_PORT, else 127.0.0.1:50051."""
    if "KVGATE_TARGET" in os.environ:
        return os.environ["KVGATE_TARGET"]
    host, _, port = DEFAULT_TARGET.partition(":")
    return f"{os.environ.get('KVGATE_HOST', host)}:{os.environ.get('KVGATE_PORT', port)}"


def sampling_params(
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop: list[str] | None = None,
    n: int | None = None,
) -> inference_pb2.SamplingParams:
    """SamplingParams with only the given fields set (the gateway fills in the rest).

    Raises:
        ValueError: naming a field its protobuf type cannot hold (a negative max_tokens).
    """
    params = inference_pb2.SamplingParams(ignore_eos=ignore_eos, stop=stop or [])
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("n", n),
    ):
        if value is not None:
            try:
                setattr(params, name, value)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{name} cannot be {value!r} ({error})") from None
    return params


# generate_request's keywords besides the prompt and the sampling parameters.
REQUEST_FIELDS = ("messages", "session_id", "priority", "request_id")


def generate_request(
    prompt: str = "",
    params: inference_pb2.SamplingParams | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    session_id: str = "",
    priority: int = 0,
    request_id: str = "",
) -> inference_pb2.GenerateRequest:
    """A GenerateRequest of `prompt`, or of `messages` ({"role": ..., "content": ...} each,
    rendered by the gateway with the model's chat template)."""
    return inference_pb2.GenerateRequest(
        prompt=prompt,
        messages=[inference_pb2.ChatMessage(**message) for message in messages or []],
        params=params,
        session_id=session_id,
        priority=priority,
        request_id=request_id,
    )


def completion_fields(fields: dict[str, object]) -> dict[str, object]:
    """generate()'s keywords as generate_stream's: `messages`, `priority`, `session_id` and
    `request_id` as they are, the rest as `sampling_params` into `params`."""
    request_fields = {k: fields.pop(k) for k in REQUEST_FIELDS if k in fields}
    return {"params": sampling_params(**fields), **request_fields}


def choice_texts(
    chunks: Iterable[inference_pb2.GenerateResponse],
) -> Iterator[tuple[int, str]]:
    """(choice index, text) of each chunk that brings text, as they stream: the chunks of a
    request of n choices interleave, and the texts of one index in order are its choice's
    whole text (index 0 alone for a request of one)."""
    for chunk in chunks:
        if chunk.text:
            yield chunk.index, chunk.text


def ended(error: grpc.RpcError) -> bool:
    """EndSession's answer from its status: False for NOT_FOUND (the tenant has no such
    session: never opened, ended already, expired, or another tenant's).

    Raises:
        grpc.RpcError: any other status.
    """
    if error.code() == grpc.StatusCode.NOT_FOUND:
        return False
    raise error


class ClientBase:
    """What both clients hold: a channel (of `channel_module`: grpc, or grpc.aio), the
    Inference stub, the deadline, the retry policy and the credentials' metadata."""

    channel_module = grpc

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        timeout_s: float | None = None,
        *,
        retry: bool = True,
        api_key: str = "",
        tls: TLSFiles | None = None,
    ) -> None:
        """
        Args:
            target: the gateway's HOST:PORT.
            timeout_s: deadline of each call; None: none.
            retry: send a call again on UNAVAILABLE or ABORTED before its first response, up
                to 4 tries within the deadline: Generate by client/retry.py, unary calls by
                gRPC under its SERVICE_CONFIG; False: fail at once. Chat streams are not
                retried.
            api_key: sent on every call as `authorization: Bearer <key>`; empty: none.
            tls: connect over TLS with these files; None: plaintext.

        Raises:
            ValueError: naming the flag of a TLS file that cannot be read.
        """
        options = channel_options(retry)
        if tls is None:
            self.channel = self.channel_module.insecure_channel(target, options)
        else:
            self.channel = self.channel_module.secure_channel(target, tls.credentials(), options)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.timeout_s = timeout_s
        self.retry = RetryPolicy() if retry else NO_RETRY
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def _call_options(self, timeout_s: float | None) -> dict[str, object]:
        """One attempt's options: what is left of the call's deadline, the credentials."""
        return {"timeout": timeout_s, "metadata": self.metadata}


class KvgateClient(ClientBase):
    """One channel to a gateway; thread-safe like the grpc channel under it."""

    def __enter__(self) -> KvgateClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate_stream(
        self,
        prompt: str = "",
        params: inference_pb2.SamplingParams | None = None,
        **fields: object,
    ) -> Iterator[inference_pb2.GenerateResponse]:
        """Stream the completion of `prompt` (or of `messages=[{"role", "content"}, ...]`)
        chunk by chunk; `fields` as generate_request's. A retry is sent unchanged, under the
        same `request_id`.

        Raises:
            grpc.RpcError: with the gateway's status (INVALID_ARGUMENT, UNAVAILABLE, ...).
        """
        request = generate_request(prompt, params, **fields)
        yield from stream_with_retries(
            lambda timeout: self.stub.Generate(request, **self._call_options(timeout)),
            self.retry,
            self.timeout_s,
        )

    def generate(self, prompt: str = "", **fields: object) -> Completion:
        """The whole completion of `prompt`; `fields` as completion_request's."""
        return Completion.of(self.generate_stream(prompt, **completion_fields(fields)))

    def chat(self, system_prompt: str = "", session_id: str = "") -> ChatSession:
        """Open a Chat stream (a new session, or `session_id` resumed)."""
        return ChatSession(self.stub, system_prompt, session_id, self.timeout_s, self.metadata)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = inference_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, **self._call_options(self.timeout_s)).token_ids)

    def model_info(self) -> inference_pb2.GetModelInfoResponse:
        request = inference_pb2.GetModelInfoRequest()
        return self.stub.GetModelInfo(request, **self._call_options(self.timeout_s))

    def end_session(self, session_id: str) -> bool:
        """End a session of the caller's tenant.

        Returns:
            True when it was ended; False when the tenant has no such session (the gateway
            answers NOT_FOUND: never opened, ended already, expired, or another tenant's).
        """
        request = inference_pb2.EndSessionRequest(session_id=session_id)
        try:
            return self.stub.EndSession(request, **self._call_options(self.timeout_s)).ended
        except grpc.RpcError as error:
            return ended(error)


class ChatTurns:
    """The state both chat sessions keep of their Chat stream: the session (its id once the
    first reply names it), whether a turn is running, whether the stream is closed."""

    def __init__(self, system_prompt: str, session_id: str) -> None:
        self._first_turn = True
        self._turn_open = False
        self._closed = False
        self.system_prompt = system_prompt
        self.session_id = session_id

    def _turn_request(
        self, content: str, params: inference_pb2.SamplingParams | None, priority: int
    ) -> inference_pb2.ChatRequest:
        """The request of a turn (the first carries the system prompt and the session to
        resume); the turn counts as running from now."""
        turn = inference_pb2.ChatTurn(content=content, params=params, priority=priority)
        if self._first_turn:
            turn.system_prompt = self.system_prompt
            turn.session_id = self.session_id
            self._first_turn = False
        self._turn_open = True
        return inference_pb2.ChatRequest(turn=turn)

    def _read(self, response: inference_pb2.ChatResponse) -> inference_pb2.ChatResponse:
        """Notes what a response says of the session and the turn."""
        self.session_id = response.session_id
        if response.chunk.finish_reason:
            self._turn_open = False
        return response


class ChatSession(ChatTurns):
    """One bidirectional Chat stream: send turns, read each reply as it streams."""

    def __init__(
        self,
        stub: inference_pb2_grpc.InferenceStub,
        system_prompt: str,
        session_id: str,
        timeout_s: float | None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._outgoing: queue.Queue[inference_pb2.ChatRequest | None] = queue.Queue()
        requests = iter(self._outgoing.get, None)
        self._responses = stub.Chat(requests, timeout=timeout_s, metadata=metadata)
        super().__init__(system_prompt, session_id)

    def send(
        self, content: str, params: inference_pb2.SamplingParams | None = None, priority: int = 0
    ) -> Iterator[inference_pb2.ChatResponse]:
        """Send a user turn and yield the reply's responses until its last chunk."""
        self._outgoing.put(self._turn_request(content, params, priority))
        yield from self._rest_of_turn()

    def _rest_of_turn(self) -> Iterator[inference_pb2.ChatResponse]:
        for response in self._responses:
            yield self._read(response)
            if not self._turn_open:
                return

    def ask(self, content: str, **params: object) -> Completion:
        """Send a turn and gather its whole reply; keyword arguments as `sampling_params`."""
        completion = Completion()
        for response in self.send(content, sampling_params(**params)):
            completion.add(response.chunk)
        return completion

    def cancel(self) -> Completion:
        """Stop the running turn and read the rest of its reply (finish reason "abort").

        Returns:
            The part of the reply that came after the cancel was sent.
        """
        rest = Completion()
        if self._turn_open:
            self._outgoing.put(inference_pb2.ChatRequest(cancel=inference_pb2.CancelTurn()))
            for response in self._rest_of_turn():
                rest.add(response.chunk)
        return rest

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Close the stream (the session stays until EndSession or its TTL).

        Between turns the stream is half-closed and the server ends the call with OK (it is
        cancelled if that takes over `wait_s` seconds); with a turn still running, or after the
        call failed, it is cancelled. Closing again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._outgoing.put(None)
        if self._turn_open:
            self._responses.cancel()
            return
        try:
            self._responses.exception(timeout=wait_s)
        except grpc.FutureTimeoutError:
            self._responses.cancel()
