"""Engine benchmark on one CUDA GPU: a random model shaped like Llama-3.2-1B, bfloat16.

    python -m bench.gpu_engine [--out bench/results/gpu_engine.json]

Prints one table: output tokens/s of kvgate's Engine and of `transformers` generate_batch at
1 and 64 concurrent requests (128 prompt, 128 output tokens, ignore_eos) on the same GPU in
the same run, and the batch-1 decode step time with CUDA graphs and without (enforce_eager)
against the bandwidth bound (weight bytes / 4.8 TB/s, the H200's HBM bandwidth).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.bench_engine import (
    Workload,
    decode_step_ms,
    hf_generate_batch_tokens_per_s,
    kvgate_tokens_per_s,
)
from bench.scratch import scratch_folder
from engine.config import EngineConfig
from engine.engine import Engine

LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
HBM_BYTES_PER_S = 4.8e12


def build_cuda_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B_SHAPE, dtype=torch.bfloat16))
    return model.to(torch.bfloat16).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    unique = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def eager_batch1_decode_ms(model_dir: Path) -> float:
    """The batch-1 decode step without CUDA graphs (enforce_eager), its engine freed after."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", max_num_seqs=1,
                                 gpu_memory_utilization=0.4, enforce_eager=True))  # fmt: skip
    kvgate_tokens_per_s(engine, Workload(num_requests=1).prompts(LLAMA_1B_SHAPE["vocab_size"]), 4)
    step_ms = decode_step_ms(engine, context_len=128, batch=1, steps=16)
    del engine
    torch.cuda.empty_cache()
    return step_ms


def measure(model_dir: Path, model: LlamaForCausalLM, concurrency: list[int]) -> dict:
    eager_ms = eager_batch1_decode_ms(model_dir)
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", max_num_seqs=max(concurrency),
                                 gpu_memory_utilization=0.8))  # fmt: skip
    workload = Workload(num_requests=max(concurrency))
    prompts = workload.prompts(LLAMA_1B_SHAPE["vocab_size"])
    kvgate_tokens_per_s(engine, prompts[:2], 4)  # warm-up: Triton compiles here
    result: dict = {"kvgate_tokens_per_s": {}, "hf_generate_batch_tokens_per_s": {}}
    for n in concurrency:
        result["kvgate_tokens_per_s"][n] = kvgate_tokens_per_s(engine, prompts[:n], 128)
        result["hf_generate_batch_tokens_per_s"][n] = hf_generate_batch_tokens_per_s(
            model, prompts[:n], 128
        )
    result["batch1_decode_ms"] = decode_step_ms(engine, context_len=128, batch=1, steps=16)
    result["batch1_decode_ms_eager"] = eager_ms
    result["bandwidth_bound_ms"] = 1000 * weight_bytes(model) / HBM_BYTES_PER_S
    return result


def print_table(result: dict) -> None:
    print(
        f"{'engine, Llama-3.2-1B shape, bf16':<44}{'kvgate':>12}{'generate_batch':>16}{'ratio':>8}"
    )
    for n, ours in result["kvgate_tokens_per_s"].items():
        theirs = result["hf_generate_batch_tokens_per_s"][n]
        print(
            f"{f'tokens/s at {n} concurrent':<44}{ours:>12.1f}{theirs:>16.1f}{ours / theirs:>8.2f}"
        )
    decode, bound = result["batch1_decode_ms"], result["bandwidth_bound_ms"]
    eager = result["batch1_decode_ms_eager"]
    print(f"{'batch-1 decode step, CUDA graphs (ms)':<44}{decode:>12.3f}")
    print(f"{'batch-1 decode step, eager (ms)':<44}{eager:>12.3f}{'':>16}{eager / decode:>8.2f}")
    print(
        f"{'bound: weight bytes / 4.8 TB/s (ms)':<44}{bound:>12.3f}{'':>16}{bound / decode:>8.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/gpu_engine.json")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_engine: no CUDA device", flush=True)
        return 2
    model = build_cuda_model()
    with scratch_folder() as folder:
        model.save_pretrained(folder)
        result = measure(folder, model, args.concurrency)
    result["device"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
