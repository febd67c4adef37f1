"""Chat templates in every layout a model is saved in, rendered as transformers renders them,
and tokenized so that only the template makes control tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.model_text import ModelText
from gateway.templates import ChatTemplateError, Message
from tests.helpers import STORIES_260K
from tests.tiny_gguf import BOS_ID, CHATML, write_tiny_llama

CONVERSATIONS = [
    [Message("user", "hi")],
    [Message("system", "Be brief."), Message("user", "Who are you?")],
    [
        Message("user", "Tell me a story."),
        Message("assistant", "Once upon a time there was a cat."),
        Message("user", "And then?"),
    ],
]


def as_dicts(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def stories_folder(folder: Path, tokenizer_config: dict | None = None) -> Path:
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(STORIES_260K / name, folder / name)
    config = json.loads((STORIES_260K / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | (tokenizer_config or {})))
    return folder


def saved_with_a_template(folder: Path) -> Path:
    """stories260K's tokenizer given ChatML and saved by save_pretrained, as transformers
    saves a chat template today."""
    tokenizer = AutoTokenizer.from_pretrained(STORIES_260K)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    shutil.copy(STORIES_260K / "config.json", folder / "config.json")
    return folder


def assert_renders_as_transformers(model_text: ModelText, reference) -> None:
    assert not model_text.chat_template.is_default, "the model's own template must be used"
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            as_dicts(messages), add_generation_prompt=True, tokenize=False
        )
        assert model_text.render_chat(messages) == expected
        expected_ids = reference.apply_chat_template(
            as_dicts(messages), add_generation_prompt=True, return_dict=False
        )
        assert model_text.encode_chat(messages) == expected_ids


def test_chat_template_jinja_beside_the_tokenizer_is_the_models_template(tmp_path: Path):
    folder = saved_with_a_template(tmp_path)
    assert (folder / "chat_template.jinja").is_file(), "save_pretrained writes this file"
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    model_text = ModelText(folder)
    assert_renders_as_transformers(model_text, AutoTokenizer.from_pretrained(folder))
    assert model_text.render_chat([Message("user", "hi")]).startswith("<|im_start|>user\nhi")


def test_a_template_string_in_tokenizer_config_is_used(tmp_path: Path):
    folder = stories_folder(tmp_path, {"chat_template": CHATML})
    assert_renders_as_transformers(ModelText(folder), AutoTokenizer.from_pretrained(folder))


def test_named_templates_in_tokenizer_config_use_default(tmp_path: Path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}]
    folder = stories_folder(tmp_path, {"chat_template": named})
    model_text = ModelText(folder)
    assert_renders_as_transformers(model_text, AutoTokenizer.from_pretrained(folder))
    assert model_text.render_chat([Message("user", "x")]) != "T"


@pytest.mark.parametrize("add_bos", [False, True])
def test_a_gguf_files_tokenizer_and_template_are_the_ones_transformers_builds(
    tmp_path: Path, add_bos: bool
):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, add_bos=add_bos)
    model_text = ModelText(path)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert_renders_as_transformers(model_text, reference)
    text = "the theme of the text"
    assert model_text.encode(text) == reference.encode(text)
    assert (model_text.encode(text)[0] == BOS_ID) == add_bos, "BOS as the file's add_bos_token"
    assert model_text.model_id == "tiny"


def test_default_template_renders_the_documented_format():
    model_text = ModelText(STORIES_260K)
    conversation = [
        Message("system", "Be kind."),
        Message("user", "hi"),
        Message("assistant", "Hello."),
        Message("user", "a story"),
    ]
    assert model_text.chat_template.is_default, "stories260K ships no chat template"
    assert model_text.render_chat(conversation) == (
        "<s>Be kind.\n\nUser: hi\nAssistant: Hello.</s>\nUser: a story\nAssistant:"
    )


def test_chat_prompt_starts_with_one_bos_and_extends_the_previous_turn():
    model_text = ModelText(STORIES_260K)
    first = model_text.encode_chat([Message("user", "hi")])
    second = model_text.encode_chat(
        [Message("user", "hi"), Message("assistant", "Hello."), Message("user", "more")]
    )
    bos = model_text.limits.bos_token_id
    assert first[0] == bos and first.count(bos) == 1, f"expected one BOS at the start: {first}"
    assert second[: len(first)] == first, "turn 2's prompt must extend turn 1's (KV reuse)"


def test_template_raise_exception_becomes_a_chat_template_error(tmp_path: Path):
    folder = stories_folder(tmp_path, {"chat_template": "{{ raise_exception('no system role') }}"})
    with pytest.raises(ChatTemplateError, match="no system role"):
        ModelText(folder).render_chat([Message("system", "x")])


def test_generation_config_eos_ids_all_end_a_turn(tmp_path: Path):
    folder = stories_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelText(folder).limits.eos_token_ids == (2, 7)
