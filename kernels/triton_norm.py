"""Triton kernels for fused residual-add RMSNorm and rotary position embedding."""

import torch
import triton
import triton.language as tl

from kernels.validation import check_rms_norm, check_rotary, expect_inner_contiguous


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    x_stride,
    residual_stride,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < HIDDEN
    x = tl.load(x_ptr + row * x_stride + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * HIDDEN + offsets, x, mask=mask)
    as_float = x.to(tl.float32)
    mean_square = tl.sum(as_float * as_float, axis=0) / HIDDEN
    normed = (as_float * tl.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + offsets, out.to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional residual add first (see the reference for the semantics).

    Args:
        x: [N, H] hidden states, rows contiguous.
        weight: [H] contiguous scale, same dtype as x.
        eps: added to the mean square before the reciprocal square root.
        residual: [N, H] added to x before normalizing, or None.

    Returns:
        (normalized r times weight, r) where r = x + residual (or x itself), both in x.dtype.
    """
    check_rms_norm(x, weight, residual)
    expect_inner_contiguous("x", x, 1)
    expect_inner_contiguous("weight", weight, 1)
    if residual is not None:
        expect_inner_contiguous("residual", residual, 1)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, summed
    _rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        summed,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        eps,
        HIDDEN=hidden,
        BLOCK=triton.next_power_of_2(hidden),
        HAS_RESIDUAL=residual is not None,
    )
    return out, summed


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    src_stride_token,
    src_stride_head,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF_DIM)[None, :]
    src = src_ptr + token * src_stride_token + heads[:, None] * src_stride_head + dims[None, :]
    first = tl.load(src, mask=mask, other=0.0)
    second = tl.load(src + HALF_DIM, mask=mask, other=0.0)
    first_f = first.to(tl.float32)
    second_f = second.to(tl.float32)
    dst = dst_ptr + token * (NUM_HEADS * 2 * HALF_DIM) + heads[:, None] * (2 * HALF_DIM)
    dst = dst + dims[None, :]
    tl.store(dst, (first_f * cos - second_f * sin).to(first.dtype), mask=mask)
    tl.store(dst + HALF_DIM, (second_f * cos + first_f * sin).to(first.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride_token,
    q_stride_head,
    k_stride_token,
    k_stride_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + position * (2 * HALF_DIM) + dims
    cos = tl.load(row, mask=dims < HALF_DIM, other=0.0)[None, :]
    sin = tl.load(row + HALF_DIM, mask=dims < HALF_DIM, other=0.0)[None, :]
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        token,
        q_stride_token,
        q_stride_head,
        cos,
        sin,
        NUM_Q_HEADS,
        HALF_DIM,
        BLOCK_Q_HEADS,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        token,
        k_stride_token,
        k_stride_head,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF_DIM,
        BLOCK_KV_HEADS,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding (rotate_half style) to q and k (see the reference).

    Args:
        positions: [N] int64 position of each token.
        q: [N, Hq, D] queries; the last dim contiguous.
        k: [N, Hkv, D] keys; the last dim contiguous.
        cos_sin_cache: [max_position, D] contiguous float32; first D/2 columns cos, last sin.

    Returns:
        (rotated q, rotated k), new contiguous tensors in q.dtype.
    """
    check_rotary(positions, q, k, cos_sin_cache)
    expect_inner_contiguous("q", q, 1)
    expect_inner_contiguous("k", k, 1)
    expect_inner_contiguous("cos_sin_cache", cos_sin_cache, 2)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF_DIM=head_dim // 2,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
    return q_out, k_out
