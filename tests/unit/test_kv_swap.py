"""The host tier of the KV cache through the engine: preemption by swap against recompute and
against no preemption at all, sessions offloaded and brought back, and its flags."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from bench.cli import main as bench_main
from engine import generate
from engine.config import EngineConfig, pop_engine_config
from engine.engine import Engine
from executor.config import build_parser
from executor.metrics import ExecutorMetrics
from tests.helpers import (
    STORIES_260K,
    greedy,
    make_engine,
    run_to_completion,
    save_random_llama,
)

# Enough host memory for every block of the tight engines below.
SWAP_GIB = 0.01
# Small blocks and no prefix cache: preemption and offload at a few requests.
SMALL_BLOCKS = {"block_size": 4, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES_260K)


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory) -> str:
    """A seeded random Llama with a realistic head (64 wide, grouped queries)."""
    path = tmp_path_factory.mktemp("random-llama")
    save_random_llama(path, vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    return str(path)


def run_three_ways(model: str, prompts: list[list[int]], num_blocks: int, max_tokens: int):
    """The same requests with room for all, and with `num_blocks` blocks preempting by
    recompute and by swap. Returns each engine's tokens and the engines."""
    engines = {
        "no preemption": make_engine(model, **SMALL_BLOCKS),
        "recompute": make_engine(
            model,
            **SMALL_BLOCKS,
            num_gpu_blocks=num_blocks,
            preemption_mode="recompute",
            swap_space_gib=SWAP_GIB,
        ),
        "swap": make_engine(
            model, **SMALL_BLOCKS, num_gpu_blocks=num_blocks, swap_space_gib=SWAP_GIB
        ),
    }
    tokens = {}
    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, greedy(max_tokens))
        tokens[name] = run_to_completion(engine)
    return tokens, engines


def assert_swap_resumes_without_recomputing(tokens, engines) -> None:
    assert tokens["swap"] == tokens["no preemption"], "swapped requests produced other tokens"
    assert tokens["recompute"] == tokens["no preemption"], "recomputed requests differ"
    swap = engines["swap"].stats()
    recompute = engines["recompute"].stats()
    assert swap.num_preemptions > 0 and recompute.num_preemptions > 0, "nothing was preempted"
    assert swap.num_swapped_out_blocks > 0, f"swap mode swapped nothing out: {swap}"
    assert swap.num_swapped_in_blocks == swap.num_swapped_out_blocks, f"not all came back: {swap}"
    assert recompute.num_swapped_out_blocks == 0, "recompute mode used the host tier"
    # every token's K/V computed exactly once, as without preemption; recompute redoes some
    unpreempted = engines["no preemption"].stats().num_batched_tokens
    assert swap.num_batched_tokens == unpreempted, (swap.num_batched_tokens, unpreempted)
    assert recompute.num_batched_tokens > unpreempted
    for engine in engines.values():
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, f"blocks still held: {stats}"
        assert stats.num_host_blocks_used == 0, f"host blocks still held: {stats}"


def test_swap_recompute_and_no_preemption_give_the_same_tokens_stories(tokenizer):
    texts = ("Once upon a time", "The dog ran", "Mom said", "A big red ball", "Lily", "The sun")
    prompts = [tokenizer(t).input_ids for t in texts]
    tokens, engines = run_three_ways(str(STORIES_260K), prompts, num_blocks=30, max_tokens=40)
    assert_swap_resumes_without_recomputing(tokens, engines)


def test_swap_recompute_and_no_preemption_give_the_same_tokens_random_llama(random_llama):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 9, 14, 21, 3)]
    tokens, engines = run_three_ways(random_llama, prompts, num_blocks=24, max_tokens=24)
    assert_swap_resumes_without_recomputing(tokens, engines)


def two_sessions_taking_turns(tokenizer, engine: Engine) -> tuple[list[int], int]:
    """Session a's turn 1, then session b's (which needs a's blocks), then a's turn 2.

    Returns:
        a's turn-2 reply and how many of its tokens were served from the cache.
    """
    turn1 = tokenizer("Once upon a time").input_ids
    engine.add_request("a1", turn1, greedy(30), session_id="a")
    reply1 = run_to_completion(engine)["a1"]
    engine.add_request("b1", tokenizer("The dog ran").input_ids, greedy(30), session_id="b")
    run_to_completion(engine)
    turn2 = turn1 + reply1 + tokenizer("Then", add_special_tokens=False).input_ids
    engine.add_request("a2", turn2, greedy(12), session_id="a")
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return [t for o in outputs for t in o.new_token_ids], outputs[0].num_cached_tokens


def test_an_evicted_session_goes_to_the_host_tier_and_comes_back(tokenizer):
    offload = make_engine(**SMALL_BLOCKS, num_gpu_blocks=12, swap_space_gib=SWAP_GIB)
    drop = make_engine(**SMALL_BLOCKS, num_gpu_blocks=12)
    reply, cached = two_sessions_taking_turns(tokenizer, offload)
    reply_dropped, cached_dropped = two_sessions_taking_turns(tokenizer, drop)
    # b's turn moves a out, and a's second turn moves b out
    assert offload.stats().num_offloaded_sessions == 2, offload.stats()
    assert drop.stats().num_evicted_sessions == 2, drop.stats()
    assert cached_dropped == 0, "the dropped session's turn found K/V somewhere"
    # turn 1's prompt and reply but its last token (never fed back) came back from the host
    assert cached == len(tokenizer("Once upon a time").input_ids) + 30 - 1, cached
    assert reply == reply_dropped, "the swapped-in session's turn differs from a cold one"
    stats = offload.stats()
    assert stats.num_swapped_in_blocks > 0 and stats.num_host_blocks_used > 0, stats
    assert sorted(offload.session_ids()) == ["a", "b"]
    assert offload.release_session("b") and offload.release_session("a")
    stats = offload.stats()
    assert stats.num_host_blocks_used == 0, f"ended sessions kept host blocks: {stats}"
    assert stats.num_free_blocks == stats.num_total_blocks


def test_offloaded_sessions_expire_and_leave_the_host_tier_oldest_first(tokenizer):
    # a host tier of 11 blocks of stories260K: one offloaded session fits, not two
    block_bytes = 2 * 5 * 4 * 8 * 4 * 4  # k and v, layers, kv heads, head dim, tokens, float32
    swap_gib = 11 * block_bytes / (1 << 30)
    engine = make_engine(
        **SMALL_BLOCKS, num_gpu_blocks=12, swap_space_gib=swap_gib, session_ttl_s=3600
    )
    assert engine.stats().num_host_blocks_total == 11
    for name, text in (("a", "Once upon a time"), ("b", "The dog ran"), ("c", "Mom said")):
        engine.add_request(name, tokenizer(text).input_ids, greedy(30), session_id=name)
        run_to_completion(engine)
    stats = engine.stats()
    assert stats.num_offloaded_sessions == 2 and stats.num_evicted_sessions == 1, stats
    assert engine.session_ids() == ["c", "b"], "the host tier should keep the newest offload"
    engine.kv_cache.session_ttl_s = 0.0
    engine.kv_cache.expire_sessions()
    stats = engine.stats()
    assert stats.num_host_blocks_used == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_metrics_show_the_host_tier(tokenizer):
    engine = make_engine(**SMALL_BLOCKS, num_gpu_blocks=12, swap_space_gib=SWAP_GIB)
    two_sessions_taking_turns(tokenizer, engine)
    metrics = ExecutorMetrics()
    metrics.record_stats(engine.stats())
    stats = engine.stats()
    want = {
        "kvgate_executor_host_kv_blocks": stats.num_host_blocks_total,
        "kvgate_executor_host_kv_blocks_used": stats.num_host_blocks_used,
        "kvgate_executor_swapped_out_blocks_total": stats.num_swapped_out_blocks,
        "kvgate_executor_swapped_in_blocks_total": stats.num_swapped_in_blocks,
        "kvgate_executor_offloaded_sessions_total": 2,
    }
    for name, value in want.items():
        assert metrics.registry.get_sample_value(name) == value, name
    assert stats.num_swapped_out_blocks > 0


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--swap-space-gib", "-1"], "--swap-space-gib"),
        (["--preemption-mode", "swap"], "--preemption-mode"),
        (["--swap-space-gib", "1e-9"], "--swap-space-gib"),
        (["--swap-space-gib", "1", "--tensor-parallel-size", "2"], "--swap-space-gib"),
        (["--swap-space-gib", "inf"], "--swap-space-gib"),
        (["--swap-space-gib", "100000"], "--swap-space-gib"),  # more than the machine has
        (["--kv-cache-gib", "inf"], "--kv-cache-gib"),
        (["--session-ttl-s", "nan"], "--session-ttl-s"),
    ],
)
def test_bad_swap_flags_are_named(capsys, argv, flag):
    argv = ["--model", str(STORIES_260K), "--prompt", "Hi", "--max-tokens", "2", *argv]
    assert generate.main(argv) == 2
    assert flag in capsys.readouterr().err


def test_unknown_preemption_mode_is_named(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preemption-mode", "drop"])
    assert "--preemption-mode" in capsys.readouterr().err


def test_generate_takes_the_swap_flags(capsys):
    argv = ["--model", str(STORIES_260K), "--prompt", "Once upon a time", "--max-tokens", "8",
            "--swap-space-gib", "0.01", "--preemption-mode", "swap", "--num-gpu-blocks", "4",
            "--block-size", "4"]  # fmt: skip
    assert generate.main(argv) == 0
    assert capsys.readouterr().out.strip()


def test_preemption_mode_defaults_to_swap_with_a_host_tier():
    def config(*argv: str) -> EngineConfig:
        return pop_engine_config(vars(build_parser().parse_args(["--model", "m", *argv])))

    assert config().swaps_on_preemption is False
    assert config("--swap-space-gib", "1").swaps_on_preemption is True
    assert (
        config("--swap-space-gib", "1", "--preemption-mode", "recompute").swaps_on_preemption
        is False
    )


def test_the_swap_benchmark_runs_and_finds_the_sessions_on_the_host(tmp_path):
    out = tmp_path / "swap.json"
    argv = [
        "scaling",
        "swap",
        "--model",
        str(STORIES_260K),
        "--device-sessions",
        "2",
        "--prompt-len",
        "24",
        "--reply-len",
        "8",
        "--new-len",
        "4",
        "--block-size",
        "4",
        "--out",
        str(out),
    ]
    assert bench_main(argv) == 0
    result = json.loads(out.read_text())
    assert result["turn2_replies_identical"] is True
    with_tier, without = result["host_tier"], result["no_host_tier"]
    assert with_tier["offloaded_sessions"] >= 2 and without["offloaded_sessions"] == 0
    # each turn 2 prefills its new message and its reply's last token, nothing more
    assert with_tier["turn2_prefill_tokens"] == result["sessions"] * (4 + 1)
    assert without["turn2_prefill_tokens"] > with_tier["turn2_prefill_tokens"]
