"""Random paged KV caches and a plain dense attention to hold the kernels against."""

import itertools
import math
from dataclasses import dataclass

import torch

UNUSED_SLOT_VALUE = 1000.0


@dataclass
class PagedCase:
    """A paged cache holding `context_lens[b]` tokens of each sequence b."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    def to(self, device: torch.device | str) -> "PagedCase":
        """The same case with every tensor on `device`."""
        tensors = (self.k_cache, self.v_cache, self.block_tables, self.context_lens)
        return PagedCase(*(t.to(device) for t in tensors))


def make_paged_case(
    gen: torch.Generator,
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> PagedCase:
    """Random cache with blocks shuffled; unused slots hold a large value to expose leaks.

    Block-table entries past a sequence's blocks are -1 for even sequences, 0 for odd ones.
    """
    blocks_needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, UNUSED_SLOT_VALUE)
    v_cache = torch.full(shape, UNUSED_SLOT_VALUE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.empty(len(context_lens), max(blocks_needed) + 1, dtype=torch.int32)
    for seq, (context_len, needed) in enumerate(zip(context_lens, blocks_needed, strict=True)):
        block_tables[seq] = -1 if seq % 2 == 0 else 0
        for index in range(needed):
            block = order.pop()
            block_tables[seq, index] = block
            used = min(block_size, context_len - index * block_size)
            kv_shape = (used, num_kv_heads, head_dim)
            k_cache[block, :used] = torch.randn(kv_shape, generator=gen)
            v_cache[block, :used] = torch.randn(kv_shape, generator=gen)
    return PagedCase(
        k_cache.to(dtype),
        v_cache.to(dtype),
        block_tables,
        torch.tensor(context_lens, dtype=torch.int32),
    )


def dense_kv(case: PagedCase, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `seq`'s keys and values token by token through its block table, float64."""
    block_size = case.k_cache.shape[1]
    keys, values = [], []
    for position in range(int(case.context_lens[seq])):
        block = int(case.block_tables[seq, position // block_size])
        keys.append(case.k_cache[block, position % block_size])
        values.append(case.v_cache[block, position % block_size])
    return torch.stack(keys).double(), torch.stack(values).double()


def naive_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention written out per query and head, float64.

    Args:
        q: [L, Hq, D]; row i sits at query_positions[i] and sees keys 0..that position.
        keys: [T, Hkv, D].
        values: [T, Hkv, D].
        query_positions: position of each query row.
        scale: multiplier of q.k.

    Returns:
        [L, Hq, D] float64.
    """
    num_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, position in enumerate(query_positions):
        for head in range(num_heads):
            seen_keys = keys[: position + 1, head // group]
            seen_values = values[: position + 1, head // group]
            probs = torch.softmax(seen_keys @ q[row, head].double() * scale, dim=0)
            out[row, head] = probs @ seen_values
    return out


def naive_decode(q: torch.Tensor, case: PagedCase, scale: float) -> torch.Tensor:
    """Decode attention by naive_attention, one sequence at a time: [B, Hq, D] float64."""
    outs = []
    for seq in range(q.shape[0]):
        keys, values = dense_kv(case, seq)
        last = int(case.context_lens[seq]) - 1
        outs.append(naive_attention(q[seq : seq + 1], keys, values, [last], scale))
    return torch.cat(outs)


def naive_prefill(
    q: torch.Tensor, case: PagedCase, query_lens: list[int], scale: float
) -> torch.Tensor:
    """Prefill attention by naive_attention, one sequence at a time: [N, Hq, D] float64."""
    outs, start = [], 0
    for seq, query_len in enumerate(query_lens):
        keys, values = dense_kv(case, seq)
        context_len = int(case.context_lens[seq])
        positions = list(range(context_len - query_len, context_len))
        outs.append(naive_attention(q[start : start + query_len], keys, values, positions, scale))
        start += query_len
    return torch.cat(outs)


def cu_seqlens(query_lens: list[int]) -> torch.Tensor:
    """[B + 1] int32 cumulative sums of query_lens, starting at 0."""
    return torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)


def random_context_lens(gen: torch.Generator, block_size: int) -> list[int]:
    """A batch mixing a 1-token context, block-boundary neighbours and a long sequence."""
    long = int(torch.randint(60, 100, (1,), generator=gen))
    return [1, block_size - 1, 3 * block_size + 1, long]


def mixed_prefill_case(
    head_dim: int, block_size: int, num_kv_heads: int, ratio: int
) -> tuple[PagedCase, torch.Tensor, list[int]]:
    """(case, q, query lengths) of a prefill batch with a 1-token context, a 1-token chunk, a
    fresh prompt, a chunk over 64 queries after a cached prefix and a sequence with no new
    tokens; seeded by the shape."""
    gen = torch.Generator().manual_seed(head_dim * 100 + block_size * 10 + ratio + 1)
    context_lens = [*random_context_lens(gen, block_size), 7]
    query_lens = [1, 1, context_lens[2], context_lens[3] - 3, 0]
    case = make_paged_case(gen, context_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(sum(query_lens), num_kv_heads * ratio, head_dim, generator=gen)
    return case, q, query_lens


def strided_prefill_case() -> tuple[PagedCase, torch.Tensor, torch.Tensor]:
    """(case, q, cu_seqlens) of two sequences prefilled from scratch whose queries are a slice
    of a fused q/k/v projection (tokens further apart than their heads)."""
    gen = torch.Generator().manual_seed(11)
    case = make_paged_case(gen, [9, 20], 4, 1, 8)
    qkv = torch.randn(29, 4 * 8 + 2 * 8, generator=gen)
    return case, qkv[:, : 4 * 8].view(29, 4, 8), cu_seqlens([9, 20])


def in_cache_format(case: PagedCase, dtype: torch.dtype) -> PagedCase:
    """The same case with its caches converted to `dtype` (int8: quantized rows with scales)."""
    from kernels.kv_format import to_cache_rows

    return PagedCase(
        to_cache_rows(case.k_cache, dtype),
        to_cache_rows(case.v_cache, dtype),
        case.block_tables,
        case.context_lens,
    )
