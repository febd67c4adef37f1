"""The C kernels against their reference twins, their checks, and how they are built.

Decode attention within 1e-5 absolute of the reference (both float32, sums in a different
order); rotary embedding and the KV store bit for bit; RMSNorm within 2e-6 (its residual sum
bit for bit); linear layers within 1e-5 of torch, in column-major layout.
"""

import pytest
import torch

from kernels import build_cos_sin_cache, cpu, cpu_attention, cpu_linear, quant
from kernels import reference as ref
from tests.kernels.paged_cases import (
    cu_seqlens,
    make_paged_case,
    mixed_prefill_case,
    naive_decode,
    naive_prefill,
    random_context_lens,
    strided_prefill_case,
)
from tests.kernels.test_triton import (
    ATTENTION_ATOL,
    LLAMA3_SCALING,
    NUM_KV_HEADS,
    SHAPE_IDS,
    SHAPES,
    assert_close,
)

# Every test here runs once per ISA level this CPU runs (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("isa_level")


def on_one_and_two_threads(run):
    """run() with one torch thread, then with two; the thread count is restored after."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        return one, run()
    finally:
        torch.set_num_threads(threads)


def decode_args(seed: int, context_lens: list[int], block_size=4, head_dim=8, ratio=2):
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, context_lens, block_size, NUM_KV_HEADS, head_dim)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * ratio, head_dim, generator=gen)
    return case, [q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3]


@pytest.mark.parametrize(("head_dim", "block_size", "ratio"), SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(head_dim, block_size, ratio):
    gen = torch.Generator().manual_seed(head_dim * 100 + block_size * 10 + ratio)
    context_lens = random_context_lens(gen, block_size)
    case, args = decode_args(head_dim + ratio, context_lens, block_size, head_dim, ratio)
    args[-1] = head_dim**-0.5
    out = cpu_attention.paged_decode_attention(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert_close(out, ref.paged_decode_attention(*args), ATTENTION_ATOL, "decode vs reference")
    expected = naive_decode(args[0], case, head_dim**-0.5)
    assert_close(out, expected, ATTENTION_ATOL, "decode vs float64 naive attention")


def test_decode_gives_the_same_result_on_one_and_on_two_threads():
    _, args = decode_args(5, [3, 70, 1, 33], block_size=16, head_dim=64, ratio=4)
    one, two = on_one_and_two_threads(lambda: cpu_attention.paged_decode_attention(*args))
    assert torch.equal(one, two), "the result depends on the thread count"


def test_empty_batch_returns_empty():
    _, args = decode_args(1, [5])
    args[0], args[3], args[4] = args[0][:0], args[3][:0], args[4][:0]
    assert cpu_attention.paged_decode_attention(*args).shape == (0, *args[0].shape[1:])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_tables", "out_of_range", r"block_tables\[1, 2\] = \d+ is not a block"),
        ("block_tables", "negative", r"block_tables\[1, 0\] = -1 is not a block of the cache"),
        ("context_lens", "zero", r"context_lens\[0\] = 0: every sequence needs at least one"),
        ("context_lens", "too_long", r"context_lens\[1\] = 400 needs 100 blocks of 4, but"),
    ],
)
def test_bad_tables_are_refused_before_any_read(field, value, message):
    _, args = decode_args(2, [3, 9])
    tables, lens = args[3].clone(), args[4].clone()
    if value == "out_of_range":
        tables[1, 2] = args[1].shape[0]
    elif value == "negative":
        tables[1, 0] = -1
    elif value == "zero":
        lens[0] = 0
    else:
        lens[1] = 400
    args[3], args[4] = tables, lens
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_decode_attention(*args)


def test_a_zero_block_size_is_refused():
    q = torch.randn(1, 2, 4)
    empty_blocks = torch.zeros(4, 0, 2, 4)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_cache block_size must be at least 1"):
        cpu_attention.paged_decode_attention(q, empty_blocks, empty_blocks, tables, lens, 1.0)


def test_wrong_dtype_and_layout_are_refused():
    _, args = decode_args(3, [3, 9])
    with pytest.raises(
        ValueError, match="q must be float32 or bfloat16 for the CPU kernels, got torch.float16"
    ):
        half = [args[0].half(), args[1].half(), args[2].half(), *args[3:]]
        cpu_attention.paged_decode_attention(*half)
    strided = torch.randn(args[0].shape[0], args[0].shape[1] * 2, args[0].shape[2])[:, ::2]
    with pytest.raises(ValueError, match="q must be contiguous"):
        cpu_attention.paged_decode_attention(strided, *args[1:])
    with pytest.raises(ValueError, match="block_tables must have dtype torch.int32"):
        cpu_attention.paged_decode_attention(*args[:3], args[3].long(), *args[4:])


@pytest.mark.parametrize("num_tokens", [0, 1, 9, 130])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_store_kvcache_equals_reference(head_dim, num_tokens):
    gen = torch.Generator().manual_seed(head_dim + num_tokens)
    num_blocks, block_size = 40, 4
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    fused = torch.randn(num_tokens, 2, NUM_KV_HEADS, head_dim, generator=gen)
    key, value = fused[:, 0], fused[:, 1]  # rows 2 x the row size apart, as in the model
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[::3] = -1
    cpu.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    ref.store_kvcache(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(k_cache, expected_k), "key cache differs from the reference store"
    assert torch.equal(v_cache, expected_v), "value cache differs from the reference store"


def test_store_kvcache_refuses_a_slot_outside_the_cache_and_writes_nothing():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key = value = torch.ones(3, 1, 8)
    for bad in (8, -2):
        with pytest.raises(ValueError, match=rf"slot_mapping\[2\] = {bad} is outside the cache"):
            cpu.store_kvcache(key, value, k_cache, v_cache, torch.tensor([0, 1, bad]))
        assert not k_cache.any() and not v_cache.any(), "a refused store wrote to the cache"


@pytest.mark.parametrize("num_tokens", [1, 5, 200])
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize(("head_dim", "ratio"), [(8, 1), (64, 2), (128, 8)])
def test_rotary_equals_reference_bit_for_bit(head_dim, ratio, rope_scaling, num_tokens):
    gen = torch.Generator().manual_seed(head_dim + ratio + num_tokens)
    num_heads = NUM_KV_HEADS * ratio
    cache = build_cos_sin_cache(head_dim, 256, 10000.0, rope_scaling)
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + NUM_KV_HEADS) * head_dim]
    k = k.view(num_tokens, NUM_KV_HEADS, head_dim)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen)
    q_out, k_out = cpu.rotary_embedding(positions, q, k, cache)
    q_expected, k_expected = ref.rotary_embedding(positions, q, k, cache)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, q_expected), "rotated q differs from the reference"
    assert torch.equal(k_out, k_expected), "rotated k differs from the reference"


def test_rotary_refuses_a_position_outside_the_cache():
    cache = build_cos_sin_cache(8, 16, 10000.0, None)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match=r"positions\[1\] = 16 is outside the rotary cache's 16"):
        cpu.rotary_embedding(torch.tensor([3, 16]), q, k, cache)
    with pytest.raises(ValueError, match="q needs its last 2 dims contiguous"):
        cpu.rotary_embedding(torch.tensor([3, 4]), q.transpose(1, 2).contiguous().mT, k, cache)


@pytest.mark.parametrize("layout", ["row-major", "column-major", "strided"])
def test_argmax_equals_torch_with_ties_and_nans(layout):
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(300, 9, generator=gen)  # [vocab, rows]: column-major logits, as in the model
    base[17, 0] = base[250, 0] = 50.0  # a tie: the first index wins
    base[40, 1] = float("nan")  # a NaN is the largest
    base[:, 2] = 0.0  # all equal: index 0
    base[3, 3] = base[200, 3] = float("nan")  # the first NaN wins
    logits = {
        "row-major": base.t().contiguous(),
        "column-major": base.t(),
        "strided": torch.randn(9, 600, generator=gen)[:, ::2],
    }[layout]
    if layout != "strided":
        assert torch.equal(cpu.argmax(logits), ref.argmax(logits))
    got = cpu.argmax(logits)
    assert torch.equal(got, logits.argmax(dim=-1)), f"{got} != {logits.argmax(dim=-1)}"


def test_argmax_checks_its_input():
    assert cpu.argmax(torch.empty(0, 5)).shape == (0,)
    with pytest.raises(ValueError, match="logits must be"):
        cpu.argmax(torch.randn(5))
    with pytest.raises(ValueError, match="logits needs at least one column"):
        cpu.argmax(torch.empty(3, 0))
    with pytest.raises(ValueError, match="logits must be float32 for the CPU argmax"):
        cpu.argmax(torch.randn(2, 4).half())


def _in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "row-major":
        return t.contiguous()
    if layout == "column-major":
        return t.t().contiguous().t()
    rows, cols = t.shape
    if layout == "row-major-padded":  # rows further apart than their length
        wide = torch.zeros(rows, cols + 5)
        wide[:, :cols] = t
        return wide[:, :cols]
    if layout == "column-major-padded":
        tall = torch.zeros(cols, rows + 3)
        tall[:, :rows] = t.t()
        return tall[:, :rows].t()
    return torch.cat([t, t], dim=1)[:, ::2]  # every other column: neither layout


RMS_LAYOUTS = [
    ("row-major", "row-major"),
    ("column-major", "column-major"),
    ("column-major", "row-major"),
    ("row-major", "column-major"),
    ("strided", "row-major"),
    ("column-major", None),
    ("row-major", None),
    ("row-major-padded", "column-major-padded"),
    ("column-major-padded", "row-major-padded"),
    ("column-major-padded", None),
]


@pytest.mark.parametrize(
    ("rows", "hidden"), [(64, 512), (37, 96), (1, 8), (2048, 64), (3, 1), (700, 128)]
)
@pytest.mark.parametrize(("x_layout", "residual_layout"), RMS_LAYOUTS)
def test_rms_norm_matches_reference_in_every_layout(rows, hidden, x_layout, residual_layout):
    gen = torch.Generator().manual_seed(rows * 7 + hidden)
    x = _in_layout(torch.randn(rows, hidden, generator=gen) * 3, x_layout)
    weight = torch.randn(hidden, generator=gen)
    residual = None
    if residual_layout is not None:
        residual = _in_layout(torch.randn(rows, hidden, generator=gen), residual_layout)
    normed, summed = cpu.rms_norm(x, weight, 1e-5, residual)
    want_normed, want_summed = ref.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, want_summed), "x + residual is one rounding, as in the reference"
    torch.testing.assert_close(normed, want_normed, rtol=2e-6, atol=2e-6)
    if x_layout.startswith("column-major") and rows > 1 and hidden > 1:
        assert normed.stride() == (1, rows), "the result should keep x's column-major layout"


def test_rms_norm_without_residual_returns_x_as_the_sum_and_leaves_inputs_alone():
    gen = torch.Generator().manual_seed(3)
    x, weight, residual = torch.randn(5, 16, generator=gen), torch.randn(16), torch.randn(5, 16)
    before = (x.clone(), residual.clone())
    _, summed = cpu.rms_norm(x, weight, 1e-6)
    assert summed is x
    cpu.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
    normed, summed = cpu.rms_norm(torch.empty(0, 16), weight, 1e-6, torch.empty(0, 16))
    assert normed.shape == summed.shape == (0, 16)


def test_rms_norm_gives_the_same_rows_whatever_the_batch_and_threads():
    gen = torch.Generator().manual_seed(11)
    x, residual = torch.randn(64, 512, generator=gen), torch.randn(64, 512, generator=gen)
    x, weight = x.t().contiguous().t(), torch.randn(512, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch, _ = cpu.rms_norm(x, weight, 1e-5, residual)
        torch.set_num_threads(1)
        alone, _ = cpu.rms_norm(x[5:6], weight, 1e-5, residual[5:6])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch[5:6], alone), "a row's result depends on its batch mates"


def test_rms_norm_checks_its_input():
    with pytest.raises(ValueError, match="x must be float32 or bfloat16 for the CPU kernels"):
        cpu.rms_norm(torch.randn(2, 4).half(), torch.randn(4).half(), 1e-6)
    with pytest.raises(ValueError, match=r"weight.shape\[0\] must equal"):
        cpu.rms_norm(torch.randn(2, 4), torch.randn(5), 1e-6)
    with pytest.raises(ValueError, match="residual must match x"):
        cpu.rms_norm(torch.randn(2, 4), torch.randn(4), 1e-6, torch.randn(3, 4))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch_and_is_column_major(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=gen), torch.randn(40, 96, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    out = cpu_linear.linear(x, weight, b)
    torch.testing.assert_close(out, ref.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert out.t().is_contiguous(), "weight @ x^T gives the transposed view of [out, rows]"
    again = cpu_linear.linear(out, torch.randn(8, 40, generator=gen))  # reads the view in place
    assert again.shape == (rows, 8)


@pytest.mark.parametrize("rows", [9, 16, 17, 33, 48, 49, 63, 64])
@pytest.mark.parametrize("layout", ["column-major", "row-major", "strided"])
def test_float32_linear_up_to_64_rows_runs_the_outer_product_kernel(rows, layout, monkeypatch):
    """9..64 float32 rows go through cpu_linear_columns.c: every count of vectors of 16 rows
    and a partial last one; 300 features are two chunks of 128 and a partial third; 37 weight
    rows leave a block of one past six blocks of six; with and without a bias. float64 is the
    reference."""
    assert cpu_linear._takes_columns(
        torch.zeros(rows, 8), torch.zeros(4, 8), None, torch.float32
    ), "the outer-product kernel must be built on this machine"
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=gen)
    if layout == "column-major":
        x = x.t().contiguous().t()
    elif layout == "strided":
        x = torch.randn(rows, 600, generator=gen)[:, ::2]
    weight, b = torch.randn(37, 300, generator=gen), torch.randn(37, generator=gen)
    calls = count_calls(monkeypatch, cpu_linear, "_columns_into")
    for bias in (None, b):
        out = cpu_linear.linear(x, weight, bias)
        expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
        assert out.t().is_contiguous(), "the result is column-major"
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert calls == [1, 1], "both products must have run the outer-product kernel"


@pytest.mark.parametrize("rows", [17, 64])
def test_linear_of_many_output_rows_runs_the_outer_product_kernel_a_panel_at_a_time(
    rows, monkeypatch
):
    """An output layer's worth of weight rows: the kernel keeps the partial sums of a panel of
    170 blocks (1020 rows) between x's chunks, so 2083 rows (348 blocks, the last of one row)
    are panels of 170, 170 and 8 blocks on one thread and of 170 and 4 on each of two.
    float32, bfloat16, int8 and int4 weights, against float64 (for int4, of x rounded to its
    int8 blocks); one thread and two give equal sums (each output's are summed in the same
    order whatever the split)."""
    assert cpu_linear._takes_columns(
        torch.zeros(rows, 8), torch.zeros(4, 8), None, torch.float32
    ), "the outer-product kernel must be built on this machine"
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 288, generator=gen)
    dense, b = torch.randn(2083, 288, generator=gen), torch.randn(2083, generator=gen)
    int8, int4 = quant.quantize_int8(dense, 32), quant.quantize_int4(dense, 32)
    cases = {  # the product, and the x and weights it multiplies
        "float32": (lambda: cpu_linear.linear(x, dense, b), x, dense),
        "bfloat16": (
            lambda: cpu_linear._widened(x.bfloat16(), dense.bfloat16(), b, torch.float32),
            x.bfloat16(),
            dense.bfloat16(),
        ),
        "int8": (lambda: cpu_linear.linear_quantized(x, int8, b), x, int8.dequantize()),
        "int4": (
            lambda: cpu_linear.linear_quantized(x, int4, b),
            quant.round_activations(x),
            int4.dequantize(),
        ),
    }
    before = torch.get_num_threads()
    dense_calls = count_calls(monkeypatch, cpu_linear, "_columns_into")
    quantized_calls = count_calls(monkeypatch, cpu_linear, "_quantized_columns_into")
    try:
        for name, (product, x_multiplied, values) in cases.items():
            torch.set_num_threads(1)
            one_thread = product()
            torch.set_num_threads(2)
            two_threads = product()
            assert torch.equal(one_thread, two_threads), name
            expected = x_multiplied.double() @ values.double().t() + b.double()
            torch.testing.assert_close(
                two_threads.double(), expected, rtol=1e-5, atol=1e-4, msg=name
            )
    finally:
        torch.set_num_threads(before)
    assert (len(dense_calls), len(quantized_calls)) == (4, 4), "each ran the outer-product kernel"


@pytest.mark.parametrize("rows", [9, 64])
def test_float32_linear_of_9_to_64_rows_takes_one_feature(rows):
    """The outer-product kernel takes x^T of one feature: [1, rows], contiguous, with the
    stride torch gives its size-1 dim (1, not rows)."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 1, generator=gen), torch.randn(5, 1, generator=gen)
    out = cpu_linear.linear(x, weight)
    torch.testing.assert_close(out.double(), x.double() @ weight.double().t())


@pytest.mark.parametrize("rows", [9, 16, 17, 33, 63, 64, 65, 300])
@pytest.mark.parametrize("features", [1, 301])
def test_bfloat16_linear_above_8_rows_sums_exact_products_in_float32(rows, features):
    """bfloat16 x and weights widened to float32 (exact), summed in float32, rounded once:
    9..64 rows on the outer-product kernel's bfloat16 weights (a block's chunk of 128 features
    widened at a time: 301 features are two chunks and a partial third that ends in a partial
    vector, 1 feature is a chunk of one), more on torch's float32 matmul. 37 weight rows leave
    a block of one past six blocks of six. The float32 result is held to float64 of the same
    bfloat16 values, and the bfloat16 one is that float32 result rounded. Run directly: the
    engine routes here only without AMX tiles."""
    gen = torch.Generator().manual_seed(rows * features)
    x = torch.randn(rows, features, generator=gen).bfloat16()
    weight = torch.randn(37, features, generator=gen).bfloat16()
    b = torch.randn(37, generator=gen).bfloat16()
    for layout in ("column-major", "row-major"):
        x = x.t().contiguous().t() if layout == "column-major" else x.contiguous()
        for bias in (None, b):
            out = cpu_linear._widened(x, weight, bias, torch.float32)
            expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
            assert out.dtype == torch.float32 and out.t().is_contiguous(), "column-major float32"
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
            rounded = cpu_linear._widened(x, weight, bias, torch.bfloat16)
            assert rounded.dtype == torch.bfloat16 and rounded.t().is_contiguous()
            assert torch.equal(rounded, out.bfloat16()), "rounded once from the float32 sums"


def test_bfloat16_linear_above_8_rows_gives_nan_and_infinity_rows():
    """A NaN in x makes every output of its row NaN, an infinity infinities, in the bfloat16
    result as in the float32 one it is rounded from."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(20, 64, generator=gen).bfloat16()
    weight = torch.rand(10, 64, generator=gen).bfloat16() + 0.5  # positive: no inf - inf
    x[3, 7], x[11, 0] = float("nan"), float("inf")
    out = cpu_linear._widened(x, weight, None, torch.bfloat16)
    assert out[3].isnan().all() and out[11].isposinf().all()
    rounded = cpu_linear._widened(x, weight, None, torch.float32).bfloat16()
    torch.testing.assert_close(out, rounded, rtol=0, atol=0, equal_nan=True)


def test_bfloat16_linear_above_8_rows_does_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 200, generator=gen).bfloat16()
    weight = torch.randn(100, 200, generator=gen).bfloat16()
    one, two = on_one_and_two_threads(lambda: cpu_linear._widened(x, weight, None, torch.float32))
    assert torch.equal(one, two)


@pytest.mark.parametrize("routing", ["this-cpu", "no-amx"])
@pytest.mark.parametrize("rows", [9, 64, 65])
def test_bfloat16_linear_above_8_rows_routes_by_the_cpu(rows, routing, monkeypatch):
    """Without AMX tiles bfloat16 products above 8 rows are summed from widened values (oneDNN's
    bfloat16 matmul runs at half the float32 rate there), dense and quantized alike; with them
    oneDNN runs the dense ones and the quantized ones meet weights rounded to bfloat16.
    this-cpu: as this CPU has AMX or not; no-amx: the tile kernel turned off."""
    if routing == "no-amx":
        monkeypatch.setattr(cpu_linear, "_tiles_built", lambda: False)
    widens = not cpu_linear._tiles_built()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    calls = count_calls(monkeypatch, cpu_linear, "_widened")
    out = cpu_linear.linear(x, weight)
    assert calls == ([1] if widens else [])
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-2)
    quantized = quant.quantize_int8(weight.float(), group_size=32)  # not the tile kernel's
    logits = cpu_linear.linear_quantized(x, quantized, None, torch.float32)
    reference = ref.linear_quantized(x, quantized, None, torch.float32)
    error = (logits - reference).abs().max() / reference.abs().max()
    assert error <= (1e-5 if widens else 4 * 2**-7), "widened x meets the exact weights"


def count_calls(monkeypatch, module, name: str) -> list[int]:
    """A list that gets a 1 each time module.name is called (the function still runs)."""
    calls: list[int] = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_float32_linear_of_no_features_gives_the_bias():
    """k = 0: the outer-product kernel's chunk loop would never run; the product is the bias."""
    for rows in (4, 16, 100):
        out = cpu_linear.linear(torch.randn(rows, 0), torch.randn(5, 0), torch.arange(5.0))
        assert torch.equal(out, torch.arange(5.0).expand(rows, 5)), rows


def test_linear_of_no_rows_is_empty_for_every_weight_format():
    """A prefill chunk that ends no prompt asks the head for logits of no rows."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(40, 64, generator=gen)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = torch.empty(0, 64, dtype=x_dtype)
        for weight in (dense.to(x_dtype), quant.quantize_int8(dense), quant.quantize_int4(dense)):
            run = (
                cpu_linear.linear
                if isinstance(weight, torch.Tensor)
                else cpu_linear.linear_quantized
            )
            out = run(x, weight, None, torch.float32)
            assert out.shape == (0, 40) and out.dtype == torch.float32, (x_dtype, type(weight))


def test_linear_checks_its_input():
    with pytest.raises(ValueError, match=r"weight.shape\[1\]"):
        cpu_linear.linear(torch.randn(2, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4))
    with pytest.raises(ValueError, match="weight dtype"):
        cpu_linear.linear(torch.randn(2, 4), torch.randn(3, 4).double())


@pytest.mark.parametrize(("head_dim", "block_size", "ratio"), SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_reference(head_dim, block_size, ratio):
    case, q, query_lens = mixed_prefill_case(head_dim, block_size, NUM_KV_HEADS, ratio)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu_seqlens(query_lens))
    out = cpu_attention.paged_prefill_attention(*args, case.context_lens, head_dim**-0.5)
    expected = ref.paged_prefill_attention(*args, case.context_lens, head_dim**-0.5)
    assert_close(out, expected, ATTENTION_ATOL, "prefill vs reference")
    naive = naive_prefill(q, case, query_lens, head_dim**-0.5)
    assert_close(out, naive, ATTENTION_ATOL, "prefill vs float64 naive attention")


def test_prefill_reads_strided_queries_and_is_thread_count_independent():
    case, q, cu = strided_prefill_case()
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu)
    one, two = on_one_and_two_threads(
        lambda: cpu_attention.paged_prefill_attention(*args, case.context_lens, 0.5)
    )
    assert torch.equal(one, two), "the result depends on the thread count"
    expected = ref.paged_prefill_attention(*args, case.context_lens, 0.5)
    assert_close(one, expected, ATTENTION_ATOL, "strided q")


@pytest.mark.parametrize(
    ("cu", "context_lens", "message"),
    [
        ([0, 3, 5], [3, 1], r"sequence 1 has 2 queries but context_lens\[1\] is 1"),
        ([0, 4, 3], [4, 4], "cu_seqlens_q must rise from 0 to the 5 packed queries"),
        ([1, 3, 5], [4, 4], "cu_seqlens_q must rise from 0"),
        ([0, 3, 4], [4, 4], "cu_seqlens_q must rise from 0 to the 5 packed queries"),
        ([0, 3, 5], [4, 40], r"context_lens\[1\] = 40 needs 10 blocks"),
    ],
)
def test_prefill_refuses_bad_offsets_and_lengths(cu, context_lens, message):
    gen = torch.Generator().manual_seed(3)
    case = make_paged_case(gen, [4, 4], 4, 2, 8)
    q = torch.randn(5, 2, 8, generator=gen)
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                    cu_seqlens_q, lens, 0.5)  # fmt: skip


def test_prefill_skips_sequences_without_queries_wherever_they_are():
    """Zero-query sequences at the front and in the middle are neither read nor checked (a
    context of 0 there is fine, as in the reference); the rest match on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(21)
    context_lens = [1, 9, 6, 20]
    case = make_paged_case(gen, context_lens, 4, 2, 16)
    case.context_lens[0] = 0  # no queries and no context
    query_lens = [0, 9, 0, 5]
    q = torch.randn(14, 4, 16, generator=gen)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu_seqlens(query_lens))
    expected = ref.paged_prefill_attention(*args, case.context_lens, 0.25)
    one, two = on_one_and_two_threads(
        lambda: cpu_attention.paged_prefill_attention(*args, case.context_lens, 0.25)
    )
    assert torch.equal(one, two), "the result depends on the thread count"
    assert_close(one, expected, ATTENTION_ATOL, "zero-query sequences vs reference")
    case.block_tables[3, 0] = 10_000
    with pytest.raises(ValueError, match=r"block_tables\[3, 0\] = 10000"):
        cpu_attention.paged_prefill_attention(*args, case.context_lens, 0.25)
