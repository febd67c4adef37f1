"""Triton paged attention: flash-decoding for one query per sequence, and varlen causal prefill.

Both read keys and values through the block table a tile of tokens at a time and keep an
online softmax in float32. The cache may have another dtype than the queries: cached values are
converted to the queries' dtype as they are read, and int8 or fp8 values are scaled back first
(kernels/kv_format.py; fp8 bytes decoded by kernels/triton_fp8.py).
"""

import math

import torch
import triton
import triton.language as tl

from kernels.kv_format import SCALED_DTYPES, cache_kv_heads, cache_token_shape
from kernels.triton_cache import scale_view
from kernels.triton_fp8 import fp8_e4m3_decode
from kernels.validation import (
    check_decode,
    check_prefill,
    expect_inner_contiguous,
    expect_triton_device,
)

MAX_HEAD_DIM = 256
DECODE_PARTITION_SIZE = 512
PREFILL_BLOCK_M = 64
MIN_DOT_SIZE = 16


@triton.jit
def _kv_rows(
    block_table_ptr,
    tokens,
    token_mask,
    BLOCK_SIZE: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
):
    """Element offsets of `tokens`' cached tokens (ROW_WIDTH elements each: every kv head, and
    an int8 or fp8 token's scale) in a contiguous paged cache."""
    blocks = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0)
    slots = blocks.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
    return slots * ROW_WIDTH


@triton.jit
def _load_kv(cache_ptr, scale_ptr, rows, head_offset, dims, kv_mask, dtype,
             SCALE_AT: tl.constexpr, QUANTIZED: tl.constexpr):  # fmt: skip
    """One kv head's values (head_offset elements into each token) of a tile of cached tokens
    as `dtype`; int8 and fp8 (uint8) values times their token's bfloat16 scale (SCALE_AT bytes
    into the token, read as int16 bits through scale_ptr)."""
    x = tl.load(cache_ptr + rows[:, None] + head_offset + dims[None, :], mask=kv_mask, other=0)
    if QUANTIZED:
        bits = tl.load(scale_ptr + (rows + SCALE_AT) // 2).to(tl.int32) & 0xFFFF
        scales = (bits << 16).to(tl.float32, bitcast=True)
        if cache_ptr.dtype.element_ty == tl.uint8:
            x = fp8_e4m3_decode(x) * scales[:, None]
        else:
            x = x.to(tl.float32) * scales[:, None]
    return x.to(dtype)


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, rows, head_offset, dims,
                 kv_mask, visible, scale, running_max, running_sum, acc,
                 DOT_PRECISION: tl.constexpr, SCALE_AT: tl.constexpr,
                 QUANTIZED: tl.constexpr):  # fmt: skip
    """One online-softmax step over a tile of cached K/V; `visible` masks scores per query."""
    k = _load_kv(k_cache_ptr, k_scale_ptr, rows, head_offset, dims, kv_mask, q.dtype, SCALE_AT,
                 QUANTIZED)  # fmt: skip
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp(running_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    v = _load_kv(v_cache_ptr, v_scale_ptr, rows, head_offset, dims, kv_mask, q.dtype, SCALE_AT,
                 QUANTIZED)  # fmt: skip
    pv = tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc * rescale[:, None] + pv


@triton.jit
def _attend_range(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table, start, end,
                  positions, head_offset, dims, dim_mask, scale, BLOCK_Q: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  ROW_WIDTH: tl.constexpr, SCALE_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  QUANTIZED: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """Online-softmax attention of q's BLOCK_Q rows over cached tokens start .. end - 1 of one
    sequence (`block_table`), BLOCK_N at a time (a quantized token's scale SCALE_AT bytes into
    it); with CAUSAL, row i sees tokens up to positions[i]. Returns the running max, the running
    sum and the unnormalized output."""
    running_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        rows = _kv_rows(block_table, tokens, token_mask, BLOCK_SIZE, ROW_WIDTH)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        visible = token_mask[None, :]
        if CAUSAL:
            visible = visible & (tokens[None, :] <= positions[:, None])
        running_max, running_sum, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, rows, head_offset, dims,
            kv_mask, visible, scale, running_max, running_sum, acc, DOT_PRECISION, SCALE_AT,
            QUANTIZED,
        )  # fmt: skip
    return running_max, running_sum, acc


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale,
    q_stride_seq,
    q_stride_head,
    block_tables_stride,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    MAX_PARTITIONS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = partition * PARTITION_SIZE
    if start >= context_len:
        return
    end = tl.minimum(start + PARTITION_SIZE, context_len)
    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + groups
    head_mask = groups < GROUP
    dim_mask = dims < HEAD_DIM
    q_offsets = seq.to(tl.int64) * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    running_max, running_sum, acc = _attend_range(
        q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_tables_ptr + seq.to(tl.int64) * block_tables_stride, start, end, groups,
        kv_head * HEAD_DIM, dims, dim_mask, scale, BLOCK_G, BLOCK_N, BLOCK_D, BLOCK_SIZE,
        ROW_WIDTH, NUM_KV_HEADS * HEAD_DIM, DOT_PRECISION, QUANTIZED, False,
    )  # fmt: skip
    part_index = (seq.to(tl.int64) * (GROUP * NUM_KV_HEADS) + heads) * MAX_PARTITIONS + partition
    out_offsets = part_index[:, None] * HEAD_DIM + dims[None, :]
    out_mask = head_mask[:, None] & dim_mask[None, :]
    tl.store(part_out_ptr + out_offsets, acc / running_sum[:, None], mask=out_mask)
    tl.store(part_max_ptr + part_index, running_max, mask=head_mask)
    tl.store(part_sum_ptr + part_index, running_sum, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    context_lens_ptr,
    out_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    MAX_PARTITIONS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    parts = tl.arange(0, BLOCK_P)
    part_mask = parts < tl.cdiv(context_len, PARTITION_SIZE)
    base = (seq.to(tl.int64) * NUM_HEADS + head) * MAX_PARTITIONS
    maxes = tl.load(part_max_ptr + base + parts, mask=part_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + parts, mask=part_mask, other=0.0)
    weights = tl.where(part_mask, tl.exp(maxes - tl.max(maxes, axis=0)) * sums, 0.0)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    out_offsets = (base + parts)[:, None] * HEAD_DIM + dims[None, :]
    outs = tl.load(
        part_out_ptr + out_offsets, mask=part_mask[:, None] & dim_mask[None, :], other=0.0
    )
    out = tl.sum(outs * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    out_index = (seq.to(tl.int64) * NUM_HEADS + head) * HEAD_DIM + dims
    tl.store(out_ptr + out_index, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _dot_precision(dtype: torch.dtype) -> str | None:
    """Exact float32 products for float32 inputs (TF32 would lose precision); default otherwise."""
    return "ieee" if dtype == torch.float32 else None


def _cache_format(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> dict[str, object]:
    """The kernels' constants for the cache's format: the elements of one cached token and
    whether its tokens carry a scale (int8, fp8)."""
    return {
        "ROW_WIDTH": math.prod(cache_token_shape(num_kv_heads, head_dim, cache.dtype)),
        "QUANTIZED": cache.dtype in SCALED_DTYPES,
    }


def _kv_tile_size(head_dim: int) -> int:
    return 32 if head_dim > 128 else 64


def _num_warps(head_dim: int) -> int:
    """More warps for wide heads keep the float32 accumulator tile in registers."""
    return 8 if head_dim > 128 else 4


def _check_triton_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    int_tensors: dict[str, torch.Tensor],
) -> None:
    """Layout checks the Triton attention kernels need beyond the shared argument checks."""
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {q.shape[2]}")
    expect_triton_device("q", q)
    expect_inner_contiguous("q", q, 1)
    expect_inner_contiguous("block_tables", block_tables, 1)
    for name, tensor in int_tensors.items():
        expect_inner_contiguous(name, tensor, 1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    partition_size: int = DECODE_PARTITION_SIZE,
) -> torch.Tensor:
    """Flash-decoding attention of one query per sequence over its cached tokens.

    Each (sequence, kv head, partition of `partition_size` tokens) runs as one program over
    all query heads of the group; a second kernel merges the partitions. The number of
    partitions comes from block_tables.shape[1], so the host never waits for the device.

    Args:
        q: [B, Hq, D] query at position context_lens[b] - 1; the last dim contiguous.
        k_cache: [num_blocks, block_size, Hkv, D] contiguous, of any cache dtype (int8, fp8:
            [num_blocks, block_size, Hkv * D + 2], kernels/kv_format.py); Hq a multiple of
            Hkv; D <= 256.
        v_cache: [num_blocks, block_size, Hkv, D] contiguous.
        block_tables: [B, max_blocks] int32, rows contiguous; entries past a sequence's
            blocks are never read.
        context_lens: [B] int32 tokens in the cache per sequence, this one included (>= 1).
        scale: multiplier of q.k before the softmax.
        partition_size: tokens per partition, a power of two >= 16.

    Returns:
        [B, Hq, D] contiguous attention output in q.dtype.
    """
    check_decode(q, k_cache, v_cache, block_tables, context_lens)
    _check_triton_attention(q, k_cache, block_tables, {"context_lens": context_lens})
    if partition_size < MIN_DOT_SIZE or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    block_size = k_cache.shape[1]
    max_partitions = triton.cdiv(block_tables.shape[1] * block_size, partition_size)
    if num_seqs == 0 or max_partitions == 0:
        return out
    part_out, part_max, part_sum = _decode_partitions(
        q, k_cache, v_cache, block_tables, context_lens, scale, partition_size, max_partitions
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_max,
        part_sum,
        context_lens,
        out,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        PARTITION_SIZE=partition_size,
        MAX_PARTITIONS=max_partitions,
        BLOCK_P=triton.next_power_of_2(max_partitions),
        BLOCK_D=_block_d(head_dim),
    )
    return out


def _block_d(head_dim: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim))


def _decode_partitions(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    partition_size: int,
    max_partitions: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the partition kernel; returns each partition's output, max and sum (float32)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], cache_kv_heads(k_cache, head_dim)
    part_shape = (num_seqs, num_heads, max_partitions)
    part_out = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    _decode_partition_kernel[(num_seqs, num_kv_heads, max_partitions)](
        q,
        k_cache,
        v_cache,
        scale_view(k_cache),
        scale_view(v_cache),
        block_tables,
        context_lens,
        part_out,
        part_max,
        part_sum,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=partition_size,
        MAX_PARTITIONS=max_partitions,
        BLOCK_G=max(MIN_DOT_SIZE, triton.next_power_of_2(group)),
        BLOCK_D=_block_d(head_dim),
        BLOCK_N=min(partition_size, _kv_tile_size(head_dim)),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=_num_warps(head_dim),
        **_cache_format(k_cache, num_kv_heads, head_dim),
    )
    return part_out, part_max, part_sum


@triton.jit
def _find_sequence(cu_seqlens_ptr, q_block, num_seqs, BLOCK_M: tl.constexpr):
    """The sequence owning global query block `q_block`.

    Sequence b's query blocks are numbered from cu_seqlens[b] // BLOCK_M + b on, which leaves
    room for every sequence's partial last block without knowing the lengths on the host.
    """
    low: tl.int32 = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_block = tl.load(cu_seqlens_ptr + mid) // BLOCK_M + mid
        if first_block <= q_block:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _load_queries(q_ptr, tokens, head, dims, mask, stride_token, stride_head):
    """One head's queries of a block of tokens: [BLOCK_M, BLOCK_D], zero where masked."""
    offsets = tokens[:, None] * stride_token + head * stride_head + dims[None, :]
    return tl.load(q_ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    num_seqs,
    q_stride_token,
    q_stride_head,
    block_tables_stride,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    q_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_ptr, q_block, num_seqs, BLOCK_M)
    q_start = tl.load(cu_seqlens_ptr + seq)
    query_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_M + seq)
    if local_block * BLOCK_M >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    rows = local_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    positions = context_len - query_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    tokens_q = (q_start + rows).to(tl.int64)
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = _load_queries(q_ptr, tokens_q, head, dims, q_mask, q_stride_token, q_stride_head)
    kv_head = head // GROUP
    kv_end = tl.minimum(context_len, context_len - query_len + (local_block + 1) * BLOCK_M)
    running_max, running_sum, acc = _attend_range(
        q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_tables_ptr + seq.to(tl.int64) * block_tables_stride, 0, kv_end, positions,
        kv_head * HEAD_DIM, dims, dim_mask, scale, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_SIZE,
        ROW_WIDTH, NUM_KV_HEADS * HEAD_DIM, DOT_PRECISION, QUANTIZED, True,
    )  # fmt: skip
    out = acc / running_sum[:, None]
    out_offsets = (tokens_q[:, None] * (GROUP * NUM_KV_HEADS) + head) * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


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

    One program per (query block of a sequence, query head); the grid is sized from the
    shapes alone (N // BLOCK_M + B blocks), so the host never waits for the device.

    Args:
        q: [N, Hq, D] queries of B sequences packed, the last dim contiguous; sequence b owns
            q[cu[b]:cu[b+1]] at positions context_lens[b] - qlen_b .. context_lens[b] - 1.
        k_cache: [num_blocks, block_size, Hkv, D] contiguous, already holding every key.
        v_cache: [num_blocks, block_size, Hkv, D] contiguous.
        block_tables: [B, max_blocks] int32, rows contiguous.
        cu_seqlens_q: [B + 1] int32 cumulative query counts, starting at 0.
        context_lens: [B] int32 cached tokens per sequence, the new ones included
            (>= the sequence's query count).
        scale: multiplier of q.k before the softmax.

    Returns:
        [N, Hq, D] contiguous attention output in q.dtype.
    """
    check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    int_tensors = {"cu_seqlens_q": cu_seqlens_q, "context_lens": context_lens}
    _check_triton_attention(q, k_cache, block_tables, int_tensors)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], cache_kv_heads(k_cache, head_dim)
    num_q_blocks = num_tokens // PREFILL_BLOCK_M + num_seqs
    _prefill_kernel[(num_q_blocks, num_heads)](
        q, k_cache, v_cache, scale_view(k_cache), scale_view(v_cache), block_tables,
        cu_seqlens_q, context_lens, out, scale, num_seqs, q.stride(0), q.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=_kv_tile_size(head_dim),
        BLOCK_D=_block_d(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=_num_warps(head_dim),
        **_cache_format(k_cache, num_kv_heads, head_dim),
    )  # fmt: skip
    return out
