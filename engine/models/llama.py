"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

q/k/v and gate/up projections are fused into one matmul each; the loader concatenates the
checkpoint's separate weights. The modules hold the weights; the decoder layers run as one
kernel of `kernels` (kernels/decoder.py: on the CPU one C call for a step of up to 64 tokens), over
the stack's weights and caches described once (`decoder_weights`). Kernels may return another
memory layout (column-major on the CPU); the batch is packed as one-token sequences first (the
decode kernel), then multi-token chunks (the prefill kernel). A linear layer's weight is dense
or weight-only quantized (int8/int4, kernels/quant.py); a quantized tied embedding reads its
rows from the output layer's quantized weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from kernels import AttentionStep, KernelBackend
from kernels.decoder import DecoderLayerWeights, DecoderWeights
from kernels.quant import QuantizedWeight


@dataclass(slots=True)
class ForwardContext:
    """Per-step inputs shared by every layer."""

    attention: AttentionStep  # positions, slots and tables, prepared by the kernels
    decoder: DecoderWeights  # the layers' weights and caches, prepared by the kernels
    kernels: KernelBackend


class Linear(nn.Module):
    """y = x @ W^T + b through the kernels, with W dense or weight-only quantized."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.quantized: QuantizedWeight | None = None

    def forward(
        self, x: torch.Tensor, kernels: KernelBackend, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if self.quantized is not None:
            return kernels.linear_quantized(x, self.quantized, self.bias, out_dtype)
        return kernels.linear(x, self.weight, self.bias, out_dtype)

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Serve this layer from `weight` and drop the dense weight."""
        if (weight.out_features, weight.in_features) != self._shape():
            raise ValueError(f"quantized weight {weight.out_features}x{weight.in_features} does "
                             f"not fit a {self._shape()[0]}x{self._shape()[1]} layer")  # fmt: skip
        self.quantized = weight
        self.weight = None

    def _shape(self) -> tuple[int, int]:
        if self.quantized is not None:
            return self.quantized.out_features, self.quantized.in_features
        return tuple(self.weight.shape)


class Embedding(nn.Module):
    """Token embeddings: a dense table, or the rows of a quantized one."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.quantized: QuantizedWeight | None = None

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.quantized is None:
            return F.embedding(input_ids, self.weight)
        return self.quantized.dequantize_rows(input_ids).to(dtype)

    def set_quantized(self, weight: QuantizedWeight) -> None:
        self.quantized = weight
        self.weight = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, kernels: KernelBackend, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, intermediate, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def weights(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> DecoderLayerWeights:
        attn, mlp = self.self_attn, self.mlp
        return DecoderLayerWeights(
            input_norm=self.input_layernorm.weight,
            qkv=_weight(attn.qkv_proj),
            o=_weight(attn.o_proj),
            post_norm=self.post_attention_layernorm.weight,
            gate_up=_weight(mlp.gate_up_proj),
            down=_weight(mlp.down_proj),
            k_cache=kv_cache[0],
            v_cache=kv_cache[1],
            qkv_bias=attn.qkv_proj.bias,
            o_bias=attn.o_proj.bias,
            gate_up_bias=mlp.gate_up_proj.bias,
            down_bias=mlp.down_proj.bias,
        )


def _weight(layer: Linear) -> torch.Tensor | QuantizedWeight:
    return layer.quantized if layer.quantized is not None else layer.weight


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral and Qwen2: they differ only in config (biases, window, rope)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def decoder_weights(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecoderWeights:
        """Every layer's weights with its KV cache, for the kernels' prepare_decoder."""
        layers = [layer.weights(kv) for layer, kv in zip(self.layers, kv_caches, strict=True)]
        return DecoderWeights(layers, self.config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [N, hidden] of the new tokens after the final norm."""
        hidden = self.embed_tokens(input_ids, self.norm.weight.dtype)
        hidden, residual = ctx.kernels.decoder_layers(ctx.decoder, hidden, ctx.attention)
        hidden, _ = self.norm(hidden, ctx.kernels, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, kernels: KernelBackend) -> torch.Tensor:
        """[N, vocab] float32 logits of hidden states [N, hidden] (in the layout of
        kernels.linear: column-major on the CPU)."""
        return self.lm_head(hidden, kernels, out_dtype=torch.float32)
