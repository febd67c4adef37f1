"""The engine on the real stories260K checkpoint against transformers: identical greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.sampling_params import SamplingParams
from tests.helpers import STORIES_260K, greedy, hf_generate, make_engine, run_to_completion

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park. They",
    "One day, a big bear",
    "Tom had a red ball",
    "The sun was hot and",
    "Sue liked to sing. Every morning she",
    "There was a tiny bird in a tree",
    "Mom said",
    "The cat jumped over the fence and ran to the big house where the old man lived",
    "A boy named Max",
    "It was a rainy day",
    "Anna found a shiny rock",
    "The fish swam",
    "Grandpa told a story about a dragon who",
    "Once there was a kind girl",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES_260K)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(STORIES_260K, dtype=torch.float32).eval()


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_once_upon_a_time_100_tokens_identical(tokenizer, hf_model, kernels):
    prompt = tokenizer("Once upon a time").input_ids
    expected = hf_generate(hf_model, prompt, 100)
    engine = make_engine(kernels=kernels)
    assert engine.runner.kernels.name == kernels
    engine.add_request("story", prompt, greedy(100))
    got = run_to_completion(engine)["story"]
    assert got == expected, (
        f"expected {tokenizer.decode(expected)!r}\ngot      {tokenizer.decode(got)!r}"
    )


def test_sixteen_prompts_together_equal_each_alone(tokenizer, hf_model):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    alone = {}
    for i, prompt in enumerate(prompts):
        engine = make_engine()
        engine.add_request(f"p{i}", prompt, greedy(48))
        alone.update(run_to_completion(engine))
    together_engine = make_engine()
    for i, prompt in enumerate(prompts):
        together_engine.add_request(f"p{i}", prompt, greedy(48))
    together = run_to_completion(together_engine)
    for i in range(len(prompts)):
        assert together[f"p{i}"] == alone[f"p{i}"], f"prompt {PROMPTS[i]!r} differs in a batch"
    first = hf_generate(hf_model, prompts[9], 48)
    assert alone["p9"] == first, "the longest prompt alone differs from transformers"


def test_stop_token_ends_generation_with_stop_reason(tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    engine = make_engine()
    engine.add_request("free", prompt, greedy(40))
    free = run_to_completion(engine)["free"]
    stop_id = free[10]
    engine.add_request(
        "stopped", prompt, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_id])
    )
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    got = [t for o in outputs for t in o.new_token_ids]
    expected = free[: free.index(stop_id) + 1]
    assert got == expected, f"expected to stop after the first {stop_id}: {expected}, got {got}"
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop", outputs[-1]


def test_every_eos_id_of_generation_config_ends_generation(tokenizer, tmp_path: Path):
    """generation_config.json's eos_token_id as a list (as SmolLM2's): each id stops."""
    prompt = tokenizer("Once upon a time").input_ids
    engine = make_engine()
    engine.add_request("free", prompt, greedy(40))
    free = run_to_completion(engine)["free"]
    # A token the free run makes for the first time well into it, beside the file's EOS id 2.
    step = next(k for k in range(8, len(free)) if free[k] not in free[:k])
    model = tmp_path / "stories"
    shutil.copytree(STORIES_260K, model)
    config = json.loads((model / "generation_config.json").read_text())
    for eos_ids in ([2, free[step]], [free[step], 2]):
        config["eos_token_id"] = eos_ids
        (model / "generation_config.json").write_text(json.dumps(config))
        engine = make_engine(model, kv_cache_gib=0.05)
        engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0.0))
        outputs = [out for _ in range(64) if engine.has_unfinished() for out in engine.step()]
        assert [t for o in outputs for t in o.new_token_ids] == free[: step + 1], eos_ids
        assert outputs[-1].finish_reason == "stop", outputs[-1]
