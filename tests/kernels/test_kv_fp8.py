"""The fp8 KV cache's float8 e4m3 conversions, which the C and Triton kernels do by integer
arithmetic on float32 bits, held to torch's float8_e4m3fn conversion (kernels/kv_format.py) bit
for bit: every byte decoded, and a sweep of float32 values encoded (every e4m3 value, the ties
between neighbours and the float32 values next to them, subnormals, the edges at +-448, values
beyond it, infinities, zeros of both signs, random bit patterns). Triton runs in the interpreter.
"""

import pytest
import torch

from kernels import cpu, reference, triton_cache, triton_fp8
from kernels.kv_format import (
    FP8_MAX,
    dequantize_rows,
    fp8_e4m3_bytes,
    fp8_e4m3_values,
    to_cache_rows,
    token_scales,
)
from tests.kernels.test_kv_cache_dtypes import assert_scale_is_the_bfloat16_at_or_above

CONVERSIONS = [cpu, triton_fp8]
IDS = ["c", "triton"]


def every_byte() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8)


def float32_sweep() -> torch.Tensor:
    """Float32 values on and around every rounding decision of e4m3, both signs."""
    values = fp8_e4m3_values(every_byte())
    magnitudes = values[(values >= 0) & ~values.isnan()].unique().double()  # sorted
    ties = (magnitudes[1:] + magnitudes[:-1]) / 2
    beyond = torch.tensor([456.0, 464.0, 472.0, 480.0, 500.0, 1e4, 3.4e38, float("inf")])
    tiny = torch.tensor([2.0**-10, 2.0**-11, 2.0**-126, 1e-40, 1e-45])
    edges = torch.cat([magnitudes, ties, beyond.double(), tiny.double()]).float()
    around = [torch.nextafter(edges, torch.full_like(edges, to)) for to in (0.0, float("inf"))]
    spread = torch.logspace(-14, 11, 20001, base=2.0)
    gen = torch.Generator().manual_seed(8)
    bits = torch.randint(0, 1 << 31, (20000,), generator=gen, dtype=torch.int64).to(torch.int32)
    finite_bits = bits.view(torch.float32)
    finite_bits = finite_bits[~finite_bits.isnan()]
    positive = torch.cat([edges, *around, spread, finite_bits.abs()])
    return torch.cat([positive, -positive])


def test_the_reference_saturates_rounds_half_to_even_and_keeps_subnormals():
    x = torch.tensor([448.0, 464.0, 1000.0, float("inf"), -1000.0, 2.0**-9, 2.0**-10,
                      3 * 2.0**-10, 0.0, -0.0, 1.0625, 1.1875, 240.0])  # fmt: skip
    expected = [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x02, 0x00, 0x80, 0x38, 0x3A, 0x77]
    assert fp8_e4m3_bytes(x).tolist() == expected
    decoded = fp8_e4m3_values(torch.tensor([0x7E, 0x01, 0x08, 0x80, 0xFF], dtype=torch.uint8))
    assert decoded[:4].tolist() == [448.0, 2.0**-9, 2.0**-6, 0.0] and decoded[3].signbit()
    assert decoded[4].isnan(), "0xFF is NaN (no infinities in e4m3)"


def _mismatches(got: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor) -> str:
    wrong = (got != expected).nonzero().flatten()[:8].tolist()
    return ", ".join(f"{inputs[i].item()!r}: {got[i].item()} not {expected[i].item()}"
                     for i in wrong)  # fmt: skip


@pytest.mark.parametrize("start", [0, 1], ids=["all-256", "last-255"])
@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
def test_every_byte_decodes_as_torch_reads_it_in_c(start):
    """255 bytes take the AVX-512 code's 16-, 8- and 1-wide loops (AVX2: 8 and 1); 256, its
    widest loop only."""
    assert_every_byte_decodes_as_torch_reads_it(cpu, start)


@pytest.mark.parametrize("start", [0, 1], ids=["all-256", "last-255"])
def test_every_byte_decodes_as_torch_reads_it_in_triton(start):
    assert_every_byte_decodes_as_torch_reads_it(triton_fp8, start)


def assert_every_byte_decodes_as_torch_reads_it(kernels, start: int) -> None:
    data = every_byte()[start:]
    got, expected = kernels.fp8_e4m3_values(data), fp8_e4m3_values(data)
    got_bits, expected_bits = got.view(torch.int32), expected.view(torch.int32)
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan), "NaN exactly at 0x7F and 0xFF"
    assert torch.equal(got_bits[~nan], expected_bits[~nan]), _mismatches(
        got_bits, expected_bits, data
    )


@pytest.mark.parametrize("kernels", CONVERSIONS, ids=IDS)
def test_float32_values_encode_as_torch_converts_them_saturated(kernels):
    x = float32_sweep()
    got, expected = kernels.fp8_e4m3_bytes(x), fp8_e4m3_bytes(x)
    assert torch.equal(got, expected), f"{len(x)} values; first differences: " + _mismatches(
        got, expected, x
    )
    nan = torch.tensor([float("nan")])
    assert kernels.fp8_e4m3_bytes(nan).item() & 0x7F == 0x7F, "NaN stays NaN"


def test_fp8_rows_hold_each_value_within_half_a_step_of_e4m3():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(40, 4, 64, generator=gen) * torch.logspace(-4, 4, 40)[:, None, None]
    x[5, 1] *= 1e-4  # one head far below the token's others: its values land on subnormals
    rows = to_cache_rows(x, torch.uint8)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 4 * 64 + 2)
    scales = token_scales(rows)
    assert_scale_is_the_bfloat16_at_or_above(scales, x.abs().amax(dim=(-2, -1))[:, None] / FP8_MAX)
    # Half a unit in the last place: 2^-4 of the value for normals, 2^-10 of the scale below.
    bound = torch.maximum(x.abs() * 2.0**-4, scales[..., None] * 2.0**-10) * (1 + 1e-6)
    error = (dequantize_rows(rows, 64) - x).abs()
    assert (error <= bound).all(), f"worst error over bound {(error / bound).max():.3g}"


@pytest.mark.parametrize("store", [cpu.store_kvcache, triton_cache.store_kvcache], ids=IDS)
def test_stores_write_fp8_rows_as_the_reference_across_magnitudes(store):
    """Rows whose values span 2^-20 .. 1 of their largest, so scaled values land on subnormals
    and on zero of both signs, beside an all-zero row (scale 0)."""
    gen = torch.Generator().manual_seed(12)
    spread = torch.logspace(-20, 0, 32, base=2.0)[torch.randperm(32, generator=gen)]
    key = torch.randn(6, 2, 32, generator=gen) * spread
    value = -key.flip(-1)
    key[2, 1] = 0.0
    key[4, 1] = -0.0
    key[3, 0, :4] = -0.0
    slots = torch.tensor([3, 0, -1, 5, 6, 1])
    caches = [torch.zeros(2, 4, 2 * 32 + 2, dtype=torch.uint8) for _ in range(4)]
    store(key, value, caches[0], caches[1], slots)
    reference.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
