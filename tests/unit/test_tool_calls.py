"""Tool calls on the OpenAI front, piece by piece: the tools and tool_choice read from a body
(bad ones refused naming the field), the grammar of a forced call compiled by llguidance on
stories260K's tokenizer (sampled sentences are calls whose arguments validate), the readers
that turn streamed text back into calls, and the chat chunks and messages they shape."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer

from common.constraints import (
    Constraint,
    ConstraintError,
    ConstraintKind,
    ConstraintLimits,
    GrammarCompiler,
    llguidance_tokenizer,
)
from common.finish_reason import FinishReason
from common.model_files import default_gguf_path
from common.model_text import ModelText
from common.templates import Message, ToolCall
from gateway.errors import InvalidArgument
from gateway.generation import Chunk
from gateway.openai_responses import Choice, ResponseShape, TokenText
from gateway.openai_schema import chat_request
from gateway.openai_tools import (
    ToolChoice,
    call_grammar,
    prompt_messages,
    read_tool_plan,
    tool_of_grammar_line,
)
from gateway.tool_call_output import CallListReader, HermesReader
from tests.helpers import STORIES_260K
from tests.tool_templates import hermes_stories_folder

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 4}, "exact": {"type": "boolean"}},
    "required": ["zone", "exact"],
    "additionalProperties": False,
}


def tool(name: str, parameters: dict | None = None, **function) -> dict:
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": {"name": name, **function}}


TOOLS = [tool("get_weather", WEATHER, description="Weather"), tool("get_time", TIME), tool("ping")]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"type": "object"}}


def body(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    text = ModelText(STORIES_260K)
    limits = text.limits
    return GrammarCompiler(
        lambda: llguidance_tokenizer(
            text.hf_tokenizer, limits.vocab_size, list(limits.eos_token_ids)
        ),
        ConstraintLimits(),
    )


def sampled_sentence(compiler: GrammarCompiler, grammar: str, seed: int) -> list[int]:
    """Tokens drawn uniformly from the grammar's allowed ones until it only allows the end."""
    matcher = compiler.matcher(Constraint(ConstraintKind.GRAMMAR, grammar))
    rng = random.Random(seed)
    tokens: list[int] = []
    eos = set(compiler.tokenizer.eos_tokens)
    while not matcher.is_stopped():
        allowed = np.flatnonzero(np.frombuffer(bytes(matcher.compute_logit_bias()), np.uint8))
        choices = [int(t) for t in allowed if int(t) not in eos] or [int(allowed[0])]
        token = rng.choice(choices)
        if token in eos:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
        assert len(tokens) < 2000, "a bounded grammar ran on past 2000 tokens"
    return tokens


def decode(compiler: GrammarCompiler, tokens: list[int]) -> str:
    return compiler.tokenizer.decode_str(tokens)


def read_in_pieces(text: str, sizes: list[int]) -> tuple[CallListReader, list]:
    reader, deltas, at = CallListReader(), [], 0
    for size in sizes:
        deltas += reader.feed(text[at : at + size]).deltas
        at += size
    deltas += reader.feed(text[at:]).deltas + reader.finish().deltas
    return reader, deltas


@pytest.mark.parametrize(
    "choice, parallel, names",
    [
        ("required", True, {"get_weather", "get_time", "ping"}),
        ("required", False, {"get_weather", "get_time", "ping"}),
        ({"type": "function", "function": {"name": "get_time"}}, True, {"get_time"}),
    ],
)
def test_forced_call_sentences_are_calls_whose_arguments_validate(
    compiler, choice, parallel, names
):
    plan = read_tool_plan(body(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel))
    grammar = call_grammar(plan)
    seen_many = False
    for seed in range(12):
        text = decode(compiler, sampled_sentence(compiler, grammar, seed))
        calls = json.loads(text)
        assert isinstance(calls, list) and calls, f"seed {seed}: {text!r} is no list of calls"
        assert parallel or len(calls) == 1, f"seed {seed}: one call expected, got {text!r}"
        seen_many |= len(calls) > 1
        for call in calls:
            assert call["name"] in names, f"seed {seed}: {call['name']!r} not in {names}"
            jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
        rng = random.Random(seed)
        reader, deltas = read_in_pieces(text, [rng.randint(1, 7) for _ in range(len(text))])
        assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [
            (c["name"], c["arguments"]) for c in calls
        ]
        assert [d.index for d in deltas if d.call_id] == list(range(len(calls)))
    assert seen_many == (parallel and choice == "required"), "parallel lists hold many calls"


def test_a_tool_schema_that_does_not_compile_names_its_tool(compiler):
    tools = [tool("a", TIME), tool("b", {"type": "object", "not": {"type": "string"}})]
    plan = read_tool_plan(body(tools=tools, tool_choice="required"))
    with pytest.raises(ConstraintError) as refused:
        compiler.matcher(Constraint(ConstraintKind.GRAMMAR, call_grammar(plan)))
    assert tool_of_grammar_line(str(refused.value), plan) == 1, str(refused.value)
    request = chat_request(body(tools=tools, tool_choice="required"))
    error = InvalidArgument("params.grammar", refused.value.problem)
    assert request.error_param(error) == "tools[1].function.parameters"


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"tools": [tool("ok"), tool("bad name")]}, "tools[1].function.name"),
        ({"tools": [tool("a"), tool("a")], "tool_choice": "required"}, "tools[1].function.name"),
        ({"tools": [{"type": "code", "function": {}}]}, "tools[0].type"),
        ({"tools": [tool("a", {"type": "array"})]}, "tools[0].function.parameters.type"),
        ({"tools": [tool("a", "{}")]}, "tools[0].function.parameters"),
        ({"tools": [tool("a", strict="yes")]}, "tools[0].function.strict"),
        ({"tools": [tool("a", extra=1)]}, "tools[0].function.extra"),
        ({"tools": "a"}, "tools"),
        ({"tools": [tool("a")], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [tool("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [tool("a")], "parallel_tool_calls": 1}, "parallel_tool_calls"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),
        ({"tools": [tool("a")], "parallel_tool_calls": False}, "parallel_tool_calls"),
        (
            {
                "tools": [tool("a")],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"functions": [tool("a")]}, "functions"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(fields: dict, name: str):
    with pytest.raises(InvalidArgument) as refused:
        chat_request(body(**fields))
    assert refused.value.field == name, str(refused.value)


CALL = {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}


@pytest.mark.parametrize(
    "messages, name",
    [
        ([{"role": "tool", "content": "4"}], "messages[0].tool_call_id"),
        (
            [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "4"}],
            "messages[1].tool_call_id",
        ),
        (
            [
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "content": "4", "tool_call_id": "call_2"},
            ],
            "messages[1].tool_call_id",
        ),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [CALL | {"function": {"name": "a", "arguments": "[1]"}}],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [CALL | {"id": None}]}],
            "messages[0].tool_calls[0].id",
        ),
        ([{"role": "user", "content": "x", "tool_call_id": "call_1"}], "messages[0].tool_call_id"),
    ],
)
def test_bad_tool_messages_are_refused_naming_the_field(messages: list, name: str):
    with pytest.raises(InvalidArgument) as refused:
        chat_request(body(messages=messages))
    assert refused.value.field == name, str(refused.value)


def test_tool_choice_defaults_to_auto_and_none_offers_nothing():
    assert read_tool_plan(body(tools=[tool("a")])).choice is ToolChoice.AUTO
    plan = read_tool_plan(body(tools=[tool("a")], tool_choice="none"))
    assert plan.choice is ToolChoice.NONE and plan.callable == ()
    assert read_tool_plan(body()) is None


def test_hermes_reader_holds_back_tags_and_passes_other_text_on():
    text = (
        'Let me look.<tool_call>\n{"name": "a", "arguments": {"x": [1, "}"]}}\n</tool_call>'
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> done <tool'
    )
    for size in (1, 3, 11, len(text)):
        reader, content, deltas = HermesReader({"a"}), [], []
        for at in range(0, len(text), size):
            reading = reader.feed(text[at : at + size])
            content.append(reading.content)
            deltas += reading.deltas
        content.append(reader.finish().content)
        assert "".join(content) == (
            'Let me look.<tool_call>{"name": "unknown", "arguments": {}}</tool_call> done <tool'
        )
        assert [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == [
            (0, "a", {"x": [1, "}"]})
        ]


def test_hermes_blocks_whose_name_is_not_a_string_stay_content():
    for name in ('["a"]', "{}", "7", "null"):
        text = f'<tool_call>{{"name": {name}, "arguments": {{}}}}</tool_call>'
        reader = HermesReader({"a"})
        reading = reader.feed(text)
        assert reading.deltas == [], name
        assert reading.content + reader.finish().content == text, name


def shape(tool_choice: object) -> ResponseShape:
    plan = read_tool_plan(body(tools=TOOLS, tool_choice=tool_choice))
    text = TokenText(ModelText(STORIES_260K).tokenizer)
    return ResponseShape(True, "m", "r1", False, text, plan)


LIST = (
    '[{"name": "get_time", "arguments": {"zone":"UTC","exact":true}}, '
    '{"name": "ping", "arguments": {}}]'
)


def test_a_forced_answer_is_a_message_of_tool_calls():
    choice = Choice(0, [LIST[:30], LIST[30:]], finish_reason=FinishReason.STOP)
    answer = shape("required").whole([choice])["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    message = answer["message"]
    assert message["content"] is None
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time", "ping"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC", "exact": True}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_a_streamed_forced_answer_streams_call_heads_then_argument_pieces():
    streamed = shape("required")
    pieces = [LIST[i : i + 5] for i in range(0, len(LIST), 5)]
    chunks = [streamed.chunk(0, Chunk(text=p, token_ids=[])) for p in pieces[:-1]]
    chunks.append(
        streamed.chunk(0, Chunk(text=pieces[-1], token_ids=[], finish_reason=FinishReason.STOP))
    )
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all("content" not in d for d in deltas), deltas
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    heads = [t for t in calls if "id" in t]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_time"), (1, "ping")]
    arguments = [
        "".join(t["function"]["arguments"] for t in calls if t["index"] == i) for i in (0, 1)
    ]
    assert [json.loads(a) for a in arguments] == [{"zone": "UTC", "exact": True}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


ARGUMENTS = {"zone": "UTC", "exact": True}
CONVERSATION = [
    Message("system", "Be brief."),
    Message("user", "What time is it in UTC?"),
    Message("assistant", "", (ToolCall("call_1", "get_time", '{"zone": "UTC", "exact": true}'),)),
    Message("tool", "12:00", tool_call_id="call_1"),
]


def test_the_served_templates_render_no_tools():
    gguf = default_gguf_path()
    assert gguf.is_file(), f"{gguf} is missing: `make setup` fetches it (deploy/fetch_model.py)"
    for model in (STORIES_260K, gguf):
        template = ModelText(model).chat_template
        assert not template.renders_tools, f"{model}'s template renders tools"
        assert not template.writes_hermes_calls


def test_a_template_that_renders_tools_renders_them_as_transformers_does(tmp_path):
    folder = hermes_stories_folder(tmp_path)
    model_text = ModelText(folder)
    assert model_text.chat_template.renders_tools and model_text.chat_template.writes_hermes_calls
    offered = [tool("get_weather", WEATHER, description="Weather"), tool("get_time", TIME)]
    plan = read_tool_plan(body(tools=offered, tool_choice="auto"))
    messages, tools = prompt_messages(plan, CONVERSATION, renders_tools=True)
    reference = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What time is it in UTC?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_time",
                            "arguments": {"zone": "UTC", "exact": True},
                        },
                    }
                ],
            },
            {"role": "tool", "content": "12:00", "tool_call_id": "call_1", "name": "get_time"},
        ],
        tools=offered,
        add_generation_prompt=True,
        tokenize=False,
    )
    rendered = model_text.render_chat(messages, tools=tools)
    assert rendered == reference
    assert '"name": "get_weather"' in rendered and "<tool_response>\n12:00" in rendered


def test_a_template_without_tools_is_told_of_forced_tools_in_the_system_message():
    plan = read_tool_plan(body(tools=TOOLS, tool_choice="required"))
    messages, tools = prompt_messages(plan, CONVERSATION, renders_tools=False)
    assert tools is None
    assert messages[0].role == "system" and messages[0].content.startswith("Be brief.\n\n")
    assert all(json.dumps(name) in messages[0].content for name in SCHEMAS)
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    assert (
        messages[2].content == '[{"name": "get_time", "arguments": {"zone": "UTC", "exact": true}}]'
    )
    assert messages[3].content == "Result of tool call call_1:\n12:00"
    rendered = ModelText(STORIES_260K).render_chat(messages)
    assert "Result of tool call call_1" in rendered
    none = read_tool_plan(body(tools=TOOLS, tool_choice="none"))
    plain, tools = prompt_messages(none, CONVERSATION[:2], renders_tools=False)
    assert plain == CONVERSATION[:2] and tools is None
    plain, tools = prompt_messages(none, CONVERSATION[:2], renders_tools=True)
    assert plain == CONVERSATION[:2] and tools is None


def test_a_list_cut_short_keeps_its_finish_reason():
    """A stop string (or max_tokens) that cuts the list: its calls so far, not tool_calls."""
    cut = Choice(0, [LIST[:-3]], finish_reason=FinishReason.STOP)
    answer = shape("required").whole([cut])["choices"][0]
    assert answer["finish_reason"] == "stop", answer
    assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == ["get_time", "ping"]
    streamed = shape("required")
    last = streamed.chunk(0, Chunk(LIST[:-3], [], finish_reason=FinishReason.STOP))
    assert last["choices"][0]["finish_reason"] == "stop", last
