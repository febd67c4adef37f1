"""GGUF files loaded with weight-only quantization: Q8_0, Q4_0 and Q4_1 blocks become kvgate's
int8 / int4 weights byte for byte (no float round trip), the rest is quantized from floats,
and the model computes what the dequantized model computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from common.gguf_metadata import GgufFile
from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.loader import load_model
from kernels.quant import INT4_BLOCK
from tests.tiny_gguf import write_tiny_llama

# Layer 0 all Q4_1 (the default model's type); layer 1's q/k/v of three types (Q4_0 and Q4_1
# fuse as int4; Q8_0 beside them does not), its o_proj Q4_0, its MLP Q8_0 and F16.
TYPES = {
    "token_embd": Q.Q8_0,
    **{f"blk.0.{n}": Q.Q4_1 for n in ("attn_q", "attn_k", "attn_v", "attn_output")},
    **{f"blk.0.{n}": Q.Q4_1 for n in ("ffn_gate", "ffn_up", "ffn_down")},
    "blk.1.attn_q": Q.Q4_0,
    "blk.1.attn_k": Q.Q4_1,
    "blk.1.attn_v": Q.Q8_0,
    "blk.1.attn_output": Q.Q4_0,
    "blk.1.ffn_gate": Q.Q8_0,
    "blk.1.ffn_up": Q.Q8_0,
    "blk.1.ffn_down": Q.F16,
}
PROMPT = [3, 9, 40, 88, 120, 200, 250, 12, 5, 77, 31]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf"
    write_tiny_llama(path, TYPES)
    return path


def file_blocks(path: Path, name: str) -> torch.Tensor:
    """A tensor's raw bytes as [rows, bytes per row]."""
    tensor = next(t for t in GgufFile(path).reader.tensors if t.name == f"{name}.weight")
    return torch.from_numpy(np.array(tensor.data)).reshape(int(tensor.shape[-1]), -1)


def test_int4_keeps_the_files_q4_and_q8_blocks_byte_for_byte(path: Path):
    model, _ = load_model(path, CPU, torch.float32, "int4")
    o_proj = model.layers[0].self_attn.o_proj.quantized
    blocks = file_blocks(path, "blk.0.attn_output").reshape(o_proj.out_features, -1, 20)
    assert (o_proj.bits, o_proj.group_size) == (4, INT4_BLOCK)
    assert torch.equal(o_proj.qweight, blocks[:, :, 4:].reshape(o_proj.out_features, -1))
    assert torch.equal(o_proj.scales.view(torch.uint8), blocks[:, :, 0:2].reshape(-1, 2 * 8))
    assert torch.equal(o_proj.zeros.view(torch.uint8), blocks[:, :, 2:4].reshape(-1, 2 * 8))
    head = model.lm_head.quantized
    table = file_blocks(path, "token_embd").reshape(head.out_features, -1, 34)
    assert (head.bits, head.group_size) == (8, 32), "the Q8_0 token table is the int8 head"
    assert torch.equal(
        head.qweight.view(torch.uint8), table[:, :, 2:].reshape(head.out_features, -1)
    )
    assert model.embed_tokens.quantized is head and model.embed_tokens.weight is None
    assert model.layers[1].self_attn.o_proj.quantized.bits == 4, "Q4_0 read as int4"
    assert model.layers[1].mlp.gate_up_proj.quantized.group_size == 32, "Q8_0 read as it is"


def test_int4_weights_equal_the_dequantized_files_values(path: Path):
    dense, _ = load_model(path, CPU, torch.float32)
    quantized, _ = load_model(path, CPU, torch.float32, "int4")
    exact = {  # kept blocks: the same values; q/k rows in Hugging Face's order
        "layers.0.self_attn.qkv_proj": "q/k/v all Q4_1",
        "layers.0.mlp.gate_up_proj": "gate/up Q4_1",
        "layers.0.mlp.down_proj": "Q4_1",
        "layers.1.self_attn.o_proj": "Q4_0",
        "layers.1.mlp.gate_up_proj": "Q8_0",
    }
    for name, what in exact.items():
        got = quantized.get_submodule(name).quantized.dequantize()
        assert torch.equal(got, dense.get_submodule(name).weight), f"{name} ({what})"
    # q (Q4_0), k (Q4_1) and v (Q8_0) do not share a format: quantized from their floats.
    qkv = quantized.layers[1].self_attn.qkv_proj.quantized
    expected = dense.layers[1].self_attn.qkv_proj.weight
    assert qkv.bits == 4 and not torch.equal(qkv.dequantize(), expected)
    assert (qkv.dequantize() - expected).abs().max() < 0.1 * expected.abs().max()
    torch.testing.assert_close(quantized.lm_head.quantized.dequantize(), dense.lm_head.weight)


def test_int8_keeps_q8_0_blocks_and_quantizes_the_q4_ones_per_channel(path: Path):
    dense, _ = load_model(path, CPU, torch.float32)
    model, _ = load_model(path, CPU, torch.float32, "int8")
    gate_up = model.layers[1].mlp.gate_up_proj.quantized
    assert (gate_up.bits, gate_up.group_size) == (8, 32)
    assert torch.equal(gate_up.dequantize(), dense.layers[1].mlp.gate_up_proj.weight)
    down = model.layers[0].mlp.down_proj.quantized  # Q4_1: no int8 blocks to keep
    assert (down.bits, down.group_size) == (8, down.in_features)


def test_engine_on_kept_blocks_computes_the_dequantized_models_logits(tmp_path: Path):
    path = tmp_path / "q4_1.gguf"  # as the default model's file: Q4_1, a Q8_0 token table
    write_tiny_llama(path, {name: Q.Q4_1 for name in TYPES} | {"token_embd": Q.Q8_0})

    def logits(quantization: str) -> torch.Tensor:
        config = EngineConfig(model=str(path), kv_cache_gib=0.02, quantization=quantization)
        return Engine(config).prompt_logits(PROMPT)

    # int4 layers multiply activations rounded to int8 blocks of 32 (kernels.quant): within a
    # percent of the largest logit of the dense model (a wrong block layout is off by far more).
    dense = logits("none")
    torch.testing.assert_close(logits("int4"), dense, atol=1e-2 * dense.abs().max(), rtol=0)
