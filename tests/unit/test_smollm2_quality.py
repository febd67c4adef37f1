"""bfloat16 and weight-only int8 against float32 on SmolLM2-135M-Instruct, the default chat
model: 16 chat prompts through its chat template, float32's greedy continuation of 64 tokens
each, and the teacher-forced top-1 agreement of each format along it (bench/quality.py),
computed here and held to >= 95%. (tests/unit/test_engine_dtypes.py holds the same on
stories260K; docs/benchmarks.md has the full table with the free-run measures.)

`make setup` puts the GGUF file in the model cache; without it this test fails, not skips."""

from __future__ import annotations

import pytest

from bench.quality import CHAT_QUESTIONS, measure_quality, tokenized_prompts
from common.model_files import default_gguf_path
from tests.helpers import one_torch_thread

MIN_TOP1_AGREEMENT = 0.95
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def quality() -> dict:
    path = default_gguf_path()
    assert path.is_file(), f"{path} is missing: `make setup` fetches it (deploy/fetch_model.py)"
    prompts = tokenized_prompts(str(path), "chat", len(CHAT_QUESTIONS))
    assert len(prompts) == 16
    with one_torch_thread():
        result = measure_quality(str(path), prompts, NEW_TOKENS, ("bfloat16", "int8"),
                                 kv_cache_gib=0.25, free_runs=False)  # fmt: skip
    return result["variants"]


def test_float32_agrees_with_its_own_greedy_continuation(quality):
    """The measure's own check: float32 teacher-forced along its greedy tokens picks them (a
    prefill and a decode step may round a near tie apart, hence not exactly 1)."""
    assert quality["float32"]["top1_agreement"] >= 0.99, quality["float32"]


@pytest.mark.parametrize("variant", ["bfloat16", "int8"])
def test_top1_agreement_with_float32_is_at_least_95_percent(quality, variant):
    measured = quality[variant]
    assert measured["top1_agreement"] >= MIN_TOP1_AGREEMENT, (
        f"{variant}: top-1 agreement {measured['top1_agreement']:.3f} along float32's greedy "
        f"continuation on SmolLM2, expected >= {MIN_TOP1_AGREEMENT}; all measures: {measured}"
    )
