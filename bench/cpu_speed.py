"""The CPU speed runs of `make bench-engine`: decode latency (bench_decode), throughput per
number format at 64 streams (bench_dtypes), the machine's limits, and the targets they meet.

    python -m bench.cpu_speed [--out bench/results/cpu_speed.json] [--baseline-tree PATH]

Every ratio is between measures of one run. The float32 one-stream speed "today" (the bar of
the int8 and int4 one-stream targets) is measured in the same run on a checkout of the code
before the change when --baseline-tree names one (bench/tree_tpot.py: its float32 and this
code's float32, int8 and int4 one-stream TPOT in alternating fresh processes, under
`same_run_baseline` in the JSON, the ratios then between those); else it is
--float32-baseline-tokens-per-s, a figure measured elsewhere, or else this code's float32.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import bench_decode, bench_dtypes, tree_tpot
from bench.bench_engine import Workload
from bench.machine import machine_limits
from bench.scratch import scratch_folder


def targets(
    decode: dict, dtypes: dict, baseline_one_stream: float | None, same_run: dict | None = None
) -> dict:
    """Each target's measured value, its bound and whether it is met; the one-stream ratios
    from `same_run` (tree_tpot.interleaved) when given."""
    variants = decode["variants"]
    one_stream = {name: v["tokens_per_s"][min(v["tokens_per_s"])] for name, v in variants.items()}
    if same_run is not None:
        one_stream = same_run["tokens_per_s"]
        baseline_one_stream = one_stream["float32 before"]
    base = baseline_one_stream or one_stream["float32"]
    rates = dtypes["tokens_per_s"]
    hf = rates["transformers bfloat16 generate_batch"]
    memory = decode["resident_bytes"]
    rows = {
        "float32 one stream / bandwidth limit": (
            variants["float32"]["fraction_of_bandwidth_limit"], 0.60),
        "int8 one stream / float32 one stream": (one_stream["int8"] / base, 3.0),
        "int4 one stream / float32 one stream": (one_stream["int4"] / base, 5.0),
        "64 streams bfloat16 / float32": (rates["kvgate bfloat16"] / rates["kvgate float32"], 1.8),
        "64 streams bfloat16 / transformers bfloat16 generate_batch": (
            rates["kvgate bfloat16"] / hf, 5.0),
        "64 streams bfloat16 / bfloat16 matmul roofline": (
            rates["kvgate bfloat16"] / dtypes["roofline_tokens_per_s"]["bfloat16"], 0.50),
        "64 streams int8 (float32 activations) / float32": (
            rates["kvgate int8"] / rates["kvgate float32"], 1.0),
    }  # fmt: skip
    if memory:
        whole = memory["int8"]["with_engine"] / memory["float32"]["with_engine"]
        rows["resident int8 / float32, whole process"] = (whole, 0.40)
        rows["resident int8 / float32, whole process, every KV block written"] = (
            _kv_full(memory["int8"]) / _kv_full(memory["float32"]), 0.40)  # fmt: skip
        rows["resident int8 / float32, without the torch import and the KV cache"] = (
            _model_share(memory["int8"]) / _model_share(memory["float32"]), 0.40)  # fmt: skip
    return {name: {"measured": value, "target": bound, "met": value >= bound
                   if not name.startswith("resident") else value <= bound}
            for name, (value, bound) in rows.items()}  # fmt: skip


def _kv_full(memory: dict) -> int:
    """The process's resident size had every block of its KV cache been written."""
    return memory["with_engine"] - memory["kv_cache_resident"] + memory["kv_cache_bytes"]


def _model_share(memory: dict) -> int:
    return memory["with_engine"] - memory["before_engine"] - memory["kv_cache_resident"]


def run(args: argparse.Namespace) -> dict:
    decode_args = argparse.Namespace(
        model=args.speed_model, variants=list(bench_decode.VARIANTS), concurrency=[1, 4, 16],
        prompt_len=128, output_len=64, profile_steps=32, memory=True,
    )  # fmt: skip
    with scratch_folder() as folder:
        model, label = bench_decode.speed_model(args.speed_model, folder)
        decode_args.model = model
        decode = bench_decode.run(decode_args) | {"model": label}
        same_run = None
        if args.baseline_tree:
            same_run = tree_tpot.interleaved(args.baseline_tree, model, args.baseline_rounds)
        dtypes = bench_dtypes.run(model, Workload(64, 128, 128), args.speed_repeats,
                                  list(bench_dtypes.KVGATE_FORMATS))  # fmt: skip
    result = {"model": label, "machine": machine_limits(), "decode": decode, "dtypes": dtypes}
    if same_run is not None:
        result["same_run_baseline"] = same_run
    result["targets"] = targets(decode, dtypes, args.float32_baseline_tokens_per_s, same_run)
    return result


def print_summary(result: dict) -> None:
    bench_decode.print_summary(result["decode"])
    bench_dtypes.print_summary(result["dtypes"])
    print(f"{'target':<72}{'measured':>10}{'bound':>8}  met")
    for name, t in result["targets"].items():
        print(f"{name:<72}{t['measured']:>10.2f}{t['target']:>8.2f}  {'yes' if t['met'] else 'NO'}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speed-model", default=None, help=bench_decode.MODEL_HELP)
    parser.add_argument("--speed-repeats", type=int, default=2)
    baseline = parser.add_mutually_exclusive_group()
    baseline.add_argument("--float32-baseline-tokens-per-s", type=float, default=None,
                          help="the float32 one-stream speed before the change, measured "
                               "elsewhere")  # fmt: skip
    baseline.add_argument("--baseline-tree", default=None, metavar="PATH",
                          help="a checkout of the code before the change (git worktree add "
                               "--detach PATH COMMIT): its float32 one-stream speed is "
                               "measured in this run, alternating with this code's")  # fmt: skip
    parser.add_argument(
        "--baseline-rounds",
        type=int,
        default=3,
        help="rounds of the alternating one-stream measures (--baseline-tree)",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--out", default="bench/results/cpu_speed.json")
    args = parser.parse_args(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
