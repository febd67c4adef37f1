"""The KV cache's element formats: float32, float16, bfloat16, and int8 with per-token scales.

A 16- or 32-bit cache holds each cached token's heads as [num_kv_heads, head_dim] elements of
its dtype. An int8 cache holds each (token, KV head) as a row of head_dim + 4 bytes: head_dim
int8 values q, then the row's float32 scale s (its 4 bytes, native order), and the row reads
back as q * s. The cache tensor is then int8 [num_blocks, block_size, num_kv_heads,
head_dim + 4] and every kernel signature stays the same as for a float cache; a block's scales
travel with it wherever the block's bytes are copied.

Why one scale per token and head (and not per block and head): a block fills one token at a
time over many steps, and full blocks are shared read-only through the prefix cache. A block
scale would have to be fixed before the block's later tokens are known, or raised later by
re-quantizing the tokens already stored (a read-modify-write of a block other sequences may be
reading). A per-token scale is set once, by the store that writes the token, from that token's
own values: s = max|x| / 127, q = round(x / s) (half to even), and q = 0 where s = 0. Its cost
is 4 bytes per head_dim values: head_dim 64 stores 68 bytes where float32 stores 256 (3.8x
the blocks per byte); head_dim 8 stores 12 where float32 stores 32 (2.7x).
"""

from __future__ import annotations

import torch

# The dtypes a KV cache may have, by the name --kv-cache-dtype takes.
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
SCALE_BYTES = 4  # an int8 row's float32 scale
INT8_MAX = 127.0


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached (token, KV head) row in a cache of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a cache [num_blocks, block_size, num_kv_heads, row] holds."""
    width = cache.shape[-1]
    return width - SCALE_BYTES if cache.dtype == torch.int8 else width


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) takes in a cache (K or V) of `dtype`, scales included."""
    return cache_row_width(head_dim, dtype) * dtype.itemsize


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] floats into int8 rows [..., head_dim + 4] (values, then the scale)."""
    if x.shape[-1] % SCALE_BYTES:
        raise ValueError(f"an int8 KV cache needs head_dim divisible by 4, got {x.shape[-1]}")
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    quantized = torch.where(scale > 0, x / scale, torch.zeros_like(x)).round().clamp(-127, 127)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8, device=x.device)
    rows[..., : x.shape[-1]] = quantized.to(torch.int8)
    rows.view(torch.float32)[..., -1:] = scale
    return rows


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] back to float32 [..., head_dim]."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    if not rows.is_contiguous():
        rows = rows.contiguous()
    scale = rows.view(torch.float32)[..., -1:]
    return rows[..., :head_dim].float() * scale


def read_cache(cache: torch.Tensor) -> torch.Tensor:
    """Cached rows as float32 [..., head_dim], whatever the cache's format."""
    return dequantize_rows(cache) if cache.dtype == torch.int8 else cache.float()


def to_cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] values as rows of a cache of `dtype` (rounded or quantized)."""
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)
