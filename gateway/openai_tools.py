"""OpenAI function tools on the chat endpoint: `tools`, `tool_choice`, `parallel_tool_calls`
and the tool fields of messages, read into a ToolPlan; the grammar of a forced call; and how
the tools reach the prompt.

A forced call (`tool_choice` "required" or a named function) is a Lark grammar on the one
constraint path (kvgate.v1's `grammar`): the output is a JSON list of calls,
`[{"name": "f", "arguments": {...}}, ...]`, each call's name one of the tools' (or the named
one) and its arguments their `parameters` schema (llguidance's `%json`). "auto" leaves the
output free and reads calls the model writes in the Hermes format (<tool_call>{...}</tool_call>):
only where the chat template renders tools in that format. "none" offers no tools.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from common.templates import Message, ToolCall, tool_free_messages
from gateway.errors import InvalidArgument

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
MAX_TOOLS = 128  # as OpenAI
# A constrained call's arguments are compact JSON: free whitespace lets a model spend its
# whole max_tokens on newlines (as JSON_OPTIONS in common/constraints.py).
ARGUMENTS_OPTIONS = {"whitespace_flexible": False}


class ToolChoice(enum.Enum):
    NONE = "none"  # no tools offered; a text answer
    AUTO = "auto"  # the model decides (templates that render Hermes-style calls only)
    REQUIRED = "required"  # at least one call of any of the tools, forced by a grammar
    NAMED = "function"  # one call of the named function, forced by a grammar


@dataclass(frozen=True, slots=True)
class Tool:
    """One function tool, checked."""

    name: str
    description: str
    parameters: dict  # the JSON Schema of its arguments, an object's

    def as_openai(self) -> dict:
        """As OpenAI's `tools` entries (and transformers' templates) spell it."""
        function = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask for."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    named: str = ""  # NAMED: the function to call
    parallel: bool = True  # forced: a list of one or more calls (False: exactly one)

    @property
    def forced(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name."""
        if self.choice is ToolChoice.NONE:
            return ()
        if self.choice is ToolChoice.NAMED:
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools


def read_tool_plan(body: dict) -> ToolPlan | None:
    """The body's tools and tool_choice (no tools and no tool_choice: None).

    Raises:
        InvalidArgument: naming the field (`tools[1].function.name`, `tool_choice`, ...).
    """
    tools = _tools(body.get("tools"))
    choice_value = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument("parallel_tool_calls", "must be true or false")
    if not tools:
        if choice_value not in (None, "none"):
            raise InvalidArgument("tool_choice", "needs tools")
        if parallel is not None:
            raise InvalidArgument("parallel_tool_calls", "needs tools")
        return None
    choice, named = _tool_choice(choice_value, tools)
    if parallel is False and choice is ToolChoice.AUTO:
        raise InvalidArgument(
            "parallel_tool_calls",
            "false is served with tool_choice 'required' or a named function (one call "
            "forced); with 'auto' the model may write several calls",
        )
    return ToolPlan(tools, choice, named, parallel is not False)


def _tools(value: object) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise InvalidArgument("tools", f"must be a list of at most {MAX_TOOLS} function tools")
    tools = tuple(_tool(item, f"tools[{index}]") for index, item in enumerate(value))
    names = [t.name for t in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise InvalidArgument(f"tools[{index}].function.name", f"{name!r} is named twice")
    return tools


def _tool(item: object, where: str) -> Tool:
    if not isinstance(item, dict) or item.get("type") != "function":
        raise InvalidArgument(f"{where}.type", "must be 'function' (the only tool kind)")
    if extra := set(item) - TOOL_FIELDS:
        raise InvalidArgument(f"{where}.{sorted(extra)[0]}", "unknown field")
    function = item.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f"{where}.function", "required: {name, description, parameters}")
    where = f"{where}.function"
    if extra := set(function) - FUNCTION_FIELDS:
        raise InvalidArgument(f"{where}.{sorted(extra)[0]}", "unknown field")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidArgument(f"{where}.name", "required: 1 to 64 of a-z, A-Z, 0-9, _ and -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidArgument(f"{where}.description", "must be a string")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidArgument(f"{where}.strict", "must be true or false")
    parameters = _parameters(function.get("parameters"), f"{where}.parameters")
    return Tool(name, description or "", parameters)


def _parameters(value: object, where: str) -> dict:
    """The arguments' schema: an object's (a schema with no type is given type object)."""
    if value is None:
        return NO_PARAMETERS
    if not isinstance(value, dict):
        raise InvalidArgument(where, "must be a JSON Schema (an object)")
    if value.get("type", "object") != "object":
        raise InvalidArgument(f"{where}.type", "must be 'object': arguments are a JSON object")
    return {"type": "object"} | value


def _tool_choice(value: object, tools: tuple[Tool, ...]) -> tuple[ToolChoice, str]:
    if value is None:
        return ToolChoice.AUTO, ""  # OpenAI's default when tools are given
    if value in ("none", "auto", "required"):
        return ToolChoice(value), ""
    if not isinstance(value, dict) or value.get("type") != "function":
        raise InvalidArgument(
            "tool_choice", "must be 'none', 'auto', 'required' or {type: 'function', function}"
        )
    function = value.get("function")
    if set(value) != {"type", "function"} or not isinstance(function, dict):
        raise InvalidArgument("tool_choice.function", "required: {name: a tool's name}")
    name = function.get("name")
    if set(function) != {"name"} or not isinstance(name, str):
        raise InvalidArgument("tool_choice.function", "must be {name: a tool's name}")
    if name not in {t.name for t in tools}:
        raise InvalidArgument("tool_choice.function.name", f"{name!r} is none of the tools")
    return ToolChoice.NAMED, name


def call_grammar(plan: ToolPlan) -> str:
    """The Lark grammar (llguidance's) of a forced call: line i + 1 holds the arguments of
    plan.tools[i], so that a compile error's line names its tool (`tool_of_grammar_line`)."""
    callable_names = {t.name for t in plan.callable}
    arguments, calls = [], []
    for index, tool in enumerate(plan.tools):
        schema = tool.parameters | {"x-guidance": ARGUMENTS_OPTIONS}
        arguments.append(f"args_{index}: %json {json.dumps(schema)}")
        if tool.name in callable_names:
            prefix = json.dumps(f'{{"name": "{tool.name}", "arguments": ')
            calls.append(f'call_{index}: {prefix} args_{index} "}}"')
    names = " | ".join(c.partition(":")[0] for c in calls)
    repeat = ' (", " call)*' if plan.parallel and plan.choice is ToolChoice.REQUIRED else ""
    return "\n".join([*arguments, *calls, f"call: {names}", f'start: "[" call{repeat} "]"'])


def tool_of_grammar_line(problem: str, plan: ToolPlan) -> int | None:
    """The tool whose arguments' line a compile error of call_grammar points at."""
    found = re.search(r"\bat (\d+)\(", problem)
    if found is None or not 1 <= int(found.group(1)) <= len(plan.tools):
        return None
    return int(found.group(1)) - 1


def tools_system_text(plan: ToolPlan) -> str:
    """How a template that renders no tools is told of a forced call's tools."""
    lines = []
    for tool in plan.callable:
        function = {"name": tool.name, "description": tool.description or None}
        function["parameters"] = tool.parameters
        compact = {key: value for key, value in function.items() if value is not None}
        lines.append(json.dumps(compact, separators=(",", ":")))
    return (
        'Call functions: answer [{"name": ..., "arguments": {...}}, ...]. The functions:\n'
        + "\n".join(lines)
    )


def prompt_messages(
    plan: ToolPlan | None, messages: list[Message], renders_tools: bool
) -> tuple[list[Message], list[dict] | None]:
    """The messages and tools to render: a template that renders tools gets them as they
    are (no tools for "none"); one that does not gets tool_free_messages, and for a forced
    call the tools described in the system message."""
    offered = plan is not None and plan.choice is not ToolChoice.NONE
    if renders_tools:
        return messages, [t.as_openai() for t in plan.tools] if offered else None
    messages = tool_free_messages(messages)
    if not offered:
        return messages, None
    description = tools_system_text(plan)
    if messages[0].role == "system":
        system = Message("system", f"{messages[0].content}\n\n{description}")
        return [system, *messages[1:]], None
    return [Message("system", description), *messages], None


def check_tool_choice(plan: ToolPlan | None, renders_hermes_calls: bool) -> None:
    """Raises: InvalidArgument naming tool_choice when it is "auto" and the template does
    not render tools in a format kvgate reads calls back from."""
    if plan is not None and plan.choice is ToolChoice.AUTO and not renders_hermes_calls:
        raise InvalidArgument(
            "tool_choice",
            "'auto' (the default with tools) needs a chat template that renders tools with "
            "Hermes-style <tool_call> calls, and this model's does not; set 'required', "
            "{type: 'function', function: {name}} or 'none'",
        )


# The tool fields of messages: an assistant's tool_calls, a tool message's tool_call_id.


def message_tool_calls(message: dict, index: int) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls, checked (arguments must be a JSON object's text)."""
    calls = message.get("tool_calls")
    where = f"messages[{index}].tool_calls"
    if calls is None:
        return ()
    if message.get("role") != "assistant":
        raise InvalidArgument(where, "only in an assistant message")
    if not isinstance(calls, list):
        raise InvalidArgument(where, "must be a list of {id, type: 'function', function}")
    return tuple(_message_call(call, f"{where}[{i}]") for i, call in enumerate(calls))


def _message_call(call: object, where: str) -> ToolCall:
    if not isinstance(call, dict) or call.get("type") != "function":
        raise InvalidArgument(f"{where}.type", "must be 'function'")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise InvalidArgument(f"{where}.id", "required: the call's id")
    function = call.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f"{where}.function", "required: {name, arguments}")
    if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
        raise InvalidArgument(f"{where}.function.name", "required: the function's name")
    arguments = function.get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"{where}.function.arguments", "must be a JSON object's text")
    return ToolCall(call["id"], function["name"], arguments)


def message_tool_call_id(message: dict, index: int, call_ids: set[str]) -> str:
    """A tool message's tool_call_id: required, and one of the earlier assistant calls'."""
    call_id = message.get("tool_call_id")
    where = f"messages[{index}].tool_call_id"
    if message.get("role") != "tool":
        if call_id is not None:
            raise InvalidArgument(where, "only in a tool message")
        return ""
    if not isinstance(call_id, str) or not call_id:
        raise InvalidArgument(where, "required in a tool message: the id of the call it answers")
    if call_id not in call_ids:
        raise InvalidArgument(where, f"{call_id!r} answers no earlier assistant tool call")
    return call_id
