"""Text on the gateway: incremental detokenization, stop strings (chat templates:
test_chat_templates.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models

from gateway.detokenizer import IncrementalDetokenizer
from gateway.model_text import ModelText
from gateway.stops import StopStringMatcher
from tests.helpers import STORIES_260K

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_text() -> ModelText:
    return ModelText(STORIES_260K)


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


def test_a_completion_cut_inside_a_character_ends_with_a_replacement_character(
    model_text: ModelText,
):
    """The held-back bytes of a character the completion never finished come out at the end
    (as U+FFFD), so the streamed text still equals the decoded whole."""
    prompt_ids = model_text.encode(PROMPT)
    cut = model_text.encode(PROMPT + " 😀")[len(prompt_ids) :][:-2]
    deltas = stream(IncrementalDetokenizer(model_text.tokenizer, prompt_ids), cut)
    expected = model_text.tokenizer.decode(prompt_ids + cut)[len(PROMPT) :]
    assert expected.endswith("\ufffd") and "".join(deltas) == expected, deltas


def test_a_prompt_ending_inside_a_character_is_never_streamed(model_text: ModelText):
    """Token-id prompts may stop half-way through a character that the completion ends."""
    emoji_ids = model_text.encode(PROMPT + " 😀")[len(model_text.encode(PROMPT)) :]
    prompt_ids = model_text.encode(PROMPT) + emoji_ids[:-2]
    completion_ids = emoji_ids[-2:] + model_text.encode(PROMPT + " there")[-1:]
    text = "".join(stream(IncrementalDetokenizer(model_text.tokenizer, prompt_ids), completion_ids))
    assert "upon" not in text and text.endswith("there"), f"streamed {text!r}"


def test_a_decoder_that_rewrites_its_text_does_not_stop_the_stream():
    """A decoder whose text is not monotonic in the tokens (here "ab" becomes "X") cannot
    take back text already sent; the stream goes on with as much as the text grew."""
    tokenizer = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "c": 2}, unk_token="c"))
    tokenizer.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    token_ids = [2, 0, 1, 2, 2, 0, 1, 0, 2]
    deltas = stream(IncrementalDetokenizer(tokenizer, [2]), token_ids)
    whole = tokenizer.decode([2, *token_ids])
    assert len("".join(deltas)) == len(whole) - 1 and deltas[-2] == "c", deltas


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
