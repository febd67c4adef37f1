"""KV cache formats against the float32 cache, in one run per model: greedy agreement, KV
blocks per GiB and decode throughput.

    python -m bench.kv_dtypes [--models stories260K smollm2]
        [--formats float16 bfloat16 int8 fp8] [--batch 16] [--context 256] [--repeats 3]
        [--steps 32] [--threads 1] [--clock wall|cpu]
        [--no-agreement]
        [--out bench/results/kv_dtypes.json]

For each model (a float32 engine on the CPU; stories260K with its story starts, SmolLM2-135M-
Instruct with bench.quality's chat questions):

- agreement: bench.quality's measures of each cache format against the float32 cache on 16
  prompts x 128 greedy tokens (EOS ignored): token agreement (the fraction of free-running
  greedy tokens equal to the float32 cache's), the identical greedy prefix, and teacher-forced
  top-1 agreement (--no-agreement leaves it out: decode speed alone, in a fraction of the
  time);
- blocks per GiB: the engine's own sizing with --kv-cache-gib 1 (an int8 or fp8 cache's
  scales counted), and its ratio to the float32 cache's;
- decode throughput: --batch streams decoding from --context tokens on, in --repeats rounds.
  A round makes a fresh engine per format, warms each up at the measured batch, prefills it,
  then takes --steps decode steps of every engine in turns (one step of each, each turn
  starting at the next format), so that the formats' steps are paired moment by moment on a
  machine whose other work comes and goes, and float32 does not always run first. A format's
  tokens/s is that of its median step; two ratios to the float32 cache: the best round's over
  float32's best ("x fp32"), and the median over the rounds of each round's median over the
  turns of float32's step time over the format's ("rounds": one lucky round or step of either
  side does not decide it). One torch thread by default: on a
  machine shared with other work, a parallel region waits for its slowest thread, and steps of
  two threads on two busy cores ran from 1 ms to 600 ms at random. --clock cpu times each step
  by the thread's CPU time instead (one thread: the whole step), which the machine's other
  work does not stretch, though it still shares the caches and memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.bench_engine import decode_step_ms, start_decoding
from bench.quality import measure_quality, tokenized_prompts
from common.model_files import default_gguf_path
from engine.config import EngineConfig
from engine.engine import Engine
from engine.host_memory import retain_freed_memory

STORIES_260K = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
MODELS = {"stories260K": (STORIES_260K, "story"), "smollm2": (None, "chat")}
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
FORMATS = ["float16", "bfloat16", "int8", "fp8"]


def model_path(name: str) -> str:
    path, _ = MODELS[name]
    return str(path if path is not None else default_gguf_path())


def blocks_per_gib(model: str, kv_cache_dtype: str) -> int:
    engine = Engine(EngineConfig(model=model, kv_cache_gib=1.0, kv_cache_dtype=kv_cache_dtype))
    return engine.runner.num_blocks


def decode_round(model: str, formats: list[str], args: argparse.Namespace) -> dict:
    """One round of decode measures: a fresh engine per cache format, each warmed up at the
    measured batch and prefilled to --context tokens, then their decode steps taken in turn, one
    step of every engine before the next of any, each turn starting at the next format. Every
    format's steps thus see the same moments of the machine's other work, and none always
    runs first.

    Returns:
        format -> (tokens/s of its median step, the median over the turns of its step time
        over float32's in the same turn).
    """
    clock = CLOCKS[args.clock]
    engines = {}
    for fmt in formats:
        engines[fmt] = Engine(EngineConfig(model=model, kv_cache_gib=0.5, max_num_seqs=args.batch,
                                           kv_cache_dtype=fmt))  # fmt: skip
        # Up to cpu_decoder.one_call_rows streams a step is one C call, above that one call
        # per kernel: the warm-up runs the measured batch, so it warms the measured path.
        decode_step_ms(engines[fmt], 8, batch=args.batch, steps=2)
        start_decoding(engines[fmt], args.context, args.batch, args.steps)
    seconds: dict[str, list[float]] = {fmt: [] for fmt in formats}
    for turn in range(args.steps):
        first = turn % len(formats)
        for fmt in formats[first:] + formats[:first]:
            start = clock()
            engines[fmt].step()
            seconds[fmt].append(clock() - start)
    float32 = seconds["float32"]
    return {
        fmt: (
            args.batch / statistics.median(steps),
            statistics.median([a / b for a, b in zip(float32, steps, strict=True)]),
        )
        for fmt, steps in seconds.items()
    }


def decode_rates(model: str, formats: list[str], args: argparse.Namespace) -> dict:
    """--repeats rounds of decode_round, and each format's figures over them."""
    rounds = [decode_round(model, formats, args) for _ in range(args.repeats)]
    rates = {f: [r[f][0] for r in rounds] for f in formats}
    ratios = {f: [r[f][1] for r in rounds] for f in formats}
    return {
        "decode_tokens_per_s": {f: max(rates[f]) for f in formats},
        "decode_samples_tokens_per_s": rates,
        "decode_over_float32": {f: max(rates[f]) / max(rates["float32"]) for f in formats},
        "decode_over_float32_by_round": ratios,
        "decode_over_float32_median_round": {f: statistics.median(ratios[f]) for f in formats},
    }


def measure_model(name: str, formats: list[str], args: argparse.Namespace) -> dict:
    model, prompt_kind = model_path(name), MODELS[name][1]
    agreement = {}
    if args.agreement:
        prompts = tokenized_prompts(model, prompt_kind, 16)
        quality = measure_quality(model, prompts, 128, tuple(f"kv-{f}" for f in formats))
        agreement = {f: quality["variants"][f"kv-{f}"] for f in formats}
    every = ["float32", *formats]
    blocks = {f: blocks_per_gib(model, f) for f in every}
    return {
        "model": model,
        "prompts": prompt_kind,
        "agreement": agreement,
        "blocks_per_gib": blocks,
        "blocks_per_gib_over_float32": {f: blocks[f] / blocks["float32"] for f in every},
        **decode_rates(model, every, args),
    }


def print_model(name: str, result: dict) -> None:
    print(f"{name}: against the float32 cache")
    print(f"{'cache':<10}{'token agr.':>11}{'top-1 agr.':>11}{'prefix':>8}{'blocks/GiB':>12}"
          f"{'x fp32':>8}{'decode tok/s':>14}{'x fp32':>8}{'rounds':>8}")  # fmt: skip
    for fmt, blocks in result["blocks_per_gib"].items():
        agreement = result["agreement"].get(fmt)
        measures = (
            f"{agreement['token_agreement']:>11.3f}{agreement['top1_agreement']:>11.3f}"
            f"{agreement['identical_prefix_mean']:>8.1f}"
            if agreement
            else f"{'-':>11}{'-':>11}{'-':>8}"
        )
        print(f"{fmt:<10}{measures}{blocks:>12}{result['blocks_per_gib_over_float32'][fmt]:>8.2f}"
              f"{result['decode_tokens_per_s'][fmt]:>14.1f}"
              f"{result['decode_over_float32'][fmt]:>8.2f}"
              f"{result['decode_over_float32_median_round'][fmt]:>8.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each with fresh engines")
    parser.add_argument("--steps", type=int, default=32, help="decode steps of each engine a round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: all cores)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="time steps by the wall clock or this thread's CPU time")  # fmt: skip
    parser.add_argument("--no-agreement", dest="agreement", action="store_false",
                        help="measure blocks per GiB and decode speed only")  # fmt: skip
    parser.add_argument("--out", default="bench/results/kv_dtypes.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()
    result: dict = {"batch": args.batch, "context": args.context, "repeats": args.repeats,
                    "steps": args.steps, "clock": args.clock,
                    "load_average_at_start": os.getloadavg(),
                    "torch_threads": torch.get_num_threads(), "models": {}}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:  # the file is written after each model
        result["models"][name] = measure_model(name, args.formats, args)
        print_model(name, result["models"][name])
        result["load_average_at_end"] = os.getloadavg()
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
