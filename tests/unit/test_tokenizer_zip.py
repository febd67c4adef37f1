"""GetTokenizer's zip (gateway/tokenizer_zip.py) from a checkpoint folder and from a GGUF
file: unpacked and loaded by transformers, it encodes and renders conversations as the
gateway's own tokenizer does."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.model_text import ModelText
from common.templates import Message
from gateway.tokenizer_zip import build_tokenizer_zip
from tests.helpers import STORIES_260K
from tests.tiny_gguf import write_tiny_llama

TEXTS = ["Once upon a time", "the theme of the text", "Lily saw 3 dogs! Ünïcödé </s>"]
CONVERSATION = [Message("system", "Be brief."), Message("user", "Who are you?")]


def unpacked(model: Path, into: Path) -> tuple[ModelText, Path, list[str]]:
    model_text = ModelText(model)
    bundle = build_tokenizer_zip(str(model), model_text)
    assert bundle.sha256 == hashlib.sha256(bundle.data).hexdigest()
    pieces = list(bundle.chunks(chunk_bytes=1000))
    assert b"".join(piece for piece, _ in pieces) == bundle.data
    assert [sha for _, sha in pieces] == [""] * (len(pieces) - 1) + [bundle.sha256]
    archive = zipfile.ZipFile(io.BytesIO(bundle.data))
    archive.extractall(into)
    return model_text, into, archive.namelist()


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_the_zip_unpacks_into_a_tokenizer_that_encodes_and_renders_as_the_gateway(
    tmp_path: Path, source: str
):
    if source == "gguf":
        model = tmp_path / "tiny.gguf"
        write_tiny_llama(model, add_bos=True)
    else:
        model = STORIES_260K
    model_text, folder, names = unpacked(model, tmp_path / "unpacked")
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names), names
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for text in TEXTS:
        assert tokenizer.encode(text, split_special_tokens=True) == model_text.encode(text), text
    messages = [{"role": m.role, "content": m.content} for m in CONVERSATION]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == model_text.render_chat(CONVERSATION)


def test_the_same_files_give_the_same_bytes(tmp_path: Path):
    model_text = ModelText(STORIES_260K)
    first = build_tokenizer_zip(str(STORIES_260K), model_text)
    assert build_tokenizer_zip(str(STORIES_260K), model_text) == first
