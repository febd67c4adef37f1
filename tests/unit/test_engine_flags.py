"""The engine's flags: every EngineConfig field an operator sets has one, its value reaches the
EngineConfig of `python -m executor` and of `python -m engine.generate` alike, and generate
runs with them."""

from __future__ import annotations

from dataclasses import fields

import pytest

from common.model_text import ModelText
from engine import generate
from engine.config import EngineConfig, pop_engine_config
from engine.engine import Engine
from executor.config import ExecutorConfig
from executor.config import build_parser as executor_parser
from tests.helpers import STORIES_260K, greedy

# Set from the environment only: KVGATE_KERNELS names the kernel backend (docs/configuration.md).
ENV_ONLY_FIELDS = {"kernels"}

# Every engine flag at a value other than its default, and the EngineConfig it must give.
FLAGS = [
    "--model", str(STORIES_260K), "--device", "cpu", "--block-size", "8",
    "--max-num-seqs", "3", "--max-num-batched-tokens", "96", "--max-model-len", "200",
    "--kv-cache-gib", "0.05", "--num-gpu-blocks", "40", "--gpu-memory-utilization", "0.5",
    "--session-ttl-s", "30", "--dtype", "bfloat16", "--no-enable-prefix-caching",
    "--no-retain-freed-memory", "--policy", "lpm", "--lpm-aging-steps", "9",
]  # fmt: skip
EXPECTED = EngineConfig(
    model=str(STORIES_260K), device="cpu", block_size=8, max_num_seqs=3,
    max_num_batched_tokens=96, max_model_len=200, kv_cache_gib=0.05, num_gpu_blocks=40,
    gpu_memory_utilization=0.5, session_ttl_s=30.0, dtype="bfloat16",
    enable_prefix_caching=False, retain_freed_memory=False, policy="lpm", lpm_aging_steps=9,
)  # fmt: skip


def test_every_engine_field_but_the_kernels_has_a_flag():
    parsed = vars(executor_parser().parse_args([]))
    missing = [f.name for f in fields(EngineConfig) if f.name not in parsed]
    assert set(missing) == ENV_ONLY_FIELDS, f"EngineConfig fields without a flag: {missing}"


def test_the_executors_engine_flags_round_trip_into_its_engine_config():
    assert ExecutorConfig.from_args(FLAGS).engine == EXPECTED


def test_generate_takes_the_same_engine_flags():
    flags = vars(generate.build_parser().parse_args([*FLAGS, "--prompt", "hi"]))
    assert pop_engine_config(flags) == EXPECTED
    assert sorted(flags) == ["ignore_eos", "max_tokens", "prompt", "seed", "temperature", "top_p"]


def test_engine_flags_read_their_environment_defaults(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVGATE_DTYPE", "bfloat16")
    monkeypatch.setenv("KVGATE_ENABLE_PREFIX_CACHING", "false")
    engine = ExecutorConfig.from_args(["--model", str(STORIES_260K)]).engine
    assert (engine.dtype, engine.enable_prefix_caching) == ("bfloat16", False)
    monkeypatch.delenv("KVGATE_DTYPE")
    engine = ExecutorConfig.from_args(["--model", str(STORIES_260K)]).engine
    assert engine.dtype is None, "--dtype auto leaves the device's default"


def test_a_bad_dtype_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        executor_parser().parse_args(["--dtype", "int4"])
    assert "--dtype" in capsys.readouterr().err


def test_generate_runs_with_the_engine_flags(capsys: pytest.CaptureFixture[str]):
    prompts = ["Once upon a time", "Once upon a time, there"]
    argv = [*FLAGS, "--max-tokens", "6", "--ignore-eos"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    assert generate.main(argv) == 0
    text = ModelText(str(STORIES_260K))
    engine = Engine(EXPECTED)
    params = greedy(6)
    expected = generate.generate(engine, [text.encode(p) for p in prompts], params)
    blocks = [text.tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert capsys.readouterr().out == "".join(f"{b}\n\n" for b in blocks)
