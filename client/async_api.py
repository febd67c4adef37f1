"""An asyncio Python client for a kvgate gateway (grpc.aio): KvgateClient's methods, retries
and result types, awaited.

async with AsyncClient("127.0.0.1:50051") as client:
    completion = await client.generate(
        messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=32, temperature=0
    )
    async for chunk in client.generate_stream("Once upon a time"):
        print(chunk.text, end="")
    chat = client.chat()
    reply = await chat.ask("Tell me a story")
    await chat.close()
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc import aio

from client.api import (
    CLOSE_WAIT_S,
    ChatTurns,
    ClientBase,
    Completion,
    completion_fields,
    ended,
    generate_request,
    sampling_params,
)
from client.retry import astream_with_retries
from protos.kvgate.v1 import inference_pb2


class AsyncClient(ClientBase):
    """One grpc.aio channel to a gateway, used from one event loop; constructed as
    KvgateClient is (the same retries: client/retry.py's policy for Generate, the channel's
    service config for unary calls; Chat is not retried)."""

    channel_module = aio

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def generate_stream(
        self,
        prompt: str = "",
        params: inference_pb2.SamplingParams | None = None,
        **fields: object,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The completion's chunks as KvgateClient.generate_stream streams them.

        Raises:
            grpc.aio.AioRpcError: with the gateway's status.
        """
        request = generate_request(prompt, params, **fields)
        return astream_with_retries(
            lambda timeout: self.stub.Generate(request, **self._call_options(timeout)),
            self.retry,
            self.timeout_s,
        )

    async def generate(self, prompt: str = "", **fields: object) -> Completion:
        """The whole completion of `prompt`; `fields` as KvgateClient.generate's."""
        completion = Completion()
        async for chunk in self.generate_stream(prompt, **completion_fields(fields)):
            completion.add(chunk)
        return completion

    def chat(self, system_prompt: str = "", session_id: str = "") -> AsyncChatSession:
        """Open a Chat stream (a new session, or `session_id` resumed)."""
        call = self.stub.Chat(timeout=self.timeout_s, metadata=self.metadata)
        return AsyncChatSession(call, system_prompt, session_id)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = inference_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        response = await self.stub.Tokenize(request, **self._call_options(self.timeout_s))
        return list(response.token_ids)

    async def model_info(self) -> inference_pb2.GetModelInfoResponse:
        return await self.stub.GetModelInfo(
            inference_pb2.GetModelInfoRequest(), **self._call_options(self.timeout_s)
        )

    async def end_session(self, session_id: str) -> bool:
        """As KvgateClient.end_session: False when the tenant has no such session."""
        request = inference_pb2.EndSessionRequest(session_id=session_id)
        try:
            options = self._call_options(self.timeout_s)
            return (await self.stub.EndSession(request, **options)).ended
        except grpc.RpcError as error:
            return ended(error)


class AsyncChatSession(ChatTurns):
    """One bidirectional Chat stream: send turns, read each reply as it streams."""

    def __init__(self, call: aio.StreamStreamCall, system_prompt: str, session_id: str) -> None:
        super().__init__(system_prompt, session_id)
        self._call = call

    async def send(
        self, content: str, params: inference_pb2.SamplingParams | None = None, priority: int = 0
    ) -> AsyncIterator[inference_pb2.ChatResponse]:
        """Send a user turn and yield the reply's responses until its last chunk."""
        await self._call.write(self._turn_request(content, params, priority))
        async for response in self._rest_of_turn():
            yield response

    async def _rest_of_turn(self) -> AsyncIterator[inference_pb2.ChatResponse]:
        while self._turn_open:
            response = await self._call.read()
            if response is aio.EOF:
                await self._call  # raises the call's status when it failed
                return
            yield self._read(response)

    async def ask(self, content: str, **params: object) -> Completion:
        """Send a turn and gather its whole reply; keyword arguments as `sampling_params`."""
        completion = Completion()
        async for response in self.send(content, sampling_params(**params)):
            completion.add(response.chunk)
        return completion

    async def cancel(self) -> Completion:
        """Stop the running turn and read the rest of its reply (finish reason "abort")."""
        rest = Completion()
        if self._turn_open:
            await self._call.write(inference_pb2.ChatRequest(cancel=inference_pb2.CancelTurn()))
            async for response in self._rest_of_turn():
                rest.add(response.chunk)
        return rest

    async def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """As ChatSession.close: half-close between turns (cancelled after `wait_s`), cancel
        with a turn running; closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._turn_open:
            self._call.cancel()
            return
        await self._call.done_writing()
        try:
            await asyncio.wait_for(self._call.code(), wait_s)
        except TimeoutError:
            self._call.cancel()
