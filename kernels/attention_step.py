"""One step's attention inputs, built once per step and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionStep:
    """Where each new token's K/V goes and what each sequence attends to, for one step.

    The step's tokens are packed: the first `num_decode_tokens` are one-token sequences (the
    decode kernel), the rest the chunks of the prefill sequences. A backend's
    `prepare_attention` checks it against the cache once and may attach what its `attention`
    kernel reads in every layer (`prepared`).
    """

    positions: torch.Tensor  # [N] int64 position of each new token
    slot_mapping: torch.Tensor  # [N] int64 cache slot of each new token, -1: not stored
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32 rotary table
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor  # [D] int32, tokens in cache including the new one
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [P + 1] int32 offsets into the prefill tokens
    prefill_context_lens: torch.Tensor  # [P] int32
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # multiplier of q.k before the softmax
    prepared: object = None  # the backend's own form of this step, from prepare_attention

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_prefill_seqs(self) -> int:
        return self.prefill_context_lens.shape[0]

    @property
    def qkv_width(self) -> int:
        """Features of a token's fused q/k/v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
