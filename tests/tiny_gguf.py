"""Tiny Llama GGUF files written by the tests with the `gguf` package's writer.

The file is what llama.cpp's converter would write for a seeded random Llama: its metadata,
a byte-level BPE tokenizer with ChatML control tokens, and the weights in the tensor types
the test names, with the Q and K rows reordered for llama.cpp's rotary layout. The gguf
package quantizes F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 itself; it has no
quantizer for the K-quants, so their blocks are random bytes with small finite scales.
The file's tokenizer is what transformers builds for `tokenizer.ggml.model` "gpt2".
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from transformers.convert_slow_tokenizer import bytes_to_unicode

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 256, 2, 4, 2, 512, 512
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
MERGES = ["Ġ t", "h e", "Ġt he"]
BOS_ID, EOS_ID, EOT_ID = 1, 2, 0
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Where each K-quant block keeps its float16 scale(s): the rest of a block may be any bytes.
K_QUANT_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
# A tensor type for every weight, so that one file holds every type transformers reads too.
MIXED_TYPES = {
    "token_embd": Q.Q8_0,
    "blk.0.attn_q": Q.Q4_0,
    "blk.0.attn_k": Q.Q4_1,
    "blk.0.attn_v": Q.Q8_0,
    "blk.0.attn_output": Q.Q4_K,
    "blk.0.ffn_gate": Q.Q6_K,
    "blk.0.ffn_up": Q.Q5_K,
    "blk.0.ffn_down": Q.Q2_K,
    "blk.1.attn_q": Q.Q3_K,
    "blk.1.attn_k": Q.F16,
    "blk.1.attn_v": Q.BF16,
    "blk.1.attn_output": Q.F32,
    "blk.1.ffn_gate": Q.Q4_K,
    "blk.1.ffn_up": Q.Q6_K,
    "blk.1.ffn_down": Q.Q4_0,
}


def vocabulary() -> list[str]:
    """Control tokens, the 256 byte-level symbols, then one token per merge."""
    byte_symbols = list(bytes_to_unicode().values())
    return [*CONTROL_TOKENS, *byte_symbols, *(m.replace(" ", "") for m in MERGES)]


def write_tiny_llama(
    path: Path,
    types: dict[str, Q] | None = None,
    seed: int = 0,
    add_bos: bool = False,
    eot_id: int = EOT_ID,
) -> dict[str, np.ndarray]:
    """Write a seeded random two-layer Llama as a GGUF file.

    Args:
        path: the file to write.
        types: tensor type by tensor name without ".weight" (default MIXED_TYPES); norms are
            F32, any other tensor Q8_0. A type that the gguf package cannot quantize gets
            random blocks (small finite scales for the K-quants).
        seed: seed of the weights.
        add_bos: the tokenizer's tokenizer.ggml.add_bos_token.
        eot_id: the tokenizer's end-of-turn id (tokenizer.ggml.eot_token_id).

    Returns:
        The float values each tensor was quantized from, by GGUF name, in Hugging Face's
        layout and row order (meaningless for random blocks).
    """
    types = MIXED_TYPES if types is None else types
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, add_bos, eot_id)
    rng = np.random.default_rng(seed)
    drawn: dict[str, np.ndarray] = {}
    for name, shape in _weight_shapes(len(vocabulary())).items():
        if name.endswith("_norm"):
            drawn[name] = 1 + 0.1 * rng.standard_normal(shape, np.float32)
            writer.add_tensor(f"{name}.weight", drawn[name])
            continue
        scale = 1.0 if name == "token_embd" else shape[1] ** -0.5
        values = drawn[name] = scale * rng.standard_normal(shape, np.float32)
        if name.endswith(("attn_q", "attn_k")):
            values = _llama_cpp_rotary_order(values, HEADS if name.endswith("q") else KV_HEADS)
        qtype = types.get(name, Q.Q8_0)
        writer.add_tensor(f"{name}.weight", _encode(values, qtype, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return drawn


def _write_metadata(writer: gguf.GGUFWriter, add_bos: bool, eot_id: int) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    tokens = vocabulary()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    control = len(CONTROL_TOKENS)
    writer.add_token_types([3] * control + [1] * (len(tokens) - control))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_eot_token_id(eot_id)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)


def _weight_shapes(vocab_size: int) -> dict[str, tuple[int, int] | tuple[int]]:
    """Hugging Face layout [out_features, in_features] of every tensor, by GGUF name."""
    head_dim = HIDDEN // HEADS
    shapes: dict[str, tuple[int, int] | tuple[int]] = {"token_embd": (vocab_size, HIDDEN)}
    for layer in range(LAYERS):
        shapes |= {
            f"blk.{layer}.attn_norm": (HIDDEN,),
            f"blk.{layer}.attn_q": (HEADS * head_dim, HIDDEN),
            f"blk.{layer}.attn_k": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{layer}.attn_v": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{layer}.attn_output": (HIDDEN, HEADS * head_dim),
            f"blk.{layer}.ffn_norm": (HIDDEN,),
            f"blk.{layer}.ffn_gate": (FFN, HIDDEN),
            f"blk.{layer}.ffn_up": (FFN, HIDDEN),
            f"blk.{layer}.ffn_down": (HIDDEN, FFN),
        }
    return shapes | {"output_norm": (HIDDEN,)}


def _llama_cpp_rotary_order(values: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two halves of each head's rows."""
    rows = values.shape[0]
    return values.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(rows, -1)


def _encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        pass
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = values.size // block_elements
    blocks = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS.get(qtype, ()):
        scales = rng.uniform(1e-4, 5e-4, num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(values.shape[0], -1)
