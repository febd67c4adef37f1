"""GenerateRequest.messages (a conversation rendered by the gateway's chat template, no
Tokenize round trip), `kvgate generate --message`, and the asyncio client kvgate.AsyncClient,
through a real stack (redis, scheduler, executor and gateway processes)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import kvgate
from client import cli
from client.api import Completion, KvgateClient, sampling_params
from protos.kvgate.v1 import inference_pb2 as pb
from tests.helpers import wait_for
from tests.integration.gateway_harness import GatewayThread, status_of

CALL_TIMEOUT_S = 60.0
CONVERSATION = [
    {"role": "system", "content": "You tell stories."},
    {"role": "user", "content": "Tell me about Lily"},
]


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory()


def test_messages_answer_the_rendered_conversation_without_a_tokenize(stack):
    with KvgateClient(stack.address, CALL_TIMEOUT_S, retry=False) as client:
        rendered = client.stub.Tokenize(
            pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in CONVERSATION])
        )
        by_messages = client.generate(messages=CONVERSATION, max_tokens=12, temperature=0.0)
        request = pb.GenerateRequest(
            prompt_token_ids=rendered.token_ids,
            params=sampling_params(max_tokens=12, temperature=0.0),
        )
        by_ids = Completion()
        for chunk in client.stub.Generate(request, timeout=CALL_TIMEOUT_S):
            by_ids.add(chunk)
    assert by_messages.usage.prompt_tokens == len(rendered.token_ids), by_messages.usage
    assert by_messages.token_ids == by_ids.token_ids, (by_messages.token_ids, by_ids.token_ids)
    assert by_messages.text == by_ids.text and by_messages.text, by_messages.text


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"prompt": "Once", "messages": CONVERSATION}, "messages", "prompt and messages"),
        ({"prompt_token_ids": [1, 5], "messages": CONVERSATION}, "messages", "prompt_token_ids"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "one of"),
        ({}, "prompt", "exactly one of prompt, prompt_token_ids, messages"),
    ],
)
def test_messages_with_another_prompt_or_a_bad_role_names_the_fields(
    gateway: GatewayThread, fields, field, words
):
    messages = [pb.ChatMessage(**m) for m in fields.pop("messages", [])]
    request = pb.GenerateRequest(messages=messages, **fields)
    code, details = status_of(gateway.stub.Generate(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert details.startswith(f"{field}:") and words in details, details


def test_cli_generate_sends_messages(stack, capsys):
    argv = ["generate", "--target", stack.address, "--max-tokens", "12", "--temperature", "0"]
    argv += [f"--message={m['role']}:{m['content']}" for m in CONVERSATION]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    with KvgateClient(stack.address, CALL_TIMEOUT_S, retry=False) as client:
        expected = client.generate(messages=CONVERSATION, max_tokens=12, temperature=0.0)
    assert printed == expected.text + "\n", (printed, expected.text)


async def _async_calls(address: str) -> dict[str, object]:
    async with kvgate.AsyncClient(address, CALL_TIMEOUT_S) as client:
        results: dict[str, object] = {
            "info": await client.model_info(),
            "ids": await client.tokenize("Once upon a time"),
            "completion": await client.generate("Once upon a time", max_tokens=10, temperature=0.0),
            "by_messages": await client.generate(
                messages=CONVERSATION, max_tokens=10, temperature=0.0
            ),
        }
        chunks = [
            chunk
            async for chunk in client.generate_stream(
                "Once upon a time", sampling_params(max_tokens=10, temperature=0.0)
            )
        ]
        results["chunks"] = chunks
        chat = client.chat(system_prompt="You tell stories.")
        results["turn"] = await chat.ask("Tell me about Lily", max_tokens=8, temperature=0.0)
        results["session_id"] = chat.session_id
        await chat.close()
        results["ended"] = await client.end_session(chat.session_id)
        results["ended_again"] = await client.end_session(chat.session_id)
    return results


def test_async_client_has_the_sync_clients_methods_and_results(stack):
    results = asyncio.run(_async_calls(stack.address))
    with KvgateClient(stack.address, CALL_TIMEOUT_S, retry=False) as client:
        expected = client.generate("Once upon a time", max_tokens=10, temperature=0.0)
        by_messages = client.generate(messages=CONVERSATION, max_tokens=10, temperature=0.0)
        ids = client.tokenize("Once upon a time")
        chat = client.chat(system_prompt="You tell stories.")
        turn = chat.ask("Tell me about Lily", max_tokens=8, temperature=0.0)
        chat.close()
        client.end_session(chat.session_id)
    completion = results["completion"]
    assert isinstance(completion, Completion) and completion.finish_reason == "length"
    assert completion.token_ids == expected.token_ids and completion.text == expected.text
    assert results["by_messages"].token_ids == by_messages.token_ids
    assert results["ids"] == ids
    assert results["info"].max_model_len == 512, results["info"]
    streamed = [t for chunk in results["chunks"] for t in chunk.token_ids]
    assert streamed == expected.token_ids and results["chunks"][-1].finish_reason
    assert results["turn"].text == turn.text and results["turn"].text, results["turn"]
    assert results["session_id"] and results["ended"] and not results["ended_again"], results


async def _refused_generate(address: str, retry: bool) -> grpc.StatusCode:
    async with kvgate.AsyncClient(address, CALL_TIMEOUT_S, retry=retry) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.generate("Once upon a time", max_tokens=2)
    return raised.value.code()


def test_async_generate_is_retried_on_unavailable_by_the_shared_policy(gateway: GatewayThread):
    """No executor: every attempt is refused UNAVAILABLE before a response; the policy of
    client/retry.py sends it 4 times, once without retries."""
    assert asyncio.run(_refused_generate(gateway.gateway.address, retry=True)) == (
        grpc.StatusCode.UNAVAILABLE
    )
    wait_for(lambda: gateway.calls("Generate", "UNAVAILABLE") == 4, "4 attempts counted")
    assert asyncio.run(_refused_generate(gateway.gateway.address, retry=False)) == (
        grpc.StatusCode.UNAVAILABLE
    )
    wait_for(lambda: gateway.calls("Generate", "UNAVAILABLE") == 5, "1 more attempt counted")
    assert gateway.calls("Generate", "UNAVAILABLE") == 5, "a call without retries was retried"
