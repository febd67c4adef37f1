"""Structured output, logit_bias and the text options through the OpenAI-compatible HTTP
front (the official `openai` package) and vLLM's gRPC engine API (the stubs of the published
`smg-grpc-proto` package), on a real stack (redis-server, scheduler, executor and gateway
processes, stories260K): sampled outputs validate, logit_bias moves the greedy token, and a
constraint that does not compile is refused before queueing, naming the field as each API
spells it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from tokenizers import Tokenizer

from client.api import Completion, KvgateClient
from deploy.stack import Stack, free_port
from protos.kvgate.v1 import inference_pb2
from tests.integration.conftest import MODEL
from tests.unit.test_engine_structured import (
    CHOICES,
    REGEX,
    SAMPLED_MAX_TOKENS,
    SCHEMAS,
    SEEDS,
)

MODEL_ID = "stories260K"
PROMPT = "Once upon a time"
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]
FEW_SEEDS = range(3)  # for the other spellings of a constraint and json_object
FORCED_TOKEN = 77  # a token logit_bias +100 forces at every step
BAD_SCHEMA = {"type": "object", "not": {"type": "string"}}  # `not`: llguidance refuses it
vllm = vllm_engine_pb2


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    return stack_factory(http_port=free_port())


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.http_url, api_key="none", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def engine(stack: Stack) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    channel = grpc.insecure_channel(stack.address)
    yield vllm_engine_pb2_grpc.VllmEngineStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


def kvgate_completion(stack: Stack, params: inference_pb2.SamplingParams) -> Completion:
    with KvgateClient(stack.address, timeout_s=120.0, retry=False) as kvgate:
        return Completion.of(kvgate.generate_stream(PROMPT, params))


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def chat(client: openai.OpenAI, seed: int, **fields):
    answer = client.chat.completions.create(
        model=MODEL_ID,
        messages=STORY,
        max_tokens=SAMPLED_MAX_TOKENS,
        temperature=1.0,
        seed=seed,
        **fields,
    )
    return answer.choices[0]


def over_seeds(call: Callable[[int], object]) -> list:
    """call(seed) for every seed of SEEDS, all at once (the executor batches them)."""
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return list(pool.map(call, SEEDS))


@pytest.mark.parametrize("schema", SCHEMAS)
def test_openai_json_schema_outputs_validate_over_seeds(client: openai.OpenAI, schema: dict):
    response_format = json_schema_format(schema)
    choices = over_seeds(lambda seed: chat(client, seed, response_format=response_format))
    for seed, choice in zip(SEEDS, choices, strict=True):
        assert choice.finish_reason == "stop", f"seed {seed}: {choice}"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_openai_streamed_json_schema_output_validates(client: openai.OpenAI):
    schema = SCHEMAS[0]
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=STORY,
        max_tokens=120,
        temperature=1.0,
        seed=7,
        stream=True,
        response_format=json_schema_format(schema),
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop", chunks[-1]
    jsonschema.validate(json.loads(text), schema)


def quote_biases(tokenizer: Tokenizer) -> dict[str, int]:
    """logit_bias -100 on every token holding a '"': stories260K writes a story into the first
    string of an object and never closes it, so these leave a JSON object no keys to open."""
    vocab = tokenizer.get_vocab()
    return {str(i): -100 for token, i in vocab.items() if '"' in token or token == "<0x22>"}


def test_openai_json_object_outputs_are_objects(client: openai.OpenAI, tokenizer: Tokenizer):
    for seed in FEW_SEEDS:
        choice = chat(
            client,
            seed,
            response_format={"type": "json_object"},
            logit_bias=quote_biases(tokenizer),
        )
        assert choice.finish_reason == "stop", f"seed {seed}: {choice}"
        assert json.loads(choice.message.content) == {}, choice.message.content


def completion_text(client: openai.OpenAI, seed: int, extra_body: dict) -> str:
    answer = client.completions.create(
        model=MODEL_ID,
        prompt=PROMPT,
        max_tokens=60,
        temperature=1.0,
        seed=seed,
        extra_body=extra_body,
    )
    assert answer.choices[0].finish_reason == "stop", answer
    return answer.choices[0].text


def completion_texts(client: openai.OpenAI, extra_body: dict) -> list[str]:
    return over_seeds(lambda seed: completion_text(client, seed, extra_body))


def test_openai_structured_outputs_regex_and_choice_match(client: openai.OpenAI):
    for text in completion_texts(client, {"structured_outputs": {"regex": REGEX}}):
        assert re.fullmatch(REGEX, text), text
    for text in completion_texts(client, {"structured_outputs": {"choice": list(CHOICES)}}):
        assert text in CHOICES, text
    for seed in FEW_SEEDS:
        text = completion_text(client, seed, {"guided_choice": list(CHOICES)})
        assert text in CHOICES, f"seed {seed}: {text!r}"


def greedy_completion(client: openai.OpenAI, max_tokens: int, **fields) -> str:
    answer = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, **fields
    )
    return answer.choices[0].text


def test_openai_logit_bias_moves_the_greedy_token(client: openai.OpenAI, stack: Stack):
    first = kvgate_completion(stack, inference_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    greedy = greedy_completion(client, 1)
    assert greedy == first.text, (greedy, first.text)
    banned = greedy_completion(client, 1, logit_bias={str(first.token_ids[0]): -100})
    assert banned != greedy, f"-100 on token {first.token_ids[0]} left {banned!r}"
    forcing = inference_pb2.SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={FORCED_TOKEN: 100}
    )
    forced = kvgate_completion(stack, forcing)
    assert forced.token_ids == [FORCED_TOKEN] * 5, forced.token_ids
    text = greedy_completion(
        client, 5, logit_bias={str(FORCED_TOKEN): 100}, extra_body={"ignore_eos": True}
    )
    assert text == forced.text, (text, forced.text)


def test_openai_allowed_token_ids_and_skip_special_tokens(client: openai.OpenAI):
    eos_only = {"allowed_token_ids": [2]}
    assert greedy_completion(client, 5, extra_body=eos_only) == ""
    shown = greedy_completion(client, 5, extra_body=eos_only | {"skip_special_tokens": False})
    assert shown == "</s>", shown


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": json_schema_format(BAD_SCHEMA)}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
        ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structured_outputs"),
        ({"logit_bias": {"one": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": [99999]}}, "allowed_token_ids"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_openai_bad_constraints_are_bad_requests_naming_the_field(
    client: openai.OpenAI, fields: dict, param: str
):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_ID, messages=STORY, **fields)
    error = raised.value
    assert error.param.startswith(param), f"expected param {param!r}: {error.body}"
    assert error.body["message"].startswith(param), error.body


def vllm_generate(
    engine, params: vllm_engine_pb2.SamplingParams
) -> vllm_engine_pb2.GenerateComplete:
    request = vllm.GenerateRequest(text=PROMPT, sampling_params=params, stream=False)
    responses = list(engine.Generate(request, timeout=120.0))
    return responses[-1].complete


def vllm_sampled(seed: int, **constraint) -> vllm_engine_pb2.SamplingParams:
    return vllm.SamplingParams(
        max_tokens=SAMPLED_MAX_TOKENS,
        temperature=1.0,
        seed=seed,
        skip_special_tokens=True,
        **constraint,
    )


def vllm_text(engine, tokenizer: Tokenizer, params: vllm_engine_pb2.SamplingParams) -> str:
    complete = vllm_generate(engine, params)
    assert complete.finish_reason == "stop", complete
    return tokenizer.decode(list(complete.output_ids), skip_special_tokens=True)


def vllm_texts(engine, tokenizer: Tokenizer, **constraint) -> list[str]:
    """The text of every seed of SEEDS under `constraint`, all sent at once."""
    return over_seeds(lambda seed: vllm_text(engine, tokenizer, vllm_sampled(seed, **constraint)))


@pytest.mark.parametrize("schema", SCHEMAS)
def test_vllm_json_schema_outputs_validate_over_seeds(engine, tokenizer: Tokenizer, schema):
    for text in vllm_texts(engine, tokenizer, json_schema=json.dumps(schema)):
        jsonschema.validate(json.loads(text), schema)


def test_vllm_regex_choice_and_json_object_outputs_match(engine, tokenizer: Tokenizer):
    for text in vllm_texts(engine, tokenizer, regex=REGEX):
        assert re.fullmatch(REGEX, text), text
    for text in vllm_texts(engine, tokenizer, choice=vllm.ChoiceConstraint(choices=CHOICES)):
        assert text in CHOICES, text
    biases = {int(i): bias for i, bias in quote_biases(tokenizer).items()}
    for seed in FEW_SEEDS:
        params = vllm_sampled(seed, json_object=True, logit_bias=biases)
        assert json.loads(vllm_text(engine, tokenizer, params)) == {}


def test_vllm_logit_bias_forces_a_token(engine):
    params = vllm.SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={FORCED_TOKEN: 100.0}
    )
    assert list(vllm_generate(engine, params).output_ids) == [FORCED_TOKEN] * 5


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"json_schema": json.dumps(BAD_SCHEMA)}, "sampling_params.json_schema"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema"),
        ({"regex": "[a-"}, "sampling_params.regex"),
        ({"choice": vllm.ChoiceConstraint(choices=[])}, "sampling_params.choice"),
        ({"structural_tag": "{}"}, "sampling_params.structural_tag"),
        ({"json_object": False}, "sampling_params.json_object"),
        ({"logit_bias": {-1: 1.0}}, "sampling_params.logit_bias"),
        ({"logit_bias": {5: 101.0}}, "sampling_params.logit_bias[5]"),
        ({"json_schema": "{}", "ignore_eos": True}, "sampling_params.ignore_eos"),
    ],
)
def test_vllm_bad_constraints_are_invalid_argument_naming_the_field(engine, fields, field):
    with pytest.raises(grpc.RpcError) as raised:
        vllm_generate(engine, vllm.SamplingParams(max_tokens=8, **fields))
    code, details = raised.value.code(), raised.value.details()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert details.startswith(f"{field}:"), details
