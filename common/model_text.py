"""The served model's text side: tokenizer, special tokens, chat template, limits.

Read from a checkpoint folder (tokenizer.json, tokenizer_config.json, chat_template.jinja,
config.json, generation_config.json) or from a GGUF file's metadata; the gateway never loads
the weights. The tokenizer is transformers' wrapper around the `tokenizers` one: transformers
reads the chat template in every layout it is saved in and tokenizes conversations so that
only the template makes control tokens.

User text is text: a prompt or a message that holds a control token's string (`</s>`,
`<|im_start|>`) is encoded as the characters it holds, never as the control token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer
from transformers import TokenizersBackend

from common.gguf_metadata import GgufFile
from common.model_files import gguf_file, model_id
from common.templates import ChatTemplate, Message

# llama.cpp's special-token keys -> transformers' names for them.
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What requests are checked against."""

    vocab_size: int
    max_model_len: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    # Characters beyond which text cannot fit max_model_len: max_model_len tokens of the
    # vocabulary's longest string (a token covers at most as many characters as its string
    # has: byte-level tokens spell each byte as one character, byte-fallback ones as six).
    max_prompt_chars: int = 0


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


class ModelText:
    """Tokenizes prompts and conversations for one model (a checkpoint folder or GGUF file)."""

    def __init__(self, model: str | Path) -> None:
        """Load the tokenizer of `model`.

        Raises:
            FileNotFoundError: a folder without tokenizer.json, or a missing GGUF file.
            ValueError: a GGUF file without a tokenizer.
        """
        self.model_id = model_id(model)
        gguf = gguf_file(model)
        if gguf is not None:
            self.hf_tokenizer, self.limits = _from_gguf(GgufFile(gguf))
        else:
            self.hf_tokenizer, self.limits = _from_folder(Path(model))
        self.tokenizer: Tokenizer = self.hf_tokenizer.backend_tokenizer
        self.longest_token_chars = max(len(t) for t in self.tokenizer.get_vocab(True))
        self.limits = replace(
            self.limits, max_prompt_chars=self.limits.max_model_len * self.longest_token_chars
        )
        self.chat_template = ChatTemplate(self.hf_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` as text (control tokens' strings too), with BOS when
        add_special_tokens and the tokenizer adds it."""
        return self.hf_tokenizer.encode(
            text, add_special_tokens=add_special_tokens, split_special_tokens=True
        )

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text of a conversation (the template writes BOS), offering `tools`."""
        return self.chat_template.render(messages, add_generation_prompt, tools)

    def encode_chat(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation ready for the assistant's reply, offering `tools`."""
        return self.chat_template.encode(messages, tools=tools)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary string of each token id."""
        return [self.tokenizer.id_to_token(t) or "" for t in token_ids]


def _from_folder(folder: Path) -> tuple[TokenizersBackend, ModelLimits]:
    if not (folder / "tokenizer.json").exists():
        raise FileNotFoundError(f"--model {folder}: no tokenizer.json there")
    tokenizer = TokenizersBackend.from_pretrained(folder, local_files_only=True)
    config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")
    eos = _as_tuple(generation.get("eos_token_id", config.get("eos_token_id")))
    limits = ModelLimits(
        vocab_size=config.get("vocab_size", tokenizer.backend_tokenizer.get_vocab_size()),
        max_model_len=config.get("max_position_embeddings", 2048),
        bos_token_id=config.get("bos_token_id", 1),
        eos_token_ids=eos or (2,),
    )
    return tokenizer, limits


def _from_gguf(gguf: GgufFile) -> tuple[TokenizersBackend, ModelLimits]:
    """The tokenizer transformers builds from a GGUF file's vocabulary, merges and special
    tokens (what `from_pretrained(..., gguf_file=...)` gives), read with the `gguf` package."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    groups = {
        group: {name: gguf.value(f"tokenizer.{key}") for key, name in renames.items()}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    vocab = {k: v for k, v in groups["tokenizer"].items() if v is not None}
    kwargs = {k: v for k, v in groups["tokenizer_config"].items() if v is not None}
    if "tokens" not in vocab:
        raise ValueError(f"--model {gguf.path}: the GGUF file holds no tokenizer")
    if vocab.get("tokenizer_type") == "llama":
        kwargs.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = gguf.value(key)
        kwargs[name] = vocab["tokens"][token_id] if token_id is not None else None
    backend, _ = convert_gguf_tokenizer(gguf.architecture, vocab)
    tokenizer = TokenizersBackend(tokenizer_object=backend, **kwargs)
    limits = ModelLimits(
        vocab_size=int(gguf.arch_value("vocab_size") or len(vocab["tokens"])),
        max_model_len=int(gguf.arch_value("context_length", 2048)),
        bos_token_id=int(gguf.value(_GGUF_SPECIAL_TOKENS["bos_token"], 1)),
        eos_token_ids=gguf.end_of_turn_ids() or (2,),
    )
    return tokenizer, limits
