"""Tensor parallelism (--tensor-parallel-size): two ranks on the CPU (gloo) give the greedy
tokens of one, for stories260K and for a seeded random Llama with biases, and for a GGUF file's
quantized blocks; head counts the size does not divide, and the combinations that cannot run, are
clear errors; the follower ranks exit with the engine, and a dead one fails the requests."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from common.finish_reason import FinishReason
from engine import generate as generate_command
from engine.config import EngineConfig, EngineConfigError, pop_engine_config
from engine.engine import Engine
from engine.models.shard import shard_columns
from executor.config import build_parser
from kernels.quant import quantize_int4, quantize_int8
from tests.helpers import (
    STORIES_260K,
    assert_greedy_matches,
    greedy,
    greedy_tokens,
    hf_greedy,
    make_engine,
    save_random_llama,
)
from tests.tiny_gguf import vocabulary, write_tiny_llama

MAX_TOKENS = 24
# Layer 0 as the default model's file (Q4_1); layer 1 mixes Q4_0, Q4_1 and Q8_0 (int8 groups).
KEPT_TYPES = {
    "token_embd": Q.Q8_0,
    **{f"blk.0.{n}": Q.Q4_1 for n in ("attn_q", "attn_k", "attn_v", "attn_output")},
    **{f"blk.0.{n}": Q.Q4_1 for n in ("ffn_gate", "ffn_up", "ffn_down")},
    **{f"blk.1.{n}": Q.Q4_0 for n in ("attn_q", "attn_k", "attn_v", "attn_output")},
    **{f"blk.1.{n}": Q.Q8_0 for n in ("ffn_gate", "ffn_up", "ffn_down")},
}
# Lengths that mix decode rows with prefill chunks in one step (block_size 4, 16-token budget).
PROMPT_LENGTHS = [1, 5, 9, 23, 40]


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _greedy_tokens(
    model: str,
    prompts: list[list[int]],
    tp: int,
    quantization: str = "none",
    max_tokens: int = MAX_TOKENS,
) -> tuple[list[list[int]], list[int]]:
    """Every prompt's greedy tokens, run concurrently; and the follower ranks' pids."""
    engine = make_engine(model, block_size=4, quantization=quantization,
                         max_num_batched_tokens=16, tensor_parallel_size=tp)  # fmt: skip
    group = engine.runner.group
    pids = [] if group is None else [p.pid for p in group.followers]
    try:
        return greedy_tokens(engine, prompts, max_tokens), pids
    finally:
        engine.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_stories260k_two_ranks_give_the_tokens_of_one_and_exit_on_close():
    prompts = _prompts(512, seed=1)
    one, _ = _greedy_tokens(str(STORIES_260K), prompts, tp=1)
    two, pids = _greedy_tokens(str(STORIES_260K), prompts, tp=2)
    assert len(pids) == 1, f"expected one follower rank, got pids {pids}"
    assert two == one, f"tensor-parallel tokens differ:\none rank  {one}\ntwo ranks {two}"
    assert all(_gone(pid) for pid in pids), f"follower ranks {pids} outlived Engine.close()"


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    """Seeded random weights, 4 query and 2 key/value heads, biases on every projection."""
    path = tmp_path_factory.mktemp("random-llama")
    model = save_random_llama(path, vocab_size=256, hidden_size=64, intermediate_size=112,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, tie_word_embeddings=False,
                              attention_bias=True, mlp_bias=True)  # fmt: skip
    return path, model


def test_random_llama_two_ranks_give_the_tokens_of_one_and_of_transformers(random_llama):
    path, hf_model = random_llama
    prompts = _prompts(256, seed=2)
    one, _ = _greedy_tokens(str(path), prompts, tp=1)
    two, _ = _greedy_tokens(str(path), prompts, tp=2)
    assert two == one, f"tensor-parallel tokens differ:\none rank  {one}\ntwo ranks {two}"
    for i, prompt in enumerate(prompts):
        reference = hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert_greedy_matches(two[i], reference, f"two ranks, prompt {i}")


def test_a_gguf_files_kept_blocks_split_into_two_ranks_give_the_tokens_of_one(tmp_path):
    """Q4_1, Q4_0 and Q8_0 blocks kept as int4 and group-wise int8: each rank serves its rows,
    or its input columns at group boundaries."""
    path = tmp_path / "tiny-q4.gguf"
    write_tiny_llama(path, KEPT_TYPES)
    prompts = _prompts(len(vocabulary()), seed=4)[1:3]  # a decode beside a chunked prefill
    one, _ = _greedy_tokens(str(path), prompts, tp=1, quantization="int4", max_tokens=12)
    two, _ = _greedy_tokens(str(path), prompts, tp=2, quantization="int4", max_tokens=12)
    assert two == one, f"one rank {one}, two ranks {two}"


@pytest.mark.parametrize(
    "weight",
    [quantize_int8(torch.randn(6, 128)), quantize_int4(torch.randn(6, 128), group_size=32)],
    ids=["int8-per-channel", "int4-groups"],
)
def test_quantized_column_shares_put_together_are_the_whole_weight(weight):
    shares = [shard_columns("down", weight, rank, num_ranks=2) for rank in range(2)]
    whole = torch.cat([share.dequantize() for share in shares], dim=1)
    assert torch.equal(whole, weight.dequantize()), "the shares' columns differ from the weight's"


def test_a_head_count_the_size_does_not_divide_is_a_start_up_error_naming_both():
    with pytest.raises(ValueError) as error:
        Engine(EngineConfig(model=str(STORIES_260K), kv_cache_gib=0.01, tensor_parallel_size=3))
    message = str(error.value)
    assert message.startswith("--tensor-parallel-size 3 does not divide the model's "), message
    for count in ("8 query heads", "4 key/value heads", "172 MLP columns"):
        assert message.count(count) == 1, f"{count!r} once: {message}"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(tensor_parallel_size=2, device="cuda"), "enforce_eager"),
    ],
    ids=["zero", "cuda-graphs"],
)
def test_combinations_that_cannot_run_are_config_errors(fields, field):
    with pytest.raises(EngineConfigError) as error:
        EngineConfig(model=str(STORIES_260K), **fields)
    assert error.value.field == field, str(error.value)


def test_the_executor_flag_reaches_the_engine_config_and_errors_name_the_flag():
    argv = ["--model", str(STORIES_260K), "--tensor-parallel-size", "2"]
    assert pop_engine_config(vars(build_parser().parse_args(argv))).tensor_parallel_size == 2
    flags = vars(build_parser().parse_args([*argv, "--device", "cuda"]))
    with pytest.raises(ValueError, match="^--enforce-eager must be set with tensor_parallel"):
        pop_engine_config(flags)


def test_generate_command_with_two_ranks_prints_the_text_of_one(capsys):
    argv = ["--model", str(STORIES_260K), "--prompt", "Once upon a time", "--prompt"]
    argv += ["The little dog", "--max-tokens", "16", "--ignore-eos", "--kv-cache-gib", "0.01"]
    assert generate_command.main(argv) == 0
    one = capsys.readouterr().out
    assert generate_command.main([*argv, "--tensor-parallel-size", "2"]) == 0
    two = capsys.readouterr().out
    assert two == one and one.strip(), f"one rank printed {one!r}, two ranks {two!r}"
    assert generate_command.main([*argv, "--tensor-parallel-size", "3"]) == 2
    assert "--tensor-parallel-size 3 does not divide" in capsys.readouterr().err


def test_a_dead_follower_fails_the_running_requests_at_once_naming_the_ranks():
    engine = make_engine(kv_cache_gib=0.01, tensor_parallel_size=2)
    try:
        params = greedy(MAX_TOKENS)
        for i, prompt in enumerate(_prompts(512, seed=3)[:3]):
            engine.add_request(f"p{i}", prompt, params)
        engine.step()
        follower = engine.runner.group.followers[0]
        follower.kill()
        follower.wait()
        outputs = engine.step()
    finally:
        engine.close()
    assert {o.request_id for o in outputs} == {"p0", "p1", "p2"}, outputs
    for out in outputs:
        assert out.finish_reason == FinishReason.ERROR, out
        assert "tensor-parallel ranks stopped" in out.error_message, out.error_message
    assert not engine.has_unfinished()


def test_a_share_that_cuts_quantized_groups_is_an_error_naming_the_flag():
    weight = quantize_int4(torch.randn(8, 64), group_size=32)
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 splits o's 64 input columns"):
        shard_columns("o", weight, rank=0, num_ranks=4)
