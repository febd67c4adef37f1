"""Weight-only quantization of a model's linear layers at load (--quantization).

`int8` stores every linear layer's weight as int8 with one scale per output channel; `int4`
stores the decoder's linear layers as int4 in groups of 32 input features (a layer whose input
width 32 does not divide stays int8). In both the output layer (and the token embeddings, which
read their rows from it when tied) is int8 per channel: it decides the sampled token, and int4
costs it the most accuracy for the fewest bytes. Norms and biases stay in the model's dtype.

A loader that reads already-quantized tensors (GGUF Q8_0, Q4_0, Q4_1) passes them in
`prequantized`, and they are used as they are.
"""

from __future__ import annotations

import logging

import torch

from kernels.quant import (
    DEFAULT_INT4_GROUP_SIZE,
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
)

logger = logging.getLogger("kvgate.executor")

QUANTIZATIONS = ("none", "int8", "int4")
_DECODER_LINEARS = (
    "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
)  # fmt: skip


def quantized_names(num_layers: int) -> list[str]:
    """Module names of every linear layer quantization applies to, the output layer last."""
    names = [f"layers.{i}.{module}" for i in range(num_layers) for module in _DECODER_LINEARS]
    return [*names, "lm_head"]


def quantize_state(
    state: dict[str, torch.Tensor],
    num_layers: int,
    quantization: str,
    prequantized: dict[str, QuantizedWeight] | None = None,
) -> dict[str, QuantizedWeight]:
    """Take the linear layers' weights out of `state` and return them quantized.

    Args:
        state: kvgate module names -> dense tensors (any float dtype); the quantized layers'
            `.weight` entries are removed from it, and a tied embedding's with its head's.
        num_layers: the model's decoder layers.
        quantization: "none", "int8" or "int4".
        prequantized: module name -> weight already in kvgate's format (from the checkpoint).

    Returns:
        module name -> quantized weight, for `apply_quantized`.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                         f"{quantization!r}")  # fmt: skip
    quantized = dict(prequantized or {})
    if quantization == "none":
        return quantized
    for name in quantized_names(num_layers):
        dense = state.pop(f"{name}.weight", None)
        if name == "lm_head" and dense is not None and dense is state.get("embed_tokens.weight"):
            del state["embed_tokens.weight"]  # tied: the embedding reads the quantized head
        if name in quantized or dense is None:
            continue
        quantized[name] = _quantize(name, dense, quantization)
    return quantized


def _quantize(name: str, weight: torch.Tensor, quantization: str) -> QuantizedWeight:
    weight = weight.float()
    if quantization == "int4" and name != "lm_head":
        if weight.shape[1] % DEFAULT_INT4_GROUP_SIZE == 0:
            return quantize_int4(weight, DEFAULT_INT4_GROUP_SIZE)
        logger.info("%s: input width %d is not a multiple of %d; int8 instead of int4",
                    name, weight.shape[1], DEFAULT_INT4_GROUP_SIZE)  # fmt: skip
    return quantize_int8(weight)


def apply_quantized(
    model: torch.nn.Module,
    quantized: dict[str, QuantizedWeight],
    device: torch.device,
    tie_word_embeddings: bool,
) -> None:
    """Put the quantized weights into their modules (on `device`); a tied embedding table
    reads its rows from the output layer's weight, an untied one gets its own int8 copy."""
    for name, weight in quantized.items():
        model.get_submodule(name).set_quantized(weight.to(device))
    head = model.lm_head.quantized
    if head is None:
        return
    embedding = model.embed_tokens
    if tie_word_embeddings:
        embedding.set_quantized(head)
    elif embedding.weight is not None:
        embedding.set_quantized(quantize_int8(embedding.weight.float()).to(device))
