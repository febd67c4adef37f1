"""The C attention's register-tiled paths for heads of 64 and 128 values
(kernels/csrc/cpu_attention_tiles.h) against the reference, and the column-major q/k/v that the
attention step copies row-major itself.

The tiled loops take 16 cached tokens a pass and 4 (64 values) or 2 (128) query heads at once
at the AVX-512 level, 8 tokens and one head at the AVX2 level; the cases put contexts on both
sides of those tiles and of the cache blocks, and GQA ratios that fill a head block, leave a
remainder or stay under it. A bfloat16 cache is read in place
(bfloat16 queries through the AVX512-BF16 dot product, float32 ones widened), float16, int8
and fp8 (uint8) rows converted a chunk at a time. Tolerances as in test_cpu_dtypes (`close`);
every format is compared with the reference reading the same cache.
"""

import pytest
import torch

from kernels import cpu_attention
from kernels import reference as ref
from tests.kernels.paged_cases import cu_seqlens, in_cache_format, make_paged_case
from tests.kernels.test_cpu_dtypes import close, layer_case

# Every test here runs once per ISA level this CPU runs (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("isa_level")

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)  # uint8: fp8
# (head_dim, GQA ratio): 64 values take 4 heads at a time (one block, a part block), 128 take
# 2 (a block and a remainder); 48 is the untiled path.
WIDE_SHAPES = [(64, 1), (64, 3), (64, 4), (128, 3), (48, 3)]
CONTEXT_LENS = [1, 15, 16, 17, 33, 70]  # tiles of 16 (AVX-512) or 8 (AVX2) tokens, blocks of 16
QUERY_LENS = [1, 15, 1, 9, 33, 2]


def wide_case(head_dim: int, ratio: int, cache_dtype: torch.dtype, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(head_dim * 10 + ratio)
    case = make_paged_case(gen, CONTEXT_LENS, 16, 2, head_dim)
    q = torch.randn(sum(QUERY_LENS), 2 * ratio, head_dim, generator=gen).to(dtype)
    return in_cache_format(case, cache_dtype), q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda d: f"cache-{str(d)[6:]}")
@pytest.mark.parametrize(("head_dim", "ratio"), WIDE_SHAPES, ids=lambda v: str(v))
def test_tiled_attention_matches_the_reference(head_dim, ratio, cache_dtype, dtype):
    case, q = wide_case(head_dim, ratio, cache_dtype, dtype)
    caches = (case.k_cache, case.v_cache, case.block_tables)
    prefill = (q, *caches, cu_seqlens(QUERY_LENS), case.context_lens, head_dim**-0.5)
    close(cpu_attention.paged_prefill_attention(*prefill),
          ref.paged_prefill_attention(*prefill), "prefill")  # fmt: skip
    decode = (q[: len(CONTEXT_LENS)].contiguous(), *caches, case.context_lens, head_dim**-0.5)
    close(cpu_attention.paged_decode_attention(*decode),
          ref.paged_decode_attention(*decode), "decode")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_column_major_qkv_gives_the_row_major_result_bit_for_bit(dtype):
    # 30 tokens: a tile of 16 and a part tile in the column-major copy.
    query_lens = (1, 1, 6, 13, 9)
    step, qkv, k_cache, v_cache = layer_case(21, dtype, dtype, "column-major", query_lens)
    assert qkv.stride(0) == 1 and qkv.shape[0] == 30
    results = []
    for layout in (qkv, qkv.contiguous()):
        k, v = k_cache.clone(), v_cache.clone()
        cpu_attention.prepare_attention(step, k)
        results.append((cpu_attention.attention(layout, k, v, step), k, v))
    (col, col_k, col_v), (row, row_k, row_v) = results
    assert torch.equal(col_k, row_k) and torch.equal(col_v, row_v), "stored K/V differ"
    assert torch.equal(col, row), "attention output differs between layouts"
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    close(col, ref.attention(qkv, expected_k, expected_v, step), "column-major vs reference")
