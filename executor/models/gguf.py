"""GGUF checkpoints (llama.cpp's format): config from the metadata, weights dequantized.

The `gguf` package reads the file and dequantizes every tensor type it implements (F32, F16,
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, the IQ types, ...) to float32;
the weights are then cast to the executor's dtype. The result is a Hugging Face state dict,
so the rest of the loader is the one safetensors checkpoints use.

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
from executor.models.config import ModelConfig

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


def read_gguf_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the Hugging Face-named float32 tensors of a GGUF file.

    Raises:
        ValueError: not a GGUF file, an unsupported architecture, a tensor kvgate does not
            know, or a tensor type the `gguf` package cannot dequantize (naming both).
    """
    start = time.perf_counter()
    gguf = GgufFile(path)
    config = gguf_model_config(gguf)
    hf_names = _hf_names(config.num_hidden_layers)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in gguf.reader.tensors:
        name = hf_names.get(tensor.name)
        if name is None:
            raise ValueError(f"--model {gguf.path}: unexpected tensor {tensor.name}")
        weight = torch.from_numpy(dequantize_tensor(tensor, gguf.path))
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rotary_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rotary_rows(weight, config.num_key_value_heads)
        tensors[name] = weight
    log.info("read %s in %.1f s", gguf.path.name, time.perf_counter() - start)
    return config, tensors


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


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of each head's rows: within a head it interleaves the
    first and second halves (row pairs 2i, 2i + 1 hold Hugging Face's rows i, i + head_dim/2)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(rows, -1)
