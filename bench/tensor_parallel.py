"""Tensor parallelism: two ranks against one, same run, float32 and bfloat16.

    python -m bench.tensor_parallel --device cpu [--model DIR] [--out FILE]
    python -m bench.tensor_parallel --device cuda [--out FILE]   # two GPUs (NCCL)

Prints, per dtype: the fraction of greedy tokens two ranks give equal to one rank's (16
prompts, 64 new tokens each, run concurrently; counted up to each prompt's first difference:
in bfloat16 the ranks' partial sums are rounded before they are added, so a near-tie may
flip), and output tokens/s of each with their ratio. The CPU default model is stories260K;
on CUDA a random model shaped like Llama-3.2-1B (32 query and 8 key/value heads), with eager
decode steps (--enforce-eager: CUDA graphs are not captured across ranks). With fewer than
two CUDA devices it says so and exits 0.
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
from engine.config import EngineConfig
from engine.engine import Engine

NUM_PROMPTS, OUTPUT_LEN = 16, 64
CPU_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def greedy_run(config: EngineConfig, prompts: list[list[int]]) -> dict:
    """Greedy tokens per prompt and output tokens/s of one engine (closed after)."""
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
        if config.device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        engine.close()
        del engine
        if config.device != "cpu":
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


def measure(model: Path, device: str, vocab_size: int, prompt_len: int) -> dict:
    workload = Workload(num_requests=NUM_PROMPTS, prompt_len=prompt_len)
    prompts = workload.prompts(vocab_size)
    result: dict = {"model": str(model), "device": device}
    for dtype in ("float32", "bfloat16"):
        runs = []
        for tp in (1, 2):
            config = EngineConfig(model=str(model), device=device, dtype=dtype, num_gpu_blocks=2048,
                                  enforce_eager=True, tensor_parallel_size=tp)  # fmt: skip
            runs.append(greedy_run(config, prompts))
        result[dtype] = {
            "equal_token_fraction": equal_fraction(runs[0]["tokens"], runs[1]["tokens"]),
            "tokens_per_s_tp1": runs[0]["tokens_per_s"],
            "tokens_per_s_tp2": runs[1]["tokens_per_s"],
        }
    return result


def print_table(result: dict) -> None:
    print(f"{'tensor parallel, ' + result['device']:<28}{'equal':>8}{'tp1 tok/s':>12}"
          f"{'tp2 tok/s':>12}{'ratio':>8}")  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        r = result[dtype]
        one, two = r["tokens_per_s_tp1"], r["tokens_per_s_tp2"]
        print(f"{dtype:<28}{r['equal_token_fraction']:>8.3f}{one:>12.1f}{two:>12.1f}"
              f"{two / one:>8.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", type=Path, default=None, help="CPU: a checkpoint folder")
    parser.add_argument("--out", default="bench/results/tensor_parallel.json")
    args = parser.parse_args()
    if args.device == "cpu":
        model = args.model or CPU_MODEL
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        result = measure(model, "cpu", vocab, prompt_len=32)
    else:
        count = torch.cuda.device_count()
        if count < 2:
            print(f"tensor_parallel: skipped: {count} CUDA device(s), two ranks need two")
            return 0
        with scratch_folder() as folder:
            built = build_cuda_model()
            built.save_pretrained(folder)
            vocab = built.config.vocab_size
            del built
            torch.cuda.empty_cache()
            result = measure(folder, "cuda", vocab, prompt_len=128)
        result["device"] = f"cuda, {count} x {torch.cuda.get_device_name()}"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
