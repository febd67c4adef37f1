"""Triton kernel writing new keys and values into the paged KV cache, in the cache's format
(float32, float16, bfloat16, or int8 or fp8 tokens with their bfloat16 scale:
kernels/kv_format.py)."""

import math

import torch
import triton
import triton.language as tl

from kernels.kv_format import SCALED_DTYPES, cache_token_shape
from kernels.triton_fp8 import fp8_e4m3_encode
from kernels.validation import check_store_kvcache, expect_inner_contiguous

# Adding then subtracting 1.5 * 2^23 rounds a float32 of magnitude below 2^22 to an integer,
# half to even (the rounding torch.round does), in plain IEEE arithmetic.
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def _token_scale(x, CODE_MAX: tl.constexpr):
    """max|x| / CODE_MAX (an IEEE division, as the reference's; a GPU's default float32
    division is not), rounded up to a bfloat16: its float32 bits (int32)."""
    exact = tl.math.div_rn(tl.max(tl.abs(x), axis=0), CODE_MAX)
    return (exact.to(tl.int32, bitcast=True) + 0xFFFF) & -0x10000


@triton.jit
def _store_token(src_ptr, cache_ptr, scale_ptr, slot, offsets, mask, WIDTH: tl.constexpr,
                 ROW_WIDTH: tl.constexpr, QUANTIZED: tl.constexpr):  # fmt: skip
    """One token's WIDTH values (all its heads) into cache slot `slot`; int8 and fp8 (uint8)
    tokens get their bfloat16 scale after the values (through scale_ptr, the cache's bytes as
    int16)."""
    x = tl.load(src_ptr + offsets, mask=mask, other=0.0)
    start = slot * ROW_WIDTH
    if QUANTIZED:
        x = x.to(tl.float32)
        if cache_ptr.dtype.element_ty == tl.uint8:
            bits = _token_scale(x, 448.0)
            scale = bits.to(tl.float32, bitcast=True)
            scaled = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0))
            encoded = fp8_e4m3_encode(tl.where(scale > 0, scaled, 0.0))
            tl.store(cache_ptr + start + offsets, encoded.to(tl.uint8), mask=mask)
        else:
            bits = _token_scale(x, 127.0)
            scale = bits.to(tl.float32, bitcast=True)
            scaled = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0))  # scale 0: all 0
            rounded = (scaled + _ROUNDER) - _ROUNDER
            tl.store(cache_ptr + start + offsets, rounded.to(tl.int8), mask=mask)
        tl.store(scale_ptr + (start + WIDTH) // 2, (bits >> 16).to(tl.int16))
    else:
        tl.store(cache_ptr + start + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    key_stride_token,
    value_stride_token,
    WIDTH: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < WIDTH
    key = key_ptr + token * key_stride_token
    value = value_ptr + token * value_stride_token
    _store_token(key, k_cache_ptr, k_scale_ptr, slot, offsets, mask, WIDTH, ROW_WIDTH, QUANTIZED)
    _store_token(value, v_cache_ptr, v_scale_ptr, slot, offsets, mask, WIDTH, ROW_WIDTH,
                 QUANTIZED)  # fmt: skip


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """An int8 or fp8 cache's bytes as int16 (where the kernels read and write the tokens'
    bfloat16 scales, as bits); a float cache itself (its kernels take no scales)."""
    return cache.view(torch.int16) if cache.dtype in SCALED_DTYPES else cache


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its cache slot, in place (see the reference).

    Args:
        key: [N, Hkv, D] new keys; each token's [Hkv, D] must be contiguous.
        value: [N, Hkv, D] new values, laid out like key.
        k_cache: [num_blocks, block_size, Hkv, D] contiguous key cache (int8 or fp8:
            [num_blocks, block_size, Hkv * D + 2]).
        v_cache: [num_blocks, block_size, Hkv, D] contiguous value cache.
        slot_mapping: [N] int64, slot = block_id * block_size + offset; -1 skips the token.
    """
    check_store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    expect_inner_contiguous("key", key, 2)
    expect_inner_contiguous("value", value, 2)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        scale_view(k_cache),
        scale_view(v_cache),
        slot_mapping,
        key.stride(0),
        value.stride(0),
        WIDTH=num_kv_heads * head_dim,
        ROW_WIDTH=math.prod(cache_token_shape(num_kv_heads, head_dim, k_cache.dtype)),
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        QUANTIZED=k_cache.dtype in SCALED_DTYPES,
    )
