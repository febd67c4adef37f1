"""GGUF checkpoints in the executor: config from the metadata, every tensor type dequantized,
llama.cpp's rotary row order undone; checked against transformers loading the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from common.gguf_metadata import GgufFile
from common.model_files import gguf_file
from common.sampling_params import SamplingParams
from engine.engine import Engine
from engine.models.gguf import dequantize_tensor
from engine.models.loader import load_model
from tests.helpers import (
    assert_greedy_matches,
    greedy_tokens,
    hf_greedy,
    make_engine,
    run_to_completion,
)
from tests.tiny_gguf import EOS_ID, EOT_ID, MIXED_TYPES, write_tiny_llama

PROMPTS = [[1, 76, 71, 259, 72, 261, 2], [3, 9, 40, 88, 120, 200, 250, 12, 5]]
# Types the gguf package dequantizes but transformers does not read: checked against the
# values the file was written from instead.
GGUF_ONLY_TYPES = (Q.Q5_0, Q.Q5_1)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf"
    write_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def hf_model(mixed_gguf: Path):
    return AutoModelForCausalLM.from_pretrained(
        mixed_gguf.parent, gguf_file=mixed_gguf.name, dtype=torch.float32
    ).eval()


def hf_weights_of(hf_model, layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}."
    return {k[len(prefix) :]: v for k, v in hf_model.state_dict().items() if k.startswith(prefix)}


def test_weights_equal_transformers_for_every_tensor_type(mixed_gguf: Path, hf_model):
    required = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K}
    assert required <= set(MIXED_TYPES.values()), "the test file lacks a required type"
    model, config = load_model(mixed_gguf, torch.device("cpu"), torch.float32)
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    for layer in range(config.num_hidden_layers):
        ours = model.layers[layer]
        q_proj, k_proj, v_proj = ours.self_attn.qkv_proj.weight.split([q, kv, kv])
        gate, up = ours.mlp.gate_up_proj.weight.split(config.intermediate_size)
        got = {
            "self_attn.q_proj.weight": q_proj,
            "self_attn.k_proj.weight": k_proj,
            "self_attn.v_proj.weight": v_proj,
            "self_attn.o_proj.weight": ours.self_attn.o_proj.weight,
            "mlp.gate_proj.weight": gate,
            "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": ours.mlp.down_proj.weight,
            "input_layernorm.weight": ours.input_layernorm.weight,
        }
        expected = hf_weights_of(hf_model, layer)
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, expected[name], msg=f"layer {layer} {name}")
    embed = hf_model.state_dict()["model.embed_tokens.weight"]
    torch.testing.assert_close(model.embed_tokens.weight, embed, msg="token_embd (Q8_0)")


def test_dequantized_values_equal_transformers_torch_dequantizer(mixed_gguf: Path):
    """transformers' from_pretrained reads Llama GGUF files with the gguf package, as kvgate
    does; its torch dequantizer (used for other architectures) is a second implementation."""
    from transformers.integrations.gguf import dequant

    checked = set()
    for tensor in GgufFile(mixed_gguf).reader.tensors:
        if int(tensor.tensor_type) not in dequant.GGML_BLOCK:
            continue
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(-1))
        expected = dequant.dequantize(raw, int(tensor.tensor_type))
        got = torch.from_numpy(dequantize_tensor(tensor, mixed_gguf)).reshape(-1)
        torch.testing.assert_close(got, expected, msg=f"{tensor.name} ({tensor.tensor_type.name})")
        checked.add(tensor.tensor_type.name)
    assert checked == {"Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def test_config_comes_from_the_metadata(mixed_gguf: Path):
    _, config = load_model(mixed_gguf, torch.device("cpu"), torch.float32)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (256, 2, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 512 and config.tie_word_embeddings
    assert config.eos_token_ids == (EOS_ID, EOT_ID), "EOS and EOT must both end a turn"


def test_engine_greedy_equals_transformers_on_the_same_gguf(mixed_gguf: Path, hf_model):
    got = greedy_tokens(make_engine(mixed_gguf), PROMPTS, 24)
    for i, prompt in enumerate(PROMPTS):
        assert_greedy_matches(got[i], hf_greedy(hf_model, prompt, 24), f"prompt {i}")


def test_generation_stops_at_the_files_end_of_turn_id(tmp_path: Path):
    path = tmp_path / "t.gguf"
    write_tiny_llama(path)
    free = run_to_completion(engine_with(path, SamplingParams(max_tokens=8, temperature=0.0)))
    tokens = free["r"]
    # The last step whose token came for the first time: the reply must end right there.
    step = max(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])
    eot = tokens[step]
    write_tiny_llama(path, eot_id=eot)  # the same weights, another end-of-turn id
    engine = engine_with(path, SamplingParams(max_tokens=8, temperature=0.0))
    outputs = [out for _ in range(16) if engine.has_unfinished() for out in engine.step()]
    assert [t for out in outputs for t in out.new_token_ids] == tokens[: step + 1]
    assert outputs[-1].finish_reason == "stop", "the end-of-turn id must end the reply"


def engine_with(path: Path, params: SamplingParams) -> Engine:
    engine = make_engine(path)
    engine.add_request("r", PROMPTS[1], params)
    return engine


def test_a_folder_holding_one_gguf_file_is_that_file(mixed_gguf: Path, tmp_path: Path):
    assert gguf_file(mixed_gguf.parent) == mixed_gguf
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        gguf_file(tmp_path)


@pytest.mark.parametrize("qtype", GGUF_ONLY_TYPES, ids=lambda q: q.name)
def test_types_transformers_cannot_read_load_close_to_the_written_values(tmp_path: Path, qtype: Q):
    drawn = write_tiny_llama(tmp_path / "t.gguf", {"blk.0.ffn_up": qtype, "blk.1.attn_q": qtype})
    model, _ = load_model(tmp_path / "t.gguf", torch.device("cpu"), torch.float32)
    loaded = {
        "blk.0.ffn_up": model.layers[0].mlp.gate_up_proj.weight[512:],
        "blk.1.attn_q": model.layers[1].self_attn.qkv_proj.weight[:256],
    }
    for name, weight in loaded.items():
        written = drawn[name]
        error = np.abs(weight.numpy() - written).max()
        # 5-bit blocks of 32 values: an error of a few percent of the block's largest value.
        assert error < 0.08 * np.abs(written).max(), f"{qtype.name} {name}: max error {error}"


def test_a_type_the_gguf_package_cannot_dequantize_names_the_tensor(tmp_path: Path):
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, {"blk.1.attn_v": Q.Q8_1})
    with pytest.raises(ValueError, match=r"tensor blk\.1\.attn_v\.weight has type Q8_1"):
        load_model(path, torch.device("cpu"), torch.float32)


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(path, torch.device("cpu"), torch.float32)
