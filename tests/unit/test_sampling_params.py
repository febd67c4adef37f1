"""SamplingParams: every bad value is a SamplingParamError naming the field; the message
conversions keep every field."""

import math

import pytest

from common.constraints import Constraint, ConstraintKind
from common.sampling_params import SamplingParamError, SamplingParams
from common.sampling_pb import (
    queued_sampling_params,
    sampling_params_from_pb,
    sampling_params_to_pb,
)
from protos.kvgate.v1 import inference_pb2 as pb

BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", False),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", math.nan),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", True),
    ("min_tokens", -1),
    ("min_tokens", 17),
    ("min_tokens", True),
    ("stop_token_ids", [1, -2]),
    ("stop_token_ids", [1, True]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_is_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(SamplingParamError) as raised:
        SamplingParams(**{field: value})
    assert raised.value.field == field, f"{field}={value!r} was blamed on {raised.value.field!r}"
    assert str(raised.value) == f"{field} {raised.value.problem}", str(raised.value)


def test_error_message_states_allowed_range() -> None:
    with pytest.raises(ValueError) as raised:
        SamplingParams(top_p=1.5)
    assert str(raised.value) == "top_p must be in (0, 1], got 1.5", (
        f"expected the range in the message, got {str(raised.value)!r}"
    )


def test_edge_values_are_accepted() -> None:
    params = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_k=0,
        top_p=1.0,
        min_p=1.0,
        repetition_penalty=0.01,
        presence_penalty=-2.0,
        frequency_penalty=2,
        seed=2**64 - 1,
        min_tokens=1,
        stop_token_ids=(0, 3),
        ignore_eos=True,
        logprobs=20,
    )
    assert params.stop_token_ids == [0, 3], f"expected a list, got {params.stop_token_ids!r}"


def test_the_message_carries_every_field_both_ways() -> None:
    params = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        top_k=7,
        top_p=0.5,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.75,
        seed=2**64 - 1,
        min_tokens=3,
        stop_token_ids=[5, 9],
        ignore_eos=True,
        logprobs=0,
    )
    message = sampling_params_to_pb(params)
    back = sampling_params_from_pb(message, max_tokens=40, min_tokens=3)
    assert back == params, f"{params} became {back} through {message}"
    unset = sampling_params_from_pb(pb.SamplingParams(), max_tokens=16, min_tokens=0)
    assert unset == SamplingParams(), f"an empty message must give the defaults, got {unset}"


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}'),
        Constraint(ConstraintKind.JSON_OBJECT),
        Constraint(ConstraintKind.REGEX, "[a-z]+"),
        Constraint(ConstraintKind.GRAMMAR, 'start: "a"'),
        Constraint(ConstraintKind.CHOICE, choices=("yes", "no")),
    ],
    ids=lambda c: c.kind.value,
)
def test_the_message_carries_constraints_and_logit_masks_both_ways(constraint) -> None:
    params = SamplingParams(
        constraint=constraint,
        logit_bias={3: -100.0, 7: 2.5},
        allowed_token_ids=[3, 7, 9],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    message = sampling_params_to_pb(params)
    assert message.WhichOneof("constraint") == constraint.kind.value, message
    back = sampling_params_from_pb(message, max_tokens=16, min_tokens=0)
    assert back == params, f"{params} became {back} through {message}"


def test_a_field_this_server_does_not_know_is_refused_naming_the_constraint() -> None:
    newer = pb.SamplingParams(temperature=0.5).SerializeToString() + bytes([0x9A, 0x06, 1, 0x78])
    with pytest.raises(SamplingParamError) as refused:
        queued_sampling_params(pb.SamplingParams.FromString(newer))  # field 99, 1 byte long
    assert refused.value.field == "constraint" and "[99]" in refused.value.problem


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 1e-6}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 2}, False),
    ],
)
def test_is_greedy(kwargs: dict, greedy: bool) -> None:
    got = SamplingParams(**kwargs).is_greedy
    assert got is greedy, f"expected is_greedy={greedy} for {kwargs}, got {got}"


@pytest.mark.parametrize(
    ("kwargs", "penalized"),
    [
        ({}, False),
        ({"repetition_penalty": 1.1}, True),
        ({"presence_penalty": 0.5}, True),
        ({"frequency_penalty": -0.5}, True),
    ],
)
def test_has_penalties(kwargs: dict, penalized: bool) -> None:
    got = SamplingParams(**kwargs).has_penalties
    assert got is penalized, f"expected has_penalties={penalized} for {kwargs}, got {got}"


def test_a_queued_request_keeps_its_whole_outputs_limits() -> None:
    """The engine counts resumed tokens as output, so max_tokens and min_tokens stay whole."""
    message = pb.SamplingParams(max_tokens=10, min_tokens=6, temperature=0.5)
    params = queued_sampling_params(message)
    assert (params.max_tokens, params.min_tokens) == (10, 6), params
    assert params.temperature == 0.5 and params.top_p == 1.0, params


def test_min_tokens_above_max_tokens_names_max_tokens() -> None:
    with pytest.raises(SamplingParamError, match=r"must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
