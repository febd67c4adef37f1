"""The engine with a KV cache of another format than the model's: 16-bit floats, and int8 or
fp8 (float8 e4m3) values with one bfloat16 scale per token (kernels/kv_format.py).

Greedy tokens must be identical where the numbers are (auto is the model's dtype, as before
the flag existed; the C kernels against their reference twins on an int8 or fp8 cache). Where
they are not (a rounded or quantized cache), the measure is bench/quality.py's teacher-forced
top-1 agreement with the float32 cache along its greedy continuation, computed here on 16 story
prompts x 128 tokens and held to the bar the bfloat16 and int8 weights meet (>= 95%); fp8 to
93%: its 3 mantissa bits step by 1/16 of a value where int8 steps by 1/254 of the token's
largest, and it measures 0.951 on stories260K, too close to 95% for a bar that must not move
with the order of a sum on another CPU. A wrong scale or a wrong code drops far below either.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.quality import measure_quality, tokenized_prompts
from engine.config import EngineConfig
from engine.engine import Engine
from executor.config import ExecutorConfig
from kernels.kv_format import KV_CACHE_DTYPES
from tests.helpers import STORIES_260K, greedy_tokens, make_engine

MIN_TOP1_AGREEMENT = {"kv-float16": 0.95, "kv-bfloat16": 0.95, "kv-int8": 0.95, "kv-fp8": 0.93}
VARIANTS = ("kv-float16", "kv-bfloat16", "kv-int8", "kv-fp8")
PROMPTS = [[1, 403, 407, 261, 378], [1, 66, 300, 18], [1, 500, 2, 7, 9, 11, 13, 99, 256]]


@pytest.fixture(scope="module")
def quality() -> dict:
    prompts = tokenized_prompts(str(STORIES_260K), "story", 16)
    return measure_quality(str(STORIES_260K), prompts, 128, VARIANTS, free_runs=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_formats_agree_with_the_float32_cache_as_their_bar_asks(quality, variant):
    measured, bar = quality["variants"][variant], MIN_TOP1_AGREEMENT[variant]
    assert measured["top1_agreement"] >= bar, (
        f"{variant}: top-1 agreement {measured['top1_agreement']:.3f} along the float32 cache's "
        f"greedy continuation, expected >= {bar}; all measures: {measured}"
    )


def _greedy(**config) -> list[list[int]]:
    return greedy_tokens(make_engine(**config), PROMPTS, 48)


def test_auto_is_the_model_dtype_token_for_token():
    assert _greedy(kv_cache_dtype="auto") == _greedy(kv_cache_dtype="float32")
    engine = make_engine(dtype="bfloat16")
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16, "auto: the model's dtype"
    bf16 = greedy_tokens(engine, PROMPTS, 48)
    assert bf16 == _greedy(dtype="bfloat16", kv_cache_dtype="bfloat16")


@pytest.mark.parametrize(
    ("name", "token"),
    [("int8", (4 * 8 + 2,)), ("float16", (4, 8)), ("fp8", (4 * 8 + 2,))],
    ids=["int8", "float16", "fp8"],
)
def test_the_c_kernels_on_a_narrow_cache_decode_as_their_reference_twins(name, token):
    engine = make_engine(kv_cache_dtype=name)
    k_cache = engine.runner.kv_caches[0][0]
    assert engine.runner.kernels.name == "cpu" and k_cache.dtype == KV_CACHE_DTYPES[name]
    assert k_cache.shape[2:] == token, "stories260K's 4 KV heads of 8 (int8, fp8: one scale)"
    c_tokens = greedy_tokens(engine, PROMPTS, 48)
    assert c_tokens == _greedy(kv_cache_dtype=name, kernels="reference")


def _smollm2_shaped_checkpoint(folder: Path, hidden: int = 576, heads: int = 9,
                               kv_heads: int = 3) -> Path:  # fmt: skip
    """A seeded random Llama with SmolLM2-135M's attention shape (9 heads, 3 KV heads of 64)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=kv_heads,
                 max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(folder)
    return folder


def _blocks_per_16_mib(model: str, layers: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    """The engine's blocks in 16 MiB for each cache format, checked against the format's bytes
    per token (int8, fp8: a byte a value and one 2-byte scale per token, K and V each) and
    against the bytes its caches allocate."""
    blocks, values = {}, kv_heads * head_dim
    for name, token_bytes in (("float32", 4 * values), ("bfloat16", 2 * values),
                              ("float16", 2 * values), ("int8", values + 2),
                              ("fp8", values + 2)):  # fmt: skip
        runner = make_engine(model, kv_cache_gib=1 / 64, kv_cache_dtype=name).runner
        block_bytes = 2 * layers * runner.block_size * token_bytes
        assert runner.num_blocks == (1 << 24) // block_bytes, f"{name}: blocks per 16 MiB"
        allocated = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
        assert allocated == runner.num_blocks * block_bytes, f"{name}: allocated bytes"
        blocks[name] = runner.num_blocks
    assert blocks["bfloat16"] == blocks["float16"] == 2 * blocks["float32"]
    assert blocks["fp8"] == blocks["int8"], "fp8 tokens are int8's size: a byte a value, a scale"
    return blocks


def test_blocks_per_gib_are_about_4x_float32_for_8_bit_caches_at_smollm2_shape(tmp_path):
    blocks = _blocks_per_16_mib(str(_smollm2_shaped_checkpoint(tmp_path)), 2, 3, 64)
    assert 3.95 < blocks["int8"] / blocks["float32"] < 3.97, blocks  # 768 / 194 bytes a token


def test_blocks_per_gib_are_about_4x_float32_for_8_bit_caches_on_stories260k():
    blocks = _blocks_per_16_mib(str(STORIES_260K), 5, 4, 8)
    assert 3.75 < blocks["int8"] / blocks["float32"] < 3.77, blocks  # 128 / 34 bytes a token


def test_bad_cache_dtypes_name_the_flag():
    model = ["--model", str(STORIES_260K)]
    assert ExecutorConfig.from_args([*model, "--kv-cache-dtype", "int8"]).engine.kv_cache_dtype \
        == "int8"  # fmt: skip
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, float32, "):
        ExecutorConfig.from_args([*model, "--kv-cache-dtype", "fp4"])
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of .*, int8, fp8, got"):
        ExecutorConfig.from_args([*model, "--kv-cache-dtype", "fp8_e5m2"])
    assert ExecutorConfig.from_args([*model, "--kv-cache-dtype", "fp8"]).engine.kv_cache_dtype \
        == "fp8"  # fmt: skip
    assert ExecutorConfig.from_args([*model, "--kv-cache-dtype", "float16"]).engine \
        .kv_cache_dtype == "float16", "the CPU kernels read and write float16"  # fmt: skip


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_8_bit_caches_refuse_a_head_dim_they_cannot_take_naming_the_flag(tmp_path, name):
    model = str(_smollm2_shaped_checkpoint(tmp_path, hidden=12, heads=2, kv_heads=2))  # head_dim 6
    refused = f"--kv-cache-dtype {name} needs a head_dim divisible by 4"
    with pytest.raises(ValueError, match=refused):
        Engine(EngineConfig(model=model, kv_cache_gib=0.01, kv_cache_dtype=name))
    Engine(EngineConfig(model=model, kv_cache_gib=0.01, kv_cache_dtype="float16"))  # 16-bit can
