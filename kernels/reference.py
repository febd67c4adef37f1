"""PyTorch reference kernels: the twin of every Triton and C kernel.

Attention accumulates in float32 whatever the input dtype and returns the input dtype; the KV
cache may have another dtype than the activations (values are converted when stored), int8
included (tokens with their scale, kernels/kv_format.py).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.attention_step import AttentionStep
from kernels.decoder import DecoderKernel, DecoderWeights, decoder_layers_with
from kernels.kv_format import cache_kv_heads, read_cache, to_cache_rows
from kernels.quant import QuantizedWeight, round_activations
from kernels.validation import (
    check_argmax,
    check_decode,
    check_linear,
    check_prefill,
    check_quantized_linear,
    check_rms_norm,
    check_rotary,
    check_silu_and_mul,
    check_store_kvcache,
)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    Args:
        key: [N, Hkv, D] new keys.
        value: [N, Hkv, D] new values.
        k_cache: [num_blocks, block_size, Hkv, D] key cache, written in place (converted to
            its dtype; int8, fp8: [num_blocks, block_size, Hkv * D + 2], each token quantized
            with its scale, kernels/kv_format.py).
        v_cache: [num_blocks, block_size, Hkv, D] value cache, written in place.
        slot_mapping: [N] int64, slot = block_id * block_size + offset; -1 skips the token.
    """
    check_store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    stored = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping.index_select(0, stored)
    for new, cache in ((key, k_cache), (value, v_cache)):
        rows = to_cache_rows(new.index_select(0, stored), cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def _gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_context_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the first `max_context_len` cached tokens of every sequence: [B, T, *token] each.

    Block-table entries past a sequence's blocks may hold anything; they are clamped into range
    here and their tokens are masked by the caller.
    """
    num_blocks, block_size = k_cache.shape[:2]
    blocks_per_seq = -(-max_context_len // block_size)
    tables = block_tables[:, :blocks_per_seq].long().clamp(0, num_blocks - 1).flatten()
    gathered_shape = (block_tables.shape[0], blocks_per_seq * block_size, *k_cache.shape[2:])
    keys = k_cache.index_select(0, tables).view(gathered_shape)[:, :max_context_len]
    values = v_cache.index_select(0, tables).view(gathered_shape)[:, :max_context_len]
    return keys, values


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new query token per sequence over that sequence's cached tokens.

    Args:
        q: [B, Hq, D] query of the token at position context_lens[b] - 1.
        k_cache: [num_blocks, block_size, Hkv, D]; Hq must be a multiple of Hkv (GQA).
        v_cache: [num_blocks, block_size, Hkv, D].
        block_tables: [B, max_blocks] int32; entries past a sequence's blocks are ignored.
        context_lens: [B] int32 tokens in the cache for each sequence, this one included (>= 1).
        scale: multiplier of q.k before the softmax.

    Returns:
        [B, Hq, D] attention output in q.dtype.
    """
    check_decode(q, k_cache, v_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    num_kv_heads = cache_kv_heads(k_cache, head_dim)
    max_context_len = int(context_lens.max())
    keys, values = _gather_context(k_cache, v_cache, block_tables, max_context_len)
    positions = torch.arange(max_context_len, device=q.device)
    valid = positions[None, :] < context_lens[:, None]
    grouped_q = q.float().reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped_q,
        read_cache(keys, head_dim).transpose(1, 2),
        read_cache(values, head_dim).transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached keys and values, [context_len, *token] each."""
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-context_len // block_size)].long()
    keys = k_cache.index_select(0, blocks).flatten(0, 1)[:context_len]
    values = v_cache.index_select(0, blocks).flatten(0, 1)[:context_len]
    return keys, values


def _causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal GQA attention of the last q.shape[0] positions over all keys, in float32.

    Args:
        q: [L, Hq, D] queries at positions T - L .. T - 1.
        keys: [T, *token] cached tokens (kernels/kv_format.py).
        values: [T, *token].
        scale: multiplier of q.k before the softmax.

    Returns:
        [L, Hq, D] float32.
    """
    query_len, context_len, head_dim = q.shape[0], keys.shape[0], q.shape[2]
    key_positions = torch.arange(context_len, device=q.device)
    query_positions = torch.arange(query_len, device=q.device) + (context_len - query_len)
    mask = key_positions[None, :] <= query_positions[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),
        read_cache(keys, head_dim).transpose(0, 1).unsqueeze(0),
        read_cache(values, head_dim).transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' cached tokens.

    Args:
        q: [N, Hq, D] queries of B sequences packed; sequence b owns q[cu[b]:cu[b+1]], at
            positions context_lens[b] - qlen_b .. context_lens[b] - 1.
        k_cache: [num_blocks, block_size, Hkv, D], already holding every key 0..context_lens[b]-1.
        v_cache: [num_blocks, block_size, Hkv, D].
        block_tables: [B, max_blocks] int32.
        cu_seqlens_q: [B + 1] int32 cumulative query counts, starting at 0.
        context_lens: [B] int32 cached tokens per sequence, the new ones included.
        scale: multiplier of q.k before the softmax.

    Returns:
        [N, Hq, D] attention output in q.dtype.
    """
    check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end - start > context_len:
            raise ValueError(
                f"sequence {seq} has {end - start} queries but context_lens[{seq}] is "
                f"{context_len}; the cache must already hold every query's key"
            )
        if end == start:
            continue
        keys, values = _sequence_kv(k_cache, v_cache, block_tables[seq], context_len)
        out[start:end] = _causal_attention(q[start:end], keys, values, scale).to(q.dtype)
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight^T + bias, as torch.nn.functional.linear.

    Args:
        x: [N, in_features].
        weight: [out_features, in_features], same dtype and device as x.
        bias: [out_features] or None.
        out_dtype: the result's dtype; None: x.dtype. Another dtype (float32 logits of a
            bfloat16 model) is computed in float32 and not rounded to x.dtype on the way.

    Returns:
        [N, out_features] (twins may return another memory layout).
    """
    check_linear(x, weight, bias)
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), bias).to(out_dtype)


def linear_quantized(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ w^T + bias for a quantized w, computed in float32 from the dequantized weight and
    rounded once to the result's dtype; for int4 weights (and int8 ones with int8_activations)
    x is first rounded to int8 blocks of 32 values (kernels.quant.round_activations), for other
    int8 ones it is used as it is.

    Args:
        x: [N, in_features] floats.
        weight: the int8 or int4 weight (kernels.quant).
        bias: [out_features] in x.dtype, or None.
        out_dtype: the result's dtype; None: x.dtype.

    Returns:
        [N, out_features] (twins may return another memory layout).
    """
    check_quantized_linear(x, weight, bias)
    bias = None if bias is None else bias.float()
    values = round_activations(x) if weight.rounds_activations else x.float()
    out = F.linear(values, weight.dequantize(torch.float32), bias)
    return out.to(out_dtype or x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a Llama MLP's fused gate/up projection.

    Args:
        x: [N, 2 * I], gate in the first I features and up in the last I.

    Returns:
        [N, I] in x.dtype (silu's result rounded to x.dtype before the product, as torch does).
    """
    check_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (the first on ties; NaN counts as largest).

    Args:
        logits: [rows, vocab] floats, any strides.

    Returns:
        [rows] int64.
    """
    check_argmax(logits)
    return logits.argmax(dim=-1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional residual add first, as Hugging Face's LlamaRMSNorm computes it.

    Args:
        x: [N, H] hidden states.
        weight: [H] scale, same dtype as x.
        eps: added to the mean square before the reciprocal square root.
        residual: [N, H] added to x before normalizing, or None.

    Returns:
        (normalized r times weight, r) where r = x + residual (or x), both in x.dtype.
    """
    check_rms_norm(x, weight, residual)
    summed = x if residual is None else x + residual
    normed = F.rms_norm(summed.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed, summed


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [N, H, D] by rotate_half (neox) style with [N, 1, D/2] cos and sin, in float32."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding (Hugging Face Llama rotate_half style) to q and k.

    Args:
        positions: [N] int64 position of each token.
        q: [N, Hq, D] queries.
        k: [N, Hkv, D] keys.
        cos_sin_cache: [max_position, D] float32; first D/2 columns cos, last D/2 sin.

    Returns:
        (rotated q, rotated k), new tensors in q.dtype.
    """
    check_rotary(positions, q, k, cos_sin_cache)
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def prepare_attention(step: AttentionStep, k_cache: torch.Tensor) -> AttentionStep:
    """The step as every layer reads it; the reference kernels check their inputs per call."""
    return step


AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionStep], torch.Tensor]


def attention_with(
    rotary: Callable, store: Callable, decode: Callable, prefill: Callable
) -> AttentionKernel:
    """One layer's attention (rotary embedding, KV store, paged attention) from these kernels.

    Args:
        rotary, store, decode, prefill: kernels with the signatures of this module's
            rotary_embedding, store_kvcache, paged_decode_attention and
            paged_prefill_attention.

    Returns:
        A kernel with the signature of `attention`.
    """

    def attention(
        qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: AttentionStep
    ) -> torch.Tensor:
        num_tokens, head_dim = qkv.shape[0], step.head_dim
        q_size, kv_size = step.num_heads * head_dim, step.num_kv_heads * head_dim
        # Rotary embedding and the KV-cache store read each token's heads contiguously.
        q, k, v = qkv.contiguous().split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, step.num_heads, head_dim)
        k = k.view(num_tokens, step.num_kv_heads, head_dim)
        v = v.reshape(num_tokens, step.num_kv_heads, head_dim)
        q, k = rotary(step.positions, q, k, step.cos_sin_cache)
        store(k, v, k_cache, v_cache, step.slot_mapping)
        out = _attend(q.contiguous(), k_cache, v_cache, step, decode, prefill)
        return out.view(num_tokens, q_size)

    return attention


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: AttentionStep,
    decode: Callable,
    prefill: Callable,
) -> torch.Tensor:
    """Decode attention of the one-token sequences, then prefill attention of the rest."""
    num_decode = step.num_decode_tokens
    decode_args = (k_cache, v_cache, step.decode_block_tables, step.decode_context_lens)
    if step.num_prefill_seqs == 0:
        return decode(q, *decode_args, step.scale)
    prefilled = prefill(
        q[num_decode:], k_cache, v_cache, step.prefill_block_tables, step.prefill_cu_seqlens_q,
        step.prefill_context_lens, step.scale,
    )  # fmt: skip
    if num_decode == 0:
        return prefilled
    return torch.cat([decode(q[:num_decode], *decode_args, step.scale), prefilled])


attention: AttentionKernel = attention_with(
    rotary_embedding, store_kvcache, paged_decode_attention, paged_prefill_attention
)
attention.__doc__ = """One layer's attention for a whole step, with the reference kernels.

Args:
    qkv: [N, (num_heads + 2 * num_kv_heads) * head_dim] fused q/k/v projection (any layout).
    k_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
    v_cache: the same.
    step: the step's positions, slots and tables (AttentionStep).

Returns:
    [N, num_heads * head_dim] attention output in qkv.dtype, contiguous.
"""


def prepare_decoder(weights: DecoderWeights) -> DecoderWeights:
    """The stack as every step reads it; the reference kernels check their inputs per call."""
    return weights


decoder_layers: DecoderKernel = decoder_layers_with(
    linear, linear_quantized, rms_norm, attention, silu_and_mul
)
decoder_layers.__doc__ = """Every decoder layer of a step, one reference kernel call at a time.

Args:
    weights: the layers' weights and caches (kernels.decoder.DecoderWeights).
    hidden: [N, hidden_size] the step's token embeddings.
    step: the step's positions, slots and tables.

Returns:
    (hidden, residual): the last layer's output and the running residual sum, [N, hidden_size].
"""
