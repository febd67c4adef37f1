"""The KV host tier on a GPU: requests preempted by swap resume with the tokens of no
preemption at all, and of preemption by recompute.

On CUDA the host tier is pinned memory and its copies run on a side stream, overlapped with
compute (engine/kv_swap.py); the CPU suite runs the same engine path with a second pool
(tests/unit). A seeded random Llama (heads of 64, grouped queries) serves the same greedy
requests three ways: with room for all, and with too few device blocks preempting by recompute
and by swap. On the CPU too, so that it cannot rot; bench/gpu_check.sh runs it on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import greedy_tokens, make_engine

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             tie_word_embeddings=False)  # fmt: skip
MODES = {
    "no preemption": {},
    "recompute": {"num_gpu_blocks": 24, "preemption_mode": "recompute"},
    "swap": {"num_gpu_blocks": 24, "preemption_mode": "swap"},
}


def run_mode(model_dir: str, device: str, prompts: list[list[int]], overrides: dict) -> dict:
    engine = make_engine(model_dir, device=device, block_size=4, enable_prefix_caching=False,
                         swap_space_gib=0.01, gpu_memory_utilization=0.3, **overrides)  # fmt: skip
    tokens = greedy_tokens(engine, prompts, 24)
    stats = engine.stats()
    return {
        "tokens": tokens,
        "preemptions": stats.num_preemptions,
        "swapped_out_blocks": stats.num_swapped_out_blocks,
        "swapped_in_blocks": stats.num_swapped_in_blocks,
        "batched_tokens": stats.num_batched_tokens,
    }


@pytest.mark.parametrize("device", DEVICES)
def test_swap_resumes_with_the_tokens_of_no_preemption(device: str, tmp_path) -> None:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 9, 14, 21, 3)]
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(tmp_path)
    runs = {name: run_mode(str(tmp_path), device, prompts, o) for name, o in MODES.items()}
    base, swap, recompute = runs["no preemption"], runs["swap"], runs["recompute"]
    assert swap["swapped_out_blocks"] > 0, f"nothing was swapped: {swap}"
    assert swap["swapped_in_blocks"] == swap["swapped_out_blocks"], swap
    assert swap["tokens"] == base["tokens"], "swap changed the greedy tokens"
    assert recompute["tokens"] == base["tokens"], "recompute changed the greedy tokens"
    assert recompute["batched_tokens"] > swap["batched_tokens"], "recompute recomputed nothing"
    assert swap["batched_tokens"] == base["batched_tokens"], (
        f"swap recomputed tokens: {swap['batched_tokens']} batched, "
        f"{base['batched_tokens']} without preemption"
    )
