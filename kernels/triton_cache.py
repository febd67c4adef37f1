"""Triton kernel writing new keys and values into the paged KV cache."""

import torch
import triton
import triton.language as tl

from kernels.validation import check_store_kvcache, expect_inner_contiguous


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_token,
    value_stride_token,
    TOKEN_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < TOKEN_SIZE
    key = tl.load(key_ptr + token * key_stride_token + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + offsets, mask=mask)
    cache_offsets = slot * TOKEN_SIZE + offsets
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


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
        k_cache: [num_blocks, block_size, Hkv, D] contiguous key cache.
        v_cache: [num_blocks, block_size, Hkv, D] contiguous value cache.
        slot_mapping: [N] int64, slot = block_id * block_size + offset; -1 skips the token.
    """
    check_store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    expect_inner_contiguous("key", key, 2)
    expect_inner_contiguous("value", value, 2)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    token_size = key.shape[1] * key.shape[2]
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        TOKEN_SIZE=token_size,
        BLOCK=triton.next_power_of_2(token_size),
    )
