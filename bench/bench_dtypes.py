"""Throughput at 64 streams per number format: kvgate float32, bfloat16, int8 and int4 beside
transformers generate_batch in bfloat16, in one run on SmolLM2-135M's shape.

    python -m bench.bench_dtypes [--model PATH] [--out bench/results/dtypes.json]

Each measure is the best of --repeats interleaved rounds (bench.bench_engine.best_rates), on
64 requests of 128 prompt and 128 output tokens (EOS ignored). The roofline of a format is the
workload's matmul FLOPs at the machine's best matmul FLOP/s in it (2048 x 2048 x 2048, read in
every round beside the formats), bench/roofline.py. int8 runs with float32 activations (the
CPU default) and with bfloat16 ones, int4 with bfloat16 ones.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from pathlib import Path

import torch

from bench.bench_decode import MODEL_HELP, speed_model
from bench.bench_engine import (
    Workload,
    best_rates,
    hf_generate_batch_tokens_per_s,
    kvgate_tokens_per_s,
    load_hf_model,
)
from bench.machine import cpu_features, matmul_flops_per_s
from bench.roofline import output_tokens_only_tokens_per_s, roofline_tokens_per_s
from bench.scratch import scratch_folder
from executor.config import EngineConfig
from executor.engine import Engine
from executor.host_memory import retain_freed_memory

ROOFLINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KVGATE_FORMATS = {
    "kvgate float32": {},
    "kvgate bfloat16": {"dtype": "bfloat16"},
    "kvgate int8": {"quantization": "int8"},
    "kvgate int8 bfloat16": {"quantization": "int8", "dtype": "bfloat16"},
    "kvgate int4 bfloat16": {"quantization": "int4", "dtype": "bfloat16"},
}


def kvgate_measure(model: str, formats: dict, prompts: list[list[int]], output_len: int):
    """A callable: a fresh engine of `formats`, warmed up, then the workload's tokens/s."""

    def measure() -> float:
        engine = Engine(EngineConfig(model=model, max_num_seqs=len(prompts), kv_cache_gib=1.0,
                                     max_num_batched_tokens=2048, **formats))  # fmt: skip
        kvgate_tokens_per_s(engine, prompts[:2], 4)
        return kvgate_tokens_per_s(engine, prompts, output_len)

    return measure


def run(model: str, workload: Workload, repeats: int, formats: list[str]) -> dict:
    retain_freed_memory()
    hf = load_hf_model(model, torch.bfloat16)
    prompts = workload.prompts(hf.config.vocab_size)
    num_params = sum(p.numel() for p in hf.parameters())
    measures = {name: kvgate_measure(model, KVGATE_FORMATS[name], prompts, workload.output_len)
                for name in formats}  # fmt: skip
    measures["transformers bfloat16 generate_batch"] = lambda: hf_generate_batch_tokens_per_s(
        hf, prompts, workload.output_len
    )
    # The rooflines' matmul rates, read in every round beside the formats: their best reading
    # is the machine's limit, whatever the moment of one reading was like.
    for dtype in ROOFLINE_DTYPES:
        measures[f"matmul {dtype}"] = functools.partial(matmul_flops_per_s, ROOFLINE_DTYPES[dtype])
    best, samples = best_rates(measures, repeats)
    flops = {dtype: best.pop(f"matmul {dtype}") for dtype in ROOFLINE_DTYPES}
    flops_samples = {dtype: samples.pop(f"matmul {dtype}") for dtype in ROOFLINE_DTYPES}
    roofline = {name: roofline_tokens_per_s(f, hf.config, workload) for name, f in flops.items()}
    output_only = {name: output_tokens_only_tokens_per_s(f, num_params)
                   for name, f in flops.items()}  # fmt: skip
    return {
        "workload": vars(workload),
        "num_parameters": num_params,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_features(),
        "load_average_at_end": os.getloadavg(),
        "matmul_flops_per_s": flops,
        "samples_matmul_flops_per_s": flops_samples,
        "roofline_tokens_per_s": roofline,
        "roofline_output_tokens_only_tokens_per_s": output_only,
        "tokens_per_s": best,
        "samples_tokens_per_s": samples,
        "medians_tokens_per_s": {n: statistics.median(v) for n, v in samples.items()},
    }


def print_summary(result: dict) -> None:
    flops, roof = result["matmul_flops_per_s"], result["roofline_tokens_per_s"]
    for name in ("float32", "bfloat16"):
        print(f"matmul {name} {flops[name] / 1e9:.0f} GFLOP/s: roofline {roof[name]:.0f} tokens/s")
    rates = result["tokens_per_s"]
    base = rates.get("kvgate float32")
    for name, rate in rates.items():
        ratio = f"{rate / base:.2f}x float32" if base else ""
        print(f"{name:<40}{rate:>10.1f} tokens/s  {ratio}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--formats", nargs="+", default=list(KVGATE_FORMATS),
                        choices=list(KVGATE_FORMATS))  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench/results/dtypes.json")
    args = parser.parse_args(argv)
    workload = Workload(args.num_requests, args.prompt_len, args.output_len)
    with scratch_folder() as folder:
        model, label = speed_model(args.model, folder)
        result = run(model, workload, args.repeats, args.formats)
    result["model"] = label
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
