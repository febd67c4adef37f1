"""Structured output with the Triton kernels (interpreter mode on CPU): the greedy argmax kernel
and the sampled path see the masked logits, so the allowed tokens are llguidance's at every
step and the output validates."""

from __future__ import annotations

import json

import jsonschema
from transformers import AutoTokenizer

from tests.helpers import STORIES_260K, make_engine
from tests.unit.test_engine_structured import (
    PERSON,
    assert_masks_are_llguidance_masks,
    run,
    sampled,
    schema,
)


def test_constrained_requests_with_triton_kernels_follow_llguidance_masks():
    tokenizer = AutoTokenizer.from_pretrained(STORIES_260K)
    engine = make_engine(kv_cache_gib=0.01, kernels="triton")
    assert engine.runner.kernels.name == "triton"
    prompt = tokenizer("Once upon a time").input_ids
    # Three sampled requests step by step against llguidance (a dozen steps: each runs the
    # interpreter), then a greedy one (the argmax kernel's path) to the end of its object.
    assert_masks_are_llguidance_masks(engine, tokenizer, schema(PERSON), prompt, max_tokens=12)
    params = {"greedy": sampled(schema(PERSON), 0, temperature=0.0)}
    for request_id, (tokens, _, error) in run(engine, params, prompt).items():
        assert not error, f"{request_id}: {error}"
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), PERSON)
