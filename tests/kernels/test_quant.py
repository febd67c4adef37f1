"""Weight-only quantization: the int8 and int4 formats, GGUF blocks read into them, and the
quantized (and bfloat16) linear kernels of the CPU and of Triton against the reference.

The reference multiplies the dequantized weight in float32 (int4, and int8 with
int8_activations: by the activations rounded to int8 blocks of 32, quant.round_activations;
the C small-batch kernels sum those blocks in integer multiply-adds). The C small-batch kernels
do the same sums in another order: within 1e-5 relative to the largest output for float32, and
equal to the reference's rounding (one bfloat16 step) for bfloat16. Larger batches multiply weights
dequantized to the activation dtype: for bfloat16 the weights are rounded too (a few steps),
except on CPUs without AMX, where bfloat16 x is widened to float32 and takes the float32 paths.
"""

import struct

import pytest
import torch

from kernels import cpu_linear, quant, triton_quant
from kernels import reference as ref
from tests.kernels.test_cpu import on_one_and_two_threads

BF16_STEP = 2.0**-7


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().item() or 1.0
    return (actual.double() - expected.double()).abs().max().item() / scale


def test_int8_and_int4_round_trips_stay_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 128, generator=gen)
    for q in (quant.quantize_int8(weight), quant.quantize_int8(weight, 32)):
        step = q.scales.repeat_interleave(q.group_size, dim=1)
        assert ((q.dequantize() - weight).abs() <= step / 2 + 1e-7).all()
    q4 = quant.quantize_int4(weight, 64)
    step = q4.scales.float().repeat_interleave(64, dim=1)
    assert ((q4.dequantize() - weight).abs() <= step / 2 + 1e-3 * step).all()
    assert q4.nbytes == 24 * 64 + 2 * 2 * 24 * 2  # nibbles + float16 scales and zeros
    values = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=gen)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(values)), values)


def test_a_weight_of_the_wrong_shape_or_dtype_is_refused_naming_the_field():
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"scales must be torch.float32 \(4, 2\)"):
        quant.QuantizedWeight(8, q, torch.ones(4, 3), None, 32)
    with pytest.raises(ValueError, match="group_size must divide in_features 64"):
        quant.QuantizedWeight(8, q, torch.ones(4, 1), None, 48)
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int4 group_size must be a multiple of 32"):
        quant.QuantizedWeight(4, packed, torch.ones(4, 4).half(), torch.ones(4, 4).half(), 16)
    with pytest.raises(ValueError, match=r"zeros must be torch.float16 \(4, 2\), got None"):
        quant.QuantizedWeight(4, packed, torch.ones(4, 2).half(), None, 32)
    with pytest.raises(ValueError, match="int8_activations needs int8 weights in groups of a "
                                         "multiple of 32"):  # fmt: skip
        quant.QuantizedWeight(8, torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 2), None,
                              24, int8_activations=True)  # fmt: skip


def test_only_int8_weights_in_whole_blocks_take_int8_activations():
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(8, 96, generator=gen)
    assert quant.with_int8_activations(quant.quantize_int8(dense)).int8_activations
    assert quant.with_int8_activations(quant.quantize_int8(dense, 32)).rounds_activations
    kept = [quant.quantize_int8(dense, 24), quant.quantize_int4(dense, 32)]
    assert all(quant.with_int8_activations(w) is w for w in kept), "returned as they are"
    assert not kept[0].rounds_activations and kept[1].rounds_activations


def gguf_blocks(kind: str, rows: int, blocks: int, seed: int) -> tuple[bytes, torch.Tensor]:
    """Random GGUF blocks of `kind` and the weights they stand for, by the format's definition:
    Q8_0 (d, 32 x int8): d * q; Q4_0 (d, 16 bytes): d * (q - 8); Q4_1 (d, m, 16 bytes):
    d * q + m; byte j of a 4-bit block holds weight j (low nibble) and j + 16 (high)."""
    gen = torch.Generator().manual_seed(seed)
    data, weights = bytearray(), torch.empty(rows, blocks * 32)
    for r in range(rows):
        for b in range(blocks):
            d = float(torch.rand(1, generator=gen)) * 0.1
            m = float(torch.randn(1, generator=gen)) * 0.1
            if kind == "q8_0":
                q = torch.randint(-128, 128, (32,), generator=gen)
                data += struct.pack("<e", d) + bytes(v & 0xFF for v in q.tolist())
                values = torch.tensor(struct.unpack("<e", struct.pack("<e", d))) * q
            else:
                q = torch.randint(0, 16, (32,), generator=gen)
                nibbles = bytes(int(q[j]) | int(q[j + 16]) << 4 for j in range(16))
                d16, m16 = (struct.unpack("<e", struct.pack("<e", v))[0] for v in (d, m))
                if kind == "q4_0":
                    data += struct.pack("<e", d) + nibbles
                    values = d16 * (q.float() - 8)
                else:
                    data += struct.pack("<ee", d, m) + nibbles
                    values = d16 * q.float() + m16
            weights[r, b * 32 : (b + 1) * 32] = values
    return bytes(data), weights


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_load_into_the_formats_exactly(kind):
    data, expected = gguf_blocks(kind, 3, 4, seed=len(kind))
    load = {"q8_0": quant.from_gguf_q8_0, "q4_0": quant.from_gguf_q4_0,
            "q4_1": quant.from_gguf_q4_1}[kind]  # fmt: skip
    weight = load(torch.frombuffer(bytearray(data), dtype=torch.uint8), 3)
    assert weight.bits == (8 if kind == "q8_0" else 4) and weight.group_size == 32
    assert torch.equal(weight.dequantize(), expected)


def test_rows_move_and_stack_with_their_scales():
    gen = torch.Generator().manual_seed(5)
    q, k = (quant.quantize_int4(torch.randn(n, 64, generator=gen)) for n in (8, 4))
    fused = quant.concat_rows([q, k])
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    order = torch.randperm(12, generator=gen)
    assert torch.equal(quant.permute_rows(fused, order).dequantize(), fused.dequantize()[order])
    with pytest.raises(ValueError, match="only weights of one format"):
        quant.concat_rows([q, quant.quantize_int8(torch.randn(4, 64))])


def make_weights(out_features: int, in_features: int, seed: int, odd_int8_groups: bool = False):
    """The formats of one seeded weight; odd_int8_groups adds int8 groups of 24 (which a 16-wide
    vector does not fit evenly); "-a8": int8 against x rounded to int8 blocks."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=gen)
    odd_groups = odd_int8_groups and in_features % 24 == 0
    kinds = {
        "int8": quant.quantize_int8(dense),
        "int8-g32": quant.quantize_int8(dense, 32) if in_features % 32 == 0 else None,
        "int8-g24": quant.quantize_int8(dense, 24) if odd_groups else None,
        "int4": quant.quantize_int4(dense, 32) if in_features % 32 == 0 else None,
        "int4-g96": quant.quantize_int4(dense, 96) if in_features % 96 == 0 else None,
        "int4-row": quant.quantize_int4(dense, in_features) if in_features % 32 == 0 else None,
    }
    for name in ("int8", "int8-g32"):
        if kinds[name] is not None and kinds[name].group_size % 32 == 0:
            kinds[f"{name}-a8"] = quant.with_int8_activations(kinds[name])
    return gen, {name: w for name, w in kinds.items() if w is not None}


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(36, 96), (38, 96), (37, 172), (37, 160), (6, 8320)]
)
@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
def test_cpu_quantized_linear_matches_the_reference(out_features, in_features, rows, dtype, layout):
    """Sizes: 96 inputs are three int4 blocks (less than the int4 kernel's four-block chunk),
    160 five (a chunk and one over), 8320 is 260 blocks (past the 256 whose scales the kernel
    converts at a time); 172 is no multiple of the 16-wide vectors; 37 and 38 outputs leave rows
    past the last four-row block."""
    seed = in_features + rows
    gen, weights = make_weights(out_features, in_features, seed, odd_int8_groups=True)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    if layout == "column-major":
        x = x.t().contiguous().t()
    bias = torch.randn(out_features, generator=gen).to(dtype)
    for name, weight in weights.items():
        out = cpu_linear.linear_quantized(x, weight, bias)
        expected = ref.linear_quantized(x, weight, bias)
        assert out.shape == (rows, out_features) and out.dtype == dtype, name
        assert out.stride(0) == 1, f"{name}: the CPU result is column-major"
        # Above 8 rows bfloat16 x meets weights rounded to bfloat16 where the CPU has AMX, and
        # is widened to float32 (the reference's arithmetic) where it has not.
        exact = rows <= 8 or dtype == torch.float32 or not cpu_linear._tiles_built()
        bound = 1e-5 if dtype == torch.float32 else BF16_STEP * (1 if exact else 4)
        assert relative_error(out, expected) <= bound, f"{name}, {rows} rows"
        logits = cpu_linear.linear_quantized(x, weight, None, torch.float32)
        expected_logits = ref.linear_quantized(x, weight, None, torch.float32)
        assert logits.dtype == torch.float32
        logit_bound = 1e-5 if exact else 4 * BF16_STEP
        assert relative_error(logits, expected_logits) <= logit_bound, f"{name} logits"


def test_activations_round_to_int8_blocks_of_32_by_their_largest_value():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 128, generator=gen) * torch.tensor([1e-3, 1.0, 50.0]).unsqueeze(1)
    x[1, 32:64] = 0.0  # a block of zeros
    x[2, 64] = -400.0  # a block whose largest magnitude is negative
    q, scales = quant.quantize_activations(x)
    assert q.dtype == torch.int8 and scales.shape == (3, 4)
    blocks = x.reshape(3, 4, 32)
    assert torch.equal(scales, blocks.abs().amax(-1) * torch.tensor(1 / 127))
    assert q.reshape(3, 4, 32).abs().amax(-1).tolist() == [[127] * 4, [127, 0, 127, 127],
                                                            [127] * 4]  # fmt: skip
    assert q[2, 64] == -127 and (q[1, 32:64] == 0).all()
    rounded = quant.round_activations(x).reshape(3, 4, 32)
    assert ((rounded - blocks).abs() <= scales.unsqueeze(-1) * (0.5 + 1e-5)).all()
    with pytest.raises(ValueError, match="x.shape.1. must be a multiple of 32, got 48"):
        quant.quantize_activations(torch.zeros(2, 48))


IDENTITIES = {  # weights that return the activations they multiply
    "int4": lambda: quant.int4_weight(torch.eye(256, dtype=torch.uint8), torch.ones(256, 8),
                                      torch.zeros(256, 8), 32),
    "int8-a8": lambda: quant.with_int8_activations(
        quant.int8_weight(torch.eye(256, dtype=torch.int8), torch.ones(256))
    ),
    "int8-g64-a8": lambda: quant.with_int8_activations(
        quant.int8_weight(torch.eye(256, dtype=torch.int8), torch.ones(256, 4), 64)
    ),
}  # fmt: skip


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("weight_format", list(IDENTITIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 7, 9, 64, 65])
def test_layers_round_activations_exactly_as_the_reference(rows, dtype, weight_format):
    """An identity int4 weight (scale 1, zero 0), or int8 one (scale 1) with int8_activations,
    returns the activations it multiplied: the C kernels' int8 blocks (small batches: their
    exact integer sums times x's block scale; 9-64 float32 rows, and bfloat16 ones widened to
    float32 on a CPU without AMX, rounded beside the outer-product kernel) and the dequantized
    matmul's (65 rows) are the reference's to the bit."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 256, generator=gen) * torch.rand(rows, 1, generator=gen) * 8).to(dtype)
    x[0, 96:128] = 0.0
    identity = IDENTITIES[weight_format]()
    out = cpu_linear.linear_quantized(x, identity, None, torch.float32)
    expected = quant.round_activations(x)
    if rows > cpu_linear.SMALL_BATCH_ROWS and cpu_linear._tiles_built():
        expected = expected.to(dtype).float()  # with AMX torch multiplies it in x's dtype
    assert torch.equal(out, expected), "the int8 blocks differ"
    assert not torch.equal(out, x.float()), "the activations were not rounded"


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [4, 9, 20, 64, 65])
def test_layers_rounding_activations_give_nan_rows_where_they_hold_a_nan(rows, bits):
    """A NaN in a row of x makes every output of that row NaN, as in the reference (the NaN's
    block gets a NaN scale), and leaves the other rows finite: the small-batch kernel, 9-64
    rows (x rounded 16 rows at a time, NaNs in the first and last lanes of a vector) and more
    (torch); int4, and int8 with int8_activations."""
    gen = torch.Generator().manual_seed(rows)
    dense = torch.randn(40, 256, generator=gen)
    weight = (
        quant.quantize_int4(dense, 32)
        if bits == 4
        else quant.with_int8_activations(quant.quantize_int8(dense))
    )
    x = torch.randn(rows, 256, generator=gen)
    nan_rows = sorted({0, rows - 1})
    x[0, 3] = float("nan")
    x[rows - 1, 255] = float("nan")
    out = cpu_linear.linear_quantized(x, weight, None, torch.float32)
    expected = ref.linear_quantized(x, weight, None, torch.float32)
    assert expected[nan_rows].isnan().all() and torch.isfinite(expected[1:-1]).all()
    assert torch.equal(out.isnan(), expected.isnan()), "rows with and without NaN"
    assert torch.isfinite(out[1:-1]).all(), "the rows without a NaN are finite"


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("rows", [1, 5, 8, 33])
def test_cpu_bfloat16_linear_matches_the_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 172, generator=gen).bfloat16()
    weight, bias = torch.randn(44, 172, generator=gen).bfloat16(), torch.randn(44).bfloat16()
    out = cpu_linear.linear(x, weight, bias)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref.linear(x, weight, bias)) <= BF16_STEP
    logits = cpu_linear.linear(x, weight, None, torch.float32)
    expected = ref.linear(x, weight, None, torch.float32)
    # Above 8 rows: float32 sums of the widened values without AMX, oneDNN's bfloat16 with it.
    widened = rows <= 8 or not cpu_linear._tiles_built()
    assert relative_error(logits, expected) <= (1e-5 if widened else BF16_STEP)


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
def test_cpu_dequantize_equals_the_format_definition():
    _, weights = make_weights(40, 64, seed=9)
    for name, weight in weights.items():
        assert torch.equal(cpu_linear.dequantize(weight, torch.float32), weight.dequantize()), name
        rows = cpu_linear.dequantize(weight, torch.bfloat16, slice(5, 17))
        assert torch.equal(rows, weight.dequantize(torch.bfloat16)[5:17]), name


def counting_library(monkeypatch, *names: str) -> dict[str, int]:
    """Calls of the named C functions through cpu_linear.library() (they still run)."""
    lib = cpu_linear.library()
    calls = dict.fromkeys(names, 0)

    class Counting:
        def __getattr__(self, name):
            if name in calls:
                calls[name] += 1
            return getattr(lib, name)

    monkeypatch.setattr(cpu_linear, "library", lambda: Counting())
    return calls


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("routing", ["this-cpu", "no-amx"])
@pytest.mark.parametrize("rows", [33, 64])
def test_quantized_linear_of_9_to_64_rows_runs_the_outer_product_kernel(rows, routing, monkeypatch):
    """100 output rows are three of the 48-row dequantized slices (the last one partial) for
    int8 in groups of 24, 17 blocks of 6 for int8 in groups of 32 and int4; float32 x.
    Per-channel int8 runs the AMX tile kernel where there is one (this-cpu: as this CPU has it
    or not), and the outer-product kernel without it (no-amx: the tile kernel turned off)."""
    gen, weights = make_weights(100, 96, rows, odd_int8_groups=True)
    x = torch.randn(rows, 96, generator=gen)
    bias = torch.randn(100, generator=gen)
    if routing == "no-amx":
        monkeypatch.setattr(cpu_linear, "_tiles_built", lambda: False)
    tiles = sum(cpu_linear._takes_tiles(w) for w in weights.values())
    calls = counting_library(monkeypatch, "kvgate_linear_columns_quantized", "kvgate_linear_tiles")
    for name, weight in weights.items():
        out = cpu_linear.linear_quantized(x, weight, bias)
        expected = ref.linear_quantized(x, weight, bias)
        assert relative_error(out, expected) <= 1e-5, f"{name}, {rows} rows"
    assert calls == {
        "kvgate_linear_columns_quantized": len(weights) - tiles,
        "kvgate_linear_tiles": tiles,
    }, "per-channel int8 on the tile kernel with AMX, every other layer on the outer-product one"


@pytest.mark.parametrize(
    "weight_format", ["int8-288", "int8-48", "int8-32", "int8-24", "int4-32", "int4-96", "int4-288"]
)
@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("rows", [9, 33, 64])
def test_quantized_outer_product_sums_equal_the_float32_kernels_over_the_dequantized_weights(
    rows, weight_format, monkeypatch
):
    """Quantized layers of 9-64 rows dequantize each 128-feature chunk of a block into the L1
    cache (int8 in groups of a multiple of 16, int4) or 48 whole rows at a time (int8 in other
    groups): either way the products are the dequantized weights' (int4: against x rounded to
    its int8 blocks) and the sums run in the float32 kernel's order, so the results are equal
    to it, bit for bit. 288 features are two chunks and a part; groups of 48 and 96 straddle
    the chunks' edges; 100 outputs leave a partial block of 6."""
    monkeypatch.setattr(cpu_linear, "_tiles_built", lambda: False)
    bits, group_size = (int(part) for part in weight_format.removeprefix("int").split("-"))
    gen = torch.Generator().manual_seed(rows + group_size)
    dense = torch.randn(100, 288, generator=gen)
    weight = (
        quant.quantize_int8(dense, group_size)
        if bits == 8
        else quant.quantize_int4(dense, group_size)
    )
    x = torch.randn(rows, 288, generator=gen)
    bias = torch.randn(100, generator=gen)
    out = cpu_linear.linear_quantized(x, weight, bias)
    x_multiplied = x if bits == 8 else quant.round_activations(x)
    assert torch.equal(out, cpu_linear.linear(x_multiplied, weight.dequantize(), bias))


def skip_without_tiles() -> None:
    if not cpu_linear._tiles_built():
        pytest.skip("this CPU has no AMX (the tile kernel's fallback is tested by the no-amx "
                    "case of the 9-64-row test)")  # fmt: skip


@pytest.mark.parametrize("rows", [9, 16, 17, 33, 48, 49, 63, 64, 65, 300])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(37, 100), (16, 64), (150, 576), (17, 31), (15, 1)]
)
def test_int8_tile_kernel_keeps_the_weights_exact_and_x_to_16_bits(rows, out_features, in_features):
    """The AMX kernel against float64 on the dequantized weights: every count of 16-row tiles
    of x and a partial last one, more than one group of 64 rows (work items of 128 weight
    rows, 150 a partial second), weight rows past a block of 16 and a block of fewer, features
    past a 32-feature tile and fewer than one. Its error stays far below what x rounded to
    bfloat16 alone would give (so the low bfloat16 part of x is summed), and it does not
    depend on the thread count. bfloat16 x is exact in one part: float32 logits from it carry
    no more than float32's error."""
    skip_without_tiles()
    gen = torch.Generator().manual_seed(rows * in_features)
    weight = quant.quantize_int8(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    exact = x.double() @ weight.dequantize().double().t() + bias.double()
    one, two = on_one_and_two_threads(lambda: cpu_linear.linear_quantized(x, weight, bias))
    assert torch.equal(one, two), "the result depends on the thread count"
    assert relative_error(one, exact) <= 1e-5
    x_bf16_only = x.bfloat16().double() @ weight.dequantize().double().t() + bias.double()
    assert relative_error(x_bf16_only, exact) > 30 * relative_error(one, exact)
    halves = cpu_linear.linear_quantized(x.bfloat16(), weight, bias.bfloat16())
    assert halves.dtype == torch.bfloat16
    assert relative_error(halves, x_bf16_only) <= BF16_STEP
    logits = cpu_linear.linear_quantized(x.bfloat16(), weight, bias.bfloat16(), torch.float32)
    bias_bf16 = bias.bfloat16().double() - bias.double()
    assert relative_error(logits, x_bf16_only + bias_bf16) <= 1e-5


def test_int8_tile_kernel_gives_the_reference_infinities_for_an_infinite_x():
    """x = hi + lo: where x is infinite, lo must be 0, not inf - inf (NaN in every output)."""
    skip_without_tiles()
    gen = torch.Generator().manual_seed(3)
    weight = quant.quantize_int8(torch.randn(20, 40, generator=gen))
    x = torch.randn(9, 40, generator=gen)
    x[0, 3], x[1, 5] = float("inf"), float("-inf")
    out = cpu_linear.linear_quantized(x, weight)
    expected = ref.linear_quantized(x, weight)
    assert expected[:2].isinf().any(), "the test needs infinities from the reference"
    finite = expected.isfinite()
    assert torch.equal(out[~finite].nan_to_num(), expected[~finite].nan_to_num())
    assert torch.equal(out[~finite].isnan(), expected[~finite].isnan())
    assert relative_error(out[finite], expected[finite]) <= 1e-5


@pytest.mark.usefixtures("isa_level")  # once per ISA level this CPU runs
@pytest.mark.parametrize("rows", [2, 20, 80])
def test_quantized_linear_reads_a_strided_bias_by_its_values(rows):
    """A bias that is a strided view: the C kernels read it by its pointer, so it must be
    made contiguous first (small batches, the tile kernel, the dequantized matmul)."""
    gen, weights = make_weights(16, 64, seed=rows)
    x = torch.randn(rows, 64, generator=gen)
    bias = torch.randn(32, generator=gen)[::2]
    for name, weight in weights.items():
        out = cpu_linear.linear_quantized(x, weight, bias)
        assert relative_error(out, ref.linear_quantized(x, weight, bias)) <= 1e-5, name


@pytest.mark.parametrize("rows", [1, 19])
def test_triton_quantized_linear_matches_the_reference(rows):
    gen, weights = make_weights(70, 96, seed=rows)
    x = torch.randn(rows, 96, generator=gen)
    bias = torch.randn(70, generator=gen)
    for name, weight in weights.items():
        out = triton_quant.linear_quantized(x, weight, bias)
        assert out.shape == (rows, 70) and out.is_contiguous(), name
        assert relative_error(out, ref.linear_quantized(x, weight, bias)) <= 1e-5, name


def test_quantized_linear_checks_its_input():
    _, weights = make_weights(8, 64, seed=1)
    weight = weights["int4"]
    with pytest.raises(ValueError, match=r"x.shape\[1\] must equal the weight's in_features"):
        cpu_linear.linear_quantized(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="x must be float32 or bfloat16 for the CPU kernels"):
        cpu_linear.linear_quantized(torch.randn(2, 64).half(), weight)
    with pytest.raises(ValueError, match="bias dtype torch.bfloat16 differs from x dtype"):
        cpu_linear.linear_quantized(torch.randn(2, 64), weight, torch.zeros(8).bfloat16())
