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
"""

from __future__ import annotations

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


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception, or a render error)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a conversation."""

    role: str  # "system", "user" or "assistant"
    content: str


class ChatTemplate:
    """Renders and tokenizes conversations with a tokenizer's chat template (or the default)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Args: tokenizer: the model's tokenizer, with its `chat_template` (or None)."""
        self.tokenizer = tokenizer
        self.is_default = not tokenizer.chat_template
        # None: the tokenizer's own template (a named one is chosen by transformers).
        self.source = DEFAULT_CHAT_TEMPLATE if self.is_default else None

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (with the BOS token when the template writes it).

        Raises:
            ChatTemplateError: the template rejects the conversation.
        """
        return self._apply(messages, add_generation_prompt, tokenize=False)

    def encode(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of the rendered conversation; control tokens inside the messages'
        contents are encoded as text.

        Raises:
            ChatTemplateError: the template rejects the conversation.
        """
        return self._apply(messages, add_generation_prompt, tokenize=True)

    def _apply(self, messages: list[Message], add_generation_prompt: bool, tokenize: bool):
        try:
            return self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                chat_template=self.source,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                sanitize_control_tokens=tokenize,
                return_dict=False,
            )
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error
