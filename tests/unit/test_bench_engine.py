"""bench/engine.py's transformers peer: generate_batch with a KV cache the size of the
workload, not of the machine's RAM."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

from bench.engine import BENCH_SHAPE, build_model, hf_generate_batch_tokens_per_s

TINY = BENCH_SHAPE | dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=300,
)  # fmt: skip
PAGE_TOKENS = 256  # ContinuousBatchingConfig's default page_size


def test_generate_batch_gets_a_cache_that_holds_the_workload_and_no_more(monkeypatch):
    sized: list[int] = []  # bytes of each cache generate_batch builds
    infer = PagedAttentionMemoryHandler.infer_max_batch_tokens_and_num_sectors

    def record(handler: PagedAttentionMemoryHandler) -> tuple[int, int]:
        max_batch_tokens, num_sectors = infer(handler)
        sized.append(num_sectors * handler.bytes_per_sector)
        return max_batch_tokens, num_sectors

    monkeypatch.setattr(
        PagedAttentionMemoryHandler, "infer_max_batch_tokens_and_num_sectors", record
    )
    prompts = torch.randint(3, 300, (6, 40), generator=torch.Generator().manual_seed(0)).tolist()
    rate = hf_generate_batch_tokens_per_s(build_model(TINY, torch.float32), prompts, 8)
    assert rate > 0
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    token_bytes = TINY["num_hidden_layers"] * 2 * TINY["num_key_value_heads"] * head_dim * 4
    pages = len(prompts) * math.ceil((40 + 8) / PAGE_TOKENS)
    workload_bytes = pages * PAGE_TOKENS * token_bytes
    # The untimed warm-up call (2 requests), then the measured one.
    assert len(sized) == 2, sized
    assert workload_bytes <= sized[1] <= 2 * workload_bytes, (sized, workload_bytes)
    assert sized[0] <= sized[1]


def test_the_executor_resident_memory_grows_with_the_kv_cache_the_workload_writes():
    """bench.engine's resident memory: a fresh process runs the workload; a workload that
    writes 64x the KV blocks is resident by about their bytes more (the KV cache is resident
    only where written), so the figure is measured, not a constant."""
    import argparse

    from bench.engine import resident_under_workload
    from tests.helpers import STORIES_260K

    def resident(num_requests: int) -> dict[str, int]:
        args = argparse.Namespace(num_requests=num_requests, prompt_len=256, output_len=4,
                                  max_num_batched_tokens=2048, kv_cache_gib=0.25,
                                  device="cpu")  # fmt: skip
        return resident_under_workload(str(STORIES_260K), args)

    with ThreadPoolExecutor(2) as pool:  # two fresh processes, each importing torch
        small, large = pool.map(resident, (1, 64))
    assert set(small) == {"VmRSS", "VmHWM", "RssAnon", "RssFile"}
    assert small["VmHWM"] >= small["VmRSS"] > 0
    # stories260K: 5 layers x K and V x 4 KV heads x 8 values x 4 bytes = 1,280 bytes a token.
    written = (64 - 1) * (256 + 4) * 1280
    assert large["VmRSS"] - small["VmRSS"] > written / 2, (small, large)
