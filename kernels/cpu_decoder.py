"""Every decoder layer of a CPU decode step in one C call (kernels/csrc/cpu_decoder.c).

`prepare_decoder` describes the model's weights and KV caches to the C code once;
`decoder_layers` then runs a step of at most `one_call_rows` tokens in one call, and larger
steps one kernel call at a time with the other CPU kernels. That is SMALL_BATCH_ROWS, or
COLUMNS_MAX_ROWS (a decode step of up to 64 streams) when kernels/cpu_linear.py runs every
layer's weights on the outer-product kernels at those sizes (`takes_columns`), which the C
stack calls the same way. Both paths run the same C kernels on the same layouts and give equal
results (finite ones: NaN's bits may differ), but for one thing: the stack holds the
embeddings column-major, and the first norm's float32 sums of squares over row-major ones run
in another order (the last bit may differ). The twin is kernels.reference.decoder_layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import cpu, cpu_attention, cpu_linear
from kernels.attention_step import AttentionStep
from kernels.cpu_build import CACHE_DTYPE_CODES, DTYPE_CODES, DecoderStruct, LayerStruct, library
from kernels.decoder import DecoderWeights, decoder_layers_with
from kernels.quant import QuantizedWeight

_one_call_at_a_time = decoder_layers_with(
    cpu_linear.linear, cpu_linear.linear_quantized, cpu.rms_norm, cpu_attention.attention,
    cpu.silu_and_mul,
)  # fmt: skip


@dataclass(slots=True)
class PreparedDecoder:
    """The C description of the stack, and what it was built from."""

    struct: DecoderStruct
    layers: ctypes.Array  # the LayerStruct array `struct` points into
    hidden_size: int
    act_dtype: torch.dtype
    cache_shape: tuple[int, ...]
    one_call_rows: int  # the most tokens a step runs in one call


def prepare_decoder(weights: DecoderWeights) -> DecoderWeights:
    """Check the stack's weights and caches and attach their C description.

    Raises:
        ValueError: a weight or cache the C code cannot read (the message names it).
    """
    first = weights.layers[0]
    act_dtype, cache = first.input_norm.dtype, first.k_cache
    hidden = first.input_norm.shape[0]
    intermediate = _out_features(first.gate_up) // 2
    layers = (LayerStruct * len(weights.layers))()
    for index, layer in enumerate(weights.layers):
        _check_layer(index, layer, act_dtype, cache)
        layers[index] = LayerStruct(
            layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
            cpu_linear.weights_struct(layer.qkv, layer.qkv_bias),
            cpu_linear.weights_struct(layer.o, layer.o_bias),
            cpu_linear.weights_struct(layer.gate_up, layer.gate_up_bias),
            cpu_linear.weights_struct(layer.down, layer.down_bias),
            layer.k_cache.data_ptr(), layer.v_cache.data_ptr(),
        )  # fmt: skip
    struct = DecoderStruct(layers, len(weights.layers), hidden, intermediate, weights.eps,
                           DTYPE_CODES[act_dtype], CACHE_DTYPE_CODES[cache.dtype],
                           cpu_linear.SMALL_BATCH_ROWS)  # fmt: skip
    names = ("qkv", "o", "gate_up", "down")
    columns = all(cpu_linear.takes_columns(getattr(layer, name), act_dtype)
                  for layer in weights.layers for name in names)  # fmt: skip
    rows = cpu_linear.COLUMNS_MAX_ROWS if columns else cpu_linear.SMALL_BATCH_ROWS
    weights.prepared = PreparedDecoder(struct, layers, hidden, act_dtype, tuple(cache.shape), rows)
    return weights


def one_call_rows(weights: DecoderWeights) -> int:
    """The most tokens `decoder_layers` runs in one call for these weights (0: unprepared)."""
    prepared = weights.prepared
    return prepared.one_call_rows if isinstance(prepared, PreparedDecoder) else 0


def _out_features(weight: torch.Tensor | QuantizedWeight) -> int:
    return weight.out_features if isinstance(weight, QuantizedWeight) else weight.shape[0]


def _check_layer(index: int, layer, act_dtype: torch.dtype, cache: torch.Tensor) -> None:
    for name in ("input_norm", "post_norm", "qkv_bias", "o_bias", "gate_up_bias", "down_bias"):
        tensor = getattr(layer, name)
        if tensor is not None and (tensor.dtype != act_dtype or not tensor.is_contiguous()):
            raise ValueError(f"layer {index} {name} must be contiguous {act_dtype}")
    for name in ("qkv", "o", "gate_up", "down"):
        weight = getattr(layer, name)
        if isinstance(weight, torch.Tensor) and (weight.dtype != act_dtype
                                                 or not weight.is_contiguous()):  # fmt: skip
            raise ValueError(f"layer {index} {name} must be contiguous {act_dtype}")
    for name in ("k_cache", "v_cache"):
        tensor = getattr(layer, name)
        if tensor.shape != cache.shape or tensor.dtype != cache.dtype or not tensor.is_contiguous():
            raise ValueError(f"layer {index} {name} must be a contiguous {cache.dtype} "
                             f"{tuple(cache.shape)} like layer 0's")  # fmt: skip


def decoder_layers(
    weights: DecoderWeights, hidden: torch.Tensor, step: AttentionStep
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU twin of kernels.reference.decoder_layers, for weights made by prepare_decoder
    and a step made by kernels.cpu_attention.prepare_attention. Results are column-major."""
    prepared, num_tokens = weights.prepared, hidden.shape[0]
    if num_tokens > max(one_call_rows(weights), cpu_linear.SMALL_BATCH_ROWS):
        return _one_call_at_a_time(weights, hidden, step)
    if not isinstance(prepared, PreparedDecoder):
        raise ValueError("weights were not prepared by kernels.cpu_decoder.prepare_decoder")
    if not isinstance(step.prepared, cpu_attention.PreparedStep):
        raise ValueError("step was not prepared by kernels.cpu_attention.prepare_attention")
    if step.prepared.cache_shape != prepared.cache_shape:
        raise ValueError(f"the step was prepared for a cache of {step.prepared.cache_shape}, "
                         f"the decoder's is {prepared.cache_shape}")  # fmt: skip
    expected = (step.num_tokens, prepared.hidden_size)
    if hidden.shape != expected or hidden.dtype != prepared.act_dtype or not hidden.is_contiguous():
        got = f"{hidden.dtype} {tuple(hidden.shape)}"
        raise ValueError(
            f"hidden must be contiguous {prepared.act_dtype} {list(expected)}, got {got}"
        )
    out = torch.empty(prepared.hidden_size, num_tokens, dtype=hidden.dtype)
    residual = torch.empty(prepared.hidden_size, num_tokens, dtype=hidden.dtype)
    failed = library().kvgate_decode_layers(
        ctypes.byref(prepared.struct), ctypes.byref(step.prepared.struct), hidden.data_ptr(),
        out.data_ptr(), residual.data_ptr(), num_tokens, torch.get_num_threads(),
    )  # fmt: skip
    if failed == 1:
        raise MemoryError("the decoder layers could not allocate their buffers")
    if failed:
        raise RuntimeError(f"the decoder layers' kernels refused this step (code {failed})")
    return out.t(), residual.t()


TIMED_KINDS = ("rms_norm", "linear", "attention", "silu_and_mul")


def kernel_seconds(keep_timing: bool) -> dict[str, float]:
    """Seconds the one-call stack spent in each kind of kernel since the last call, and timing
    turned on or off for what follows (it costs two clock reads per kernel; for profiling)."""
    seconds = (ctypes.c_double * len(TIMED_KINDS))()
    library().kvgate_decoder_timing(int(keep_timing), seconds)
    return dict(zip(TIMED_KINDS, seconds, strict=True))
