"""`kvgate bench engine steps`: each weight format's prefill and decode-step time on the CPU
by the stepping thread's own CPU time, the formats' engines stepped in turn.

On a machine shared with other work, wall-clock step times follow the load: a step waits while
another process holds the core, and formats measured one after another meet different loads.
With one torch thread (--threads 1, the default here) the C kernels run on the thread that
calls `Engine.step()`, whose CPU time (`time.thread_time`) leaves the waiting out, and stepping
the formats in turn gives each round the same machine (sharing the caches and the memory
bandwidth still shows). The kernels' ISA level is in the results' `cpu` block
(`KVGATE_CPU_ISA` picks a lower one).

    KVGATE_CPU_ISA=avx2 kvgate bench engine steps --model smollm2 --streams 1 --steps 24
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.cpu import (
    MODEL_HELP,
    VARIANTS,
    engine_for,
    speed_model,
    start_decoding,
    weight_bytes_per_step,
)
from bench.harness import (
    BenchFailure,
    Benchmark,
    add_model,
    add_threads,
    cpu_features,
    load_average,
    scratch_folder,
)


def cpu_seconds(step) -> float:
    """The calling thread's CPU seconds for step()."""
    start = time.thread_time()
    step()
    return time.thread_time() - start


def measure_steps(model: str, args: argparse.Namespace) -> dict:
    engines = {v: engine_for(model, v, max_num_seqs=args.streams) for v in args.variants}
    prefill_s = {
        v: cpu_seconds(lambda e=e: start_decoding(e, args.streams, args.prompt_len, args.steps + 2))
        for v, e in engines.items()
    }
    step_s: dict[str, list[float]] = {v: [] for v in engines}
    for _ in range(args.steps):
        for v, engine in engines.items():
            step_s[v].append(cpu_seconds(engine.step))
    formats = {}
    for v, times in step_s.items():
        median = statistics.median(times)
        formats[v] = {
            "prefill_cpu_s": prefill_s[v],
            "step_cpu_ms_median": 1000 * median,
            "step_cpu_ms_min": 1000 * min(times),
            "decode_tokens_per_cpu_s": args.streams / median,
            "weight_bytes_per_step": weight_bytes_per_step(engines[v]),
        }
    return {"formats": formats, "streams": args.streams, "prompt_len": args.prompt_len}


def run_steps(args: argparse.Namespace) -> dict:
    """`kvgate bench engine steps`."""
    for flag, value in (("--streams", args.streams), ("--steps", args.steps),
                        ("--prompt-len", args.prompt_len)):  # fmt: skip
        if value < 1:
            raise BenchFailure(f"{flag} must be at least 1, got {value}")
    with scratch_folder() as folder:
        model, label = speed_model(args.model, folder)
        result = measure_steps(model, args)
    return result | {"model": label, "cpu": cpu_features(), "load_average_at_end": load_average()}


def summarize_steps(result: dict) -> None:
    formats = result["formats"]
    base = formats.get("float32")
    print(f"{result['streams']} streams, kernels {result['cpu'].get('kernels_isa')}, "
          f"load {result['load_average_at_end']}; thread CPU time")  # fmt: skip
    for name, f in formats.items():
        step = f["step_cpu_ms_median"]
        ratio = f" ({base['step_cpu_ms_median'] / step:.2f}x float32)" if base else ""
        prefill = f" ({base['prefill_cpu_s'] / f['prefill_cpu_s']:.2f}x)" if base else ""
        print(f"{name:<9} decode step {step:.2f} ms{ratio}, min {f['step_cpu_ms_min']:.2f}; "
              f"prefill {f['prefill_cpu_s']:.2f} s{prefill}")  # fmt: skip


def add_steps_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, None, MODEL_HELP)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--streams", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per format")
    add_threads(parser, default=1)


BENCHMARKS = {
    "engine steps": Benchmark(add_steps_arguments, run_steps, "steps.json", summarize_steps),
}
