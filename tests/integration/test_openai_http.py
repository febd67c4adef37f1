"""The OpenAI-compatible HTTP front, driven by the official `openai` package and raw HTTP
against a real stack (two executors, --auth keys): the same answers as the gRPC front, the
SDK's own exceptions for each error, bad bodies refused naming the field. The prefix cache
across turns and cancels on disconnect are tested on SmolLM2 (test_openai_http_smollm2.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from client import admin
from client.api import KvgateClient, sampling_params
from deploy.stack import Stack, free_port
from protos.kvgate.v1 import inference_pb2 as pb
from tests.integration.conftest import scrape, session_executor

MODEL_ID = "stories260K"
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    return stack_factory(num_executors=2, auth="keys", http_port=free_port())


def new_key(stack: Stack, tenant: str) -> str:
    return admin.create_key(stack.redis(), stack.keys, tenant, lambda _: None)


@pytest.fixture(scope="module")
def api_key(stack: Stack) -> str:
    return new_key(stack, "openai-tests")


@pytest.fixture
def client(stack: Stack, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.http_url, api_key=api_key, max_retries=0) as sdk:
        yield sdk


def post(stack: Stack, path: str, api_key: str, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {api_key}", **kwargs.pop("headers", {})}
    url = stack.http_url + path
    return httpx.post(url, headers=headers, timeout=60.0, **kwargs)


def grpc_chat(stack: Stack, api_key: str, messages: list[dict], max_tokens: int):
    """The gRPC front's greedy answer to the same conversation: (text, last chunk)."""
    with KvgateClient(stack.address, api_key=api_key, timeout_s=60.0, retry=False) as kvgate:
        chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        tokenized = kvgate.stub.Tokenize(
            pb.TokenizeRequest(messages=chat), metadata=kvgate.metadata, timeout=60.0
        )
        request = pb.GenerateRequest(
            prompt_token_ids=tokenized.token_ids,
            params=sampling_params(temperature=0.0, max_tokens=max_tokens),
        )
        chunks = list(kvgate.stub.Generate(request, metadata=kvgate.metadata, timeout=60.0))
    return "".join(c.text for c in chunks), chunks[-1]


def test_models_list_names_the_served_model(client: openai.OpenAI):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID], models
    assert models[0].model_extra["max_model_len"] == 512, models[0]


def test_streamed_chat_with_usage_matches_the_grpc_front(
    stack: Stack, client: openai.OpenAI, api_key: str
):
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=STORY,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length", chunks[-2]
    assert len({c.id for c in chunks}) == 1, "every chunk of a stream has its id"

    grpc_text, last = grpc_chat(stack, api_key, STORY, 24)
    assert text == grpc_text, f"HTTP {text!r} != gRPC {grpc_text!r}"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        last.usage.prompt_tokens,
        last.usage.completion_tokens,
    ), f"HTTP usage {usage} != gRPC {last.usage}"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_whole_chat_answer_is_the_streamed_text(client: openai.OpenAI):
    params = {"model": MODEL_ID, "messages": STORY, "max_tokens": 16, "temperature": 0}
    whole = client.chat.completions.create(**params)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**params, stream=True)
    )
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens == 16, whole.usage


def test_completions_stop_at_a_stop_string(client: openai.OpenAI):
    free = client.completions.create(
        model=MODEL_ID, prompt="Once upon a time", max_tokens=24, temperature=0
    )
    text = free.choices[0].text
    stop = text.split()[3]  # a word well inside the free completion
    stopped = client.completions.create(
        model=MODEL_ID, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop]
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.text == text[: text.index(stop)], f"{choice.text!r} vs {text!r} cut at {stop!r}"


def test_completions_take_a_list_of_prompts_and_token_ids(client: openai.OpenAI, stack: Stack):
    prompts = ["Once upon a time", "The cat sat"]
    both = client.completions.create(model=MODEL_ID, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in both.choices] == [0, 1], both.choices
    with KvgateClient(stack.address, api_key=client.api_key, retry=False) as kvgate:
        ids = kvgate.tokenize(prompts[1])
    alone = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=8, temperature=0)
    assert alone.choices[0].text == both.choices[1].text, (alone.choices, both.choices)
    assert both.usage.completion_tokens == 16, both.usage


def test_logprobs_come_with_their_alternatives(client: openai.OpenAI):
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=STORY, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content), content
    assert all(t.logprob <= 0 and t.logprob == t.top_logprobs[0].logprob for t in content)


def bad_request(call, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as raised:
        call(**kwargs)
    return raised.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"n": 2, "extra_body": {"best_of": 1}}, "best_of"),
        ({"logit_bias": {"one": 5}}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"stop": ["x"] * 40}, "stop"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"extra_body": {"stop_token_ids": [99_999]}}, "stop_token_ids"),
        ({"extra_body": {"min_tokens": 30}, "max_tokens": 10}, "min_tokens"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages[0].name"),
        ({"logit_bias": {"1" * 5000: 5}}, "logit_bias"),
    ],
)
def test_each_bad_field_is_a_bad_request_naming_it(client: openai.OpenAI, fields, param):
    kwargs = {"model": MODEL_ID, "messages": STORY, **fields}
    error = bad_request(client.chat.completions.create, **kwargs)
    assert error.param == param, f"expected param {param!r}: {error.body}"
    assert error.body["message"].startswith(param), error.body


def test_unknown_model_and_route_are_not_found(client: openai.OpenAI, stack: Stack, api_key: str):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=STORY)
    assert "gpt-4o" in raised.value.body["message"]
    answer = post(stack, "/embeddings", api_key, json={"model": MODEL_ID, "input": "x"})
    assert answer.status_code == 404 and "error" in answer.json(), answer.text


def test_a_missing_or_wrong_key_is_an_authentication_error(stack: Stack):
    with openai.OpenAI(base_url=stack.http_url, api_key="sk-not-ours", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError) as raised:
            sdk.models.list()
    assert "unknown or revoked" in raised.value.body["message"], raised.value.body
    # the SDK always sends a key: without one, raw HTTP
    missing = httpx.get(stack.http_url + "/models", timeout=10)
    assert missing.status_code == 401, missing.text
    assert "missing" in missing.json()["error"]["message"], missing.text


class RecordingOpenAI(openai.OpenAI):
    """The SDK, noting each retry's wait and the headers it was computed from."""

    waits: list[tuple[float, dict]]

    def _calculate_retry_timeout(self, remaining_retries, options, response_headers=None):
        wait_s = super()._calculate_retry_timeout(remaining_retries, options, response_headers)
        self.waits.append((wait_s, dict(response_headers or {})))
        return wait_s


def test_a_quota_refusal_is_a_rate_limit_error_whose_retry_waits_retry_after(stack: Stack):
    key = new_key(stack, "openai-rated")
    admin.set_limits(stack.redis(), stack.keys, "openai-rated", {"requests_per_s": 1.0}, print)
    request = {"model": MODEL_ID, "prompt": "Once", "max_tokens": 2}
    with openai.OpenAI(base_url=stack.http_url, api_key=key, max_retries=0) as sdk:
        sdk.completions.create(**request)
        with pytest.raises(openai.RateLimitError) as raised:
            sdk.completions.create(**request)
    headers = raised.value.response.headers
    assert int(headers["retry-after-ms"]) > 0 and int(headers["retry-after"]) >= 1, headers
    assert raised.value.body["code"] == "requests_per_s", raised.value.body

    sdk = RecordingOpenAI(base_url=stack.http_url, api_key=key, max_retries=3)
    sdk.waits = []
    with sdk:
        sdk.completions.create(**request)  # refused first (the bucket is empty), then served
    assert sdk.waits, "the SDK must have retried a refused call"
    for wait_s, given in sdk.waits:
        assert wait_s == int(given["retry-after-ms"]) / 1000, (wait_s, given)


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        (b'{"model": "stories260K", "prompt": "x", "max_tokens": "10"}', "max_tokens"),
        (b'{"model": "stories260K", "prompt": "x", "max_tokens": -5}', "max_tokens"),
        (b'{"model": "stories260K", "prompt": "x", "max_tokens": 1e400}', "max_tokens"),
        (b'{"model": "stories260K", "prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"model": "stories260K", "prompt": "x", "temperature": Infinity}', "temperature"),
        (b'{"model": "stories260K", "prompt": "x", "seed": 100000000000000000000000}', "seed"),
        (b'{"model": "stories260K", "prompt": "x", "stream": "yes"}', "stream"),
        (b'{"model": "stories260K", "prompt": [1, -2]}', "prompt"),
        (b'{"model": "stories260K", "prompt": [1, 70000]}', "prompt"),
        (b'{"model": "stories260K", "prompt": ""}', "prompt"),
        (b'{"model": "stories260K"}', "prompt"),
        (b'{"prompt": "x"}', "model"),
        (b'{"model": "stories260K", "prompt": "x", "seed": ' + b"1" * 5000 + b"}", "body"),
        (b"[" * 100_000 + b"]" * 100_000, "body"),
        (
            b'{"model": "stories260K", "prompt": "x", "logit_bias": {"' + b"1" * 5000 + b'": 1}}',
            "logit_bias",
        ),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(stack: Stack, api_key: str, content, param):
    answer = post(
        stack,
        "/completions",
        api_key,
        content=content,
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}, error


def test_a_3_mb_body_is_too_large(stack: Stack, api_key: str):
    body = {"model": MODEL_ID, "prompt": "story " * 500_000}
    answer = post(stack, "/completions", api_key, json=body)
    assert answer.status_code == 413, answer.text[:200]
    assert "limit" in answer.json()["error"]["message"]


def test_health_and_ready(stack: Stack):
    base = stack.http_url.removesuffix("/v1")
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    ready = httpx.get(base + "/ready", timeout=10)
    assert ready.status_code == 200, ready.text


def test_a_session_id_pins_the_session_on_its_executor(client: openai.OpenAI, stack: Stack):
    answer = client.chat.completions.create(
        model=MODEL_ID,
        messages=STORY,
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": "openai-session-1"},
    )
    assert answer.choices[0].message.content, answer
    executor_id = session_executor(stack, "openai-session-1", tenant="openai-tests")
    assert executor_id, "the session names the executor that holds its KV"


def test_http_requests_carry_the_openai_api_label_and_count_for_the_keys_tenant(
    client: openai.OpenAI, stack: Stack
):
    client.completions.create(model=MODEL_ID, prompt="Once", max_tokens=2)
    text = scrape(stack, "gateway")
    for needle in (
        'kvgate_gateway_requests_total{api="openai",code="OK",method="completions",'
        'service="openai"}',
        'kvgate_gateway_ttft_seconds_count{api="openai"}',
        'kvgate_gateway_finished_requests_total{api="openai",finish_reason="length"}',
        'kvgate_gateway_tenant_requests_total{tenant="openai-tests"}',
    ):
        assert needle in text, f"{needle} not in the gateway's metrics"


def test_the_sdk_stream_raises_on_a_refusal_before_its_first_chunk(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL_ID, messages=STORY, stream=True, max_tokens=10_000
        )
    assert raised.value.param == "max_tokens", raised.value.body


NUM_STREAMS = 1000


async def one_stream(http: httpx.AsyncClient, index: int) -> str:
    """One streamed completion: "complete" once [DONE] came after a finish reason, else the
    refusal's status and message."""
    body = {"model": MODEL_ID, "prompt": f"Once upon a time {index}", "max_tokens": 8}
    async with http.stream("POST", "/completions", json={**body, "stream": True}) as answer:
        if answer.status_code != 200:
            error = json.loads(await answer.aread())["error"]
            return f"{answer.status_code}: {error['message']}"
        events = [line async for line in answer.aiter_lines() if line.startswith("data: ")]
    finished = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    return "complete" if events[-1] == "data: [DONE]" and finished[-1] else f"cut: {events}"


def test_1000_concurrent_streams_all_complete_or_are_refused_with_a_reason(
    stack: Stack, api_key: str
):
    async def run_all() -> list[str]:
        limits = httpx.Limits(max_connections=NUM_STREAMS, max_keepalive_connections=0)
        headers = {"authorization": f"Bearer {api_key}"}
        async with httpx.AsyncClient(
            base_url=stack.http_url, headers=headers, limits=limits, timeout=120.0
        ) as http:
            return await asyncio.gather(*(one_stream(http, i) for i in range(NUM_STREAMS)))

    outcomes = asyncio.run(run_all())
    unexpected = [o for o in outcomes if o != "complete" and not o.startswith(("429:", "503:"))]
    assert not unexpected, (
        f"{len(unexpected)} streams neither completed nor refused: {unexpected[:5]}"
    )
    assert outcomes.count("complete") > 0, outcomes[:5]
