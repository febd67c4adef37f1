"""CPU paged attention in C (kernels/csrc/cpu_attention.c): decode and prefill kernels, and one
layer's whole attention step (rotary, KV store, attention) in one call.

The reference attention gathers every sequence's blocks into a (padded) copy each layer of
each step; on a CPU that copy and the masked attention over it cost more than the model's
matmuls at long contexts. The C code walks the block table instead. `attention` runs a layer's
rotary embedding, KV-cache store and attention in one parallel region; the step's positions,
slots and tables are checked once per step by `prepare_attention`, not once per layer.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass

import torch

from kernels.attention_step import AttentionStep
from kernels.cpu import check_cpu, token_stride
from kernels.cpu_build import CACHE_DTYPE_CODES, DTYPE_CODES, AttentionStepStruct, library
from kernels.kv_format import cache_kv_heads, cache_token_shape
from kernels.validation import check_decode, check_kv_caches, check_prefill


def check_tables(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    sequences: torch.Tensor | None = None,
) -> None:
    """Raise a ValueError naming the first sequence (of `sequences`, default all) whose
    context or block ids the C attention would read out of range."""
    tables, lens = block_tables, context_lens
    if sequences is not None and len(sequences) < len(context_lens):
        tables, lens = block_tables[sequences].contiguous(), context_lens[sequences].contiguous()
    num_seqs, max_blocks = tables.shape
    bad = library().kvgate_first_invalid_sequence(
        tables.data_ptr(), lens.data_ptr(), num_seqs, max_blocks, block_size, num_blocks
    )
    if bad >= 0:
        seq = int(sequences[bad]) if tables is not block_tables else bad
        raise ValueError(_bad_sequence(seq, block_tables, context_lens, num_blocks, block_size))


def _bad_sequence(
    seq: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
) -> str:
    """What is wrong with sequence `seq`, which the C check found invalid."""
    context_len = int(context_lens[seq])
    if context_len < 1:
        return f"context_lens[{seq}] = {context_len}: every sequence needs at least one token"
    needed = -(-context_len // block_size)
    if needed > block_tables.shape[1]:
        return (
            f"context_lens[{seq}] = {context_len} needs {needed} blocks of {block_size}, but "
            f"block_tables has {block_tables.shape[1]} columns"
        )
    row = block_tables[seq, :needed].tolist()
    column = next(i for i, block in enumerate(row) if not 0 <= block < num_blocks)
    return (
        f"block_tables[{seq}, {column}] = {row[column]} is not a block of the cache "
        f"[0, {num_blocks}); sequence {seq} uses its first {needed} columns"
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU twin of kernels.reference.paged_decode_attention (same arguments and result).

    Also requires float32 or bfloat16 contiguous CPU tensors (the caches may be float16 or
    int8), and checks every block-table entry a sequence's context uses (the C code trusts them).
    """
    check_decode(q, k_cache, v_cache, block_tables, context_lens)
    check_cpu(
        {"q": q, "k_cache": k_cache, "v_cache": v_cache,
         "block_tables": block_tables, "context_lens": context_lens},
        floats=("q", "k_cache", "v_cache"),
        inner_dims={},
    )  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    num_kv_heads = cache_kv_heads(k_cache, head_dim)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    check_tables(block_tables, context_lens, num_blocks, block_size)
    failed = library().kvgate_paged_decode_attention(
        q.data_ptr(), DTYPE_CODES[q.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
        CACHE_DTYPE_CODES[k_cache.dtype], block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        block_tables.shape[1], scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged decode attention could not allocate its score buffer")
    return out


def check_query_offsets(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, n: int) -> None:
    """Raise unless cu_seqlens_q runs from 0 to n without going down, and no sequence has more
    queries than context (the C code trusts both)."""
    starts = cu_seqlens_q.tolist()
    if starts[0] != 0 or starts[-1] != n or any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"cu_seqlens_q must rise from 0 to the {n} packed queries, got {starts}")
    for seq, context_len in enumerate(context_lens.tolist()):
        if starts[seq + 1] - starts[seq] > context_len:
            raise ValueError(
                f"sequence {seq} has {starts[seq + 1] - starts[seq]} queries but "
                f"context_lens[{seq}] is {context_len}; the cache must already hold every "
                "query's key"
            )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU twin of kernels.reference.paged_prefill_attention (same arguments and result).

    Each query token attends through the block table in place, as in decode, where the
    reference gathers a copy of every sequence's cache. q's tokens may lie any distance apart
    (heads and head_dim contiguous); every block-table entry a context uses is checked.
    """
    check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    check_cpu(
        {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
         "cu_seqlens_q": cu_seqlens_q, "context_lens": context_lens},
        floats=("q", "k_cache", "v_cache"),
        inner_dims={"q": 2},
    )  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    num_kv_heads = cache_kv_heads(k_cache, head_dim)
    check_query_offsets(cu_seqlens_q, context_lens, num_tokens)
    out = torch.empty(q.shape, dtype=q.dtype)
    if num_tokens == 0:
        return out
    # Sequences without new tokens are not read (the reference skips them too).
    querying = (cu_seqlens_q[1:] > cu_seqlens_q[:-1]).nonzero().flatten()
    check_tables(block_tables, context_lens, num_blocks, block_size, querying)
    failed = library().kvgate_paged_prefill_attention(
        q.data_ptr(), DTYPE_CODES[q.dtype], token_stride(q), k_cache.data_ptr(),
        v_cache.data_ptr(), CACHE_DTYPE_CODES[k_cache.dtype], block_tables.data_ptr(),
        cu_seqlens_q.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
        context_lens.shape[0], num_heads, num_kv_heads, head_dim, block_size,
        block_tables.shape[1], scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged prefill attention could not allocate its score buffer")
    return out


@dataclass(slots=True)
class PreparedStep:
    """What the C attention reads in every layer of one step, checked once."""

    struct: AttentionStepStruct
    cache_shape: tuple[int, ...]
    cache_dtype: torch.dtype


def prepare_attention(step: AttentionStep, k_cache: torch.Tensor) -> AttentionStep:
    """Check a step's positions, slots, offsets and tables against the cache once, and attach
    the C form of the step (`step.prepared`) that `attention` reads in every layer.

    Raises:
        ValueError: an index the C code would read or write out of range (the message names
            the tensor and entry).
    """
    check_kv_caches(k_cache, k_cache)
    num_blocks, block_size = k_cache.shape[:2]
    token = cache_token_shape(step.num_kv_heads, step.head_dim, k_cache.dtype)
    if tuple(k_cache.shape[2:]) != token:
        raise ValueError(f"the cache's tokens {tuple(k_cache.shape[2:])} are not the step's "
                         f"{token} ({step.num_kv_heads} KV heads of {step.head_dim})")  # fmt: skip
    _check_step_indices(step, num_blocks * block_size)
    prefill_tokens = step.num_tokens - step.num_decode_tokens
    check_query_offsets(step.prefill_cu_seqlens_q, step.prefill_context_lens, prefill_tokens)
    decode_lens = step.decode_context_lens
    if decode_lens.shape[0] != step.num_decode_tokens:
        raise ValueError(f"decode_context_lens has {decode_lens.shape[0]} entries for "
                         f"{step.num_decode_tokens} decode tokens")  # fmt: skip
    check_tables(step.decode_block_tables, decode_lens, num_blocks, block_size)
    cu = step.prefill_cu_seqlens_q
    querying = (cu[1:] > cu[:-1]).nonzero().flatten()
    check_tables(step.prefill_block_tables, step.prefill_context_lens, num_blocks, block_size,
                 querying)  # fmt: skip
    step.prepared = PreparedStep(_step_struct(step, block_size), tuple(k_cache.shape),
                                 k_cache.dtype)  # fmt: skip
    return step


def _check_step_indices(step: AttentionStep, num_slots: int) -> None:
    tensors = {
        "positions": step.positions, "slot_mapping": step.slot_mapping,
        "decode_block_tables": step.decode_block_tables,
        "decode_context_lens": step.decode_context_lens,
        "prefill_block_tables": step.prefill_block_tables,
        "prefill_cu_seqlens_q": step.prefill_cu_seqlens_q,
        "prefill_context_lens": step.prefill_context_lens,
        "cos_sin_cache": step.cos_sin_cache,
    }  # fmt: skip
    check_cpu(tensors, floats=(), inner_dims={})
    if step.cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32, got {step.cos_sin_cache.dtype}")
    lib, n = library(), step.num_tokens
    if step.slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must be [{n}], got {tuple(step.slot_mapping.shape)}")
    checks = (
        ("positions", step.positions, 0, step.cos_sin_cache.shape[0]),
        ("slot_mapping", step.slot_mapping, -1, num_slots),
    )
    for name, values, low, high in checks:
        bad = lib.kvgate_first_out_of_range(values.data_ptr(), n, low, high)
        if bad >= 0:
            raise ValueError(f"{name}[{bad}] = {int(values[bad])} is outside [{low}, {high})")


def _step_struct(step: AttentionStep, block_size: int) -> AttentionStepStruct:
    return AttentionStepStruct(
        positions=step.positions.data_ptr(),
        cos_sin=step.cos_sin_cache.data_ptr(),
        slot_mapping=step.slot_mapping.data_ptr(),
        decode_tables=step.decode_block_tables.data_ptr(),
        decode_lens=step.decode_context_lens.data_ptr(),
        prefill_tables=step.prefill_block_tables.data_ptr(),
        cu_seqlens=step.prefill_cu_seqlens_q.data_ptr(),
        prefill_lens=step.prefill_context_lens.data_ptr(),
        num_tokens=step.num_tokens,
        num_decode=step.num_decode_tokens,
        decode_width=step.decode_block_tables.shape[1],
        num_prefill_seqs=step.num_prefill_seqs,
        prefill_width=step.prefill_block_tables.shape[1],
        num_heads=step.num_heads,
        num_kv_heads=step.num_kv_heads,
        head_dim=step.head_dim,
        block_size=block_size,
        scale=step.scale,
        num_threads=torch.get_num_threads(),
    )


def attention(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: AttentionStep
) -> torch.Tensor:
    """The CPU twin of kernels.reference.attention, for a step made by `prepare_attention`.

    qkv may be row- or column-major (any 2-D strides); the caches must have the shape and dtype
    the step was prepared with.
    """
    prepared = step.prepared
    if not isinstance(prepared, PreparedStep):
        raise ValueError("step was not prepared by kernels.cpu_attention.prepare_attention")
    if qkv.dim() != 2 or qkv.shape != (step.num_tokens, step.qkv_width):
        raise ValueError(f"qkv must be [{step.num_tokens}, {step.qkv_width}], got "
                         f"{tuple(qkv.shape)}")  # fmt: skip
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(cache.shape) != prepared.cache_shape or cache.dtype != prepared.cache_dtype:
            raise ValueError(f"{name} must be {prepared.cache_dtype} {prepared.cache_shape} as "
                             f"prepared, got {cache.dtype} {tuple(cache.shape)}")  # fmt: skip
        if not cache.is_contiguous() or cache.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    if qkv.dtype not in DTYPE_CODES or qkv.device.type != "cpu":
        raise ValueError(f"qkv must be a float32 or bfloat16 CPU tensor, got {qkv.dtype}")
    width = step.num_heads * step.head_dim
    out = torch.empty(step.num_tokens, width, dtype=qkv.dtype)
    q_rotated = torch.empty(step.num_tokens, width, dtype=torch.float32)
    failed = library().kvgate_attention_layer(
        ctypes.byref(prepared.struct), qkv.data_ptr(), DTYPE_CODES[qkv.dtype], qkv.stride(0),
        qkv.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPE_CODES[k_cache.dtype],
        out.data_ptr(), q_rotated.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("attention could not allocate its score buffer")
    return out
