"""Checks of public requests; each failure is an InvalidArgument naming the field.

The sampling ranges are the engine's (executor/sampling_params.py); the gateway
checks them first so a client learns of a bad field at once, by its proto name.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field

from gateway.errors import InvalidArgument
from gateway.model_text import ModelLimits
from protos.kvgate.v1 import inference_pb2

MAX_ID_LEN = 128
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]+")
MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1


@dataclass(slots=True)
class SamplingSpec:
    """Resolved sampling parameters (every default filled in), as the engine takes them."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None


@dataclass(slots=True)
class StopLimits:
    """How many stop strings a request may have, and how long."""

    max_count: int
    max_len: int


@dataclass(slots=True)
class GenerationSpec:
    """A validated request, ready to queue."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    stop: list[str]
    priority: int
    session_id: str  # empty: none


def check_id(field_name: str, value: str) -> None:
    """An id (request or session) must be 1-128 characters of [A-Za-z0-9._:-]."""
    if len(value) > MAX_ID_LEN or not ID_PATTERN.fullmatch(value):
        raise InvalidArgument(
            field_name, f"must be 1-{MAX_ID_LEN} characters of A-Z a-z 0-9 . _ : -, got {value!r}"
        )


def resolve_request_id(field_name: str, value: str) -> str:
    """The client's request id when it gave one (checked), else a new one."""
    if not value:
        return uuid.uuid4().hex
    check_id(field_name, value)
    return value


def check_token_ids(field_name: str, token_ids: list[int], vocab_size: int) -> None:
    """Every id must be below the vocabulary size."""
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise InvalidArgument(field_name, f"token id {token_id} >= vocab_size {vocab_size}")


def check_prompt_len(field_name: str, num_tokens: int, max_model_len: int) -> None:
    """A prompt must be non-empty and leave room for one generated token."""
    if num_tokens == 0:
        raise InvalidArgument(field_name, "the prompt has no tokens")
    if num_tokens >= max_model_len:
        raise InvalidArgument(
            field_name, f"{num_tokens} tokens; at most {max_model_len - 1} fit max_model_len"
        )


def _finite_in(field_name: str, value: float, low: float, high: float, allowed: str) -> float:
    if math.isnan(value) or math.isinf(value) or not low <= value <= high:
        raise InvalidArgument(field_name, f"must be in {allowed}, got {value}")
    return value


def _max_tokens(params: inference_pb2.SamplingParams, room: int, default: int) -> int:
    if not params.HasField("max_tokens"):
        return min(default, room)
    if params.max_tokens < 1:
        raise InvalidArgument("params.max_tokens", f"must be >= 1, got {params.max_tokens}")
    if params.max_tokens > room:
        raise InvalidArgument(
            "params.max_tokens",
            f"{params.max_tokens} does not fit: the prompt leaves room for {room} tokens",
        )
    return params.max_tokens


def _temperature(params: inference_pb2.SamplingParams) -> float:
    if not params.HasField("temperature"):
        return 1.0
    return _finite_in("params.temperature", params.temperature, 0.0, math.inf, "[0, inf)")


def _top_p(params: inference_pb2.SamplingParams) -> float:
    if not params.HasField("top_p"):
        return 1.0
    if params.top_p <= 0.0:
        raise InvalidArgument("params.top_p", f"must be in (0, 1], got {params.top_p}")
    return _finite_in("params.top_p", params.top_p, 0.0, 1.0, "(0, 1]")


def _repetition_penalty(params: inference_pb2.SamplingParams) -> float:
    if not params.HasField("repetition_penalty"):
        return 1.0
    value = params.repetition_penalty
    if value <= 0.0:
        raise InvalidArgument("params.repetition_penalty", f"must be in (0, inf), got {value}")
    return _finite_in("params.repetition_penalty", value, 0.0, math.inf, "(0, inf)")


def _logprobs(params: inference_pb2.SamplingParams) -> int | None:
    if not params.HasField("logprobs"):
        return None
    if params.logprobs > MAX_LOGPROBS:
        raise InvalidArgument(
            "params.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {params.logprobs}"
        )
    return params.logprobs


def check_stop(stop: list[str], limits: StopLimits) -> list[str]:
    """Stop strings: at most limits.max_count, each 1 to limits.max_len characters."""
    if len(stop) > limits.max_count:
        raise InvalidArgument("params.stop", f"at most {limits.max_count} strings, got {len(stop)}")
    for index, text in enumerate(stop):
        if not 0 < len(text) <= limits.max_len:
            raise InvalidArgument(
                f"params.stop[{index}]", f"must be 1-{limits.max_len} characters, got {len(text)}"
            )
    return list(stop)


def sampling_spec(
    params: inference_pb2.SamplingParams,
    prompt_len: int,
    limits: ModelLimits,
    default_max_tokens: int,
) -> SamplingSpec:
    """Check `params` for a prompt of `prompt_len` tokens and fill in defaults.

    Raises:
        InvalidArgument: naming the first bad field (`params.<name>`).
    """
    max_tokens = _max_tokens(params, limits.max_model_len - prompt_len, default_max_tokens)
    if params.min_tokens > max_tokens:
        raise InvalidArgument(
            "params.min_tokens", f"must be <= max_tokens ({max_tokens}), got {params.min_tokens}"
        )
    check_token_ids("params.stop_token_ids", list(params.stop_token_ids), limits.vocab_size)
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=_temperature(params),
        top_p=_top_p(params),
        top_k=params.top_k,
        min_p=_finite_in("params.min_p", params.min_p, 0.0, 1.0, "[0, 1]"),
        repetition_penalty=_repetition_penalty(params),
        presence_penalty=_finite_in(
            "params.presence_penalty", params.presence_penalty, -2.0, 2.0, "[-2, 2]"
        ),
        frequency_penalty=_finite_in(
            "params.frequency_penalty", params.frequency_penalty, -2.0, 2.0, "[-2, 2]"
        ),
        seed=params.seed if params.HasField("seed") else None,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        logprobs=_logprobs(params),
    )
