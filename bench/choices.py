"""`kvgate bench engine choices`: one request of n choices against n separate requests of
the same prompt, in one run on one Engine configuration.

The n choices of one request prefill the prompt once and share its KV blocks (copy on write);
n separate requests sent together each prefill it. Both are sampled at temperature 1 with
EOS ignored, so both produce n * output_len tokens; the figure is their tokens/s ratio, with
the KV blocks each held at its peak. With prefix caching (the engine's default) the separate
requests admitted a step after the first ones reuse their prompt blocks, so the group saves
less there than against `--no-prefix-caching`.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from bench import harness
from bench.engine import BENCH_SHAPE, Workload, benchmark_model, best_rates
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.host_memory import retain_freed_memory


def _params(args: argparse.Namespace, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=args.seed, n=n)


def run_requests(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    """Add the requests at once and step until all finish: tokens per second of wall time and
    per second of this process's CPU time (which other work on a shared machine does not
    inflate), and the peak blocks held."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"bench-{i}", prompt, params)
    produced, peak_blocks = 0, 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
        stats = engine.stats()
        peak_blocks = max(peak_blocks, stats.num_total_blocks - stats.num_free_blocks)
    if engine.config.device == "cuda":
        torch.cuda.synchronize()
    return {
        "tokens_per_s": produced / (time.perf_counter() - start),
        "tokens_per_cpu_s": produced / (time.process_time() - start_cpu),
        "peak_blocks": peak_blocks,
    }


def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        retain_freed_memory()  # as every CPU Engine sets it: both peers measure alike
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with benchmark_model(args, dtype) as (engine_model, model):
        vocab_size = model.config.vocab_size
        del model
        config = EngineConfig(
            model=engine_model, device=args.device, max_num_seqs=max(args.n, 8),
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
            enable_prefix_caching=not args.no_prefix_caching,
        )  # fmt: skip
        engine = Engine(config)
        prompt_round = iter(range(1_000_000))

        def prompt() -> list[int]:  # a new prompt every round: nothing cached between rounds
            return Workload(1, args.prompt_len, 1, seed=next(prompt_round)).prompts(vocab_size)[0]

        peaks: dict[str, int] = {}
        per_cpu_s: dict[str, list[float]] = {"group": [], "separate": []}

        def measure(name: str, requests) -> float:
            result = run_requests(engine, requests)
            peaks[name] = max(peaks.get(name, 0), result["peak_blocks"])
            per_cpu_s[name].append(result["tokens_per_cpu_s"])
            return result["tokens_per_s"]

        run_requests(engine, [(prompt(), _params(args, args.n))])  # warm-up
        best, samples = best_rates(
            {
                "group": lambda: measure("group", [(prompt(), _params(args, args.n))]),
                "separate": lambda: measure(
                    "separate", [(p, _params(args, 1)) for p in [prompt()] * args.n]
                ),
            },
            args.repeats,
        )
    result = _result(args, engine_model, best, samples, peaks, engine.config.block_size)
    return result | {
        "samples_tokens_per_cpu_s": per_cpu_s,
        "group_over_separate_cpu_median": median(per_cpu_s["group"])
        / median(per_cpu_s["separate"]),
    }


def _result(args, model: str, best: dict, samples: dict, peaks: dict, block_size: int) -> dict:
    return {
        "model": args.model
        or f"random llama {BENCH_SHAPE['hidden_size']}x{BENCH_SHAPE['num_hidden_layers']}",
        "device": args.device,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "group_tokens_per_s": best["group"],
        "separate_tokens_per_s": best["separate"],
        "group_over_separate": best["group"] / best["separate"],
        "group_over_separate_median": median(samples["group"]) / median(samples["separate"]),
        "samples_tokens_per_s": samples,
        "prompt_blocks": -(-args.prompt_len // block_size),
        "peak_blocks": peaks,
        "loaded": model,
        "torch_threads": torch.get_num_threads(),
        "load_average": harness.load_average(),
    }


def summarize(result: dict) -> None:
    n = result["n"]
    print(f"n={n}, {result['prompt_len']}-token prompt, {result['output_len']} tokens each")
    print(f"  one request, n={n}   {result['group_tokens_per_s']:10.1f} output tokens/s")
    print(f"  {n} separate requests {result['separate_tokens_per_s']:10.1f} output tokens/s")
    print(f"  ratio                {result['group_over_separate']:.2f}x best rounds, "
          f"{result['group_over_separate_median']:.2f}x median rounds, "
          f"{result['group_over_separate_cpu_median']:.2f}x per CPU second")  # fmt: skip
    peaks = result["peak_blocks"]
    print(f"  peak KV blocks: {peaks['group']} (group) vs {peaks['separate']} (separate); "
          f"the prompt takes {result['prompt_blocks']}")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench engine choices`."""
    harness.add_model(
        parser, "", "checkpoint folder, GGUF file or smollm2 (default: a seeded random Llama)"
    )
    harness.add_device(parser)
    harness.add_workload(parser, num_requests=1, prompt_len=1024, output_len=16)
    parser.add_argument("--n", type=int, default=4, help="choices of the one request")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of every request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="separate requests admitted a step apart then cannot reuse the "
                             "first ones' prompt blocks")  # fmt: skip
    harness.add_repeats(parser, 3)
    harness.add_threads(parser)


BENCHMARKS = {"engine choices": harness.Benchmark(add_arguments, run, "choices.json", summarize)}
