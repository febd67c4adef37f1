"""Chat templates: the model's own (Hugging Face's `chat_template`) or kvgate's default.

A model's template comes with its tokenizer, as transformers reads it: `chat_template.jinja`
beside the tokenizer, `tokenizer_config.json`'s `chat_template` (one string, or a list of
named templates of which "default" is used), or a GGUF file's `tokenizer.chat_template`.
transformers renders it (`apply_chat_template`), so a prompt is the text transformers makes
of the same conversation, and tokenizes it with `sanitize_control_tokens`: a control token
typed in a message is encoded as text, and only the template itself writes control tokens.

The default, for models that ship none (stories260K has none), renders:

    <s>{system}\\n\\nUser: {user}\\nAssistant: {assistant}</s>\\nUser: {user}\\nAssistant:

(BOS, the system prompt and a blank line when there is one, then each user turn on
a `User: ` line and each assistant turn on an `Assistant: ` line ended by EOS;
with add_generation_prompt it ends with `Assistant:` for the model to continue.)

Tools (OpenAI's function tools) reach a template that renders them as transformers passes
them (`tools=`, assistant messages' `tool_calls`, `tool` messages); a template renders tools
when a probe tool's name shows in its output. A template that does not (the default,
SmolLM2's) gets the conversation rewritten into the roles it knows (`tool_free_messages`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
ROLES = ("system", "user", "assistant")
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "kvgate_probe_tool",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    },
}
# The call format of templates trained on Hermes-style calls (Qwen2.5, Hermes, ...): each
# call is {"name": ..., "arguments": {...}} between these tags.
HERMES_CALL_OPEN = "<tool_call>"
HERMES_CALL_CLOSE = "</tool_call>"


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception, or a render error)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant message made."""

    call_id: str  # "call_..."; a tool message answers it by this id
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a conversation."""

    role: str  # "system", "user", "assistant" or "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str = ""  # tool: the call it answers


def call_list_json(calls: tuple[ToolCall, ...]) -> str:
    """Calls as the JSON list a constrained tool call writes: [{"name", "arguments"}, ...]."""
    items = [f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls]
    return "[" + ", ".join(items) + "]"


def tool_free_messages(messages: list[Message]) -> list[Message]:
    """The conversation in roles every template renders: an assistant's calls become its
    text (content, then the calls' JSON list), a tool message becomes a user message that
    names the call it answers."""
    rewritten = []
    for message in messages:
        if message.role == "tool":
            text = f"Result of tool call {message.tool_call_id}:\n{message.content}"
            rewritten.append(Message("user", text))
        elif message.tool_calls:
            parts = [message.content, call_list_json(message.tool_calls)]
            rewritten.append(Message("assistant", "\n".join(p for p in parts if p)))
        else:
            rewritten.append(message)
    return rewritten


def _template_dict(message: Message, call_names: dict[str, str]) -> dict:
    """A message as transformers' templates read it (arguments as an object, a tool
    message with the name of the function it answers)."""
    item: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        item["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.role == "tool":
        item["tool_call_id"] = message.tool_call_id
        item["name"] = call_names.get(message.tool_call_id, "")
    return item


def template_dicts(messages: list[Message]) -> list[dict]:
    """The conversation as the dicts transformers' apply_chat_template takes."""
    call_names = {c.call_id: c.name for m in messages for c in m.tool_calls}
    return [_template_dict(m, call_names) for m in messages]


class ChatTemplate:
    """Renders and tokenizes conversations with a tokenizer's chat template (or the default)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Args: tokenizer: the model's tokenizer, with its `chat_template` (or None)."""
        self.tokenizer = tokenizer
        self.is_default = not tokenizer.chat_template
        # None: the tokenizer's own template (a named one is chosen by transformers).
        self.source = DEFAULT_CHAT_TEMPLATE if self.is_default else None
        self.renders_tools = not self.is_default and self._renders_probe_tool()
        # auto tool choice needs calls in a format kvgate reads back from the output.
        self.writes_hermes_calls = self.renders_tools and HERMES_CALL_OPEN in (
            self.tokenizer.get_chat_template(tools=[PROBE_TOOL])
        )

    def _renders_probe_tool(self) -> bool:
        probe = [Message("user", "hi")]
        try:
            text = self._apply(probe, True, tokenize=False, tools=[PROBE_TOOL])
        except (ChatTemplateError, TypeError, ValueError, LookupError):
            return False  # a template that cannot render the probe renders no tools
        return PROBE_TOOL["function"]["name"] in text

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text of a conversation (with the BOS token when the template writes it).

        Args:
            tools: OpenAI function tools to offer; only for a template that renders_tools.

        Raises:
            ChatTemplateError: the template rejects the conversation.
        """
        return self._apply(messages, add_generation_prompt, tokenize=False, tools=tools)

    def encode(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The token ids of the rendered conversation; control tokens inside the messages'
        contents are encoded as text. `tools` as in render.

        Raises:
            ChatTemplateError: the template rejects the conversation.
        """
        return self._apply(messages, add_generation_prompt, tokenize=True, tools=tools)

    def _apply(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        tokenize: bool,
        tools: list[dict] | None = None,
    ):
        try:
            return self.tokenizer.apply_chat_template(
                template_dicts(messages),
                tools=tools or None,
                chat_template=self.source,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                sanitize_control_tokens=tokenize,
                return_dict=False,
            )
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error
