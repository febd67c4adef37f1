"""KV caches of another format than the model's: 16-bit floats, and int8 or fp8 (uint8 bytes)
rows with a float32 scale per token and head (kernels/kv_format.py), written and read by the C
and Triton kernels and held against their reference twins (Triton in the interpreter).

Tolerances: the stores equal the reference bit for bit (except the Triton interpreter's
bfloat16 conversion, which truncates where torch rounds to nearest: one unit in the last place
toward zero at most); attention within 1e-5 absolute of the reference reading the same cache.
"""

import pytest
import torch

from kernels import cpu, cpu_attention, triton_attention, triton_cache
from kernels import reference as ref
from kernels.kv_format import (
    cache_row_width,
    dequantize_rows,
    format_name,
    quantize_rows,
    to_cache_rows,
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
    row = cache_row_width(16, cache_dtype)
    caches = [torch.zeros(8, 4, 2, row, dtype=cache_dtype) for _ in range(4)]
    return key, value, slots, caches


def test_int8_rows_hold_each_value_within_half_a_step_of_its_row_scale():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(50, 4, 64, generator=gen) * torch.logspace(-3, 3, 50)[:, None, None]
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 4, 68)
    scales = rows.view(torch.float32)[..., -1:]
    assert torch.equal(scales, x.abs().amax(dim=-1, keepdim=True) / 127)
    error = (dequantize_rows(rows) - x).abs()
    assert (error <= scales / 2 * (1 + 1e-6)).all(), f"worst error {error.max():.3g}"
    assert torch.equal(dequantize_rows(quantize_rows(torch.zeros(3, 8))), torch.zeros(3, 8))


@pytest.mark.parametrize("activation_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
def test_cpu_store_writes_the_cache_format_as_the_reference(cache_dtype, activation_dtype):
    key, value, slots, caches = store_case(cache_dtype, activation_dtype)
    cpu.store_kvcache(key, value, caches[0], caches[1], slots)
    ref.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


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


ATTENTION_CASES = [(cpu_attention, d) for d in CPU_CACHE_DTYPES] + [
    (triton_attention, d) for d in TRITON_CACHE_DTYPES
]


@pytest.mark.parametrize(
    ("kernels", "cache_dtype"),
    ATTENTION_CASES,
    ids=[f"{k.__name__.split('.')[-1]}-{format_name(d)}" for k, d in ATTENTION_CASES],
)
def test_attention_reads_the_cache_format_as_the_reference(kernels, cache_dtype):
    decode, prefill = _attention_cases(cache_dtype)
    assert_close(kernels.paged_decode_attention(*decode),
                 ref.paged_decode_attention(*decode), 1e-5, "decode")  # fmt: skip
    assert_close(kernels.paged_prefill_attention(*prefill),
                 ref.paged_prefill_attention(*prefill), 1e-5, "prefill")  # fmt: skip


# Each width takes its own C path: narrow rows (8, 16, 32) converted one row at a time for the
# whole query group, AVX-512 registers at 64 and 128 (bfloat16 rows read in place, other formats
# converted a chunk of 32 tokens at a time), each element inside the dot products for any other
# width.
@pytest.mark.parametrize("head_dim", [8, 16, 48, 128])
@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
def test_cpu_attention_reads_the_cache_format_at_every_head_width(cache_dtype, head_dim):
    decode, prefill = _attention_cases(cache_dtype, head_dim)
    assert_close(cpu_attention.paged_decode_attention(*decode),
                 ref.paged_decode_attention(*decode), 1e-5, "decode")  # fmt: skip
    assert_close(cpu_attention.paged_prefill_attention(*prefill),
                 ref.paged_prefill_attention(*prefill), 1e-5, "prefill")  # fmt: skip


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
    bad = case.k_cache.to(torch.int8)  # no room for the scales: rows of 16, not 20
    with pytest.raises(ValueError, match="head_dim"):
        ref.paged_decode_attention(q, bad, bad, case.block_tables, case.context_lens, 0.25)
