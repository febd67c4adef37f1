"""The engine in bfloat16 and with weight-only int8 / int4 weights, on stories260K.

Greedy tokens of these cannot equal float32's everywhere (their numbers differ); their quality
is the teacher-forced top-1 agreement with float32 along float32's greedy continuation
(bench/quality.py), computed here on 16 story prompts x 128 tokens and held to >= 95% for
bfloat16, int8, and int8 with its activations rounded to int8 blocks (--int8-activations).
"""

from __future__ import annotations

import pytest
import torch

from bench.quality import measure_quality, tokenized_prompts
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from executor.config import ExecutorConfig
from kernels.quant import QuantizedWeight
from tests.helpers import STORIES_260K, greedy_tokens, make_engine, run_to_completion

MIN_TOP1_AGREEMENT = 0.95
PROMPT = [1, 403, 407, 261, 378]


@pytest.fixture(scope="module")
def quality() -> dict:
    prompts = tokenized_prompts(str(STORIES_260K), "story", 16)
    variants = ("bfloat16", "int8", "int8-a8")
    return measure_quality(str(STORIES_260K), prompts, 128, variants)["variants"]


@pytest.mark.parametrize("variant", ["bfloat16", "int8", "int8-a8"])
def test_teacher_forced_top1_agreement_with_float32_is_at_least_95_percent(quality, variant):
    measured = quality[variant]
    assert measured["top1_agreement"] >= MIN_TOP1_AGREEMENT, (
        f"{variant}: top-1 agreement {measured['top1_agreement']:.3f} along float32's greedy "
        f"continuation, expected >= {MIN_TOP1_AGREEMENT}; all measures: {measured}"
    )


def test_quantized_model_keeps_its_linear_layers_quantized_and_shares_the_tied_table():
    engine = make_engine(quantization="int4", kv_cache_gib=0.05)
    model = engine.runner.model
    head = model.lm_head.quantized
    assert isinstance(head, QuantizedWeight) and head.bits == 8, "the output layer is int8"
    assert model.embed_tokens.quantized is head, "the tied embedding reads the output layer's"
    assert model.lm_head.weight is None and model.embed_tokens.weight is None
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.quantized.bits == 4  # input width 64: int4
    assert layer.mlp.down_proj.quantized.bits == 8  # input width 172 is not a multiple of 32
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    quantized = sum(m.quantized.nbytes for m in model.modules() if getattr(m, "quantized", None)
                    is not None and m is not model.embed_tokens)  # fmt: skip
    float32 = make_engine(kv_cache_gib=0.05).runner.model
    float32_bytes = 4 * sum(p.numel() for p in float32.parameters())
    assert dense + quantized < 0.35 * float32_bytes, (dense, quantized, float32_bytes)
    [tokens] = greedy_tokens(engine, [PROMPT], 16)
    assert len(tokens) == 16 and all(0 <= t < 512 for t in tokens)


def test_int8_activations_reach_every_int8_layer_in_whole_blocks():
    engine = make_engine(quantization="int8", int8_activations=True, kv_cache_gib=0.05)
    model = engine.runner.model
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.quantized.int8_activations  # input width 64
    assert model.lm_head.quantized.int8_activations
    assert not layer.mlp.down_proj.quantized.int8_activations  # 172: no whole blocks of 32
    assert len(greedy_tokens(engine, [PROMPT], 16)[0]) == 16


def test_bfloat16_engine_keeps_a_bfloat16_cache_and_decodes():
    engine = make_engine(dtype="bfloat16", kv_cache_gib=0.05)
    assert engine.runner.kernels.name == "cpu"
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in engine.runner.kv_caches)
    assert len(greedy_tokens(engine, [PROMPT], 16)[0]) == 16


def test_prompt_logits_predict_the_first_greedy_token_and_need_an_idle_engine():
    engine = make_engine(kv_cache_gib=0.05)
    logits = engine.prompt_logits(PROMPT)
    assert logits.shape == (5, 512) and logits.dtype == torch.float32
    engine.add_request("busy", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        engine.prompt_logits(PROMPT)
    assert run_to_completion(engine)["busy"] == [int(logits[-1].argmax())]


def test_config_names_a_bad_quantization_or_a_cpu_float16():
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4, got 'fp8'"):
        EngineConfig(model=str(STORIES_260K), quantization="fp8")
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16 on the CPU"):
        EngineConfig(model=str(STORIES_260K), dtype="float16")
    with pytest.raises(ValueError, match="int8_activations must be only with quantization int8"):
        EngineConfig(model=str(STORIES_260K), int8_activations=True)


def test_executor_flags_reach_the_engine_and_bad_ones_name_the_flag(monkeypatch):
    model = ["--model", str(STORIES_260K)]
    flags = ["--dtype", "bfloat16", "--quantization", "int8", "--enforce-eager"]
    config = ExecutorConfig.from_args([*model, *flags, "--int8-activations"])
    engine = config.engine
    assert (engine.dtype, engine.quantization, engine.enforce_eager) == ("bfloat16", "int8", True)
    assert engine.int8_activations and not ExecutorConfig.from_args(model).engine.int8_activations
    monkeypatch.setenv("KVGATE_QUANTIZATION", "int4")
    assert ExecutorConfig.from_args(model).engine.quantization == "int4"
    with pytest.raises(ValueError, match="--quantization must be one of none, int8, int4"):
        ExecutorConfig.from_args([*model, "--quantization", "int3"])
    with pytest.raises(ValueError, match="--dtype must be float32 or bfloat16 on the CPU"):
        ExecutorConfig.from_args([*model, "--dtype", "float16"])
