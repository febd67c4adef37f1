"""The KV cache's element formats: float32, float16, bfloat16, and int8 or fp8 with per-token
scales.

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

An fp8 cache has the same rows and scales, for the same reasons, with float8 e4m3 bytes in place
of the int8 values: uint8 [num_blocks, block_size, num_kv_heads, head_dim + 4]. The scale is
s = max|x| / 448 (e4m3's largest finite value), each value is x / s as torch.float8_e4m3fn has
it (sign, 4 exponent bits of bias 7, 3 mantissa bits; subnormals down to 2^-9; 0x7F and 0xFF
NaN, no infinities), rounded to nearest even, and anything beyond +-448 saturates to +-448 (as
vLLM's fp8 cache does; torch's own conversion would make it NaN), and 0 where s = 0. The rows
read back as value * s. The kernels encode and decode the bytes with integer arithmetic on the
float32 bits (kernels/triton_fp8.py, kernels/csrc/cpu_common.h), and tests hold every byte
and a sweep of float32 values to `fp8_e4m3_bytes` and `fp8_e4m3_values` here, bit for bit.
"""

from __future__ import annotations

import torch

# The dtypes a KV cache may have, by the name --kv-cache-dtype takes.
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.uint8,  # float8 e4m3 bytes
}
# The formats whose rows end with a float32 scale, by their cache tensor's dtype.
SCALED_DTYPES = {torch.int8: "int8", torch.uint8: "fp8"}
SCALE_BYTES = 4  # a scaled row's float32 scale
INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest finite float8 e4m3 value


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached (token, KV head) row in a cache of `dtype`."""
    return head_dim + SCALE_BYTES if dtype in SCALED_DTYPES else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a cache [num_blocks, block_size, num_kv_heads, row] holds."""
    width = cache.shape[-1]
    return width - SCALE_BYTES if cache.dtype in SCALED_DTYPES else width


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) takes in a cache (K or V) of `dtype`, scales included."""
    return cache_row_width(head_dim, dtype) * dtype.itemsize


def format_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype name of a cache tensor's dtype (uint8: fp8)."""
    return SCALED_DTYPES.get(dtype) or str(dtype).removeprefix("torch.")


def fp8_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """Values as float8 e4m3 bytes (uint8): nearest, ties to even, subnormals kept, beyond
    +-448 (infinities too) saturated to +-448, NaN stays NaN."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_e4m3_values(data: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 bytes (uint8) as float32 values (0x7F and 0xFF: NaN)."""
    return data.view(torch.float8_e4m3fn).float()


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., head_dim] floats into scaled rows [..., head_dim + 4] of `dtype` (int8, or uint8
    for fp8): the values, then the scale."""
    if x.shape[-1] % SCALE_BYTES:
        raise ValueError(
            f"an {SCALED_DTYPES[dtype]} KV cache needs head_dim divisible by 4, got {x.shape[-1]}"
        )
    x = x.float()
    if dtype == torch.uint8:
        scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        values = fp8_e4m3_bytes(torch.where(scale > 0, x / scale, torch.zeros_like(x)))
    else:
        scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
        scaled = torch.where(scale > 0, x / scale, torch.zeros_like(x))
        values = scaled.round().clamp(-127, 127).to(torch.int8)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=dtype, device=x.device)
    rows[..., : x.shape[-1]] = values
    rows.view(torch.float32)[..., -1:] = scale
    return rows


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """Scaled rows [..., head_dim + 4] (int8, or uint8 for fp8) back to float32 [..., head_dim]."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    if not rows.is_contiguous():
        rows = rows.contiguous()
    scale = rows.view(torch.float32)[..., -1:]
    values = rows[..., :head_dim]
    return (fp8_e4m3_values(values) if rows.dtype == torch.uint8 else values.float()) * scale


def read_cache(cache: torch.Tensor) -> torch.Tensor:
    """Cached rows as float32 [..., head_dim], whatever the cache's format."""
    return dequantize_rows(cache) if cache.dtype in SCALED_DTYPES else cache.float()


def to_cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] values as rows of a cache of `dtype` (rounded or quantized)."""
    return quantize_rows(x, dtype) if dtype in SCALED_DTYPES else x.to(dtype)
