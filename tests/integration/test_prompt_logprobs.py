"""Prompt logprobs on every API of one real stack (redis, scheduler, executor, gateway with
keys): kvgate.v1's SamplingParams.prompt_logprobs, the OpenAI completions' `echo` (through
the official `openai` package) and vLLM's `prompt_logprobs` extension, and the vLLM engine
API's input_logprobs (stubs of the published proto package). Every API reports the same
numbers as kvgate.v1; the engine's own are checked against transformers in
tests/unit/test_prompt_logprobs.py. Also: logprob token texts join into the answer's text."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from client import admin
from client.api import KvgateClient
from deploy.stack import Stack, free_port
from protos.kvgate.v1 import inference_pb2 as pb

MODEL_ID = "stories260K"
PROMPT = "Once upon a time, there was a little dog"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    return stack_factory(auth="keys", http_port=free_port())


@pytest.fixture(scope="module")
def api_key(stack: Stack) -> str:
    return admin.create_key(stack.redis(), stack.keys, "scoring", lambda _: None)


@pytest.fixture
def client(stack: Stack, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.http_url, api_key=api_key, max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def kvgate_answer(stack: Stack, api_key: str) -> tuple[list[int], list[pb.GenerateResponse]]:
    """The prompt's ids and kvgate.v1's chunks of a greedy answer with prompt_logprobs=2."""
    with KvgateClient(stack.address, api_key=api_key, timeout_s=TIMEOUT_S, retry=False) as kv:
        prompt_ids = kv.tokenize(PROMPT)
        request = pb.GenerateRequest(
            prompt=PROMPT,
            params=pb.SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
        )
        chunks = list(kv.stub.Generate(request, metadata=kv.metadata, timeout=TIMEOUT_S))
    return prompt_ids, chunks


def test_kvgate_v1_sends_the_prompt_logprobs_on_the_first_chunk(kvgate_answer):
    prompt_ids, chunks = kvgate_answer
    entries = chunks[0].prompt_logprobs
    assert [e.token_id for e in entries] == prompt_ids[1:]
    assert all(e.logprob <= 0 and len(e.top) == 2 for e in entries)
    assert all(not c.prompt_logprobs for c in chunks[1:])
    assert chunks[-1].usage.cached_prompt_tokens == 0, "computed, not served from a cache"


def test_kvgate_v1_refuses_prompt_logprobs_over_20_naming_it(stack: Stack, api_key: str):
    with KvgateClient(stack.address, api_key=api_key, timeout_s=TIMEOUT_S, retry=False) as kv:
        request = pb.GenerateRequest(prompt=PROMPT, params=pb.SamplingParams(prompt_logprobs=21))
        with pytest.raises(grpc.RpcError) as raised:
            list(kv.stub.Generate(request, metadata=kv.metadata, timeout=TIMEOUT_S))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.prompt_logprobs" in raised.value.details()


def expected_logprobs(kvgate_answer) -> list[float]:
    return [e.logprob for e in kvgate_answer[1][0].prompt_logprobs]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    assert all(math.isclose(g, w, abs_tol=1e-5) for g, w in zip(got, want, strict=True))


def test_echo_with_logprobs_starts_with_the_prompt_and_its_logprobs(client, kvgate_answer):
    answer = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice = answer.choices[0]
    generated = "".join(c.text for c in kvgate_answer[1])
    assert choice.text == PROMPT + generated
    logprobs = choice.logprobs
    num_prompt = len(kvgate_answer[0])
    assert len(logprobs.tokens) == num_prompt + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert_close(logprobs.token_logprobs[1:num_prompt], expected_logprobs(kvgate_answer))
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert answer.usage.completion_tokens == 4


def test_echo_streams_the_prompt_first_and_equals_the_whole_answer(client):
    fields = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    whole = client.completions.create(**fields, echo=True, logprobs=0)
    chunks = list(client.completions.create(**fields, echo=True, logprobs=0, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert_close(streamed[1:], whole.choices[0].logprobs.token_logprobs[1:])


def test_echo_without_logprobs_keeps_the_prefix_cache(client):
    fields = {"model": MODEL_ID, "prompt": PROMPT * 3, "max_tokens": 2, "temperature": 0}
    client.completions.create(**fields)
    answer = client.completions.create(**fields, echo=True)
    assert answer.choices[0].text.startswith(PROMPT * 3) and answer.choices[0].logprobs is None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, kvgate_answer):
    """What evaluation harnesses send to score a text: the prompt back with its logprobs."""
    prompts = [PROMPT, "The cat sat"]
    answer = client.completions.create(
        model=MODEL_ID, prompt=prompts, max_tokens=0, echo=True, logprobs=0
    )
    first, second = answer.choices
    assert first.text == PROMPT and first.finish_reason == "length"
    assert_close(first.logprobs.token_logprobs[1:], expected_logprobs(kvgate_answer))
    assert second.text == "The cat sat" and second.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in second.logprobs.token_logprobs[1:])
    assert answer.usage.completion_tokens == 0


def test_echo_with_n_echoes_the_prompt_in_every_choice(client):
    answer = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=3, n=2, seed=3, echo=True, logprobs=0
    )
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.text.startswith(PROMPT) and choice.logprobs.token_logprobs[0] is None


def test_vllm_prompt_logprobs_extension_on_both_endpoints(client, kvgate_answer):
    completion = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    listed = completion.choices[0].model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(kvgate_answer[0])
    for entry, token_id, want in zip(
        listed[1:], kvgate_answer[0][1:], expected_logprobs(kvgate_answer), strict=True
    ):
        assert math.isclose(entry[str(token_id)]["logprob"], want, abs_tol=1e-5)
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2]
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    listed = chat.model_extra["prompt_logprobs"]
    assert listed[0] is None and all(len(entry) == 1 for entry in listed[1:])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 30}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_prompt_logprobs_fields_are_refused_naming_them(stack, api_key, body, param):
    response = httpx.post(
        stack.http_url + "/completions",
        headers={"authorization": f"Bearer {api_key}"},
        json={"model": MODEL_ID, "prompt": PROMPT, **body},
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_chat_refuses_echo_saying_where_it_is_served(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body={"echo": True},
        )
    assert raised.value.param == "echo" and "/v1/completions" in raised.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_engine_api_answers_input_logprobs(stack, api_key, kvgate_answer, stream):
    prompt_ids = kvgate_answer[0]
    request = vllm_engine_pb2.GenerateRequest(
        request_id=f"scored-{stream}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt_ids),
        sampling_params=vllm_engine_pb2.SamplingParams(
            temperature=0.0, max_tokens=3, prompt_logprobs=2
        ),
        stream=stream,
    )
    metadata = (("authorization", f"Bearer {api_key}"),)
    with grpc.insecure_channel(stack.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        responses = list(stub.Generate(request, metadata=metadata, timeout=TIMEOUT_S))
    if stream:
        found = [r.chunk.input_logprobs for r in responses if r.chunk.HasField("input_logprobs")]
        assert len(found) == 1, "in the first chunk only"
        (given,) = found
    else:
        given = responses[-1].complete.input_logprobs
    assert list(given.token_ids) == prompt_ids
    assert not given.token_logprobs[0].HasField("value")
    assert_close([v.value for v in given.token_logprobs[1:]], expected_logprobs(kvgate_answer))
    assert len(given.top_logprobs[0].token_ids) == 0
    assert all(len(top.token_ids) == 2 for top in given.top_logprobs[1:])


def test_logprob_tokens_join_into_the_answers_text(client):
    """Each token's text is what it adds to the text, its leading space included."""
    fields = {"model": MODEL_ID, "max_tokens": 12, "temperature": 0}
    completion = client.completions.create(**fields, prompt=PROMPT, logprobs=0)
    choice = completion.choices[0]
    assert "".join(choice.logprobs.tokens) == choice.text
    offsets = [len("".join(choice.logprobs.tokens[:i])) for i in range(12)]
    assert choice.logprobs.text_offset == offsets
    chat = client.chat.completions.create(
        **fields, messages=[{"role": "user", "content": PROMPT}], logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content) == chat.choices[0].message.content.encode()
