"""Checks of public requests; each failure is an InvalidArgument naming the field.

The sampling ranges are checked by building the engine's SamplingParams
(common/sampling_params.py, their one definition) here, before queueing, so a
client learns of a bad field at once, by its proto name.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from common.constraints import ConstraintError
from common.model_text import ModelLimits
from common.sampling_params import SamplingParamError, SamplingParams
from common.sampling_pb import sampling_params_from_pb
from gateway.errors import InvalidArgument, shown
from protos.kvgate.v1 import inference_pb2, internal_pb2

MAX_ID_LEN = 128
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]+")


@dataclass(slots=True)
class StopLimits:
    """How many stop strings a request may have and how long, and how many stop token ids."""

    max_count: int
    max_len: int
    max_token_ids: int = 64


@dataclass(slots=True)
class GenerationSpec:
    """A validated request, ready to queue."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    priority: int
    session_id: str  # empty: none
    priority_clamped: bool = False  # priority was lowered to the tenant's max_priority
    api: str = "kvgate"  # the front it came through: kvgate, openai or vllm (metrics)


def check_id(field_name: str, value: str) -> None:
    """An id (request or session) must be 1-128 characters of [A-Za-z0-9._:-]."""
    if len(value) > MAX_ID_LEN or not ID_PATTERN.fullmatch(value):
        raise InvalidArgument(
            field_name,
            f"must be 1-{MAX_ID_LEN} characters of A-Z a-z 0-9 . _ : -, got {shown(value)}",
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


def check_stop(stop: list[str], stop_token_ids: list[int], limits: StopLimits) -> list[str]:
    """Stop strings: at most limits.max_count, each 1 to limits.max_len characters; at most
    limits.max_token_ids stop token ids (their values are checked with the sampling ones).

    Returns: the stop strings.
    """
    if len(stop_token_ids) > limits.max_token_ids:
        raise InvalidArgument(
            "params.stop_token_ids", f"at most {limits.max_token_ids}, got {len(stop_token_ids)}"
        )
    if len(stop) > limits.max_count:
        raise InvalidArgument("params.stop", f"at most {limits.max_count} strings, got {len(stop)}")
    for index, text in enumerate(stop):
        if not 0 < len(text) <= limits.max_len:
            raise InvalidArgument(
                f"params.stop[{index}]", f"must be 1-{limits.max_len} characters, got {len(text)}"
            )
    return list(stop)


def checked_sampling_params(
    params: inference_pb2.SamplingParams,
    prompt_len: int,
    limits: ModelLimits,
    default_max_tokens: int,
) -> SamplingParams:
    """Check `params` for a prompt of `prompt_len` tokens and fill in defaults (a constraint's
    form only: TextWork.check_constraint compiles it).

    Raises:
        InvalidArgument: naming the first bad field (`params.<name>`).
    """
    max_tokens = _max_tokens(params, limits.max_model_len - prompt_len, default_max_tokens)
    check_token_ids("params.stop_token_ids", list(params.stop_token_ids), limits.vocab_size)
    check_token_ids("params.logit_bias", list(params.logit_bias), limits.vocab_size)
    check_token_ids("params.allowed_token_ids", list(params.allowed_token_ids), limits.vocab_size)
    try:
        return sampling_params_from_pb(params, max_tokens=max_tokens, min_tokens=params.min_tokens)
    except (SamplingParamError, ConstraintError) as err:
        raise InvalidArgument(f"params.{err.field}", err.problem) from None


def check_num_sequences(
    sampling: SamplingParams, statuses: list[internal_pb2.ExecutorStatus]
) -> None:
    """Raises: InvalidArgument naming `params.n` (or `params.best_of`) when the request asks
    for more sequences than the executors taking work run at once (their max_num_seqs); no
    such executor: nothing to check against (queueing says so)."""
    limit = max((s.max_num_seqs for s in statuses if not s.draining), default=0)
    if limit and sampling.num_sequences > limit:
        name = "best_of" if sampling.best_of else "n"
        raise InvalidArgument(
            f"params.{name}",
            f"{sampling.num_sequences} sequences; an executor runs at most {limit} at once "
            "(--max-num-seqs), and a request's sequences run together on one",
        )
