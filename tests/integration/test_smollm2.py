"""SmolLM2-135M-Instruct (GGUF, Q4_1), the default chat model: a two-turn Chat through the
whole stack (redis, scheduler, executor, gateway) against transformers loading the same file
with gguf_file= (tests/unit/test_smollm2.py compares the rendered prompt and the engine's
greedy tokens in process).

`make setup` puts the file in the model cache; without it this test fails, not skips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client.api import KvgateClient
from deploy.stack import Stack, StackConfig, free_port
from tests.helpers import chat_ids

IM_END = 2  # <|im_end|>: SmolLM2's EOS, the end of an assistant turn


def hf_reply(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy reply, ended by the model's EOS (<|im_end|>) as generate ends it."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


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
    stack: Stack, smollm2_tokenizer, smollm2_model
):
    messages: list[dict[str, str]] = []
    with KvgateClient(stack.address, timeout_s=120) as client:
        session = client.chat()
        for index, question in enumerate(["What is the capital of France?", "And of Italy?"]):
            reply = session.ask(question, max_tokens=48, temperature=0.0)
            messages.append({"role": "user", "content": question})
            expected = hf_reply(smollm2_model, chat_ids(smollm2_tokenizer, messages), 48)
            assert reply.token_ids == expected, (
                f"turn {index + 1}: {reply.text!r} differs from transformers' "
                f"{smollm2_tokenizer.decode(expected)!r}"
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
