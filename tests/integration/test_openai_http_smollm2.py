"""The OpenAI-compatible HTTP front on SmolLM2-135M-Instruct, a real chat model, with two
executors: a stateless chat that resends its history hits the prefix cache on the executor
that holds it, and a client that disconnects mid-stream has its request cancelled and its KV
blocks freed (the model is slow enough that the request could not have finished first)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from deploy.stack import Stack, StackConfig, free_port
from tests.helpers import wait_for
from tests.integration.conftest import scrape

EXECUTORS = ("executor-0", "executor-1")


@pytest.fixture(scope="module")
def stack(gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    config = StackConfig(
        model=str(gguf),
        port=free_port(),
        http_port=free_port(),
        log_dir=tmp_path_factory.mktemp("smollm2-openai"),
        executor_flags=["--num-gpu-blocks", "256", "--block-size", "16"],
        scheduler_flags=["--batch-window-ms", "2"],
    )
    running = Stack(config)
    try:
        running.start_all(num_executors=len(EXECUTORS))
        yield running
    finally:
        running.stop_all()


@pytest.fixture
def client(stack: Stack):
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as sdk:
        yield sdk


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_a_resent_history_hits_the_prefix_cache_of_turn_one(client: openai.OpenAI):
    model = model_id(client)
    messages = [{"role": "user", "content": "Write a short story about a red fox."}]
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0
    )
    turn_1 = first.usage.prompt_tokens + first.usage.completion_tokens
    reply = first.choices[0].message.content
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    second = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= math.ceil(0.9 * turn_1), (
        f"turn 2 reused {cached} cached tokens; turn 1 had {turn_1} (prompt + reply {reply!r})"
    )


def metric(text: str, name: str) -> float:
    line = next(li for li in text.splitlines() if li.startswith(name + " "))
    return float(line.split()[-1])


def kv_in_use(stack: Stack) -> float:
    """The KV blocks held by requests, summed over the executors (ratios of equal pools)."""
    return sum(metric(scrape(stack, e), "kvgate_executor_kv_usage_ratio") for e in EXECUTORS)


def running(stack: Stack) -> float:
    return sum(metric(scrape(stack, e), "kvgate_executor_running_requests") for e in EXECUTORS)


def test_a_client_that_disconnects_mid_stream_frees_its_kv(client: openai.OpenAI, stack: Stack):
    body = {
        "model": model_id(client),
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=120.0) as http:
        with http.stream("POST", stack.http_url + "/completions", json=body) as answer:
            assert answer.status_code == 200, answer.read()
            events = (line for line in answer.iter_lines() if line.startswith("data: "))
            first = json.loads(next(events)[6:])
            assert first["choices"][0]["finish_reason"] is None, first
            wait_for(lambda: running(stack) == 1, "the request running on an executor")
            assert kv_in_use(stack) > 0, "a running request holds KV blocks"
    # the connection is closed: the request is cancelled and its blocks freed
    wait_for(lambda: running(stack) == 0 and kv_in_use(stack) == 0, "the KV cache idle again")

    def counted_cancelled() -> bool:
        lines = scrape(stack, "gateway").splitlines()
        return any(
            li.startswith("kvgate_gateway_requests_total{")
            and 'code="CANCELLED"' in li
            and 'service="openai"' in li
            for li in lines
        )

    wait_for(counted_cancelled, "the HTTP call counted CANCELLED")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_smollm2_calls_a_tool_it_is_told_of_and_answers_its_result(client: openai.OpenAI):
    """SmolLM2's template renders no tools: the tools are described in the system message,
    the grammar holds the call to their schema, and the result's turn renders as text."""
    model = model_id(client)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    schema = WEATHER_TOOL["function"]["parameters"]
    for seed in range(3):
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=seed,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", f"seed {seed}: {choice}"
        [tool_call] = choice.message.tool_calls
        jsonschema.validate(json.loads(tool_call.function.arguments), schema)
    result = {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny, 24 degrees"}
    messages += [choice.message.model_dump(exclude_none=True), result]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
        max_tokens=24, temperature=0,
    )  # fmt: skip
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
