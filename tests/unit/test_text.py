"""Text on the gateway: incremental detokenization, stop strings (chat templates:
test_chat_templates.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.model_text import ModelText
from gateway.stops import StopStringMatcher

STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_text() -> ModelText:
    return ModelText(STORIES)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    deltas = [detokenizer.add([t]) for t in token_ids]
    return [*deltas, detokenizer.flush()]


@pytest.mark.parametrize(
    "completion",
    [" there was a girl", " héllo wörld", " 😀 smiles", " 日本語 text", " a😀😀b", "ü"],
)
def test_streamed_text_equals_the_decoded_whole(model_text: ModelText, completion: str):
    prompt_ids = model_text.encode(PROMPT)
    completion_ids = model_text.encode(PROMPT + completion)[len(prompt_ids) :]
    deltas = stream(IncrementalDetokenizer(model_text.tokenizer, prompt_ids), completion_ids)
    full = model_text.tokenizer.decode(prompt_ids + completion_ids)
    expected = full[len(model_text.tokenizer.decode(prompt_ids)) :]
    assert "".join(deltas) == expected, f"streamed {deltas!r}, expected {expected!r}"
    assert not any("\ufffd" in d for d in deltas), f"a delta holds half a character: {deltas!r}"


def test_a_character_split_over_byte_fallback_tokens_comes_out_whole(model_text: ModelText):
    emoji_ids = model_text.encode("😀", add_special_tokens=False)
    byte_tokens = [t for t in model_text.token_strings(emoji_ids) if t.startswith("<0x")]
    assert len(byte_tokens) == 4, f"stories260K should spell 😀 in 4 byte tokens: {byte_tokens}"
    detokenizer = IncrementalDetokenizer(model_text.tokenizer, model_text.encode(PROMPT))
    deltas = [detokenizer.add([t]) for t in emoji_ids]
    assert "".join(deltas).strip() == "😀"
    assert [d for d in deltas[:-1] if d.strip()] == [], f"emitted before complete: {deltas!r}"


def test_first_token_keeps_its_leading_space(model_text: ModelText):
    prompt_ids = model_text.encode(PROMPT)
    there = model_text.encode(PROMPT + " there")[len(prompt_ids) :]
    detokenizer = IncrementalDetokenizer(model_text.tokenizer, prompt_ids)
    assert detokenizer.add(there) == " there"


def test_special_tokens_are_not_text(model_text: ModelText):
    detokenizer = IncrementalDetokenizer(model_text.tokenizer, model_text.encode(PROMPT))
    eos = model_text.limits.eos_token_ids[0]
    assert detokenizer.add([eos]) + detokenizer.flush() == ""


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    text = ""
    for delta in deltas:
        result = matcher.feed(delta)
        text += result.text
        if result.stopped:
            return text, True
    return text + matcher.flush(), False


@pytest.mark.parametrize(
    ("stop", "deltas", "expected"),
    [
        (["."], ["Lily was happy", ". The end"], ("Lily was happy", True)),
        (["The end"], ["Lily. The", " e", "nd!"], ("Lily. ", True)),
        (["xyz"], ["ab", "xy", "c"], ("abxyc", False)),
        (["b", "abc"], ["xab", "c"], ("xa", True)),
        (["!!"], ["wow!", "!"], ("wow", True)),
        ([], ["plain"], ("plain", False)),
    ],
)
def test_stop_strings_cut_the_text_before_the_first_match(stop, deltas, expected):
    assert feed_all(StopStringMatcher(stop), deltas) == expected


def test_text_that_may_start_a_stop_string_is_held_back():
    matcher = StopStringMatcher(["The end"])
    first = matcher.feed("happy. The")
    assert (first.text, first.stopped) == ("happy. ", False)
    assert matcher.flush() == "The"
