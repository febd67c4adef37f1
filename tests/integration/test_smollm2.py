"""SmolLM2-135M-Instruct (GGUF, Q4_1), the default chat model, against transformers loading
the same file with gguf_file=: the rendered chat prompt, the engine's greedy tokens, and a
two-turn Chat through the whole stack (redis, scheduler, executor, gateway).

`make setup` puts the file in the model cache; without it these tests fail, not skip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TokenizersBackend

from client.api import KvgateClient
from common.model_text import ModelText
from common.templates import Message
from deploy.stack import Stack, StackConfig, free_port
from engine.config import EngineConfig
from engine.engine import Engine
from tests.helpers import (
    assert_greedy_matches,
    greedy,
    hf_greedy,
    one_torch_thread,
    run_to_completion,
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


@pytest.fixture(scope="module")
def hf_tokenizer(gguf: Path):
    """The class AutoTokenizer picks for a GGUF file, without its slow config read."""
    return TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def hf_model(gguf: Path):
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


def chat_ids(hf_tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def hf_reply(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy reply, ended by the model's EOS (<|im_end|>) as generate ends it."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_tokens)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def test_the_rendered_chat_prompt_is_transformers_own(gguf: Path, hf_tokenizer):
    model_text = ModelText(gguf)
    conversations = [
        [Message("user", QUESTIONS[0])],
        [Message("system", "You answer in French."), Message("user", QUESTIONS[1])],
        [Message("user", "Hi!"), Message("assistant", "Hello! How can I help?"),
         Message("user", QUESTIONS[2])],
    ]  # fmt: skip
    for messages in conversations:
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        expected = hf_tokenizer.apply_chat_template(
            dicts, add_generation_prompt=True, tokenize=False
        )
        assert model_text.render_chat(messages) == expected
        assert model_text.encode_chat(messages) == chat_ids(hf_tokenizer, dicts)
    assert model_text.limits.eos_token_ids == (IM_END,)
    assert model_text.render_chat([Message("user", "x")]).startswith("<|im_start|>system\n")


def test_engine_greedy_equals_transformers_on_four_chat_prompts(gguf: Path, hf_tokenizer, hf_model):
    prompts = [chat_ids(hf_tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = Engine(EngineConfig(model=str(gguf), kv_cache_gib=0.1))
    params = greedy(NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
    got = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        reference = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_greedy_matches(got[f"q{i}"], reference, QUESTIONS[i])


@pytest.fixture(scope="module")
def stack(gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    config = StackConfig(
        model=str(gguf),
        port=free_port(),
        log_dir=tmp_path_factory.mktemp("smollm2-stack"),
        executor_flags=["--num-gpu-blocks", "256", "--block-size", "16"],
        scheduler_flags=["--batch-window-ms", "2"],
    )
    running = Stack(config)
    try:
        running.start_all(num_executors=1)
        yield running
    finally:
        running.stop_all()


def test_a_two_turn_chat_through_the_stack_matches_transformers_and_reuses_turn_one(
    stack: Stack, hf_tokenizer, hf_model
):
    messages: list[dict[str, str]] = []
    with KvgateClient(stack.address, timeout_s=120) as client:
        session = client.chat()
        for index, question in enumerate(["What is the capital of France?", "And of Italy?"]):
            reply = session.ask(question, max_tokens=48, temperature=0.0)
            messages.append({"role": "user", "content": question})
            expected = hf_reply(hf_model, chat_ids(hf_tokenizer, messages), 48)
            assert reply.token_ids == expected, (
                f"turn {index + 1}: {reply.text!r} differs from transformers' "
                f"{hf_tokenizer.decode(expected)!r}"
            )
            assert reply.finish_reason == "stop" and expected[-1] == IM_END, (
                f"turn {index + 1} must end at <|im_end|>: {reply.finish_reason}, {expected}"
            )
            assert "<|im_end|>" not in reply.text
            if index == 1:
                assert reply.usage.cached_prompt_tokens > 0, "turn 2 reused none of turn 1's KV"
            messages.append({"role": "assistant", "content": reply.text.strip()})
        session.close()
    assert "Paris" in messages[1]["content"], messages
