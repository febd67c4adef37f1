"""`kvgate bench GROUP NAME [flags]`: every benchmark of kvgate behind one command.

    kvgate bench load --target 127.0.0.1:50051 --num-requests 32 --request-rate 4
    kvgate bench engine throughput --model smollm2
    kvgate bench --help                  (the list of benchmarks)

Each benchmark writes its results as JSON to --out (default: bench/results/NAME.json) and
prints a summary; with --out-key KEY the results go under KEY into the JSON object --out holds
(made if missing), its other keys kept: runs of one benchmark share one file. Only the chosen
benchmark's module is imported, so `kvgate bench load` runs without torch. `python -m bench.cli
...` is the same command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

from bench.harness import BenchFailure, add_out, results_beside, run_stamp, write_results

# Benchmarks start stacks (subprocess.Popen: fork, then exec) from a process whose gRPC threads
# run; gRPC's fork handlers are then skipped with a warning, or can wait inside fork() forever.
# A child that execs at once needs none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


@dataclass(frozen=True, slots=True)
class Command:
    """One `kvgate bench GROUP NAME`: the module whose BENCHMARKS["GROUP NAME"] runs it."""

    group: str
    name: str
    module: str
    help: str

    @property
    def words(self) -> str:
        """How the command is typed, and its key in its module's BENCHMARKS."""
        return f"{self.group} {self.name}".rstrip()


COMMANDS = (
    Command("load", "", "bench.load", "load a running gateway: TTFT, TPOT, ITL, goodput, sweeps"),
    Command("serve", "stack", "bench.serve", "the whole stack against the in-process Engine"),
    Command("serve", "fronts", "bench.serve", "kvgate.v1, vLLM's gRPC API and OpenAI HTTP"),
    Command("serve", "hops", "bench.security", "what each defence adds to one hop"),
    Command("serve", "tenants", "bench.security", "a quiet tenant's TTFT beside a noisy one"),
    Command("serve", "structured", "bench.decoding", "JSON schema streams and TTFT vs none"),
    Command("engine", "throughput", "bench.engine", "the Engine against transformers"),
    Command("engine", "cpu", "bench.cpu", "decode latency, number formats and their targets"),
    Command("engine", "decode", "bench.cpu", "decode latency against the bandwidth limit"),
    Command("engine", "dtypes", "bench.cpu", "64 streams per number format"),
    Command("engine", "steps", "bench.kernels", "formats' step CPU time, stepped in turn"),
    Command("engine", "choices", "bench.decoding", "n choices of one request vs n requests"),
    Command("engine", "spec", "bench.decoding", "one stream with n-gram speculation vs without"),
    Command("engine", "gpu", "bench.kernels", "the Engine on one CUDA GPU"),
    Command("kernels", "linear", "bench.kernels", "CPU linear layers beside torch's"),
    Command("kernels", "gpu", "bench.kernels", "paged attention on one CUDA GPU"),
    Command("quality", "weights", "bench.quality", "weight and activation formats vs float32"),
    Command("quality", "kv", "bench.quality", "KV cache formats: agreement, blocks, speed"),
    Command("scaling", "swap", "bench.scaling", "the KV host tier on overflowing chat sessions"),
    Command("scaling", "tp", "bench.scaling", "two tensor-parallel ranks against one"),
    Command("scaling", "executors", "bench.scaling", "the autoscaler on a local stack"),
    Command("scaling", "restart", "bench.scaling", "chat sessions through a rolling restart"),
)


def usage(group: str = "") -> str:
    """The list of benchmarks; of `group`'s only, when it names one."""
    if group:
        head = f"usage: kvgate bench {group} NAME [flags] (--help after one for its flags)"
    else:
        head = "usage: kvgate bench GROUP [NAME] [flags] (--help after one for its flags)"
    lines = [head, ""]
    for command in COMMANDS:
        if not group or command.group == group:
            lines.append(f"  {command.words:<20}{command.help}")
    return "\n".join(lines)


def find_command(argv: list[str]) -> tuple[Command, list[str]] | None:
    """The command argv names, and the flags after its name; None when it names none."""
    for command in COMMANDS:
        words = command.words.split()
        if argv[: len(words)] == words:
            return command, argv[len(words) :]
    return None


def main(argv: list[str] | None = None) -> int:
    """Runs `kvgate bench`. Args: its words and flags (None: sys.argv). Returns: the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    found = find_command(argv)
    if found is None:
        group = argv[0] if argv and argv[0] in {c.group for c in COMMANDS} else ""
        asked_for_help = argv[1 if group else 0 :][:1] in ([], ["-h"], ["--help"])
        if group and len(argv) == 1:
            asked_for_help = False  # a group without a NAME names no benchmark
            print(f"kvgate bench {group}: name one of its benchmarks", file=sys.stderr)
        elif argv and not asked_for_help:
            print(f"kvgate bench: no benchmark {' '.join(argv[: 2 if group else 1])!r}",
                  file=sys.stderr)  # fmt: skip
        print(usage(group), file=sys.stdout if asked_for_help else sys.stderr)
        return 0 if asked_for_help and argv else 2
    command, flags = found
    benchmark = importlib.import_module(command.module).BENCHMARKS[command.words]
    parser = argparse.ArgumentParser(prog=f"kvgate bench {command.words}", description=command.help)
    add_out(parser, benchmark.out, benchmark.out_key)
    benchmark.add_arguments(parser)
    args = parser.parse_args(flags)
    try:
        results_beside(args.out, args.out_key)  # a bad --out fails before the run
        if getattr(args, "threads", 0):
            import torch

            torch.set_num_threads(args.threads)
        result = benchmark.run(args)
        if benchmark.summarize is not None:
            benchmark.summarize(result)
        write_results(result, args.out, args.out_key, run_stamp(argv))
    except BenchFailure as error:
        print(f"kvgate bench: {error}", file=sys.stderr)
        return 2
    failure = benchmark.failure(result) if benchmark.failure is not None else None
    if failure:
        print(f"kvgate bench: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
