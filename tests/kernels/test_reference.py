"""The reference kernels against plain dense attention and against transformers."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kernels import build_cos_sin_cache
from kernels import reference as ref
from kernels.rotary import rope_inv_freq
from tests.kernels.paged_cases import (
    cu_seqlens,
    make_paged_case,
    naive_decode,
    naive_prefill,
)

ATOL = 1e-5
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= atol, f"{what}: max abs error {error:.3g} exceeds {atol:.3g}"


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "context_lens"),
    [
        (2, 2, 8, 4, [1, 5, 8, 13]),
        (4, 2, 16, 16, [33, 1, 16]),
        (8, 1, 8, 4, [7, 30]),
    ],
)
def test_decode_matches_naive_attention(
    num_heads, num_kv_heads, head_dim, block_size, context_lens
):
    gen = torch.Generator().manual_seed(sum(context_lens))
    case = make_paged_case(gen, context_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = ref.paged_decode_attention(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, naive_decode(q, case, scale), ATOL, "decode vs naive")


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "context_lens", "query_lens"),
    [
        (2, 2, 8, 4, [6, 9, 1], [6, 3, 1]),
        (4, 2, 16, 16, [40, 17], [40, 5]),
        (8, 1, 8, 4, [13, 4, 22], [1, 4, 10]),
    ],
)
def test_prefill_matches_naive_attention(
    num_heads, num_kv_heads, head_dim, block_size, context_lens, query_lens
):
    gen = torch.Generator().manual_seed(sum(query_lens))
    case = make_paged_case(gen, context_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    scale = 0.3
    out = ref.paged_prefill_attention(
        q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        cu_seqlens(query_lens),
        case.context_lens,
        scale,
    )
    assert out.shape == q.shape
    assert_close(out, naive_prefill(q, case, query_lens, scale), ATOL, "prefill vs naive")


def test_prefill_of_one_token_equals_decode():
    gen = torch.Generator().manual_seed(3)
    context_lens = [5, 12, 1]
    case = make_paged_case(gen, context_lens, 4, 2, 8)
    q = torch.randn(3, 4, 8, generator=gen)
    args = (case.k_cache, case.v_cache, case.block_tables)
    decode = ref.paged_decode_attention(q, *args, case.context_lens, 0.5)
    prefill = ref.paged_prefill_attention(q, *args, cu_seqlens([1, 1, 1]), case.context_lens, 0.5)
    assert_close(prefill, decode, ATOL, "one-token prefill vs decode")


def test_prefill_rejects_more_queries_than_context():
    gen = torch.Generator().manual_seed(4)
    case = make_paged_case(gen, [3], 4, 1, 8)
    q = torch.randn(5, 1, 8)
    with pytest.raises(ValueError, match="sequence 0 has 5 queries but context_lens"):
        ref.paged_prefill_attention(
            q, case.k_cache, case.v_cache, case.block_tables, cu_seqlens([5]), case.context_lens, 1
        )


def test_store_kvcache_writes_slots_and_skips_minus_one():
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key = torch.randn(5, 2, 8, generator=gen)
    value = torch.randn(5, 2, 8, generator=gen)
    slot_mapping = torch.tensor([13, -1, 0, 6, -1])
    ref.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    expected_k = torch.zeros(16, 2, 8)
    expected_v = torch.zeros(16, 2, 8)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot] = key[token]
            expected_v[slot] = value[token]
    assert torch.equal(k_cache.view(16, 2, 8), expected_k), "key cache differs from slot mapping"
    assert torch.equal(v_cache.view(16, 2, 8), expected_v), "value cache differs from slot mapping"


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(with_residual, dtype):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    residual = torch.randn(5, 32, generator=gen).to(dtype) if with_residual else None
    hf_norm = LlamaRMSNorm(32, eps=1e-6).to(dtype)
    hf_norm.weight.data = torch.randn(32, generator=gen).to(dtype)
    summed = x if residual is None else x + residual
    out, out_residual = ref.rms_norm(x, hf_norm.weight.data, 1e-6, residual)
    assert out.dtype == dtype and out_residual.dtype == dtype
    assert torch.equal(out_residual, summed), "residual output is not x + residual"
    with torch.no_grad():
        assert torch.equal(out, hf_norm(summed)), "rms_norm differs from LlamaRMSNorm"


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rotary_matches_transformers(rope_scaling):
    head_dim, max_position = 16, 256
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
    )
    hf_rotary = LlamaRotaryEmbedding(config)
    inv_freq = rope_inv_freq(head_dim, 500000.0, rope_scaling)
    assert torch.equal(inv_freq, hf_rotary.inv_freq), "inverse frequencies differ"

    gen = torch.Generator().manual_seed(7)
    positions = torch.tensor([0, 1, 63, 64, 200, 255])
    q = torch.randn(6, 4, head_dim, generator=gen)
    k = torch.randn(6, 2, head_dim, generator=gen)
    cache = build_cos_sin_cache(head_dim, max_position, 500000.0, rope_scaling, "cpu")
    q_out, k_out = ref.rotary_embedding(positions, q, k, cache)

    cos, sin = hf_rotary(q, positions[None, :])
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin, unsqueeze_dim=1
    )
    assert_close(q_out, hf_q[0].transpose(0, 1), 1e-6, "rotated q vs transformers")
    assert_close(k_out, hf_k[0].transpose(0, 1), 1e-6, "rotated k vs transformers")


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="'yarn' is not supported; supported: default, llama3"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_llama3_scaling_without_its_keys_is_named():
    with pytest.raises(ValueError, match="lacks low_freq_factor"):
        rope_inv_freq(16, 10000.0, {"rope_type": "llama3", "factor": 8.0})


def test_bad_arguments_raise_clear_errors():
    gen = torch.Generator().manual_seed(8)
    case = make_paged_case(gen, [3, 5], 4, 2, 8)
    q = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="block_tables must have dtype torch.int32"):
        ref.paged_decode_attention(
            q, case.k_cache, case.v_cache, case.block_tables.long(), case.context_lens, 1.0
        )
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple"):
        ref.paged_decode_attention(
            torch.randn(2, 3, 8),
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.context_lens,
            1,
        )
    with pytest.raises(ValueError, match="head_dim"):
        ref.paged_decode_attention(
            torch.randn(2, 4, 16),
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.context_lens,
            1,
        )
    with pytest.raises(ValueError, match="slot_mapping must have dtype torch.int64"):
        ref.store_kvcache(
            torch.randn(2, 2, 8),
            torch.randn(2, 2, 8),
            case.k_cache,
            case.v_cache,
            torch.tensor([0, 1], dtype=torch.int32),
        )
