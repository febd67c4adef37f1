"""Triton weight-only quantized matmul: y = x @ w^T with w in int8 or int4 (kernels/quant.py).

Each program computes a [BLOCK_M, BLOCK_N] tile of y, dequantizing a [BLOCK_N, BLOCK_K] tile of
the weight in registers per step of K (w = q * scale, or q * scale + zero for int4) and
accumulating in float32. float32 activations multiply the float32 weights exactly (ieee dot);
16-bit activations multiply weights rounded to their dtype. The twin is
kernels.reference.linear_quantized.
"""

import torch
import triton
import triton.language as tl

from kernels.quant import QuantizedWeight, round_activations
from kernels.validation import check_quantized_linear, expect_triton_device

BLOCK_N = 64
BLOCK_K = 64  # a multiple of the 32-weight int4 block


@triton.jit
def _dequantized_tile(q_ptr, scales_ptr, zeros_ptr, rn, rk, mask, K, groups,
                      GROUP: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """The [BLOCK_N, BLOCK_K] weight tile of rows rn and columns rk, as float32."""
    group_index = rn[:, None] * groups + rk[None, :] // GROUP
    scale = tl.load(scales_ptr + group_index, mask=mask, other=0.0).to(tl.float32)
    if BITS == 8:
        q = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=mask, other=0)
        return q.to(tl.float32) * scale
    # int4: byte j of a 32-weight block holds weight j (low nibble) and j + 16 (high nibble).
    in_block = rk % 32
    byte_index = rn[:, None] * (K // 2) + (rk[None, :] // 32) * 16 + in_block[None, :] % 16
    packed = tl.load(q_ptr + byte_index, mask=mask, other=0).to(tl.int32)
    shift = (in_block[None, :] >= 16).to(tl.int32) * 4
    q = (packed >> shift) & 15
    zero = tl.load(zeros_ptr + group_index, mask=mask, other=0.0).to(tl.float32)
    return q.to(tl.float32) * scale + zero


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, q_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, M, N, K, groups,
    stride_xm, stride_xk, stride_om, stride_on,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=x_mask,
                    other=0.0)  # fmt: skip
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = _dequantized_tile(q_ptr, scales_ptr, zeros_ptr, rn, rk, w_mask, K, groups, GROUP, BITS)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_offsets = rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def linear_quantized(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ w^T + bias for an int8 or int4 weight (see kernels.reference.linear_quantized).

    Args:
        x: [N, in_features] float32, bfloat16 or float16, any strides.
        weight: the quantized weight, on x's device.
        bias: [out_features] in x.dtype, or None.
        out_dtype: the result's dtype; None: x.dtype.

    Returns:
        [N, out_features] contiguous.
    """
    check_quantized_linear(x, weight, bias)
    expect_triton_device("x", x)
    if weight.rounds_activations:  # int8 blocks of x (see kernels.quant), back in x's dtype
        x = round_activations(x).to(x.dtype)
    num_rows, k = x.shape
    n = weight.out_features
    out = torch.empty(num_rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_m = 16 if num_rows <= 16 else 64
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, BLOCK_N))
    _quantized_matmul_kernel[grid](
        x, weight.qweight, weight.scales, zeros, bias if bias is not None else weight.scales, out,
        num_rows, n, k, k // weight.group_size, x.stride(0), x.stride(1), out.stride(0),
        out.stride(1),
        GROUP=weight.group_size, BITS=weight.bits, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
    )  # fmt: skip
    return out
