"""Structured output and logit masks through a real stack's kvgate.v1 API (redis-server,
scheduler, executor and gateway processes, stories260K): sampled outputs validate, bad
constraints and token ids are refused naming their field, and a constraint that compiles too
slowly is refused while the gateway keeps serving."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from client.api import Completion, KvgateClient
from protos.kvgate.v1 import inference_pb2 as pb
from tests.integration.conftest import Stack
from tests.unit.test_engine_structured import (
    CHOICES,
    REGEX,
    SAMPLED_MAX_TOKENS,
    SCHEMAS,
    SEEDS,
)

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    return stack_factory()


def complete(address: str, params: pb.SamplingParams, prompt: str = PROMPT) -> Completion:
    completion = Completion()
    with KvgateClient(address, timeout_s=120.0, retry=False) as client:
        for chunk in client.generate_stream(prompt, params):
            completion.add(chunk)
    return completion


def refusal(address: str, params: pb.SamplingParams) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        complete(address, params)
    return raised.value.code(), raised.value.details()


def sampled(seed: int, **constraint) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=SAMPLED_MAX_TOKENS, temperature=1.0, seed=seed, **constraint
    )


def complete_seeds(address: str, **constraint) -> list[Completion]:
    """One completion per seed of SEEDS, all sent at once on one channel (the executor batches
    them), each checked to have finished with `stop`."""
    with KvgateClient(address, timeout_s=120.0, retry=False) as client:

        def complete_seed(seed: int) -> Completion:
            return Completion.of(client.generate_stream(PROMPT, sampled(seed, **constraint)))

        with ThreadPoolExecutor(len(SEEDS)) as pool:
            done = list(pool.map(complete_seed, SEEDS))
    for seed, completion in zip(SEEDS, done, strict=True):
        assert completion.finish_reason == "stop", f"seed {seed}: {completion}"
    return done


@pytest.mark.parametrize("schema", SCHEMAS)
def test_schema_outputs_over_seeds_validate_through_the_api(stack: Stack, schema: dict):
    for completion in complete_seeds(stack.address, json_schema=json.dumps(schema)):
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_choice_outputs_match_through_the_api(stack: Stack):
    for completion in complete_seeds(stack.address, regex=REGEX):
        assert re.fullmatch(REGEX, completion.text), completion.text
    for completion in complete_seeds(stack.address, choice=pb.Choice(choices=CHOICES)):
        assert completion.text in CHOICES, completion.text


def test_logit_bias_allowed_token_ids_and_special_tokens_through_the_api(stack: Stack):
    bias = pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={77: 100})
    biased = complete(stack.address, bias)
    assert biased.token_ids == [77] * 5, biased.token_ids
    eos_only = pb.SamplingParams(max_tokens=5, allowed_token_ids=[2])
    assert complete(stack.address, eos_only).text == ""
    eos_only.skip_special_tokens = False
    shown = complete(stack.address, eos_only)
    assert shown.token_ids == [2] and shown.text == "</s>", shown


def test_include_stop_str_in_output_keeps_the_stop_string(stack: Stack):
    params = pb.SamplingParams(max_tokens=60, temperature=0.0, stop=["."])
    cut = complete(stack.address, params)
    params.include_stop_str_in_output = True
    kept = complete(stack.address, params)
    assert kept.text == cut.text + ".", f"kept {kept.text!r}, cut {cut.text!r}"


def with_unknown_field(params: pb.SamplingParams, field_number: int) -> pb.SamplingParams:
    """`params` as a newer client would send it, with a field this server does not know."""
    tag = bytes([(field_number << 3 | 2) & 0x7F | 0x80, field_number >> 4])
    return pb.SamplingParams.FromString(params.SerializeToString() + tag + b"\x02{}")


@pytest.mark.parametrize(
    ("params", "field", "problem"),
    [
        (with_unknown_field(pb.SamplingParams(), 99), "params.constraint", "does not know"),
        (pb.SamplingParams(json_schema="{"), "params.json_schema", "not valid JSON"),
        (pb.SamplingParams(json_schema='{"type": "foo"}'), "params.json_schema", "compile"),
        (
            pb.SamplingParams(json_schema="[" * 10_000 + "]" * 10_000),
            "params.json_schema",
            "deeply",
        ),
        (
            pb.SamplingParams(json_schema='{"a":' * 500 + "{}" + "}" * 500),
            "params.json_schema",
            "recursion",
        ),
        (pb.SamplingParams(json_schema='{"oneOf": []}'), "params.json_schema", "compile"),
        (pb.SamplingParams(regex="[a-"), "params.regex", "compile"),
        (pb.SamplingParams(grammar="start: (("), "params.grammar", "compile"),
        (pb.SamplingParams(choice=pb.Choice()), "params.choice", "at least one"),
        (pb.SamplingParams(regex="a" * 70_000), "params.regex", "at most 65536"),
        (pb.SamplingParams(json_schema="{}", ignore_eos=True), "params.ignore_eos", "constraint"),
        (pb.SamplingParams(logit_bias={512: 1.0}), "params.logit_bias", "vocab_size"),
        (pb.SamplingParams(logit_bias={5: math.nan}), "params.logit_bias[5]", "finite"),
        (pb.SamplingParams(logit_bias={5: -101}), "params.logit_bias[5]", "[-100, 100]"),
        (pb.SamplingParams(allowed_token_ids=[3, 999]), "params.allowed_token_ids", "vocab_size"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_input_is_refused_naming_the_field(stack: Stack, params, field, problem):
    code, details = refusal(stack.address, params)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert details.startswith(field) and problem in details, details


def nested_any_of(depth: int) -> str:
    """A schema a few kilobytes long whose grammar takes long to build: each level refers
    to the one below three times, through anyOf, an object and an array."""
    defs: dict[str, object] = {"d0": {"type": "string"}}
    for level in range(1, depth + 1):
        below = {"$ref": f"#/$defs/d{level - 1}"}
        defs[f"d{level}"] = {
            "anyOf": [
                {"type": "object", "properties": {"a": below, "b": below}, "required": ["a"]},
                {"type": "array", "items": below},
                {"allOf": [below, {"minLength": 2}]},
            ]
        }
    return json.dumps({"$defs": defs, "$ref": f"#/$defs/d{depth}"})


def test_a_slow_schema_is_refused_at_the_time_limit_while_the_gateway_serves(stack_factory):
    slow = stack_factory(gateway_flags=["--constraint-timeout-s", "0.02"])
    schema = nested_any_of(120)
    with ThreadPoolExecutor(2) as pool:
        refused = pool.submit(refusal, slow.address, sampled(0, json_schema=schema))
        served = pool.submit(complete, slow.address, pb.SamplingParams(max_tokens=8))
        code, details = refused.result()
        assert served.result().finish_reason == "length", "the gateway stopped serving"
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details}"
    assert details.startswith("params.json_schema: took longer than 0.02 s"), details
    again = refusal(slow.address, sampled(1, json_schema=schema))
    assert again == (code, details), f"a second try was answered {again}"
    assert complete(slow.address, pb.SamplingParams(max_tokens=8)).finish_reason == "length"
