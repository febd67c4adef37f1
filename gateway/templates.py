"""Chat templates: the model's own (Hugging Face `chat_template`, Jinja2) or kvgate's default.

The default, for models that ship none (stories260K has none), renders:

    <s>{system}\\n\\nUser: {user}\\nAssistant: {assistant}</s>\\nUser: {user}\\nAssistant:

(BOS, the system prompt and a blank line when there is one, then each user turn on
a `User: ` line and each assistant turn on an `Assistant: ` line ended by EOS;
with add_generation_prompt it ends with `Assistant:` for the model to continue.)
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception, or a render error)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a conversation."""

    role: str  # "system", "user" or "assistant"
    content: str


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template with the model's special tokens."""

    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        """Compile `source`, or the default template when it is None.

        Args:
            source: Jinja2 text of the model's chat template, or None.
            bos_token: text of the BOS token (the template writes it).
            eos_token: text of the EOS token.
        """
        self.is_default = source is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self.template = env.from_string(DEFAULT_CHAT_TEMPLATE if source is None else source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (with the BOS token when the template writes it).

        Raises:
            ChatTemplateError: the template rejects the conversation.
        """
        try:
            return self.template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error


def template_source(tokenizer_config: dict) -> str | None:
    """The chat template of a tokenizer_config.json, or None when it has none.

    A config may hold one template or a list of named ones; "default" is chosen
    from a list.
    """
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source}
        return named.get("default")
    return source
