"""vLLM's engine API requests (`vllm.grpc.engine`, the stubs of `smg-grpc-proto`) as kvgate's
own: the sampling fields translated to kvgate.v1's SamplingParams and checked by the same
code (gateway/validation.py), so both fronts accept and refuse the same values. A field
kvgate cannot honour is refused with INVALID_ARGUMENT naming it, never ignored; two are
accepted without effect, as docs/api.md says: spaces_between_special_tokens (the router makes
its text from the ids) and grammar_from_first_token (constraints start at the first token
either way).

vLLM's conventions are kept where its proto leaves a zero meaning "unset": top_p 0 and
repetition_penalty 0 are 1.0 (off), n 0 is 1, and an unset max_tokens fills the model's
context (vLLM's None), not the gateway's --default-max-tokens. skip_special_tokens has no
"unset": false keeps special tokens in the text, as vLLM's own server reads it.

The constraint oneof maps one to one onto kvgate.v1's (structural_tag is refused), and is
compiled by the same code before the request is queued (TextWork.check_constraint).
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2

from common.model_text import ModelLimits
from gateway.errors import InvalidArgument
from gateway.validation import (
    StopLimits,
    check_prompt_len,
    check_stop,
    check_token_ids,
    checked_sampling_params,
)
from protos.kvgate.v1 import inference_pb2

SAMPLING = "sampling_params"
# GenerateRequest fields of disaggregated prefill, multimodal input and data parallelism.
UNSUPPORTED_MESSAGES = ("kv_transfer_params", "mm_inputs", "media_refs")
# Sampling fields with presence that kvgate has no counterpart of yet.
UNSUPPORTED_OPTIONALS = ("truncate_prompt_tokens",)


def refuse_unsupported_request_fields(request: vllm_engine_pb2.GenerateRequest) -> None:
    """Raises: InvalidArgument naming a set field kvgate does not serve."""
    for name in UNSUPPORTED_MESSAGES:
        if request.HasField(name):
            raise InvalidArgument(name, "not supported by kvgate")
    if request.extra_mm_inputs:
        raise InvalidArgument("extra_mm_inputs", "not supported by kvgate")
    if request.HasField("kv_transfer_params_json"):
        raise InvalidArgument("kv_transfer_params_json", "not supported by kvgate")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidArgument(
            "data_parallel_rank", f"kvgate has one rank (0), got {request.data_parallel_rank}"
        )


def _refuse_unsupported_sampling(params: vllm_engine_pb2.SamplingParams) -> None:
    if params.WhichOneof("constraint") == "structural_tag":
        raise InvalidArgument(f"{SAMPLING}.structural_tag", "not supported by kvgate")
    for name in UNSUPPORTED_OPTIONALS:
        if params.HasField(name):
            raise InvalidArgument(f"{SAMPLING}.{name}", "not supported by kvgate")
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name) and getattr(params, name) < 0:
            raise InvalidArgument(
                f"{SAMPLING}.{name}",
                f"must be 0-20 (-1, all, is not served), got {getattr(params, name)}",
            )


def kvgate_sampling(
    params: vllm_engine_pb2.SamplingParams, room: int
) -> inference_pb2.SamplingParams:
    """The same request in kvgate.v1's terms.

    Args:
        room: tokens the prompt leaves in the model's context (max_tokens when unset).

    Raises:
        InvalidArgument: a field kvgate does not serve (structural_tag...).
    """
    _refuse_unsupported_sampling(params)
    translated = inference_pb2.SamplingParams(
        max_tokens=params.max_tokens if params.HasField("max_tokens") else max(room, 1),
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop,
        n=params.n,  # 0 is 1; out of range is refused as kvgate.v1 refuses it
    )
    if params.HasField("temperature"):
        translated.temperature = params.temperature
    if params.top_p != 0.0:
        translated.top_p = params.top_p
    if params.repetition_penalty != 0.0:
        translated.repetition_penalty = params.repetition_penalty
    if params.HasField("seed"):
        if params.seed < 0:
            raise InvalidArgument(f"{SAMPLING}.seed", f"must be >= 0, got {params.seed}")
        translated.seed = params.seed
    if params.HasField("logprobs"):
        translated.logprobs = params.logprobs
    if params.HasField("prompt_logprobs"):
        translated.prompt_logprobs = params.prompt_logprobs
    _translate_logit_masks(params, translated)
    return translated


def _translate_logit_masks(
    params: vllm_engine_pb2.SamplingParams, translated: inference_pb2.SamplingParams
) -> None:
    """The constraint oneof, logit_bias and the text options, as kvgate.v1 holds them."""
    for token_id, bias in params.logit_bias.items():
        if token_id < 0:
            raise InvalidArgument(f"{SAMPLING}.logit_bias", f"token id {token_id} is negative")
        translated.logit_bias[token_id] = bias
    translated.include_stop_str_in_output = params.include_stop_str_in_output
    translated.skip_special_tokens = params.skip_special_tokens
    constraint = params.WhichOneof("constraint")
    if constraint == "json_object":
        if not params.json_object:
            raise InvalidArgument(f"{SAMPLING}.json_object", "must be true when set")
        translated.json_object.SetInParent()
    elif constraint == "choice":
        translated.choice.choices.extend(params.choice.choices)
    elif constraint is not None:
        setattr(translated, constraint, getattr(params, constraint))


def checked_vllm_sampling(
    params: vllm_engine_pb2.SamplingParams, prompt_len: int, limits: ModelLimits, stop: StopLimits
):
    """kvgate's SamplingParams and stop strings for `params`, checked as kvgate.v1's are.

    Returns: (SamplingParams, stop strings).

    Raises:
        InvalidArgument: naming the field as vLLM's proto does (`sampling_params.<name>`).
    """
    translated = kvgate_sampling(params, limits.max_model_len - prompt_len)
    try:
        sampling = checked_sampling_params(translated, prompt_len, limits, translated.max_tokens)
        strings = check_stop(list(translated.stop), list(translated.stop_token_ids), stop)
    except InvalidArgument as error:
        raise renamed(error) from None
    return sampling, strings


def renamed(error: InvalidArgument) -> InvalidArgument:
    """kvgate.v1's `params.<name>` error as `sampling_params.<name>`."""
    problem = str(error)[len(error.field) + 2 :]
    field = error.field.removeprefix("params.")
    return InvalidArgument(f"{SAMPLING}.{field}", problem)


def checked_token_input(input_ids: list[int], limits: ModelLimits) -> list[int]:
    """A tokenized prompt's ids, checked against the vocabulary and the context."""
    check_token_ids("tokenized.input_ids", input_ids, limits.vocab_size)
    check_prompt_len("tokenized.input_ids", len(input_ids), limits.max_model_len)
    return input_ids
