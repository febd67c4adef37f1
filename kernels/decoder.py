"""A Llama-family decoder stack as the kernels run it: the weights of every layer, and the
layers run one kernel call at a time (the twin of the CPU's one-call stack, kernels/cpu_decoder.py).

Each layer: RMSNorm with the residual add, fused q/k/v projection, attention (rotary, KV store,
paged attention), output projection, RMSNorm with the residual add, fused gate/up projection,
SiLU-and-multiply, down projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention_step import AttentionStep
from kernels.quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


@dataclass(slots=True)
class DecoderLayerWeights:
    """One layer's weights (dense [out, in] or quantized) and its KV cache."""

    input_norm: torch.Tensor
    qkv: Weight
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(slots=True)
class DecoderWeights:
    """Every layer, the norms' epsilon, and the backend's own form (prepare_decoder)."""

    layers: list[DecoderLayerWeights]
    eps: float
    prepared: object = None


DecoderKernel = Callable[
    [DecoderWeights, torch.Tensor, AttentionStep], tuple[torch.Tensor, torch.Tensor]
]


def decoder_layers_with(
    linear: Callable,
    linear_quantized: Callable,
    rms_norm: Callable,
    attention: Callable,
    silu_and_mul: Callable,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> DecoderKernel:
    """The decoder stack from these kernels (signatures of kernels.reference's).

    The returned kernel takes (weights, hidden [N, hidden] embeddings, step) and returns
    (hidden, residual): the last layer's output and the running residual sum, which the final
    norm adds. With `all_reduce` (tensor parallelism: each rank holds some heads and MLP
    columns) the output and down projections' partial sums are summed across the ranks by it.
    """

    def project(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return linear_quantized(x, weight, bias)
        return linear(x, weight, bias)

    def decoder_layers(
        weights: DecoderWeights, hidden: torch.Tensor, step: AttentionStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = None
        for layer in weights.layers:
            normed, residual = rms_norm(hidden, layer.input_norm, weights.eps, residual)
            qkv = project(normed, layer.qkv, layer.qkv_bias)
            out = attention(qkv, layer.k_cache, layer.v_cache, step)
            hidden = project(out, layer.o, layer.o_bias)
            if all_reduce is not None:
                hidden = all_reduce(hidden)
            normed, residual = rms_norm(hidden, layer.post_norm, weights.eps, residual)
            gate_up = project(normed, layer.gate_up, layer.gate_up_bias)
            hidden = project(silu_and_mul(gate_up), layer.down, layer.down_bias)
            if all_reduce is not None:
                hidden = all_reduce(hidden)
        return hidden, residual

    return decoder_layers
