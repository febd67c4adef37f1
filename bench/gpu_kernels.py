"""Kernel checks and the paged-decode benchmark on one CUDA GPU, printed as one table.

    python -m bench.gpu_kernels [--skip-bench]

1. Every Triton kernel against its PyTorch reference on CUDA in bfloat16, float16 and
   float32 (the weight-only int8/int4 matmuls too): max abs error, and pass/fail against the
   tolerance of the dtype.
2. Paged decode attention at batch 64, context 4096, 32 query / 8 KV heads, head_dim 128,
   block_size 16, bfloat16: median time (CUDA events), KV bytes read per second, fraction of
   the H200's 4.8 TB/s; next to PyTorch's scaled_dot_product_attention on the same K/V
   already gathered contiguously, and the reference kernel (gather, then SDPA).
3. Paged prefill attention of 8 sequences x 2048 new tokens, same heads: time next to SDPA
   (causal) on contiguous K/V.

Before them, the fp8 KV cache (kernels/triton_fp8.py): every e4m3 byte decoded and every one of
the 2^32 float32 bit patterns encoded, bit for bit against torch's float8_e4m3fn on the GPU;
the store into an fp8 cache exact, and attention reading it against the reference.

Exits non-zero when CUDA or Triton is missing, or when a kernel check fails.
"""

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import KernelBackend, build_cos_sin_cache, get_kernels, triton_fp8
from kernels import reference as ref
from kernels.kv_format import fp8_e4m3_bytes, fp8_e4m3_values, to_cache_rows
from kernels.quant import quantize_int4, quantize_int8

H200_BANDWIDTH_GBPS = 4800.0
# (atol, rtol) of Triton vs reference per dtype: outputs are rounded to the dtype on both sides.
TOLERANCES = {
    torch.bfloat16: (1e-2, 2e-2),
    torch.float16: (2e-3, 4e-3),
    torch.float32: (1e-4, 1e-4),
}


@dataclass(frozen=True)
class Shape:
    """One attention shape to check."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]


CHECK_SHAPES = (
    Shape(32, 8, 128, 16, (1, 15, 17, 700, 1500)),
    Shape(8, 4, 8, 16, (1, 33, 600)),
    Shape(8, 1, 256, 4, (5, 300)),
)


@dataclass
class Row:
    """One line of the printed table."""

    section: str
    case: str
    dtype: str
    metric: str
    value: str
    status: str = ""


def paged_case(
    shape: Shape, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches with shuffled blocks, block tables (-1 past the end), context lens."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_needed = [math.ceil(n / shape.block_size) for n in shape.context_lens]
    num_blocks = sum(blocks_needed) + 1
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(blocks_needed), max(blocks_needed) + 1), -1, dtype=torch.int32)
    used = 0
    for seq, needed in enumerate(blocks_needed):
        block_tables[seq, :needed] = order[used : used + needed]
        used += needed
    context_lens = torch.tensor(shape.context_lens, dtype=torch.int32)
    return k_cache, v_cache, block_tables.to(device), context_lens.to(device)


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


def run_checks(device: torch.device, tk: KernelBackend) -> list[Row]:
    rows = check_fp8_conversions(device)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in CHECK_SHAPES:
            rows.extend(check_attention(shape, dtype, device, tk))
        rows.append(check_store(dtype, device, tk))
        rows.extend(check_norm_and_rotary(dtype, device, tk))
        rows.extend(check_quantized_linear(dtype, device, tk))
        rows.extend(check_fp8_cache(dtype, device, tk))
    return rows


def cuda_time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """Median of `iters` CUDA-event-timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bandwidth_rows(case: str, name: str, time_ms: float, kv_bytes: int) -> list[Row]:
    gbps = kv_bytes / (time_ms * 1e-3) / 1e9
    return [
        Row("decode", case, "bfloat16", f"{name} time", f"{time_ms * 1e3:.1f} us"),
        Row(
            "decode",
            case,
            "bfloat16",
            f"{name} KV GB/s",
            f"{gbps:.0f} ({gbps / H200_BANDWIDTH_GBPS:.0%} of 4.8 TB/s)",
        ),
    ]


def bench_decode(device: torch.device, tk: KernelBackend) -> list[Row]:
    batch, context_len, num_heads, num_kv_heads, head_dim, block_size = 64, 4096, 32, 8, 128, 16
    shape = Shape(num_heads, num_kv_heads, head_dim, block_size, (context_len,) * batch)
    k_cache, v_cache, block_tables, context_lens = paged_case(shape, torch.bfloat16, device, 4)
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    kv_bytes = 2 * batch * context_len * num_kv_heads * head_dim * k_cache.element_size()
    case = f"B{batch} ctx{context_len} {num_heads}/{num_kv_heads}h d{head_dim} bs{block_size}"
    args = (q, k_cache, v_cache, block_tables, context_lens, scale)
    triton_ms = cuda_time_ms(lambda: tk.paged_decode_attention(*args))
    reference_ms = cuda_time_ms(lambda: ref.paged_decode_attention(*args), warmup=3, iters=10)

    tables = block_tables[:, : context_len // block_size].long().flatten()
    gathered = (batch, context_len, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, tables).view(gathered).transpose(1, 2).contiguous()
    values = v_cache.index_select(0, tables).view(gathered).transpose(1, 2).contiguous()
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    sdpa_ms = cuda_time_ms(
        lambda: F.scaled_dot_product_attention(grouped_q, keys, values, scale=scale)
    )
    return [
        *bandwidth_rows(case, "triton paged", triton_ms, kv_bytes),
        *bandwidth_rows(case, "sdpa contiguous", sdpa_ms, kv_bytes),
        *bandwidth_rows(case, "reference", reference_ms, kv_bytes),
        Row("decode", case, "bfloat16", "triton / sdpa time", f"{triton_ms / sdpa_ms:.2f}x"),
    ]


def bench_prefill(device: torch.device, tk: KernelBackend) -> list[Row]:
    num_seqs, seq_len, num_heads, num_kv_heads, head_dim, block_size = 8, 2048, 32, 8, 128, 16
    shape = Shape(num_heads, num_kv_heads, head_dim, block_size, (seq_len,) * num_seqs)
    k_cache, v_cache, block_tables, context_lens = paged_case(shape, torch.bfloat16, device, 5)
    q = torch.randn(num_seqs * seq_len, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * seq_len
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, block_tables, cu, context_lens, scale)
    triton_ms = cuda_time_ms(lambda: tk.paged_prefill_attention(*args), warmup=3, iters=10)
    keys = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, device=device)
    keys = keys.to(torch.bfloat16)
    queries = q.view(num_seqs, seq_len, num_heads, head_dim).transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(
            queries, keys, keys, is_causal=True, scale=scale, enable_gqa=True
        )

    sdpa_ms = cuda_time_ms(sdpa, warmup=3, iters=10)
    case = f"{num_seqs}x{seq_len} new tokens {num_heads}/{num_kv_heads}h d{head_dim}"
    return [
        Row("prefill", case, "bfloat16", "triton paged time", f"{triton_ms * 1e3:.0f} us"),
        Row("prefill", case, "bfloat16", "sdpa causal time", f"{sdpa_ms * 1e3:.0f} us"),
        Row("prefill", case, "bfloat16", "triton / sdpa time", f"{triton_ms / sdpa_ms:.2f}x"),
    ]


def print_table(rows: list[Row]) -> None:
    headers = ("section", "case", "dtype", "metric", "value", "status")
    cells = [headers, *[(r.section, r.case, r.dtype, r.metric, r.value, r.status) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def require_cuda() -> torch.device:
    """The CUDA device, or exit saying it is missing (get_kernels then refuses a missing triton)."""
    if not torch.cuda.is_available():
        sys.exit(f"gpu_kernels: no CUDA device visible to torch {torch.__version__}; run on a GPU")
    return torch.device("cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-bench", action="store_true", help="only the correctness checks")
    args = parser.parse_args()
    device = require_cuda()
    tk = get_kernels(device, "triton")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    rows = run_checks(device, tk)
    if not args.skip_bench:
        rows.extend(bench_decode(device, tk))
        rows.extend(bench_prefill(device, tk))
    print_table(rows)
    failed = [row.case for row in rows if row.status == "FAIL"]
    if failed:
        print(f"FAILED checks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
