"""The served model's text side: tokenizer, special tokens, chat template, limits.

Read from the model folder (tokenizer.json, tokenizer_config.json, config.json,
generation_config.json); the gateway never loads the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from gateway.templates import ChatTemplate, Message, template_source


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What requests are checked against."""

    vocab_size: int
    max_model_len: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


class ModelText:
    """Tokenizes prompts and conversations for one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        """Load the tokenizer files of `model_dir`.

        Raises:
            FileNotFoundError: the folder has no tokenizer.json.
        """
        folder = Path(model_dir)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.exists():
            raise FileNotFoundError(f"--model {folder}: no tokenizer.json there")
        self.model_id = folder.resolve().name
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.limits = self._read_limits(folder)
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        self.chat_template = ChatTemplate(
            template_source(tokenizer_config),
            bos_token=self._token_text(tokenizer_config.get("bos_token"), self.limits.bos_token_id),
            eos_token=self._token_text(
                tokenizer_config.get("eos_token"), self.limits.eos_token_ids[0]
            ),
        )

    def _read_limits(self, folder: Path) -> ModelLimits:
        config = _read_json(folder / "config.json")
        generation = _read_json(folder / "generation_config.json")
        eos = _as_tuple(generation.get("eos_token_id", config.get("eos_token_id")))
        return ModelLimits(
            vocab_size=config.get("vocab_size", self.tokenizer.get_vocab_size()),
            max_model_len=config.get("max_position_embeddings", 2048),
            bos_token_id=config.get("bos_token_id", 1),
            eos_token_ids=eos or (2,),
        )

    def _token_text(self, configured: str | dict | None, token_id: int) -> str:
        if isinstance(configured, dict):
            return configured["content"]
        return configured or self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with BOS when add_special_tokens and the tokenizer adds it)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (the template writes BOS)."""
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation ready for the assistant's reply."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary string of each token id."""
        return [self.tokenizer.id_to_token(t) or "" for t in token_ids]
