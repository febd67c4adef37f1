"""GGUF checkpoints (llama.cpp's format): config from the metadata, weights dequantized or
kept in their blocks.

The `gguf` package reads the file and dequantizes every tensor type it implements (F32, F16,
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, the IQ types, ...) to float32;
the weights are then cast to the executor's dtype. The result is a Hugging Face state dict,
so the rest of the loader is the one safetensors checkpoints use.

With weight-only quantization, linear layers whose blocks are already kvgate's format are
not dequantized: Q8_0 becomes int8 in groups of 32 (`--quantization int8` or `int4`), Q4_0
and Q4_1 become int4 in groups of 32 (`int4`; not for the output layer, which kvgate keeps
int8). Their bytes are copied as they are (kernels/quant.py).

llama.cpp's converter reorders the rows of each head in the Q and K projections of Llama
models (its rotary embedding pairs neighbouring dimensions, Hugging Face's pairs the two
halves of a head); the reordering is undone here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, ReaderTensor, quants

from common.gguf_metadata import GgufFile
from engine.models.config import ModelConfig
from kernels.quant import (
    QuantizedWeight,
    from_gguf_q4_0,
    from_gguf_q4_1,
    from_gguf_q8_0,
    permute_rows,
)

log = logging.getLogger(__name__)

# GGUF architecture -> the Hugging Face architecture kvgate builds for it.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_GLOBAL_TENSORS = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
}
_LAYER_TENSORS = {
    MODEL_TENSOR.ATTN_NORM: "input_layernorm",
    MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
    MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
    MODEL_TENSOR.FFN_GATE: "mlp.gate_proj",
    MODEL_TENSOR.FFN_UP: "mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
}
_BLOCK_READERS = {
    GGMLQuantizationType.Q8_0: from_gguf_q8_0,
    GGMLQuantizationType.Q4_0: from_gguf_q4_0,
    GGMLQuantizationType.Q4_1: from_gguf_q4_1,
}
# Block types kept as they are, by --quantization: for the decoder's linear layers, and for
# the output layer (or a tied token table, which is the output layer).
_KEPT_LINEAR = {
    "int8": {GGMLQuantizationType.Q8_0},
    "int4": set(_BLOCK_READERS),
}
_KEPT_OUTPUT = {"int8": {GGMLQuantizationType.Q8_0}, "int4": {GGMLQuantizationType.Q8_0}}
_LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight")


def gguf_model_config(gguf: GgufFile) -> ModelConfig:
    """The model's shape from the GGUF metadata.

    Raises:
        ValueError: an architecture or a rope setting kvgate does not implement.
    """
    architecture = GGUF_ARCHITECTURES.get(gguf.architecture)
    if architecture is None:
        raise ValueError(
            f"--model {gguf.path}: GGUF architecture {gguf.architecture!r} is not supported; "
            f"kvgate reads {', '.join(GGUF_ARCHITECTURES)}"
        )
    _check_rope(gguf)
    hidden_size = int(gguf.arch_value("embedding_length"))
    num_heads = int(gguf.arch_value("attention.head_count"))
    names = set(gguf.tensor_names())
    vocab_size = gguf.arch_value("vocab_size") or len(gguf.value("tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(gguf.arch_value("feed_forward_length")),
        num_hidden_layers=int(gguf.arch_value("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(gguf.arch_value("attention.head_count_kv", num_heads)),
        head_dim=int(gguf.arch_value("attention.key_length", hidden_size // num_heads)),
        rms_norm_eps=float(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf.arch_value("rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(gguf.arch_value("context_length", 2048)),
        tie_word_embeddings=f"{TENSOR_NAMES[MODEL_TENSOR.OUTPUT]}.weight" not in names,
        qkv_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        sliding_window=None,
        eos_token_ids=gguf.end_of_turn_ids(),
    )


def _check_rope(gguf: GgufFile) -> None:
    scaling = gguf.arch_value("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"--model {gguf.path}: rope scaling {scaling!r} is not supported")
    if f"{TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS]}.weight" in gguf.tensor_names():
        raise ValueError(
            f"--model {gguf.path}: per-dimension rope frequencies (rope_freqs, Llama 3.1 "
            "scaling) are not supported"
        )


def read_gguf_checkpoint(
    path: str | Path, quantization: str = "none"
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """The config, the Hugging Face-named float32 tensors of a GGUF file, and the linear
    weights kept in their blocks for `quantization` (Hugging Face module names; a tied token
    table kept is the output layer, "lm_head").

    Raises:
        ValueError: not a GGUF file, an unsupported architecture, a tensor kvgate does not
            know, or a tensor type the `gguf` package cannot dequantize (naming both).
    """
    start = time.perf_counter()
    gguf = GgufFile(path)
    config = gguf_model_config(gguf)
    hf_names = _hf_names(config.num_hidden_layers)
    tensors: dict[str, torch.Tensor] = {}
    kept: dict[str, QuantizedWeight] = {}
    for tensor in gguf.reader.tensors:
        name = hf_names.get(tensor.name)
        if name is None:
            raise ValueError(f"--model {gguf.path}: unexpected tensor {tensor.name}")
        if config.tie_word_embeddings and name == "model.embed_tokens.weight":
            name = "lm_head.weight"  # read as the output layer when kept, renamed back if not
        qtype = GGMLQuantizationType(tensor.tensor_type)
        order = _rotary_order(name, config)
        if qtype in _kept_types(name, quantization):
            blocks = torch.from_numpy(np.array(tensor.data))  # copied out of the file mapping
            weight = _BLOCK_READERS[qtype](blocks, int(tensor.shape[-1]))
            kept[name.removesuffix(".weight")] = (
                weight if order is None else permute_rows(weight, order)
            )
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        weight = torch.from_numpy(dequantize_tensor(tensor, gguf.path))
        tensors[name] = weight if order is None else weight[order]
    log.info("read %s in %.1f s (%d linear layers kept in their blocks)",
             gguf.path.name, time.perf_counter() - start, len(kept))  # fmt: skip
    return config, tensors, kept


def _kept_types(name: str, quantization: str) -> set[GGMLQuantizationType]:
    if not name.endswith(_LINEAR_SUFFIXES):
        return set()
    table = _KEPT_OUTPUT if name == "lm_head.weight" else _KEPT_LINEAR
    return table.get(quantization, set())


def _hf_names(num_layers: int) -> dict[str, str]:
    names = {f"{TENSOR_NAMES[t]}.weight": f"{hf}.weight" for t, hf in _GLOBAL_TENSORS.items()}
    for layer in range(num_layers):
        for tensor, hf in _LAYER_TENSORS.items():
            gguf_name = TENSOR_NAMES[tensor].format(bid=layer)
            names[f"{gguf_name}.weight"] = f"model.layers.{layer}.{hf}.weight"
    return names


def dequantize_tensor(tensor: ReaderTensor, path: Path) -> np.ndarray:
    """A tensor of the file as float32, in Hugging Face's [out_features, in_features] layout.

    Raises:
        ValueError: naming the tensor and its type, when the gguf package cannot dequantize it.
    """
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ValueError(
            f"--model {path}: tensor {tensor.name} has type {qtype.name}, which the gguf "
            "package cannot dequantize"
        ) from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dim first
    # F32 tensors come back as views of the read-only file mapping: those are copied.
    return np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]).reshape(shape)


def _rotary_order(name: str, config: ModelConfig) -> torch.Tensor | None:
    """The row order that undoes llama.cpp's reordering of each head's rows in the Q and K
    projections (within a head it interleaves the first and second halves: row pairs 2i,
    2i + 1 hold Hugging Face's rows i, i + head_dim/2); None for other tensors."""
    if name.endswith("q_proj.weight"):
        num_heads = config.num_attention_heads
    elif name.endswith("k_proj.weight"):
        num_heads = config.num_key_value_heads
    else:
        return None
    half = config.head_dim // 2
    return (
        torch.arange(num_heads * config.head_dim)
        .reshape(num_heads, half, 2)
        .transpose(1, 2)
        .flatten()
    )
