"""Tool calls through the OpenAI-compatible HTTP front, with the official `openai` package, on
real stacks (redis-server, scheduler, executor and gateway processes): stories260K, whose
template renders no tools, and stories260K saved with a template that renders Hermes-style
tools. Forced calls sampled at temperature 1 validate against their tools' schemas, streamed
and whole answers have OpenAI's shapes as the SDK parses them, a next turn with tool messages
renders through the template, and bad tools are refused naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from deploy.stack import Stack, free_port
from tests.tool_templates import hermes_stories_folder

MODEL_ID = "stories260K"
# Small schemas: the tools' text is in the prompt, and stories260K has 512 positions.
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 4}},
    "required": ["zone"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(6)
MAX_TOKENS = 150  # with a prompt of about 350 tokens, within stories260K's 512 positions
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
# The Hermes template writes tools as indented JSON: one tool fits stories260K's positions.
HERMES_TOOLS = [TOOLS[1]]
GET_TIME = {"type": "function", "function": {"name": "get_time"}}
GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    return stack_factory(http_port=free_port())


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hermes_stories_folder(tmp_path_factory.mktemp("hermes-stories"))


@pytest.fixture(scope="module")
def hermes_stack(stack_factory, hermes_model: Path) -> Stack:
    return stack_factory(http_port=free_port(), model=hermes_model)


def sdk(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.http_url, api_key="none", max_retries=0) as client:
        yield client


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    yield from sdk(stack)


@pytest.fixture
def hermes(hermes_stack: Stack) -> Iterator[openai.OpenAI]:
    yield from sdk(hermes_stack)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def call(client: openai.OpenAI, seed: int, **fields):
    fields = {
        "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX_TOKENS,
    } | fields  # fmt: skip
    return client.chat.completions.create(
        model=model_of(client), temperature=1.0, seed=seed, **fields
    )


def assert_valid_calls(choice, names: set[str], what: str) -> None:
    assert choice.finish_reason == "tool_calls", f"{what}: {choice}"
    assert choice.message.content is None, f"{what}: {choice.message}"
    calls = choice.message.tool_calls
    assert calls, f"{what}: no tool_calls in {choice.message}"
    for tool_call in calls:
        assert tool_call.type == "function" and tool_call.id.startswith("call_"), tool_call
        assert tool_call.function.name in names, f"{what}: {tool_call}"
        arguments = json.loads(tool_call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[tool_call.function.name])
    assert len({c.id for c in calls}) == len(calls), f"{what}: ids repeat in {calls}"


def test_required_calls_at_temperature_1_validate_over_seeds(client: openai.OpenAI):
    for seed in SEEDS:
        choice = call(client, seed, parallel_tool_calls=False).choices[0]
        assert_valid_calls(choice, set(SCHEMAS), f"seed {seed}")
        assert len(choice.message.tool_calls) == 1, choice.message


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_parallel_calls_are_a_list_of_valid_calls(client: openai.OpenAI):
    """The model decides how many calls it lists: a list cut by max_tokens ends with
    `length` (its last call may be cut short); every complete call validates."""
    most_calls = 0
    for seed in SEEDS:
        answer = call(client, seed)
        choice, calls = answer.choices[0], answer.choices[0].message.tool_calls
        if choice.finish_reason == "length":
            assert answer.usage.completion_tokens == MAX_TOKENS, answer
            if calls and not is_json(calls[-1].function.arguments):
                choice.message.tool_calls = calls = calls[:-1]
            choice.finish_reason = "tool_calls"
        if calls:
            assert_valid_calls(choice, set(SCHEMAS), f"seed {seed}")
        most_calls = max(most_calls, len(calls))
    assert most_calls > 1, "no answer listed more than one call"


def test_a_named_function_is_the_one_called(client: openai.OpenAI):
    for seed in SEEDS:
        choice = call(client, seed, tool_choice=GET_TIME).choices[0]
        assert_valid_calls(choice, {"get_time"}, f"seed {seed}")
        assert len(choice.message.tool_calls) == 1, choice.message


@pytest.mark.parametrize("tool_choice", ["required", GET_WEATHER])
def test_every_choice_of_n_is_a_valid_forced_call(client: openai.OpenAI, tool_choice):
    """n = 3: each choice is a call of its own (the grammar's matcher is forked with it)."""
    names = set(SCHEMAS) if tool_choice == "required" else {"get_weather"}
    answer = call(client, 5, n=3, tool_choice=tool_choice, parallel_tool_calls=False)
    assert [c.index for c in answer.choices] == [0, 1, 2], answer
    for choice in answer.choices:
        assert_valid_calls(choice, names, f"choice {choice.index}")
        assert len(choice.message.tool_calls) == 1, choice.message
    ids = [c.message.tool_calls[0].id for c in answer.choices]
    assert len(set(ids)) == 3, f"tool call ids repeat across choices: {ids}"
    chunks = list(call(client, 5, n=3, tool_choice=tool_choice, parallel_tool_calls=False,
                       stream=True))  # fmt: skip
    arguments = {0: "", 1: "", 2: ""}
    for choice in (c for chunk in chunks for c in chunk.choices):
        for piece in choice.delta.tool_calls or []:
            arguments[choice.index] += piece.function.arguments
    whole = {c.index: c.message.tool_calls[0].function.arguments for c in answer.choices}
    assert arguments == whole, "a streamed choice's call differs from the whole answer's"


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_calls_have_openais_chunks_and_accumulate_to_the_whole_answer(
    client: openai.OpenAI, parallel: bool
):
    for seed in SEEDS[:3]:
        whole_choice = call(client, seed, parallel_tool_calls=parallel).choices[0]
        whole = whole_choice.message.tool_calls
        chunks = list(call(client, seed, parallel_tool_calls=parallel, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant" and deltas[0].content is None, deltas[0]
        heads = [t for d in deltas for t in d.tool_calls or [] if t.id is not None]
        assert [(h.index, h.function.name) for h in heads] == [
            (i, c.function.name) for i, c in enumerate(whole)
        ]
        assert all(h.type == "function" and h.id.startswith("call_") for h in heads), heads
        arguments = [""] * len(whole)
        for delta in deltas:
            for piece in delta.tool_calls or []:
                arguments[piece.index] += piece.function.arguments
        assert arguments == [c.function.arguments for c in whole], f"seed {seed}"
        assert chunks[-1].choices[0].finish_reason == whole_choice.finish_reason
        if parallel:
            continue  # the SDK's stream helper refuses an answer cut by max_tokens
        assert whole_choice.finish_reason == "tool_calls", whole_choice
        with client.chat.completions.stream(
            model=MODEL_ID, messages=QUESTION, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
        ) as stream:  # fmt: skip
            done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion().choices[0]
        assert [e.name for e in done] == [c.function.name for c in whole]
        assert [c.function.arguments for c in final.message.tool_calls] == arguments
        assert final.finish_reason == "tool_calls"


def test_the_sdks_pydantic_tools_parse_the_arguments(client: openai.OpenAI):
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    for seed in SEEDS[:3]:
        answer = client.chat.completions.parse(
            model=MODEL_ID, messages=QUESTION, tools=[tool], tool_choice="required",
            parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
        )  # fmt: skip
        calls = answer.choices[0].message.tool_calls
        assert calls and all(isinstance(c.function.parsed_arguments, Weather) for c in calls)


def next_turn(answer, as_sent: bool = False) -> list:
    """The conversation after the assistant's calls, each answered by a tool message; the
    assistant's message as the SDK gave it (`as_sent`) or as a dict."""
    message = answer.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": f"result {i}"}
        for i, c in enumerate(message.tool_calls)
    ]
    return [*QUESTION, message if as_sent else message.model_dump(), *results]


def test_a_next_turn_with_tool_messages_is_answered(client: openai.OpenAI):
    first = call(client, 0, tool_choice=GET_TIME)
    messages = next_turn(first, as_sent=True)
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content, choice
    # a forced call after the results (one short call fits what the prompt leaves)
    again = call(client, 1, messages=messages, tool_choice=GET_WEATHER, max_tokens=50)
    assert_valid_calls(again.choices[0], set(SCHEMAS), "second call")
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_the_next_turn_renders_through_a_template_that_renders_tools(
    hermes: openai.OpenAI, hermes_model: Path
):
    first = call(hermes, 0, tools=HERMES_TOOLS, tool_choice=GET_TIME, max_tokens=60)
    messages = next_turn(first)
    answer = hermes.chat.completions.create(
        model=model_of(hermes), messages=messages, tools=HERMES_TOOLS, max_tokens=4, temperature=0
    )
    reference = AutoTokenizer.from_pretrained(hermes_model)
    for message in messages:
        for tool_call in message.get("tool_calls", []):
            tool_call["function"]["arguments"] = json.loads(tool_call["function"]["arguments"])
        if message["role"] == "tool":
            message["name"] = "get_time"
    token_ids = reference.apply_chat_template(
        messages, tools=HERMES_TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert answer.usage.prompt_tokens == len(token_ids)


def test_auto_reads_hermes_calls_the_model_writes(hermes: openai.OpenAI):
    """The model's text is held to a Hermes call by a choice constraint (with "auto", a
    constraint holds for the whole text), so that the calls kvgate reads are known."""
    fields = {
        "model": model_of(hermes), "messages": QUESTION, "tools": HERMES_TOOLS, "max_tokens": 100,
        "extra_body": {"structured_outputs": {"choice": [f"Let me see.{HERMES_CALL}"]}},
    }  # fmt: skip
    whole = hermes.chat.completions.create(**fields).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content == "Let me see.", whole.message
    [tool_call] = whole.message.tool_calls
    assert tool_call.function.name == "get_time" and tool_call.id.startswith("call_")
    assert json.loads(tool_call.function.arguments) == {"zone": "UTC"}
    chunks = list(hermes.chat.completions.create(stream=True, **fields))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == "Let me see." and len(calls) == 1, chunks
    assert json.loads(calls[0].function.arguments) == {"zone": "UTC"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = hermes.chat.completions.create(**fields | {"extra_body": {}}).choices[0]
    assert plain.message.content and plain.finish_reason in ("stop", "length"), plain


BAD_SCHEMA = {"type": "object", "not": {"type": "string"}}  # `not`: llguidance refuses it


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),  # auto (the default) on a template without tools
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [
                    *TOOLS,
                    {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}},
                ],
                "tool_choice": "required",
            },
            "tools[2].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
            "tools[0].function.name",
        ),
        (
            {
                "messages": [*QUESTION, {"role": "tool", "content": "4"}],
                "tool_choice": "none",
                "tools": TOOLS,
            },
            "messages[1].tool_call_id",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tools_are_bad_requests_naming_the_field(client: openai.OpenAI, fields, param):
    kwargs = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 8} | fields
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(stream=stream, **kwargs)
        error = raised.value
        assert error.param == param, f"expected param {param!r}: {error.body}"
        assert error.body["message"].startswith(param), error.body
