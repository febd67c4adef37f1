"""The engine's stories260K greedy check with the Triton kernels (interpreter mode on CPU)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.sampling_params import SamplingParams
from tests.helpers import STORIES_260K, hf_generate, make_engine, run_to_completion


def test_stories260k_greedy_with_triton_kernels_matches_transformers():
    tokenizer = AutoTokenizer.from_pretrained(STORIES_260K)
    hf_model = AutoModelForCausalLM.from_pretrained(STORIES_260K, dtype=torch.float32).eval()
    prompt = tokenizer("Once upon a time").input_ids
    # 48 tokens: past three KV blocks, and each step runs in the interpreter.
    expected = hf_generate(hf_model, prompt, 48)
    engine = make_engine(kv_cache_gib=0.01, kernels="triton")
    assert engine.runner.kernels.name == "triton"
    engine.add_request("story", prompt, SamplingParams(max_tokens=48, temperature=0.0))
    got = run_to_completion(engine)["story"]
    assert got == expected, (
        f"expected {tokenizer.decode(expected)!r}\ngot      {tokenizer.decode(got)!r}"
    )
