"""bench/engine.py's roofline: the workload's matmul FLOPs against a count by hand, on a tiny
Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.engine import (
    Workload,
    decoder_linear_parameters,
    output_tokens_only_tokens_per_s,
    roofline_tokens_per_s,
    workload_matmul_flops,
)

# hidden 8, 2 query heads and 1 KV head of 4, intermediate 12, 3 layers, vocabulary 20.
TINY = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=12, num_hidden_layers=3, vocab_size=20)  # fmt: skip
# One layer: q 8x8 + k 8x4 + v 8x4 = 128, o 8x8 = 64, gate and up 2 x 8x12 = 192, down 96.
TINY_LAYER_WEIGHTS = 128 + 64 + 192 + 96
TINY_HEAD_WEIGHTS = 8 * 20


def test_decoder_linear_parameters_count_every_projection_of_every_layer():
    assert decoder_linear_parameters(TINY) == 3 * TINY_LAYER_WEIGHTS
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert decoder_linear_parameters(TINY) == sum(m.weight.numel() for m in linears)


def test_workload_flops_count_prompt_tokens_without_the_output_layer():
    # 2 requests of 5 prompt and 3 output tokens: 5 + 3 - 1 = 7 tokens through the decoder
    # (the last output token is never fed back), 3 rows of logits (the last prompt token's
    # and the 2 fed-back output tokens'), 2 FLOPs a weight.
    per_request = 7 * 3 * TINY_LAYER_WEIGHTS + 3 * TINY_HEAD_WEIGHTS
    assert workload_matmul_flops(TINY, 2, 5, 3) == 2 * 2 * per_request == 42240
    with pytest.raises(ValueError, match="prompt_len"):
        workload_matmul_flops(TINY, 2, 0, 3)


def test_roofline_is_output_tokens_per_second_at_the_matmul_rate():
    workload = Workload(num_requests=2, prompt_len=5, output_len=3)
    # At 42240 FLOP/s the whole workload takes a second and produces 2 x 3 tokens.
    assert roofline_tokens_per_s(42240.0, TINY, workload) == pytest.approx(6.0)
    # The older figure charges one forward of every parameter per output token only.
    assert output_tokens_only_tokens_per_s(1000.0, 50) == pytest.approx(10.0)
