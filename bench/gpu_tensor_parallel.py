"""Tensor parallelism on CUDA: two ranks (two GPUs, NCCL) against one, same run.

    python -m bench.gpu_tensor_parallel [--out bench/results/gpu_tensor_parallel.json]

A random model shaped like Llama-3.2-1B (32 query and 8 key/value heads), eager decode steps
(--enforce-eager: CUDA graphs are not captured across ranks). Prints, for float32 and
bfloat16: the fraction of greedy tokens two ranks give equal to one rank's (16 prompts of 128
tokens, 64 new tokens each, concurrently; a split reduction may flip a near-tie), and output
tokens/s of each with their ratio. Needs two CUDA devices; says so and exits 0 with fewer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.bench_engine import Workload
from bench.gpu_engine import build_cuda_model
from bench.scratch import scratch_folder
from common.sampling_params import SamplingParams
from executor.config import EngineConfig
from executor.engine import Engine

NUM_PROMPTS, OUTPUT_LEN = 16, 64


def greedy_run(model_dir: Path, dtype: str, tp: int, prompts: list[list[int]]) -> dict:
    """Greedy tokens per prompt and output tokens/s of one engine (closed after)."""
    config = EngineConfig(model=str(model_dir), device="cuda", dtype=dtype, enforce_eager=True,
                          num_gpu_blocks=2048, tensor_parallel_size=tp)  # fmt: skip
    engine = Engine(config)
    try:
        params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        engine.add_request("warm-up", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        tokens: dict[str, list[int]] = {}
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()
    return {"tokens": tokens, "tokens_per_s": sum(map(len, tokens.values())) / seconds}


def equal_fraction(one: dict[str, list[int]], two: dict[str, list[int]]) -> float:
    """Tokens equal position by position up to each prompt's first difference."""
    equal = 0
    for rid, ours in one.items():
        for a, b in zip(ours, two[rid], strict=True):
            if a != b:
                break
            equal += 1
    return equal / sum(map(len, one.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/gpu_tensor_parallel.json")
    args = parser.parse_args()
    count = torch.cuda.device_count()
    if count < 2:
        print(f"gpu_tensor_parallel: skipped: {count} CUDA device(s), two ranks need two")
        return 0
    model = build_cuda_model()
    prompts = Workload(num_requests=NUM_PROMPTS).prompts(model.config.vocab_size)
    result: dict = {"device": torch.cuda.get_device_name(), "devices": count}
    with scratch_folder() as folder:
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
        for dtype in ("float32", "bfloat16"):
            one, two = (greedy_run(folder, dtype, tp, prompts) for tp in (1, 2))
            result[dtype] = {
                "equal_token_fraction": equal_fraction(one["tokens"], two["tokens"]),
                "tokens_per_s_tp1": one["tokens_per_s"],
                "tokens_per_s_tp2": two["tokens_per_s"],
            }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'tensor parallel, Llama-3.2-1B shape':<40}{'equal':>8}{'tp1 tok/s':>12}"
          f"{'tp2 tok/s':>12}{'ratio':>8}")  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        r = result[dtype]
        one, two = r["tokens_per_s_tp1"], r["tokens_per_s_tp2"]
        print(f"{dtype:<40}{r['equal_token_fraction']:>8.3f}{one:>12.1f}{two:>12.1f}"
              f"{two / one:>8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
