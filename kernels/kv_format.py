"""The KV cache's element formats: float32, float16, bfloat16, and int8 or fp8 with a scale per
token.

A 16- or 32-bit cache holds each cached token's heads as [num_kv_heads, head_dim] elements of
its dtype: the cache tensor is [num_blocks, block_size, num_kv_heads, head_dim]. An int8 cache
holds each cached token's K (and, in its own cache, V) as num_kv_heads * head_dim int8 values q
(head after head), then the token's scale s as a bfloat16 (its 2 bytes, native order); value i
reads back as q[i] * s. The cache tensor is then int8 [num_blocks, block_size,
num_kv_heads * head_dim + 2], a token's heads are found from the model's head_dim
(`cache_kv_heads`), and a block's scales travel with it wherever the block's bytes are copied.

Why one scale per token (and not per block): a block fills one token at a time over many steps,
and full blocks are shared read-only through the prefix cache. A block scale would have to be
fixed before the block's later tokens are known, or raised later by re-quantizing the tokens
already stored (a read-modify-write of a block other sequences may be reading). A per-token
scale is set once, by the store that writes the token, from that token's own values. It is
max|x| / 127 over all of the token's heads, computed in float32 and rounded up to the next
bfloat16 (so that no value lands past 127 through the scale's rounding), and quantizing uses
that stored scale: q = round(x / s) (half to even), q = 0 where s = 0. One scale per token
rather than per (token, head), and 2 bytes rather than 4, because the scale's bytes are what
keep small heads from the 4x of 8-bit values: with a float32 scale per head, head_dim 8 stored
12 bytes per head where float32 stores 32 (2.7x the blocks per byte) and head_dim 64 stored 68
(3.8x). Now 4 KV heads of 8 store 34 bytes per token where float32 stores 128 (3.76x), and 3 of
64 store 194 where float32 stores 768 (3.96x). The price: a head much smaller than the token's
largest is quantized on the largest one's grid (`kvgate bench quality kv` measures what that costs
against float32).

An fp8 cache has the same layout and scales, for the same reasons, with float8 e4m3 bytes in
place of the int8 values: uint8 [num_blocks, block_size, num_kv_heads * head_dim + 2]. The scale
is max|x| / 448 (e4m3's largest finite value) rounded up to a bfloat16, each value is x / s as
torch.float8_e4m3fn has it (sign, 4 exponent bits of bias 7, 3 mantissa bits; subnormals down to
2^-9; 0x7F and 0xFF NaN, no infinities), rounded to nearest even, and anything beyond +-448
saturates to +-448 (as vLLM's fp8 cache does; torch's own conversion would make it NaN), and 0
where s = 0. The values read back as value * s. The kernels encode and decode the bytes with
integer arithmetic on the float32 bits (kernels/triton_fp8.py, kernels/csrc/cpu_common.h), and
tests hold every byte and a sweep of float32 values to `fp8_e4m3_bytes` and `fp8_e4m3_values`
here, bit for bit.
"""

from __future__ import annotations

import math

import torch

# The dtypes a KV cache may have, by the name --kv-cache-dtype takes.
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.uint8,  # float8 e4m3 bytes
}
# The formats whose tokens end with a bfloat16 scale, by their cache tensor's dtype.
SCALED_DTYPES = {torch.int8: "int8", torch.uint8: "fp8"}
SCALE_BYTES = 2  # a scaled token's bfloat16 scale
INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest finite float8 e4m3 value


def cache_token_shape(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape of one cached token (K or V) in a cache of `dtype`: [num_kv_heads, head_dim],
    or for int8 and fp8 [num_kv_heads * head_dim + 2] (the values, then the scale's bytes)."""
    if dtype in SCALED_DTYPES:
        return (num_kv_heads * head_dim + SCALE_BYTES,)
    return (num_kv_heads, head_dim)


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token takes in a cache (K or V) of `dtype`, its scale included."""
    return math.prod(cache_token_shape(num_kv_heads, head_dim, dtype)) * dtype.itemsize


def cache_kv_heads(cache: torch.Tensor, head_dim: int) -> int:
    """The KV heads of head_dim values each that a cache [num_blocks, block_size, *token] holds.

    Raises:
        ValueError: an int8 or fp8 cache whose tokens are not whole heads of head_dim plus the
            scale.
    """
    if cache.dtype not in SCALED_DTYPES:
        return cache.shape[2]
    values = cache.shape[-1] - SCALE_BYTES
    if head_dim < 1 or values < head_dim or values % head_dim:
        raise ValueError(
            f"an {SCALED_DTYPES[cache.dtype]} cache's tokens must be num_kv_heads * head_dim "
            f"values and a {SCALE_BYTES}-byte scale; {cache.shape[-1]} bytes do not hold heads "
            f"of head_dim {head_dim}"
        )
    return values // head_dim


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


def _bfloat16_above(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 values rounded up to the nearest bfloat16 (as float32)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Tokens' heads [..., num_kv_heads, head_dim] as cached tokens [..., num_kv_heads *
    head_dim + 2] of `dtype` (int8, or uint8 for fp8): the values, then the scale's bytes."""
    if x.shape[-1] % 4:
        raise ValueError(
            f"an {SCALED_DTYPES[dtype]} KV cache needs head_dim divisible by 4, got {x.shape[-1]}"
        )
    x = x.float().flatten(-2)
    code_max = FP8_MAX if dtype == torch.uint8 else INT8_MAX
    scale = _bfloat16_above(x.abs().amax(dim=-1, keepdim=True) / code_max)
    scaled = torch.where(scale > 0, x / scale, torch.zeros_like(x))
    if dtype == torch.uint8:
        values = fp8_e4m3_bytes(scaled)
    else:
        values = scaled.round().clamp(-127, 127).to(torch.int8)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=dtype, device=x.device)
    rows[..., : x.shape[-1]] = values
    rows[..., x.shape[-1] :] = scale.to(torch.bfloat16).view(dtype)
    return rows


def token_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales [..., 1] of cached int8 or fp8 tokens [..., width]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()


def dequantize_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cached int8 or fp8 (uint8) tokens [..., num_kv_heads * head_dim + 2] back to float32
    [..., num_kv_heads, head_dim]."""
    values = rows[..., :-SCALE_BYTES]
    decoded = fp8_e4m3_values(values.contiguous()) if rows.dtype == torch.uint8 else values.float()
    return (decoded * token_scales(rows)).unflatten(-1, (-1, head_dim))


def read_cache(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cached tokens as float32 [..., num_kv_heads, head_dim], whatever the cache's format."""
    return dequantize_rows(cache, head_dim) if cache.dtype in SCALED_DTYPES else cache.float()


def to_cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tokens' heads [..., num_kv_heads, head_dim] as cached tokens of a cache of `dtype`
    (rounded, or quantized with their scales)."""
    return quantize_rows(x, dtype) if dtype in SCALED_DTYPES else x.to(dtype)
