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

from bench.kernels import Row, Shape, paged_case
from kernels import KernelBackend, build_cos_sin_cache, get_kernels, triton_fp8
from kernels import reference as ref
from kernels.kv_format import fp8_e4m3_bytes, fp8_e4m3_values, to_cache_rows
from kernels.quant import quantize_int4, quantize_int8

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

CHECK_SHAPES = (
    Shape(32, 8, 128, 16, (1, 15, 17, 700, 1500)),
    Shape(8, 4, 8, 16, (1, 33, 600)),
    Shape(8, 1, 256, 4, (5, 300)),
)


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda")


@pytest.fixture(scope="module")
def tk(device: torch.device) -> KernelBackend:
    return get_kernels(device, "triton")


def assert_ok(rows: list[Row]) -> None:
    failed = [f"{r.case} ({r.dtype}): {r.metric} {r.value}" for r in rows if r.status != "ok"]
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


def compare(name: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> Row:
    atol, rtol = TOLERANCES[dtype]
    diff = (actual.float() - expected.float()).abs()
    ok = bool((diff <= atol + rtol * expected.float().abs()).all())
    return Row(
        "check",
        name,
        str(dtype).removeprefix("torch."),
        "max abs err",
        f"{diff.max().item():.2e}",
        "ok" if ok else "FAIL",
    )


def check_attention(
    shape: Shape, dtype: torch.dtype, device: torch.device, tk: KernelBackend
) -> list[Row]:
    k_cache, v_cache, block_tables, context_lens = paged_case(shape, dtype, device, seed=0)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batch, scale = len(shape.context_lens), shape.head_dim**-0.5
    q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen).to(device, dtype)
    caches = (k_cache, v_cache, block_tables)
    label = f"{shape.num_heads}/{shape.num_kv_heads}h d{shape.head_dim} bs{shape.block_size}"
    rows = [
        compare(
            f"decode {label}",
            dtype,
            tk.paged_decode_attention(q, *caches, context_lens, scale),
            ref.paged_decode_attention(q, *caches, context_lens, scale),
        )
    ]
    query_lens = [min(n, 1 + n // 3) for n in shape.context_lens]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)
    q_packed = torch.randn(sum(query_lens), shape.num_heads, shape.head_dim, generator=gen)
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


def check_store(dtype: torch.dtype, device: torch.device, tk: KernelBackend) -> Row:
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
    exact = torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    return Row(
        "check",
        "store_kvcache 8h d128",
        str(dtype).removeprefix("torch."),
        "exact",
        str(exact),
        "ok" if exact else "FAIL",
    )


def check_norm_and_rotary(dtype: torch.dtype, device: torch.device, tk: KernelBackend) -> list[Row]:
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
) -> list[Row]:
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


def exact_row(case: str, dtype: str, exact: bool) -> Row:
    return Row("check", case, dtype, "exact", str(exact), "ok" if exact else "FAIL")


def check_fp8_conversions(
    device: torch.device, chunks: int = 16, chunk_bits: int = 28
) -> list[Row]:
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
    return [exact_row("fp8 decode, 256 bytes", "fp8", decoded),
            exact_row(encode_case, "fp8", encoded)]  # fmt: skip


def check_fp8_cache(dtype: torch.dtype, device: torch.device, tk: KernelBackend) -> list[Row]:
    """The store into an fp8 cache (exact) and attention reading it (against the reference)."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    caches = [torch.zeros(64, 16, 8 * 128 + 2, dtype=torch.uint8, device=device) for _ in range(4)]
    key, value = (torch.randn(100, 8, 128, generator=gen).to(device, dtype) for _ in "kv")
    slot_mapping = torch.randperm(64 * 16, generator=gen)[:100].to(device)
    tk.store_kvcache(key, value, caches[0], caches[1], slot_mapping)
    ref.store_kvcache(key, value, caches[2], caches[3], slot_mapping)
    exact = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    rows = [exact_row("store_kvcache fp8 8h d128", str(dtype).removeprefix("torch."), exact)]
    for shape in CHECK_SHAPES:
        k_cache, v_cache, tables, lens = paged_case(shape, torch.float32, device, seed=4)
        fp8 = (to_cache_rows(k_cache, torch.uint8), to_cache_rows(v_cache, torch.uint8))
        q = torch.randn(len(lens), shape.num_heads, shape.head_dim, generator=gen)
        q, scale = q.to(device, dtype), shape.head_dim**-0.5
        rows.append(compare(f"decode fp8 cache d{shape.head_dim}", dtype,
                            tk.paged_decode_attention(q, *fp8, tables, lens, scale),
                            ref.paged_decode_attention(q, *fp8, tables, lens, scale)))  # fmt: skip
    return rows
