"""The CPU decoder stack (every layer of a step in one C call) against its reference twin
(the same layers one reference kernel call at a time), and the caches both leave behind.

Tolerances: float32 within 1e-4 relative to the largest output (two layers of sums in another
order); bfloat16 within a few bfloat16 steps (each kernel rounds where the reference rounds,
but a one-step difference early on grows through the layers).
"""

import pytest
import torch

from kernels import cpu_attention, cpu_decoder, cpu_linear, quant
from kernels import reference as ref
from kernels.decoder import DecoderLayerWeights, DecoderWeights
from tests.kernels.test_cpu_dtypes import layer_case

# Every test here runs once per ISA level this CPU runs (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("isa_level")

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 32
HIDDEN, INTERMEDIATE = 64, 96


def make_weights(gen, fmt: str, dtype: torch.dtype, caches, biases: bool) -> DecoderWeights:
    """Two layers of random weights in `fmt` (dense, int8 or int4) over the given caches."""

    def weight(out_features: int, in_features: int):
        dense = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
        if fmt == "int8":
            return quant.quantize_int8(dense)
        if fmt == "int4":
            return quant.quantize_int4(dense, 32)
        return dense.to(dtype)

    def bias(size: int):
        return (0.1 * torch.randn(size, generator=gen)).to(dtype) if biases else None

    qkv_width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    layers = [
        DecoderLayerWeights(
            input_norm=(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
            qkv=weight(qkv_width, HIDDEN),
            o=weight(HIDDEN, NUM_HEADS * HEAD_DIM),
            post_norm=(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype),
            gate_up=weight(2 * INTERMEDIATE, HIDDEN),
            down=weight(HIDDEN, INTERMEDIATE),
            k_cache=k,
            v_cache=v,
            qkv_bias=bias(qkv_width),
            o_bias=bias(HIDDEN),
            gate_up_bias=bias(2 * INTERMEDIATE),
            down_bias=bias(HIDDEN),
        )  # fmt: skip
        for k, v in caches
    ]
    return DecoderWeights(layers, 1e-5)


SMALL_STEP = (1, 1, 2, 3, 1)  # 8 tokens: two decodes and three prefill chunks


def stacks(
    fmt: str, dtype: torch.dtype, cache_dtype: torch.dtype, biases: bool, query_lens=SMALL_STEP
):
    """(cpu weights, reference weights, step, hidden) over equal copies of two layers' caches."""
    step, _, k_cache, v_cache = layer_case(21, dtype, cache_dtype, "row-major", query_lens)
    gen = torch.Generator().manual_seed(22)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    expected_caches = [(k.clone(), v.clone()) for k, v in caches]
    weights = make_weights(gen, fmt, dtype, caches, biases)
    gen.manual_seed(22)
    expected = make_weights(gen, fmt, dtype, expected_caches, biases)
    hidden = torch.randn(step.num_tokens, HIDDEN, generator=gen).to(dtype)
    return weights, expected, step, hidden


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() /
            expected.double().abs().max()).item()  # fmt: skip


@pytest.mark.parametrize("biases", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_stack_matches_the_reference_and_fills_the_same_caches(dtype, fmt, biases):
    weights, expected_weights, step, hidden = stacks(fmt, dtype, dtype, biases)
    assert step.num_tokens == 8, "the small-batch kernels' whole range"
    expected, expected_residual = ref.decoder_layers(expected_weights, hidden, step)
    cpu_attention.prepare_attention(step, weights.layers[0].k_cache)
    cpu_decoder.prepare_decoder(weights)
    out, residual = cpu_decoder.decoder_layers(weights, hidden, step)
    assert out.shape == expected.shape and out.dtype == dtype
    bound = 1e-4 if dtype == torch.float32 else 8 * 2.0**-8
    assert relative_error(out, expected) <= bound, "hidden"
    assert relative_error(residual, expected_residual) <= bound, "residual"
    for layer, expected_layer in zip(weights.layers, expected_weights.layers, strict=True):
        assert relative_error(layer.k_cache, expected_layer.k_cache) <= bound, "stored keys"
        assert relative_error(layer.v_cache, expected_layer.v_cache) <= bound, "stored values"


LARGER_STEP = (1, 1, 6, 8, 1)  # 17 tokens


def expected_one_call_rows(fmt: str, dtype: torch.dtype) -> int:
    """What cpu_linear routes 9-64-row products of these weights to, by hand: the outer-product
    kernels (so the C stack takes up to 64 tokens) unless the CPU has AMX tiles and the
    activations are bfloat16 (oneDNN, or torch on weights dequantized to bfloat16) or the layer
    is per-channel int8 (the tile kernel)."""
    if not cpu_linear._columns_built():
        return cpu_linear.SMALL_BATCH_ROWS
    if not cpu_linear._tiles_built():
        return cpu_linear.COLUMNS_MAX_ROWS
    on_columns = dtype == torch.float32 and fmt != "int8"
    return cpu_linear.COLUMNS_MAX_ROWS if on_columns else cpu_linear.SMALL_BATCH_ROWS


@pytest.mark.parametrize("biases", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_up_to_64_tokens_gives_in_one_call_what_it_gives_a_kernel_call_at_a_time(
    dtype, fmt, biases
):
    weights, expected_weights, step, hidden = stacks(fmt, dtype, dtype, biases, LARGER_STEP)
    per_call, _, per_call_step, _ = stacks(fmt, dtype, dtype, biases, LARGER_STEP)
    cpu_attention.prepare_attention(step, weights.layers[0].k_cache)
    cpu_attention.prepare_attention(per_call_step, per_call.layers[0].k_cache)
    cpu_decoder.prepare_decoder(weights)
    assert cpu_decoder.one_call_rows(weights) == expected_one_call_rows(fmt, dtype)
    assert step.num_tokens == 17
    out, residual = cpu_decoder.decoder_layers(weights, hidden, step)
    # The stack holds the embeddings column-major as the linear layers' outputs; given so, the
    # per-call path's first norm sums each token's squares in the same order as well.
    expected_out, expected_residual = cpu_decoder._one_call_at_a_time(
        per_call, hidden.t().contiguous().t(), per_call_step
    )
    assert torch.equal(out, expected_out), "hidden"
    assert torch.equal(residual, expected_residual), "residual"
    for layer, expected_layer in zip(weights.layers, per_call.layers, strict=True):
        assert torch.equal(layer.k_cache, expected_layer.k_cache), "stored keys"
        assert torch.equal(layer.v_cache, expected_layer.v_cache), "stored values"
    # int4 layers round x to int8 blocks: a last-bit difference upstream can move one of its
    # values by a step of its block (test_quant holds the 9-64-row path to its reference).
    bound = 1e-2 if fmt == "int4" else 1e-4 if dtype == torch.float32 else 8 * 2.0**-8
    reference, _ = ref.decoder_layers(expected_weights, hidden, step)
    assert relative_error(out, reference) <= bound


def test_a_larger_step_runs_one_kernel_call_at_a_time_and_a_bfloat16_cache_serves_float32():
    weights, expected_weights, step, hidden = stacks(
        "int8", torch.float32, torch.bfloat16, True, LARGER_STEP
    )
    cpu_attention.prepare_attention(step, weights.layers[0].k_cache)
    cpu_decoder.prepare_decoder(weights)
    weights.prepared.one_call_rows = cpu_linear.SMALL_BATCH_ROWS  # as for weights on oneDNN
    timed = cpu_decoder.kernel_seconds(keep_timing=True)
    out, _ = cpu_decoder.decoder_layers(weights, hidden, step)
    timed = cpu_decoder.kernel_seconds(keep_timing=False)
    assert not any(timed.values()), "17 tokens ran in the one-call stack"
    expected, _ = ref.decoder_layers(expected_weights, hidden, step)
    assert relative_error(out, expected) <= 1e-4


def test_unprepared_or_mismatched_inputs_are_refused():
    weights, _, step, hidden = stacks("dense", torch.float32, torch.float32, False)
    small = hidden[:2]  # the step has 8 tokens
    cpu_attention.prepare_attention(step, weights.layers[0].k_cache)
    with pytest.raises(ValueError, match="weights were not prepared"):
        cpu_decoder.decoder_layers(weights, small, step)
    cpu_decoder.prepare_decoder(weights)
    with pytest.raises(ValueError, match=r"hidden must be contiguous torch.float32 \[8, 64\]"):
        cpu_decoder.decoder_layers(weights, small, step)
    weights.layers[1].v_cache = weights.layers[1].v_cache[:-1]
    with pytest.raises(ValueError, match="layer 1 v_cache must be a contiguous torch.float32"):
        cpu_decoder.prepare_decoder(weights)
