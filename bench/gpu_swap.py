"""The KV host tier on a GPU: requests preempted by swap resume with the tokens of no
preemption at all, and of preemption by recompute.

    python -m bench.gpu_swap [--device cuda]

On CUDA the host tier is pinned memory and its copies run on a side stream, overlapped with
compute (engine/kv_swap.py); the CPU test suite runs the same engine path with a second
pool. A seeded random Llama (heads of 64, grouped queries) serves the same greedy requests
three ways: with room for all, and with too few device blocks preempting by recompute and by
swap. Prints one JSON object; exits 1 when the tokens differ or nothing was swapped.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.scratch import scratch_folder
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             tie_word_embeddings=False)  # fmt: skip
MODES = {
    "no preemption": {},
    "recompute": {"num_gpu_blocks": 24, "preemption_mode": "recompute"},
    "swap": {"num_gpu_blocks": 24, "preemption_mode": "swap"},
}


def run_mode(model_dir: str, device: str, prompts: list[list[int]], overrides: dict) -> dict:
    engine = Engine(EngineConfig(model=model_dir, device=device, block_size=4, kv_cache_gib=0.02,
                                 enable_prefix_caching=False, swap_space_gib=0.01,
                                 gpu_memory_utilization=0.3, **overrides))  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    stats = engine.stats()
    return {
        "tokens": tokens,
        "preemptions": stats.num_preemptions,
        "swapped_out_blocks": stats.num_swapped_out_blocks,
        "swapped_in_blocks": stats.num_swapped_in_blocks,
        "batched_tokens": stats.num_batched_tokens,
    }


def check(device: str) -> dict:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 9, 14, 21, 3)]
    torch.manual_seed(0)
    with scratch_folder() as folder:
        LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder)
        runs = {name: run_mode(str(folder), device, prompts, o) for name, o in MODES.items()}
    base, swap = runs["no preemption"], runs["swap"]
    result = {name: {k: v for k, v in run.items() if k != "tokens"} for name, run in runs.items()}
    result["device"] = device
    result["swap_tokens_equal"] = swap["tokens"] == base["tokens"]
    result["recompute_tokens_equal"] = runs["recompute"]["tokens"] == base["tokens"]
    result["ok"] = (
        result["swap_tokens_equal"]
        and result["recompute_tokens_equal"]
        and swap["swapped_out_blocks"] > 0
        and swap["swapped_in_blocks"] == swap["swapped_out_blocks"]
        and swap["batched_tokens"] == base["batched_tokens"]  # nothing recomputed
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_swap: no CUDA device", flush=True)
        return 2
    result = check(args.device)
    print(json.dumps(result, indent=2), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
