"""SmolLM2-135M-Instruct (GGUF, Q4_1), the default chat model, against transformers loading
the same file with gguf_file=, in process: the rendered chat prompt and the engine's greedy
tokens (tests/integration/test_smollm2.py takes a two-turn chat through the whole stack).

`make setup` puts the file in the model cache; without it these tests fail, not skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.model_text import ModelText
from common.templates import Message
from tests.helpers import (
    assert_greedy_matches,
    chat_ids,
    greedy_tokens,
    hf_greedy,
    make_engine,
    one_torch_thread,
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "Name three fruits that are red.",
]
NEW_TOKENS = 64
IM_END = 2  # <|im_end|>: SmolLM2's EOS, the end of an assistant turn


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    with one_torch_thread():
        yield


def test_the_rendered_chat_prompt_is_transformers_own(gguf: Path, smollm2_tokenizer):
    model_text = ModelText(gguf)
    conversations = [
        [Message("user", QUESTIONS[0])],
        [Message("system", "You answer in French."), Message("user", QUESTIONS[1])],
        [Message("user", "Hi!"), Message("assistant", "Hello! How can I help?"),
         Message("user", QUESTIONS[2])],
    ]  # fmt: skip
    for messages in conversations:
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        expected = smollm2_tokenizer.apply_chat_template(
            dicts, add_generation_prompt=True, tokenize=False
        )
        assert model_text.render_chat(messages) == expected
        assert model_text.encode_chat(messages) == chat_ids(smollm2_tokenizer, dicts)
    assert model_text.limits.eos_token_ids == (IM_END,)
    assert model_text.render_chat([Message("user", "x")]).startswith("<|im_start|>system\n")


def test_engine_greedy_equals_transformers_on_four_chat_prompts(
    gguf: Path, smollm2_tokenizer, smollm2_model
):
    prompts = [chat_ids(smollm2_tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    got = greedy_tokens(make_engine(gguf, kv_cache_gib=0.1), prompts, NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        reference = hf_greedy(smollm2_model, prompt, NEW_TOKENS)
        assert_greedy_matches(got[i], reference, QUESTIONS[i])
