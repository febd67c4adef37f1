"""Every Triton kernel against its reference twin, in the Triton interpreter, float32.

Tolerances: attention, RMSNorm and rotary outputs within 1e-5 absolute (both sides compute in
float32, reductions in a different order); the KV store and the residual sum exactly.
"""

import itertools

import pytest
import torch

from kernels import build_cos_sin_cache, triton_attention, triton_cache, triton_norm
from kernels import reference as ref
from tests.kernels.paged_cases import (
    cu_seqlens,
    make_paged_case,
    mixed_prefill_case,
    random_context_lens,
    strided_prefill_case,
)

ATTENTION_ATOL = 1e-5
ELEMENTWISE_ATOL = 1e-5
HEAD_DIMS = (8, 64, 128)
BLOCK_SIZES = (4, 16)
HEAD_RATIOS = (1, 2, 8)
NUM_KV_HEADS = 2
SHAPES = list(itertools.product(HEAD_DIMS, BLOCK_SIZES, HEAD_RATIOS))
SHAPE_IDS = [f"d{d}-bs{bs}-gqa{ratio}" for d, bs, ratio in SHAPES]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= atol, f"{what}: max abs error {error:.3g} exceeds {atol:.3g}"


@pytest.mark.parametrize("partition_size", [16, 512])
@pytest.mark.parametrize(("head_dim", "block_size", "ratio"), SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(head_dim, block_size, ratio, partition_size):
    gen = torch.Generator().manual_seed(head_dim * 100 + block_size * 10 + ratio)
    context_lens = random_context_lens(gen, block_size)
    case = make_paged_case(gen, context_lens, block_size, NUM_KV_HEADS, head_dim)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * ratio, head_dim, generator=gen)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5)
    out = triton_attention.paged_decode_attention(*args, partition_size=partition_size)
    assert_close(out, ref.paged_decode_attention(*args), ATTENTION_ATOL, "decode vs reference")


@pytest.mark.parametrize(("head_dim", "block_size", "ratio"), SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_reference(head_dim, block_size, ratio):
    case, q, query_lens = mixed_prefill_case(head_dim, block_size, NUM_KV_HEADS, ratio)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu_seqlens(query_lens))
    out = triton_attention.paged_prefill_attention(*args, case.context_lens, 0.25)
    expected = ref.paged_prefill_attention(*args, case.context_lens, 0.25)
    assert_close(out, expected, ATTENTION_ATOL, "prefill vs reference")


def test_prefill_reads_strided_queries():
    case, q, cu = strided_prefill_case()
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens)
    out = triton_attention.paged_prefill_attention(*args, 0.5)
    assert_close(out, ref.paged_prefill_attention(*args, 0.5), ATTENTION_ATOL, "strided q")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_store_kvcache_matches_reference(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_tokens = 5, 4, 9
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    fused = torch.randn(num_tokens, 2, NUM_KV_HEADS, head_dim, generator=gen)
    key, value = fused[:, 0], fused[:, 1]
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[1, 4]] = -1
    triton_cache.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    ref.store_kvcache(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(k_cache, expected_k), "key cache differs from the reference store"
    assert torch.equal(v_cache, expected_v), "value cache differs from the reference store"


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [8, 100, 256])
def test_rms_norm_matches_reference(hidden, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(6, 2 * hidden, generator=gen)[:, :hidden]
    weight = torch.randn(hidden, generator=gen)
    residual = torch.randn(6, hidden, generator=gen) if with_residual else None
    out, summed = triton_norm.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_summed = ref.rms_norm(x, weight, 1e-5, residual)
    assert_close(out, expected_out, ELEMENTWISE_ATOL, "normalized output")
    assert_close(summed, expected_summed, 0.0, "residual sum")


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("ratio", HEAD_RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rotary_matches_reference(head_dim, ratio, rope_scaling):
    gen = torch.Generator().manual_seed(head_dim + ratio)
    num_tokens, num_heads = 5, NUM_KV_HEADS * ratio
    cache = build_cos_sin_cache(head_dim, 128, 10000.0, rope_scaling)
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + NUM_KV_HEADS) * head_dim]
    k = k.view(num_tokens, NUM_KV_HEADS, head_dim)
    positions = torch.tensor([0, 1, 31, 77, 127])
    q_out, k_out = triton_norm.rotary_embedding(positions, q, k, cache)
    q_expected, k_expected = ref.rotary_embedding(positions, q, k, cache)
    assert_close(q_out, q_expected, ELEMENTWISE_ATOL, "rotated q")
    assert_close(k_out, k_expected, ELEMENTWISE_ATOL, "rotated k")


def test_wrappers_reject_bad_layouts_before_launch():
    gen = torch.Generator().manual_seed(12)
    case = make_paged_case(gen, [5, 9], 4, 2, 8)
    q = torch.randn(2, 4, 8, generator=gen)
    args = (case.k_cache, case.v_cache, case.block_tables, case.context_lens, 1.0)
    with pytest.raises(ValueError, match="q needs its last 1 dims contiguous"):
        triton_attention.paged_decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), *args
        )
    with pytest.raises(ValueError, match="partition_size must be a power of two"):
        triton_attention.paged_decode_attention(q, *args, partition_size=24)
    big = make_paged_case(gen, [3], 4, 1, 512)
    with pytest.raises(ValueError, match="head_dim must be at most 256"):
        triton_attention.paged_decode_attention(
            torch.randn(1, 1, 512), big.k_cache, big.v_cache, big.block_tables, big.context_lens, 1
        )
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        triton_attention.paged_decode_attention(
            q, case.k_cache.transpose(0, 1), case.v_cache.transpose(0, 1), *args[2:]
        )
