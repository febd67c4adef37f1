"""Triton kernel writing new keys and values into the paged KV cache, in the cache's format
(float32, float16, bfloat16, or int8 or fp8 rows with their scale: kernels/kv_format.py)."""

import torch
import triton
import triton.language as tl

from kernels.kv_format import SCALED_DTYPES, cache_row_width
from kernels.triton_fp8 import fp8_e4m3_encode
from kernels.validation import check_store_kvcache, expect_inner_contiguous

# Adding then subtracting 1.5 * 2^23 rounds a float32 of magnitude below 2^22 to an integer,
# half to even (the rounding torch.round does), in plain IEEE arithmetic.
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def _store_row(src_ptr, cache_ptr, scale_ptr, row, dims, mask,
               HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr):  # fmt: skip
    """One head's values into cache row `row` (element offset); int8 and fp8 (uint8) rows get
    their scale."""
    x = tl.load(src_ptr + dims, mask=mask, other=0.0)
    if QUANTIZED:
        x = x.to(tl.float32)
        if cache_ptr.dtype.element_ty == tl.uint8:
            # IEEE divisions (a GPU's default float32 division is not), as the reference's.
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0)
            scaled = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0))
            encoded = fp8_e4m3_encode(tl.where(scale > 0, scaled, 0.0))
            tl.store(cache_ptr + row + dims, encoded.to(tl.uint8), mask=mask)
        else:
            scale = tl.max(tl.abs(x), axis=0) / 127.0
            scaled = x / tl.where(scale > 0, scale, 1.0)  # scale 0: every value is 0
            rounded = (scaled + _ROUNDER) - _ROUNDER
            tl.store(cache_ptr + row + dims, rounded.to(tl.int8), mask=mask)
        tl.store(scale_ptr + (row + HEAD_DIM) // 4, scale)
    else:
        tl.store(cache_ptr + row + dims, x.to(cache_ptr.dtype.element_ty), mask=mask)


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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    dims = tl.arange(0, BLOCK_D)
    mask = dims < HEAD_DIM
    row = (slot * NUM_KV_HEADS + head) * ROW_WIDTH
    key = key_ptr + token * key_stride_token + head * HEAD_DIM
    value = value_ptr + token * value_stride_token + head * HEAD_DIM
    _store_row(key, k_cache_ptr, k_scale_ptr, row, dims, mask, HEAD_DIM, QUANTIZED)
    _store_row(value, v_cache_ptr, v_scale_ptr, row, dims, mask, HEAD_DIM, QUANTIZED)


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """An int8 or fp8 cache's bytes as float32 (where the kernels read and write the rows'
    scales); a float cache itself (its kernels take no scales)."""
    return cache.view(torch.float32) if cache.dtype in SCALED_DTYPES else cache


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
        k_cache: [num_blocks, block_size, Hkv, D] contiguous key cache (int8 or fp8: rows of
            D + 4).
        v_cache: [num_blocks, block_size, Hkv, D] contiguous value cache.
        slot_mapping: [N] int64, slot = block_id * block_size + offset; -1 skips the token.
    """
    check_store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    expect_inner_contiguous("key", key, 2)
    expect_inner_contiguous("value", value, 2)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        scale_view(k_cache),
        scale_view(v_cache),
        slot_mapping,
        key.stride(0),
        value.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROW_WIDTH=cache_row_width(head_dim, k_cache.dtype),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZED=k_cache.dtype in SCALED_DTYPES,
    )
