"""The same requests offline through `transformers`, for a ratio against the served run.

Two peers, both greedy with exact output lengths, run in the bench's process after the
served run has finished: `generate` one request at a time (a sample of the requests, as a
rate), and `generate_batch` (transformers' continuous batching) over all of them. Requests
are grouped by output length, since generate_batch takes one max_new_tokens; with
--range-ratio 0 that is one batch.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from bench.bench_engine import (
    hf_generate_batch_tokens_per_s,
    hf_generate_tokens_per_s,
    load_hf_model,
)


def one_at_a_time_tokens_per_s(model, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Output tokens/s of `generate` called once per request, in order."""
    seconds = sum(
        output_len / hf_generate_tokens_per_s(model, [prompt], output_len)
        for prompt, output_len in zip(prompts, output_lens, strict=True)
    )
    return sum(output_lens) / seconds


def batch_tokens_per_s(model, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Output tokens/s of `generate_batch`, one call per distinct output length."""
    groups: dict[int, list[list[int]]] = defaultdict(list)
    for prompt, output_len in zip(prompts, output_lens, strict=True):
        groups[output_len].append(prompt)
    seconds = sum(
        len(group) * output_len / hf_generate_batch_tokens_per_s(model, group, output_len)
        for output_len, group in groups.items()
    )
    return sum(output_lens) / seconds


def compare_hf(
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    kvgate_tokens_per_s: float,
    sample: int,
) -> dict[str, float | int | str]:
    """Runs the peers and returns their throughputs and kvgate's ratios to them.

    Args:
        model_dir: the served model's folder or GGUF file.
        prompts: the run's prompts as token ids, as the gateway tokenized them.
        output_lens: each request's output tokens.
        kvgate_tokens_per_s: the served run's output token throughput.
        sample: how many requests `generate` runs one at a time.

    Returns:
        The peers' output tokens/s, the ratios, the device and the sample size.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf_model(model_dir).to(device)
    with torch.inference_mode():
        one = one_at_a_time_tokens_per_s(model, prompts[:sample], output_lens[:sample])
        batch = batch_tokens_per_s(model, prompts, output_lens)
    return {
        "device": device,
        "generate_sample_requests": len(prompts[:sample]),
        "generate_batch_requests": len(prompts),
        "hf_generate_tokens_per_s": one,
        "hf_generate_batch_tokens_per_s": batch,
        "kvgate_over_hf_generate": kvgate_tokens_per_s / one,
        "kvgate_over_hf_generate_batch": kvgate_tokens_per_s / batch,
    }


def print_comparison(comparison: dict) -> None:
    print(
        f"transformers on {comparison['device']}: generate one at a time on a sample of "
        f"{comparison['generate_sample_requests']} requests, generate_batch on "
        f"{comparison['generate_batch_requests']} (small samples: a rate, not a full run)"
    )
    print(f"  generate        {comparison['hf_generate_tokens_per_s']:10.1f} output tokens/s")
    print(f"  generate_batch  {comparison['hf_generate_batch_tokens_per_s']:10.1f} output tokens/s")
    print(f"  kvgate / generate        {comparison['kvgate_over_hf_generate']:.2f}x")
    print(f"  kvgate / generate_batch  {comparison['kvgate_over_hf_generate_batch']:.2f}x")
