"""The Triton kernels on a CUDA GPU against their PyTorch references in bfloat16, float16 and
float32 (the weight-only int8/int4 matmuls too), and the fp8 KV cache (kernels/triton_fp8.py):
every e4m3 byte decoded and every one of the 2^32 float32 bit patterns encoded, bit for bit
against torch's float8_e4m3fn; the store into an fp8 cache exact, and attention reading it
against the reference. bench/gpu_check.sh runs them on a GPU machine (`pytest tests/gpu`).
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import KernelBackend, build_cos_sin_cache, get_kernels, triton_fp8
from kernels import reference as ref
from kernels.kv_format import fp8_e4m3_bytes, fp8_e4m3_values
from kernels.quant import quantize_int4, quantize_int8
from tests.kernels.paged_cases import PagedCase, cu_seqlens, in_cache_format, make_paged_case

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh)"
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="the Triton interpreter is on (tests/conftest.py sets it unless TRITON_INTERPRET=0)",
    ),
]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (atol, rtol) of Triton vs reference per dtype: outputs are rounded to the dtype on both sides.
TOLERANCES = {
    torch.bfloat16: (1e-2, 2e-2),
    torch.float16: (2e-3, 4e-3),
    torch.float32: (1e-4, 1e-4),
}

# (query heads, KV heads, head_dim, block_size, context lengths) of each attention case
CHECK_SHAPES = (
    (32, 8, 128, 16, [1, 15, 17, 700, 1500]),
    (8, 4, 8, 16, [1, 33, 600]),
    (8, 1, 256, 4, [5, 300]),
)
Shape = tuple[int, int, int, int, list[int]]


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda")


@pytest.fixture(scope="module")
def tk(device: torch.device) -> KernelBackend:
    return get_kernels(device, "triton")


def assert_ok(failures: list[str | None]) -> None:
    """`failures` holds one entry a check: None where it passed, else what it measured."""
    failed = [failure for failure in failures if failure]
    assert not failed, "outside the tolerance of the dtype: " + "; ".join(failed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CHECK_SHAPES)
def test_paged_attention(shape: Shape, dtype: torch.dtype, device, tk) -> None:
    assert_ok(check_attention(shape, dtype, device, tk))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache(dtype: torch.dtype, device, tk) -> None:
    assert_ok([check_store(dtype, device, tk)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_rotary(dtype: torch.dtype, device, tk) -> None:
    assert_ok(check_norm_and_rotary(dtype, device, tk))


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_linear(dtype: torch.dtype, device, tk) -> None:
    assert_ok(check_quantized_linear(dtype, device, tk))


def test_fp8_conversions(device) -> None:
    assert_ok(check_fp8_conversions(device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache(dtype: torch.dtype, device, tk) -> None:
    assert_ok(check_fp8_cache(dtype, device, tk))


def compare(
    name: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor
) -> str | None:
    """None where `actual` is within the dtype's tolerance of `expected`, else the error."""
    atol, rtol = TOLERANCES[dtype]
    diff = (actual.float() - expected.float()).abs()
    ok = bool((diff <= atol + rtol * expected.float().abs()).all())
    return None if ok else f"{name} ({dtype_name(dtype)}): max abs err {diff.max().item():.2e}"


def exact(name: str, dtype: str, equal: bool) -> str | None:
    return None if equal else f"{name} ({dtype}): not exact"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention_case(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> PagedCase:
    _, num_kv_heads, head_dim, block_size, context_lens = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return make_paged_case(gen, context_lens, block_size, num_kv_heads, head_dim, dtype).to(device)


def check_attention(
    shape: Shape, dtype: torch.dtype, device: torch.device, tk: KernelBackend
) -> list[str | None]:
    num_heads, num_kv_heads, head_dim, block_size, lengths = shape
    case = attention_case(shape, dtype, device, seed=0)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batch, scale = len(lengths), head_dim**-0.5
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device, dtype)
    caches, context_lens = (case.k_cache, case.v_cache, case.block_tables), case.context_lens
    label = f"{num_heads}/{num_kv_heads}h d{head_dim} bs{block_size}"
    rows = [
        compare(
            f"decode {label}",
            dtype,
            tk.paged_decode_attention(q, *caches, context_lens, scale),
            ref.paged_decode_attention(q, *caches, context_lens, scale),
        )
    ]
    query_lens = [min(n, 1 + n // 3) for n in lengths]
    cu = cu_seqlens(query_lens).to(device)
    q_packed = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    q_packed = q_packed.to(device, dtype)
    rows.append(
        compare(
            f"prefill {label}",
            dtype,
            tk.paged_prefill_attention(q_packed, *caches, cu, context_lens, scale),
            ref.paged_prefill_attention(q_packed, *caches, cu, context_lens, scale),
        )
    )
    return rows


def check_store(dtype: torch.dtype, device: torch.device, tk: KernelBackend) -> str | None:
    gen = torch.Generator(device="cpu").manual_seed(2)
    cache_shape = (64, 16, 8, 128)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    key = torch.randn(100, 8, 128, generator=gen).to(device, dtype)
    value = torch.randn(100, 8, 128, generator=gen).to(device, dtype)
    slot_mapping = torch.randperm(64 * 16, generator=gen)[:100]
    slot_mapping[::7] = -1
    slot_mapping = slot_mapping.to(device)
    tk.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    ref.store_kvcache(key, value, expected_k, expected_v, slot_mapping)
    equal = torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    return exact("store_kvcache 8h d128", dtype_name(dtype), equal)


def check_norm_and_rotary(
    dtype: torch.dtype, device: torch.device, tk: KernelBackend
) -> list[str | None]:
    gen = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(300, 4096, generator=gen).to(device, dtype)
    residual = torch.randn(300, 4096, generator=gen).to(device, dtype)
    weight = torch.randn(4096, generator=gen).to(device, dtype)
    out, summed = tk.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_summed = ref.rms_norm(x, weight, 1e-5, residual)
    rows = [
        compare("rms_norm+residual 4096", dtype, out, expected_out),
        compare("residual sum 4096", dtype, summed, expected_summed),
    ]
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cache = build_cos_sin_cache(128, 16384, 500000.0, scaling, device)
    positions = torch.randint(0, 16384, (300,), generator=gen).to(device)
    q = torch.randn(300, 32, 128, generator=gen).to(device, dtype)
    k = torch.randn(300, 8, 128, generator=gen).to(device, dtype)
    q_out, k_out = tk.rotary_embedding(positions, q, k, cache)
    q_expected, k_expected = ref.rotary_embedding(positions, q, k, cache)
    rows.append(compare("rotary q llama3 d128", dtype, q_out, q_expected))
    rows.append(compare("rotary k llama3 d128", dtype, k_out, k_expected))
    return rows


def check_quantized_linear(
    dtype: torch.dtype, device: torch.device, tk: KernelBackend
) -> list[str | None]:
    """int8 and int4 weight-only matmuls at 1 and 64 rows, errors relative to the largest
    output (16-bit activations multiply weights rounded to their dtype)."""
    gen = torch.Generator(device="cpu").manual_seed(4)
    weight = torch.randn(4096, 4096, generator=gen) * 0.02
    rows = []
    for name, quantized in (("int8", quantize_int8(weight)), ("int4 g32", quantize_int4(weight))):
        quantized = quantized.to(device)
        for num_rows in (1, 64):
            x = torch.randn(num_rows, 4096, generator=gen).to(device, dtype)
            expected = ref.linear_quantized(x, quantized)
            scale = expected.float().abs().max()
            rows.append(compare(f"{name} linear {num_rows}x4096", dtype,
                                tk.linear_quantized(x, quantized).float() / scale,
                                expected.float() / scale))  # fmt: skip
    return rows


def check_fp8_conversions(
    device: torch.device, chunks: int = 16, chunk_bits: int = 28
) -> list[str | None]:
    """Every e4m3 byte decoded, and the first chunks x 2^chunk_bits float32 bit patterns (all
    2^32 by default) encoded, by the Triton kernels' integer code against torch's conversion."""
    data = torch.arange(256, device=device).to(torch.uint8)
    got, expected = triton_fp8.fp8_e4m3_values(data), fp8_e4m3_values(data)
    nan = expected.isnan()
    decoded = torch.equal(got.isnan(), nan) and torch.equal(
        got.view(torch.int32)[~nan], expected.view(torch.int32)[~nan]
    )
    encoded = True
    for chunk in range(chunks):
        start, end = chunk << chunk_bits, (chunk + 1) << chunk_bits
        bits = torch.arange(start, end, device=device).to(torch.int32)
        x = bits.view(torch.float32)
        got, expected = triton_fp8.fp8_e4m3_bytes(x), fp8_e4m3_bytes(x)
        numbers = ~x.isnan()
        encoded &= torch.equal(got[numbers], expected[numbers])
        encoded &= bool(((got[~numbers] & 0x7F) == 0x7F).all())
    encode_case = f"fp8 encode, {chunks} x 2^{chunk_bits} float32"
    return [exact("fp8 decode, 256 bytes", "fp8", decoded), exact(encode_case, "fp8", encoded)]


def check_fp8_cache(
    dtype: torch.dtype, device: torch.device, tk: KernelBackend
) -> list[str | None]:
    """The store into an fp8 cache (exact) and attention reading it (against the reference)."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    caches = [torch.zeros(64, 16, 8 * 128 + 2, dtype=torch.uint8, device=device) for _ in range(4)]
    key, value = (torch.randn(100, 8, 128, generator=gen).to(device, dtype) for _ in "kv")
    slot_mapping = torch.randperm(64 * 16, generator=gen)[:100].to(device)
    tk.store_kvcache(key, value, caches[0], caches[1], slot_mapping)
    ref.store_kvcache(key, value, caches[2], caches[3], slot_mapping)
    equal = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    rows = [exact("store_kvcache fp8 8h d128", dtype_name(dtype), equal)]
    for shape in CHECK_SHAPES:
        num_heads, _, head_dim, _, _ = shape
        case = in_cache_format(attention_case(shape, torch.float32, device, seed=4), torch.uint8)
        fp8, tables, lens = (case.k_cache, case.v_cache), case.block_tables, case.context_lens
        q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
        q, scale = q.to(device, dtype), head_dim**-0.5
        rows.append(compare(f"decode fp8 cache d{head_dim}", dtype,
                            tk.paged_decode_attention(q, *fp8, tables, lens, scale),
                            ref.paged_decode_attention(q, *fp8, tables, lens, scale)))  # fmt: skip
    return rows
