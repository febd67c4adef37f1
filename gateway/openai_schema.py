"""OpenAI request bodies (chat and text completions) read into what the request path takes.

Every field is checked for its JSON type here, and its range where the gRPC message could not
hold it (a negative or huge count); the sampling ranges are then checked by the gRPC front's
own validation (gateway/validation.py), whose field names `openai_param` translates back.
A field kvgate does not support yet, or one it does not know, is refused with the field's
name: none is accepted and ignored. null is the same as leaving a field out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.sampling_params import MAX_LOGIT_BIAS, MAX_N
from common.templates import ROLES, Message
from gateway.errors import InvalidArgument, shown
from gateway.openai_constraints import CONSTRAINT_FIELDS, fill_constraint
from gateway.openai_tools import (
    ToolPlan,
    call_grammar,
    message_tool_call_id,
    message_tool_calls,
    read_tool_plan,
    tool_of_grammar_line,
)
from protos.kvgate.v1 import inference_pb2

MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
MAX_PRIORITY = 2**31 - 1
MAX_USER_CHARS = 256
# Why each field kvgate does not serve yet is refused (the rest of the message names the field).
UNSUPPORTED = {
    "functions": "is not supported by kvgate (use tools)",
    "function_call": "is not supported by kvgate (use tool_choice)",
    "audio": "is not supported by kvgate (text only)",
    "modalities": "is not supported by kvgate (text only)",
    "prediction": "is not supported by kvgate yet",
    "reasoning_effort": "is not supported by kvgate",
    "web_search_options": "is not supported by kvgate",
    "suffix": "is not supported by kvgate yet",
    "store": "is not supported by kvgate (nothing is stored)",
    "metadata": "is not supported by kvgate (nothing is stored)",
    "service_tier": "is not supported by kvgate (use priority)",
    "echo": "is served on /v1/completions only",
}
# Fields both endpoints read; then each endpoint's own.
COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop",
    "seed", "presence_penalty", "frequency_penalty", "user", "n", "logprobs",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
    "priority", "session_id", "best_of", "logit_bias", "allowed_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", *CONSTRAINT_FIELDS,
})  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls",
}  # fmt: skip
CHAT_ROLES = (*ROLES, "tool")
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
# The gRPC front's names of the fields whose OpenAI names differ.
GRPC_NAMES = {"params.max_tokens": "max_tokens", "params.logprobs": "logprobs"}


@dataclass(slots=True)
class OpenAIRequest:
    """A checked chat or text completion request."""

    model: str
    params: inference_pb2.SamplingParams
    messages: list[Message] = field(default_factory=list)  # chat
    prompts: list[str | list[int]] = field(default_factory=list)  # completions, one per choice
    stream: bool = False
    include_usage: bool = False  # stream: a last chunk with the usage
    priority: int = 0
    session_id: str = ""
    user: str = ""
    logprobs: bool = False  # answer with each token's logprob (params.logprobs alternatives)
    names: dict[str, str] = field(default_factory=dict)  # gRPC field name -> the body's
    tool_plan: ToolPlan | None = None  # chat: the tools and tool_choice (None: no tools)
    # completions' echo: each choice's text (and logprobs) starts with its prompt's
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    # vLLM's prompt_logprobs: each choice reports its prompt's logprobs in vLLM's shape
    prompt_logprobs: bool = False

    @property
    def num_choices(self) -> int:
        """Choices of the answer: n for each prompt (one prompt for chat)."""
        return max(1, len(self.prompts)) * self.params.n

    def openai_param(self, grpc_field: str) -> str:
        """The body's name of a field the request path names as the gRPC front does."""
        if grpc_field in self.names:
            return self.names[grpc_field]
        name = grpc_field.removeprefix("params.")
        return GRPC_NAMES.get(name, name)

    def error_param(self, error: InvalidArgument) -> str:
        """The body's name of the field `error` names: a forced call's grammar that does not
        compile names the tool whose parameters it could not read, when it can tell."""
        plan = self.tool_plan
        if error.field == "params.grammar" and plan is not None and plan.forced:
            index = tool_of_grammar_line(str(error), plan)
            if index is not None:
                return f"tools[{index}].function.parameters"
        return self.openai_param(error.field)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise InvalidArgument(name, f"must be an integer in [{low}, {high}], got {_shown(value)}")
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgument(name, f"must be a finite number, got {_shown(value)}")
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(name, f"must be true or false, got {_shown(value)}")
    return value


def _string(body: dict, name: str, max_chars: int | None = None) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgument(name, f"must be a string, got {_shown(value)}")
    if max_chars is not None and len(value) > max_chars:
        raise InvalidArgument(name, f"at most {max_chars} characters, got {len(value)}")
    return value


def _shown(value: object) -> str:
    if isinstance(value, str):
        return shown(value)
    return shown(repr(value)) if len(repr(value)) > 64 else repr(value)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    return stop


def _token_ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t <= MAX_UINT32 for t in value):
        raise InvalidArgument(name, "must be a list of token ids (integers >= 0)")
    return value


def _refuse_unsupported(body: dict, allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED and name not in allowed and value is not None and value is not False:
            raise InvalidArgument(name, UNSUPPORTED[name])
        if name not in allowed and name not in UNSUPPORTED:
            raise InvalidArgument(name, "unknown field (kvgate refuses fields it would ignore)")


def _fill_choices(body: dict, params: inference_pb2.SamplingParams, stream: bool) -> None:
    """n and best_of; best_of > n ranks whole sequences, so it cannot stream (as OpenAI)."""
    params.n = _int(body, "n", 1, MAX_N) or 1
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is None:
        return
    if best_of < params.n:
        raise InvalidArgument("best_of", f"must be >= n ({params.n}), got {best_of}")
    if stream and best_of > params.n:
        raise InvalidArgument("best_of", "greater than n cannot be streamed (stream: true)")
    params.best_of = best_of


def _sampling(body: dict, max_tokens_name: str) -> inference_pb2.SamplingParams:
    """The sampling fields as the gRPC message (vLLM's top_k -1, "all", is 0 there)."""
    params = inference_pb2.SamplingParams(stop=_stop(body))
    for name in ("temperature", "top_p", "repetition_penalty"):
        if (value := _number(body, name)) is not None:
            setattr(params, name, value)
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        setattr(params, name, _number(body, name) or 0.0)
    if (max_tokens := _int(body, max_tokens_name, 1, MAX_UINT32)) is not None:
        params.max_tokens = max_tokens
    if (seed := _int(body, "seed", 0, MAX_UINT64)) is not None:
        params.seed = seed
    top_k = _int(body, "top_k", -1, MAX_UINT32)
    params.top_k = 0 if top_k in (None, -1) else top_k
    params.min_tokens = _int(body, "min_tokens", 0, MAX_UINT32) or 0
    params.ignore_eos = _bool(body, "ignore_eos")
    if body.get("stop_token_ids") is not None:
        params.stop_token_ids.extend(_token_ids(body["stop_token_ids"], "stop_token_ids"))
    _fill_logit_masks(body, params)
    return params


def _fill_logit_masks(body: dict, params: inference_pb2.SamplingParams) -> None:
    """logit_bias, allowed_token_ids and the text options (vLLM's extensions)."""
    for token_id, bias in _logit_bias(body.get("logit_bias")).items():
        params.logit_bias[token_id] = bias
    if body.get("allowed_token_ids") is not None:
        allowed = _token_ids(body["allowed_token_ids"], "allowed_token_ids")
        if not allowed:
            raise InvalidArgument("allowed_token_ids", "must not be empty when set")
        params.allowed_token_ids.extend(allowed)
    params.include_stop_str_in_output = _bool(body, "include_stop_str_in_output")
    if body.get("skip_special_tokens") is not None:
        params.skip_special_tokens = _bool(body, "skip_special_tokens")


def _logit_bias(value: object) -> dict[int, float]:
    """OpenAI's logit_bias: token ids written as JSON keys (strings) -> a bias in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument("logit_bias", f"must map token ids to numbers, got {_shown(value)}")
    biases = {}
    for key, bias in value.items():
        is_id = key.isascii() and key.isdigit() and len(key) <= len(str(MAX_UINT32))
        if not (is_id and int(key) <= MAX_UINT32):
            raise InvalidArgument("logit_bias", f"keys must be token ids, got {_shown(key)}")
        is_number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not is_number or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidArgument(
                "logit_bias", f"token {key}'s bias must be in [-100, 100], got {_shown(bias)}"
            )
        biases[int(key)] = float(bias)
    return biases


def _common(body: dict, allowed: frozenset[str], max_tokens_name: str) -> OpenAIRequest:
    _refuse_unsupported(body, allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model", "required: the served model's id (GET /v1/models)")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise InvalidArgument("stream_options", "only with stream: true")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise InvalidArgument("stream_options", "must be {'include_usage': true or false}")
    request = OpenAIRequest(
        model=model,
        params=_sampling(body, max_tokens_name),
        stream=stream,
        include_usage=_bool(options or {}, "include_usage"),
        priority=_int(body, "priority", -MAX_PRIORITY, MAX_PRIORITY) or 0,
        session_id=_string(body, "session_id"),
        user=_string(body, "user", MAX_USER_CHARS),
        names={"params.max_tokens": max_tokens_name},
    )
    fill_constraint(body, request.params, request.names)
    _fill_choices(body, request.params, stream)
    if (prompt_logprobs := _int(body, "prompt_logprobs", 0, MAX_UINT32)) is not None:
        request.params.prompt_logprobs = prompt_logprobs
        request.prompt_logprobs = True
    return request


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    name = f"messages[{index}].content"
    if content is None and message.get("tool_calls"):
        return ""  # an assistant message that only calls tools
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(name, "must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidArgument(name, "only text parts ({'type': 'text', 'text': ...})")
        if not isinstance(part.get("text"), str):
            raise InvalidArgument(name, "a text part's text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _message(message: object, index: int, call_ids: set[str]) -> Message:
    if not isinstance(message, dict):
        raise InvalidArgument(f"messages[{index}]", "must be an object {role, content}")
    given = {key for key, value in message.items() if value is not None}
    if extra := given - {"role", "content", "tool_calls", "tool_call_id"}:
        field_name = sorted(extra)[0]
        # name included: the chat templates served render no participant names
        raise InvalidArgument(f"messages[{index}].{field_name}", "is not supported")
    role = message.get("role")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in CHAT_ROLES:
        raise InvalidArgument(f"messages[{index}].role", f"must be one of {', '.join(CHAT_ROLES)}")
    tool_calls = message_tool_calls(message, index)
    tool_call_id = message_tool_call_id(message, index, call_ids)
    call_ids.update(c.call_id for c in tool_calls)
    return Message(role, _content(message, index), tool_calls, tool_call_id)


def _messages(body: dict) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "required: a non-empty list of {role, content}")
    call_ids: set[str] = set()  # of the assistant tool calls so far
    return [_message(message, index, call_ids) for index, message in enumerate(messages)]


def _fill_tools(body: dict, request: OpenAIRequest) -> None:
    """The tools, and for a forced call its grammar as the request's constraint (with
    "auto", a constraint the body sets holds for the whole output, calls included)."""
    plan = read_tool_plan(body)
    request.tool_plan = plan
    if plan is None or not plan.forced:
        return
    if (kind := request.params.WhichOneof("constraint")) is not None:
        given = request.openai_param(f"params.{kind}").partition(".")[0]
        raise InvalidArgument(given, "cannot be combined with a forced tool call's grammar")
    request.params.grammar = call_grammar(plan)
    request.names["params.grammar"] = "tools"


def chat_request(body: dict) -> OpenAIRequest:
    """A /v1/chat/completions body, checked.

    Raises:
        InvalidArgument: naming the first bad field as the body does.
    """
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise InvalidArgument("max_completion_tokens", "set max_tokens or it, not both")
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    request = _common(body, CHAT_FIELDS, name)
    request.messages = _messages(body)
    _fill_tools(body, request)
    request.logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_UINT32)
    if top is not None and not request.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    if request.logprobs:
        request.params.logprobs = top or 0
        request.names["params.logprobs"] = "top_logprobs"
    return request


def completion_request(body: dict) -> OpenAIRequest:
    """A /v1/completions body, checked.

    Raises:
        InvalidArgument: naming the first bad field as the body does.
    """
    echo = _bool(body, "echo")
    echo_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    if echo_only:  # vLLM's way of scoring a prompt: one token is run and left out
        body = {**body, "max_tokens": 1}
    request = _common(body, COMPLETION_FIELDS, "max_tokens")
    request.prompts = _prompts(body.get("prompt"))
    request.echo, request.echo_only = echo, echo_only
    logprobs = _int(body, "logprobs", 0, MAX_UINT32)
    if logprobs is not None:
        request.logprobs = True
        request.params.logprobs = logprobs
        if echo:  # the echoed prompt's tokens come with their logprobs too
            request.params.prompt_logprobs = max(logprobs, request.params.prompt_logprobs)
            request.names.setdefault("params.prompt_logprobs", "logprobs")
    return request


def _prompts(prompt: object) -> list[str | list[int]]:
    """A string, a list of strings, token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if not all(prompt):
                raise InvalidArgument("prompt", "an empty string is no prompt")
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [_token_ids(prompt, "prompt")]
        if all(isinstance(p, list) for p in prompt):
            return [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidArgument(
        "prompt", "required: a string, a list of strings, or token ids (or lists of them)"
    )
