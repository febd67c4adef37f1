"""Each token's own bytes (common/token_bytes.py), for OpenAI's logprobs: on both vocabulary
kinds served (SentencePiece with byte fallback: stories260K; byte-level BPE: SmolLM2's GGUF),
the bytes of a text's tokens joined are the text's bytes, spaces and split characters included."""

from __future__ import annotations

import pytest

from common.model_files import default_gguf_path
from common.model_text import ModelText
from common.token_bytes import TokenBytes
from tests.helpers import STORIES_260K

TEXTS = [
    "Once upon a time, a cat  sat.\nThe end",
    "naïve café: 東京 🐈 — “quotes”",
]


@pytest.fixture(scope="module", params=["stories260K", "smollm2"])
def model_text(request) -> ModelText:
    if request.param == "stories260K":
        return ModelText(STORIES_260K)
    path = default_gguf_path()
    assert path.is_file(), f"{path} is missing: `make setup` fetches it (deploy/fetch_model.py)"
    return ModelText(path)


@pytest.mark.parametrize("text", TEXTS)
def test_a_texts_tokens_bytes_join_into_its_bytes(model_text: ModelText, text: str):
    tokenizer = model_text.tokenizer
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.kind in ("byte_level", "sentencepiece")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    joined = b"".join(token_bytes.of(i) for i in ids)
    decoded = tokenizer.decode(ids).encode()
    # SentencePiece's decoder strips the first space it adds; the bytes keep the token's own
    assert joined.removeprefix(b" ") == decoded, (joined, decoded)


def test_a_token_holding_part_of_a_character_has_that_part(model_text: ModelText):
    tokenizer = model_text.tokenizer
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode("🐈", add_special_tokens=False).ids
    parts = [token_bytes.of(i) for i in ids]
    assert b"".join(parts).removeprefix(b" ") == "🐈".encode()
    assert len(parts) > 1 and token_bytes.text(ids[-1]).endswith("\ufffd")


def test_special_tokens_are_their_text(model_text: ModelText):
    token_bytes = TokenBytes(model_text.tokenizer)
    for token_id, token in model_text.tokenizer.get_added_tokens_decoder().items():
        assert token_bytes.of(token_id) == token.content.encode()
