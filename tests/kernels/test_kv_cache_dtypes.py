"""KV caches of another format than the model's: 16-bit floats, and int8 or fp8 (uint8 bytes)
tokens with one bfloat16 scale per token for all its KV heads (kernels/kv_format.py), written
and read by the C and Triton kernels and held against their reference twins (Triton in the
interpreter).

Tolerances: the stores equal the reference bit for bit (except the Triton interpreter's
bfloat16 conversion, which truncates where torch rounds to nearest: one unit in the last place
toward zero at most); attention within 1e-5 absolute of the reference reading the same cache.
"""

import pytest
import torch

from kernels import cpu, cpu_attention, triton_attention, triton_cache
from kernels import reference as ref
from kernels.kv_format import (
    cache_token_shape,
    dequantize_rows,
    format_name,
    quantize_rows,
    to_cache_rows,
    token_scales,
)
from tests.kernels.paged_cases import in_cache_format, make_paged_case, mixed_prefill_case
from tests.kernels.test_cpu_dtypes import layer_case
from tests.kernels.test_triton import assert_close

CPU_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8, torch.uint8)
TRITON_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8, torch.uint8)


def store_case(cache_dtype: torch.dtype, activation_dtype: torch.dtype = torch.float32):
    """(key, value, slots, four empty caches) for 9 tokens, two of them skipped."""
    gen = torch.Generator().manual_seed(11)
    key, value = (3 * torch.randn(9, 2, 16, generator=gen).to(activation_dtype) for _ in "kv")
    key[4] = 0.0  # a row of zeros quantizes with scale 0
    slots = torch.tensor([5, -1, 0, 7, 12, 3, -1, 30, 31])
    key[6, 0] *= 1e4  # heads of very different magnitude in one token
    value[3, 1] *= 1e-4
    caches = [torch.zeros(8, 4, *cache_token_shape(2, 16, cache_dtype), dtype=cache_dtype)
              for _ in range(4)]  # fmt: skip
    return key, value, slots, caches


def assert_scale_is_the_bfloat16_at_or_above(scales: torch.Tensor, exact: torch.Tensor) -> None:
    """Each scale is a bfloat16 no smaller than `exact` (max|x| / code max, float32) and no
    bfloat16 lies between them."""
    assert torch.equal(scales.to(torch.bfloat16).float(), scales), "the scale is a bfloat16"
    assert (scales >= exact).all(), "rounded up, never down"
    below = (scales.to(torch.bfloat16).view(torch.int16) - 1).view(torch.bfloat16).float()
    assert (below[exact > 0] < exact[exact > 0]).all(), "the nearest bfloat16 above"


def test_int8_tokens_hold_each_value_within_half_a_step_of_the_token_scale():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(50, 4, 64, generator=gen) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 2] *= 1e-3  # one head far below the token's others
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 4 * 64 + 2)
    scales = token_scales(rows)
    assert_scale_is_the_bfloat16_at_or_above(scales, x.abs().amax(dim=(-2, -1))[:, None] / 127)
    error = (dequantize_rows(rows, 64) - x).abs()
    assert (error <= scales[..., None] / 2 * (1 + 1e-6)).all(), f"worst error {error.max():.3g}"
    zeros = torch.zeros(3, 2, 8)
    assert torch.equal(dequantize_rows(quantize_rows(zeros), 8), zeros)


def test_a_scale_that_is_not_a_bfloat16_rounds_up_and_clips_nothing():
    """max|x| / 127 = 1 / 127 lies between two bfloat16s: the scale is the larger one, so the
    largest value stays within half a step (a scale rounded down would push it past 127)."""
    x = torch.tensor([[[1.0, -0.5, 0.25, 0.0], [-0.999, 0.1, 0.0, 0.003]]])
    exact = torch.tensor([[1.0 / 127]])
    assert exact.to(torch.bfloat16).float() != exact, "the case needs a scale between bfloat16s"
    rows = quantize_rows(x)
    scale = token_scales(rows)
    assert_scale_is_the_bfloat16_at_or_above(scale, exact)
    assert (scale > exact).all()
    values = rows[..., :-2].int()
    assert values.abs().max() <= 127 and values[0, 0].item() == round(1.0 / scale.item())
    error = (dequantize_rows(rows, 4) - x).abs()
    assert (error <= scale / 2 * (1 + 1e-6)).all(), f"worst error {error.max():.3g}"


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("activation_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
def test_cpu_store_writes_the_cache_format_as_the_reference(cache_dtype, activation_dtype):
    key, value, slots, caches = store_case(cache_dtype, activation_dtype)
    cpu.store_kvcache(key, value, caches[0], caches[1], slots)
    ref.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


STORES = [ref.store_kvcache, cpu.store_kvcache, triton_cache.store_kvcache]


@pytest.mark.parametrize("store", STORES, ids=["reference", "c", "triton"])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.uint8], ids=["int8", "fp8"])
def test_a_zero_token_is_stored_as_zero_values_and_scale_0(store, cache_dtype):
    key = torch.zeros(2, 2, 16)
    key[1, 1, 3] = 5.0  # beside a token that is not zero
    caches = [torch.full((2, 4, 2 * 16 + 2), 7, dtype=cache_dtype) for _ in "kv"]
    store(key, -key, *caches, torch.tensor([2, 5]))
    for cache in caches:
        assert (cache.flatten(0, 1)[2] == 0).all(), "values and scale bytes all 0"
        assert token_scales(cache.flatten(0, 1)[5]).item() > 0


@pytest.mark.parametrize("cache_dtype", TRITON_CACHE_DTYPES)
def test_triton_store_writes_the_cache_format_as_the_reference(cache_dtype):
    key, value, slots, caches = store_case(cache_dtype)
    triton_cache.store_kvcache(key, value, caches[0], caches[1], slots)
    ref.store_kvcache(key, value, caches[2], caches[3], slots)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        if cache_dtype != torch.bfloat16:
            assert torch.equal(got, expected)
            continue
        bits = got.view(torch.int16).int(), expected.view(torch.int16).int()
        toward_zero = (bits[0] - bits[1]).abs() <= 1
        assert toward_zero.all() and (got.float().abs() <= expected.float().abs()).all()


def _attention_cases(cache_dtype: torch.dtype, head_dim: int = 64):
    case, q, query_lens = mixed_prefill_case(head_dim, 16, 2, 3)
    case = in_cache_format(case, cache_dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    prefill = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.125)
    decode_q = q[: len(query_lens)].contiguous()
    decode = (decode_q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    return decode, prefill


def assert_reads_as_the_reference(kernels, cache_dtype: torch.dtype, head_dim: int = 64):
    """Decode and prefill attention of `kernels` over a cache of cache_dtype, as the reference."""
    decode, prefill = _attention_cases(cache_dtype, head_dim)
    assert_close(kernels.paged_decode_attention(*decode),
                 ref.paged_decode_attention(*decode), 1e-5, "decode")  # fmt: skip
    assert_close(kernels.paged_prefill_attention(*prefill),
                 ref.paged_prefill_attention(*prefill), 1e-5, "prefill")  # fmt: skip


ATTENTION_CASES = [(cpu_attention, d) for d in CPU_CACHE_DTYPES] + [
    (triton_attention, d) for d in TRITON_CACHE_DTYPES
]


@pytest.mark.parametrize(
    ("kernels", "cache_dtype"),
    ATTENTION_CASES,
    ids=[f"{k.__name__.split('.')[-1]}-{format_name(d)}" for k, d in ATTENTION_CASES],
)
def test_attention_reads_the_cache_format_as_the_reference(kernels, cache_dtype):
    assert_reads_as_the_reference(kernels, cache_dtype)


# The Triton kernels index a token's heads and its scale from head_dim: stories260K's width (8),
# where the scale is a large share of the token, and one that is no power of 2.
@pytest.mark.parametrize("head_dim", [8, 12])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.uint8], ids=["int8", "fp8"])
def test_triton_attention_reads_8_bit_caches_of_narrow_heads(cache_dtype, head_dim):
    assert_reads_as_the_reference(triton_attention, cache_dtype, head_dim)


# Each width takes its own C path: narrow rows (8, 16, 32) converted one row at a time for the
# whole query group, AVX-512 registers at 64 and 128 (bfloat16 rows read in place, other formats
# converted a chunk of 32 tokens at a time), each element inside the dot products for any other
# width.
@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("head_dim", [8, 16, 48, 128])
@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
def test_cpu_attention_reads_the_cache_format_at_every_head_width(cache_dtype, head_dim):
    assert_reads_as_the_reference(cpu_attention, cache_dtype, head_dim)


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8, torch.uint8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_step_stores_and_reads_the_cache_format_as_the_reference(dtype, cache_dtype):
    step, qkv, k_cache, v_cache = layer_case(12, dtype, torch.float32, "row-major")
    k_cache, v_cache = to_cache_rows(k_cache, cache_dtype), to_cache_rows(v_cache, cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected = ref.attention(qkv, expected_k, expected_v, step)
    cpu_attention.prepare_attention(step, k_cache)
    out = cpu_attention.attention(qkv, k_cache, v_cache, step)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), "stored K/V"
    assert_close(out.float(), expected.float(), 1e-5 if dtype == torch.float32 else 0.02, "step")


def test_an_int8_cache_with_rows_of_the_wrong_width_is_refused():
    gen = torch.Generator().manual_seed(13)
    case = make_paged_case(gen, [5], 4, 2, 16)
    q = torch.randn(1, 2, 16, generator=gen)
    bad = case.k_cache.to(torch.int8).flatten(2)  # no room for the scale: 32 bytes, not 34
    with pytest.raises(ValueError, match="head_dim"):
        ref.paged_decode_attention(q, bad, bad, case.block_tables, case.context_lens, 0.25)
    four_d = case.k_cache.to(torch.int8)  # the float layout
    with pytest.raises(ValueError, match="num_kv_heads \\* head_dim \\+ 2"):
        ref.paged_decode_attention(q, four_d, four_d, case.block_tables, case.context_lens, 0.25)
    good = to_cache_rows(case.k_cache, torch.int8)  # 2 heads of 16 and the scale
    with pytest.raises(ValueError, match="head_dim 12"):
        ref.paged_decode_attention(q[..., :12], good, good, case.block_tables,
                                   case.context_lens, 0.25)  # fmt: skip
