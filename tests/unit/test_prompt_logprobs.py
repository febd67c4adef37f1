"""Prompt logprobs in the engine (SamplingParams.prompt_logprobs) on stories260K: equal to
transformers' log-softmax of the same weights, whole or in chunks, never served from a cached
prefix, recomputed after a preemption, shared by the choices of a group, bounds named."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from common.sampling_params import SamplingParams
from engine.engine import Engine
from engine.outputs import RequestOutput
from tests.helpers import STORIES_260K, greedy, make_engine

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside."


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return AutoTokenizer.from_pretrained(STORIES_260K)(STORY).input_ids


@pytest.fixture(scope="module")
def reference(prompt: list[int]) -> torch.Tensor:
    """transformers' logprobs of every prompt token after the first: [len - 1]."""
    model = LlamaForCausalLM.from_pretrained(STORIES_260K, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = logits.log_softmax(-1)[:-1]
    return logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


def outputs_of(engine: Engine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return outputs


def first_prompt_logprobs(outputs: list[RequestOutput], request_id: str, index: int = 0):
    mine = [o for o in outputs if o.request_id == request_id and o.index == index]
    assert all(o.prompt_logprobs is None for o in mine[1:]), "sent once, with the first token"
    return mine[0]


@pytest.mark.parametrize("budget", [512, 7], ids=["whole", "chunks-of-7"])
def test_prompt_logprobs_equal_transformers(prompt, reference, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    engine.add_request("r", prompt, greedy(3, prompt_logprobs=3))
    first = first_prompt_logprobs(outputs_of(engine), "r")
    entries = first.prompt_logprobs
    assert [e.token_id for e in entries] == prompt[1:]
    got = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)
    for entry in entries:
        assert len(entry.top) == 3
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6


def test_a_cached_prefix_does_not_stand_in_for_prompt_logprobs(prompt, reference):
    engine = make_engine(block_size=4)
    engine.add_request("warm", prompt, greedy(2))
    outputs_of(engine)
    engine.add_request("plain", prompt, greedy(2))
    assert outputs_of(engine)[0].num_cached_tokens > 0, "the prefix cache must be warm"
    engine.add_request("scored", prompt, greedy(2, prompt_logprobs=0))
    first = first_prompt_logprobs(outputs_of(engine), "scored")
    assert first.num_cached_tokens == 0
    got = torch.tensor([e.logprob for e in first.prompt_logprobs])
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)
    assert all(e.top == [] for e in first.prompt_logprobs)


def test_a_preempted_prefill_reports_the_same_prompt_logprobs(prompt, reference):
    """A low-priority request in its chunked prefill loses its blocks to the others' growth
    (it is the first victim) and is recomputed from its first token."""
    tight = make_engine(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=6)
    tokenizer = AutoTokenizer.from_pretrained(STORIES_260K)
    for i, text in enumerate(["Lily", "The dog ran", "Mom said"]):
        tight.add_request(f"o{i}", tokenizer(text).input_ids, greedy(30))
    tight.step()
    tight.add_request("scored", prompt, greedy(2, prompt_logprobs=1), priority=1)
    outputs: list[RequestOutput] = []
    while not any(o.request_id == "scored" for o in outputs):
        outputs += tight.step()
    assert tight.stats().num_preemptions > 0, "the prefill was expected to be preempted"
    first = first_prompt_logprobs(outputs + outputs_of(tight), "scored")
    got = torch.tensor([e.logprob for e in first.prompt_logprobs])
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)


def test_every_choice_of_a_group_reports_the_prompt_logprobs(prompt, reference):
    engine = make_engine()
    engine.add_request("g", prompt, SamplingParams(max_tokens=3, n=3, seed=5, prompt_logprobs=0))
    outputs = outputs_of(engine)
    for index in range(3):
        first = first_prompt_logprobs(outputs, "g", index)
        got = torch.tensor([e.logprob for e in first.prompt_logprobs])
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)


def test_a_one_token_prompt_has_no_prompt_logprobs():
    engine = make_engine()
    engine.add_request("one", [1], greedy(2, prompt_logprobs=2))
    assert outputs_of(engine)[0].prompt_logprobs == []


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="^prompt_logprobs must be an int in"):
        SamplingParams(prompt_logprobs=value)
