"""The C kernels with bfloat16 activations and a KV cache of either dtype, and one layer's
whole attention step (rotary, store, attention in one call), against their reference twins.

bfloat16 results round where the reference rounds, so they equal it but for the last bit of a
sum taken in another order: rotary and the store bit for bit, RMSNorm and SiLU-and-multiply
within one bfloat16 step (2^-7 relative); attention within 1e-5 absolute for float32 outputs
and, for bfloat16 outputs, within 1e-5 absolute plus the two rounding steps that a 1e-5
difference before the final rounding can become.
"""

import pytest
import torch

from kernels import build_cos_sin_cache, cpu, cpu_attention
from kernels import reference as ref
from kernels.attention_step import AttentionStep
from tests.kernels.paged_cases import cu_seqlens, make_paged_case, mixed_prefill_case
from tests.kernels.test_triton import assert_close

# Every test here runs once per ISA level this CPU runs (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("isa_level")

DTYPES = (torch.float32, torch.bfloat16)
BF16_STEP = 2.0**-7  # relative size of one bfloat16 unit in the last place, at worst
FLOAT32_STEP = 2.0**-23  # and of one float32 unit


def assert_within_one_step(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to one bfloat16 step relative to the larger magnitude, elementwise."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.double(), expected.double()
    bound = BF16_STEP * torch.maximum(a.abs(), e.abs()) + 1e-30
    worst = ((a - e).abs() / bound).max().item() if a.numel() else 0.0
    assert worst <= 1.0, f"{what}: {worst:.2f} bfloat16 steps apart at worst"


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Attention outputs: see the module docstring."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.dtype != torch.bfloat16:
        assert_close(actual, expected, 1e-5, what)
        return
    a, e = actual.double(), expected.double()
    excess = (a - e).abs() - 2 * BF16_STEP * torch.maximum(a.abs(), e.abs())
    assert excess.max().item() <= 1e-5, f"{what}: off by {excess.max().item():.3g} beyond bound"


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_converts_to_the_cache_dtype_like_the_reference(dtype, cache_dtype):
    gen = torch.Generator().manual_seed(3)
    key, value = (torch.randn(9, 2, 16, generator=gen).to(dtype) for _ in range(2))
    slots = torch.tensor([5, -1, 0, 7, 12, 3, -1, 30, 31])
    caches = [torch.zeros(8, 4, 2, 16, dtype=cache_dtype) for _ in range(4)]
    cpu.store_kvcache(key, value, caches[0], caches[1], slots)
    ref.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rotary_in_bfloat16_equals_the_reference_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    cache = build_cos_sin_cache(64, 128, 100000.0, None)
    qkv = torch.randn(7, (6 + 4) * 64, generator=gen).bfloat16()
    q = qkv[:, : 6 * 64].view(7, 6, 64)
    k = qkv[:, 6 * 64 : 8 * 64].view(7, 2, 64)
    positions = torch.randint(0, 128, (7,), generator=gen)
    got = cpu.rotary_embedding(positions, q, k, cache)
    expected = ref.rotary_embedding(positions, q, k, cache)
    for name, a, e in zip(("q", "k"), got, expected, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, e), f"rotated {name} differs"


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_in_bfloat16_matches_the_reference(with_residual, layout):
    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(19, 96, generator=gen).bfloat16() for _ in range(2))
    if layout == "column-major":
        x, residual = x.t().contiguous().t(), residual.t().contiguous().t()
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).bfloat16()
    residual = residual if with_residual else None
    normed, summed = cpu.rms_norm(x, weight, 1e-5, residual)
    expected_normed, expected_summed = ref.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_summed), "the residual sum differs from the reference"
    assert_within_one_step(normed, expected_normed, "RMSNorm")


@pytest.mark.parametrize("layout", ["row-major", "column-major", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_reference(dtype, layout):
    gen = torch.Generator().manual_seed(6)
    x = 3 * torch.randn(13, 2 * 40, generator=gen).to(dtype)
    x = {
        "row-major": x,
        "column-major": x.t().contiguous().t(),
        "strided": torch.cat([x, x], dim=1)[:, ::2],
    }[layout]
    out = cpu.silu_and_mul(x)
    expected = ref.silu_and_mul(x)
    assert out.shape == (13, 40) and out.stride() in ((40, 1), (1, 13))
    if dtype == torch.float32:
        # Each ISA level's vector expf (libmvec) rounds its own way, so the bits differ from
        # torch's by a step or two of outputs up to ~200; both are judged against float64.
        gate, up = x[:, :40].double(), x[:, 40:].double()
        exact = gate * torch.sigmoid(gate) * up
        for name, result in (("C kernel", out), ("reference", expected)):
            steps = (result.double() - exact).abs() / (exact.abs() * FLOAT32_STEP + 1e-30)
            assert steps.max() <= 4, f"{name}: {steps.max():.2f} float32 steps from float64"
    else:
        assert_within_one_step(out, expected, "SiLU-and-multiply")


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_prefill_read_a_cache_of_either_dtype(dtype, cache_dtype):
    case, q, query_lens = mixed_prefill_case(64, 16, 2, 3)
    k_cache, v_cache = case.k_cache.to(cache_dtype), case.v_cache.to(cache_dtype)
    q = q.to(dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k_cache, v_cache, case.block_tables, cu, case.context_lens, 0.125)
    out = cpu_attention.paged_prefill_attention(*args)
    assert out.dtype == dtype
    close(out, ref.paged_prefill_attention(*args), "prefill")
    decode_q = q[: len(query_lens)].contiguous()
    decode_args = (decode_q, k_cache, v_cache, case.block_tables, case.context_lens, 0.125)
    close(cpu_attention.paged_decode_attention(*decode_args),
          ref.paged_decode_attention(*decode_args), "decode")  # fmt: skip


def layer_case(
    seed: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    layout: str,
    query_lens: tuple[int, ...] = (1, 1, 6, 8, 1),
):
    """(step, qkv, k_cache, v_cache) of a step with two decodes and three prefill chunks (by
    default a fresh prompt, a chunk after a cached prefix, a one-token chunk), 6 query and 2 KV
    heads."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 4
    context_lens = [5, 17, 6, 13, 9]
    case = make_paged_case(gen, context_lens, block_size, num_kv_heads, head_dim, cache_dtype)
    positions, slots = [], []
    for seq, (context, queries) in enumerate(zip(context_lens, query_lens, strict=True)):
        for position in range(context - queries, context):
            block = int(case.block_tables[seq, position // block_size])
            positions.append(position)
            slots.append(block * block_size + position % block_size)
    slots[3] = -1  # a token whose K/V is not stored (the step still attends for it)
    step = AttentionStep(
        torch.tensor(positions), torch.tensor(slots),
        build_cos_sin_cache(head_dim, 64, 10000.0, None), 2,
        case.block_tables[:2].contiguous(), case.context_lens[:2].contiguous(),
        case.block_tables[2:].contiguous(), cu_seqlens(list(query_lens[2:])),
        case.context_lens[2:].contiguous(), num_heads, num_kv_heads, head_dim, head_dim**-0.5,
    )  # fmt: skip
    qkv = torch.randn(len(positions), step.qkv_width, generator=gen).to(dtype)
    if layout == "column-major":
        qkv = qkv.t().contiguous().t()
    return step, qkv, case.k_cache, case.v_cache


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_step_equals_the_reference_composition(dtype, cache_dtype, layout):
    step, qkv, k_cache, v_cache = layer_case(7, dtype, cache_dtype, layout)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected = ref.attention(qkv, expected_k, expected_v, step)
    cpu_attention.prepare_attention(step, k_cache)
    out = cpu_attention.attention(qkv, k_cache, v_cache, step)
    assert out.shape == (17, 6 * 32) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), "stored K/V"
    close(out, expected, "attention step")


def test_prepared_step_refuses_bad_indices_before_any_layer_runs():
    step, _, k_cache, _ = layer_case(8, torch.float32, torch.float32, "row-major")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad_slot = AttentionStep(**{**_fields(step), "slot_mapping": step.slot_mapping.clone()})
    bad_slot.slot_mapping[4] = num_slots
    with pytest.raises(ValueError, match=rf"slot_mapping\[4\] = {num_slots} is outside"):
        cpu_attention.prepare_attention(bad_slot, k_cache)
    bad_position = AttentionStep(**{**_fields(step), "positions": step.positions + 60})
    with pytest.raises(ValueError, match=r"positions\[0\] = 64 is outside \[0, 64\)"):
        cpu_attention.prepare_attention(bad_position, k_cache)
    bad_table = AttentionStep(**{**_fields(step), "decode_block_tables":
                                 step.decode_block_tables.clone()})  # fmt: skip
    bad_table.decode_block_tables[1, 0] = 10_000
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 10000 is not a block"):
        cpu_attention.prepare_attention(bad_table, k_cache)


def test_attention_refuses_an_unprepared_step_and_another_cache():
    step, qkv, k_cache, v_cache = layer_case(9, torch.float32, torch.float32, "row-major")
    with pytest.raises(ValueError, match="step was not prepared"):
        cpu_attention.attention(qkv, k_cache, v_cache, step)
    cpu_attention.prepare_attention(step, k_cache)
    with pytest.raises(ValueError, match="v_cache must be torch.float32"):
        cpu_attention.attention(qkv, k_cache, v_cache[:-1], step)
    with pytest.raises(ValueError, match=r"qkv must be \[17, 320\]"):
        cpu_attention.attention(qkv[:, :-1], k_cache, v_cache, step)


def _fields(step: AttentionStep) -> dict:
    return {name: getattr(step, name) for name in AttentionStep.__slots__ if name != "prepared"}
