"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

q/k/v and gate/up projections are fused into one matmul each; the loader concatenates the
checkpoint's separate weights. Linear layers, norms and attention run through `kernels`, whose
linear may return another memory layout (column-major on the CPU); the batch is packed as
one-token sequences first (the decode kernel), then multi-token chunks (the prefill kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor.models.config import ModelConfig
from kernels import KernelBackend


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends to, for one step."""

    slot_mapping: torch.Tensor  # [N] int64 cache slot of each new token
    num_decode_tokens: int  # the first D tokens are one-token sequences
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor  # [D] int32, tokens in cache including the new one
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [P + 1] int32 offsets into the prefill tokens
    prefill_context_lens: torch.Tensor  # [P] int32

    @property
    def num_prefill_seqs(self) -> int:
        return self.prefill_context_lens.shape[0]


@dataclass(slots=True)
class ForwardContext:
    """Per-step inputs shared by every layer."""

    positions: torch.Tensor  # [N] int64
    attn: AttentionMetadata
    cos_sin_cache: torch.Tensor  # [max_pos, head_dim]
    kernels: KernelBackend


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
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens, kernels = hidden.shape[0], ctx.kernels
        # Rotary embedding and the KV-cache store read each token's heads contiguously.
        qkv = kernels.linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias).contiguous()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = kernels.rotary_embedding(ctx.positions, q, k, ctx.cos_sin_cache)
        k_cache, v_cache = kv_cache
        kernels.store_kvcache(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
        out = self._attend(q.contiguous(), k_cache, v_cache, ctx)
        return kernels.linear(
            out.view(num_tokens, self.q_size), self.o_proj.weight, self.o_proj.bias
        )

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attn, kernels = ctx.attn, ctx.kernels
        num_decode = attn.num_decode_tokens
        if attn.num_prefill_seqs == 0:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, attn.decode_block_tables, attn.decode_context_lens, self.scale
            )
        prefill = kernels.paged_prefill_attention(
            q[num_decode:], k_cache, v_cache, attn.prefill_block_tables,
            attn.prefill_cu_seqlens_q, attn.prefill_context_lens, self.scale,
        )  # fmt: skip
        if num_decode == 0:
            return prefill
        decode = kernels.paged_decode_attention(
            q[:num_decode], k_cache, v_cache, attn.decode_block_tables,
            attn.decode_context_lens, self.scale,
        )  # fmt: skip
        return torch.cat([decode, prefill])


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        hidden, intermediate, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, kernels: KernelBackend) -> torch.Tensor:
        gate_up = kernels.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return kernels.linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, ctx.kernels, residual)
        hidden = self.self_attn(hidden, kv_cache, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, ctx.kernels, residual)
        return self.mlp(hidden, ctx.kernels), residual


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral and Qwen2: they differ only in config (biases, window, rope)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """Hidden states [N, hidden] of the new tokens after the final norm."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, kv_cache, ctx)
        hidden, _ = self.norm(hidden, ctx.kernels, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, kernels: KernelBackend) -> torch.Tensor:
        """[N, vocab] float32 logits of hidden states [N, hidden] (in the layout of
        kernels.linear: column-major on the CPU)."""
        return kernels.linear(hidden, self.lm_head.weight).float()
