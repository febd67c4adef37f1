"""SamplingParams to and from the `kvgate.v1.SamplingParams` message.

Kept out of common/sampling_params.py so the in-process engine needs no generated code.
"""

from __future__ import annotations

from google.protobuf.unknown_fields import UnknownFieldSet

from common.constraints import Constraint, ConstraintKind
from common.sampling_params import DEFAULT_MAX_TOKENS, SamplingParamError, SamplingParams
from protos.kvgate.v1 import inference_pb2


def sampling_params_from_pb(
    params: inference_pb2.SamplingParams, *, max_tokens: int, min_tokens: int
) -> SamplingParams:
    """The message's fields, each unset optional one at the engine's default.

    Args:
        params: the message; its own max_tokens and min_tokens are not read.
        max_tokens, min_tokens: the values to use for those two (the caller resolves them).

    Raises:
        SamplingParamError: naming the first field out of range.
    """
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_k=params.top_k,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        min_p=params.min_p,
        repetition_penalty=(
            params.repetition_penalty if params.HasField("repetition_penalty") else 1.0
        ),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed if params.HasField("seed") else None,
        min_tokens=min_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        constraint=constraint_from_pb(params),
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=list(params.allowed_token_ids) or None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=(
            params.skip_special_tokens if params.HasField("skip_special_tokens") else True
        ),
        n=params.n or 1,
        best_of=params.best_of or None,
    )


def constraint_from_pb(params: inference_pb2.SamplingParams) -> Constraint | None:
    """The message's constraint oneof, or None when unset.

    Raises:
        SamplingParamError: a field this server does not know is set (a constraint kind of a
            newer API version must not be silently ignored), or a kind's value is empty.
        ConstraintError: a constraint's value is malformed (empty choices).
    """
    unknown = sorted({f.field_number for f in UnknownFieldSet(params)})
    if unknown:
        raise SamplingParamError(
            "constraint", f"has field numbers {unknown} this server does not know (a newer kind?)"
        )
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(params.choice.choices))
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    return Constraint(ConstraintKind(kind), text=getattr(params, kind))


def _constraint_to_pb(constraint: Constraint, params: inference_pb2.SamplingParams) -> None:
    kind = constraint.kind
    if kind is ConstraintKind.CHOICE:
        params.choice.choices.extend(constraint.choices)
    elif kind is ConstraintKind.JSON_OBJECT:
        params.json_object.SetInParent()
    else:
        setattr(params, kind.value, constraint.text)


def queued_sampling_params(params: inference_pb2.SamplingParams) -> SamplingParams:
    """The parameters of a queued request, its whole output's: max_tokens and min_tokens
    count the tokens an earlier attempt produced too (the engine counts them as output).

    Raises:
        SamplingParamError: naming the first field out of range.
    """
    max_tokens = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    return sampling_params_from_pb(params, max_tokens=max_tokens, min_tokens=params.min_tokens)


def sampling_params_to_pb(sampling: SamplingParams) -> inference_pb2.SamplingParams:
    """The message for `sampling`, with every field set explicitly."""
    params = inference_pb2.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        min_tokens=sampling.min_tokens,
        ignore_eos=sampling.ignore_eos,
        stop_token_ids=sampling.stop_token_ids,
        logit_bias=sampling.logit_bias,
        allowed_token_ids=sampling.allowed_token_ids or [],
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        skip_special_tokens=sampling.skip_special_tokens,
        n=sampling.n,
        best_of=sampling.best_of or 0,
    )
    if sampling.constraint is not None:
        _constraint_to_pb(sampling.constraint, params)
    if sampling.seed is not None:
        params.seed = sampling.seed
    if sampling.logprobs is not None:
        params.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        params.prompt_logprobs = sampling.prompt_logprobs
    return params
