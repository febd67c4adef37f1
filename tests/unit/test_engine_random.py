"""Seeded random-weight Llama, Qwen2 and Mistral checkpoints: the engine against transformers.

Greedy tokens must match token for token; see tests.helpers.assert_greedy_matches for the
only tolerated divergence (a float32 near-tie in the reference's logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.engine import Engine
from tests.helpers import (
    GreedyReference,
    assert_greedy_matches,
    greedy,
    hf_greedy,
    make_engine,
    move_rope_theta_to_top_level,
    randomize_weights,
    run_to_completion,
)

MAX_NEW_TOKENS = 32
VOCAB = 256
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@dataclass
class Checkpoint:
    name: str
    path: Path
    prompts: list[list[int]]
    references: list[GreedyReference]
    hf_model: torch.nn.Module


def _llama_gqa_untied_sharded():
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)), {
        "max_shard_size": "60KB"
    }


def _llama_tied_llama3_rope():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_parameters=rope)
    return LlamaForCausalLM(config), {}


def _llama_attention_and_mlp_bias():
    config = LlamaConfig(**SHAPE, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    return LlamaForCausalLM(config), {}


def _qwen2_bias():
    config = Qwen2Config(**SHAPE, tie_word_embeddings=False, use_sliding_window=False)
    return Qwen2ForCausalLM(config), {}


def _mistral_tied():
    config = MistralConfig(**SHAPE, tie_word_embeddings=True, sliding_window=None)
    return MistralForCausalLM(config), {}


BUILDERS = {
    "llama-gqa-untied-sharded": _llama_gqa_untied_sharded,
    "llama-tied-llama3-rope-top-level-theta": _llama_tied_llama3_rope,
    "llama-attention-and-mlp-bias": _llama_attention_and_mlp_bias,
    "qwen2-bias": _qwen2_bias,
    "mistral-tied": _mistral_tied,
}


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 7, 12, 16, 21, 33, 50]
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    name = request.param
    torch.manual_seed(0)
    model, save_kwargs = BUILDERS[name]()
    randomize_weights(model, seed=len(name))
    model.eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, **save_kwargs)
    if "top-level-theta" in name:
        move_rope_theta_to_top_level(path)
    prompts = _prompts(seed=len(name))
    references = [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]
    return Checkpoint(name, path, prompts, references, model)


def _engine(ckpt: Checkpoint, **overrides) -> Engine:
    return make_engine(ckpt.path, kv_cache_gib=0.01, **overrides)


def _run_all(engine: Engine, ckpt: Checkpoint) -> dict[str, list[int]]:
    for i, prompt in enumerate(ckpt.prompts):
        engine.add_request(f"p{i}", prompt, greedy(MAX_NEW_TOKENS))
    return run_to_completion(engine)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(block_size=4),
        dict(block_size=16),
        dict(block_size=4, max_num_batched_tokens=8),  # chunked prefill
    ],
    ids=["block4", "block16", "chunked-prefill"],
)
def test_concurrent_greedy_matches_transformers(checkpoint, overrides):
    got = _run_all(_engine(checkpoint, **overrides), checkpoint)
    for i, ref in enumerate(checkpoint.references):
        label = f"{checkpoint.name} {overrides} prompt {i} ({len(checkpoint.prompts[i])} tokens)"
        assert_greedy_matches(got[f"p{i}"], ref, label)


def test_shared_prefix_is_cached_and_gives_same_tokens(checkpoint):
    engine = _engine(checkpoint, block_size=4)
    long_prompt = checkpoint.prompts[-1]
    engine.add_request("first", long_prompt, greedy(MAX_NEW_TOKENS))
    run_to_completion(engine)
    shared = long_prompt[:41]
    second_prompt = shared + [7, 8, 9, 10, 11]
    engine.add_request("second", second_prompt, greedy(MAX_NEW_TOKENS))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    second = [t for o in outputs for t in o.new_token_ids]
    cached = outputs[0].num_cached_tokens
    expected_cached = len(shared) // 4 * 4
    assert cached == expected_cached, f"expected {expected_cached} cached tokens, got {cached}"
    reference = hf_greedy(checkpoint.hf_model, second_prompt, MAX_NEW_TOKENS)
    assert_greedy_matches(second, reference, f"{checkpoint.name} sharing a cached prefix")
