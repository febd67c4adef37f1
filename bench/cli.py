"""`kvgate bench`: load a running gateway and report TTFT, TPOT, ITL, latency and goodput.

kvgate bench --target 127.0.0.1:50051 --num-requests 100 --request-rate 4 --out run.json
kvgate bench --workload shared-prefix --num-prefixes 4 --prefix-len 96 --input-len 32 ...
kvgate bench --workload chat --num-turns 3 --input-len 32 --output-len 32 ...
kvgate bench --sweep-rates 1,2,4,inf ...      (one run per rate, plotted)
kvgate bench --sweep-window 0,5,20,100 ...    (starts its own stack on --model)
kvgate bench --sweep-policy fcfs,lpm ...      (its own stack, scheduler and executor per policy)
kvgate bench --compare-hf ...                 (the same requests through transformers)

Writes the results JSON to --out and PNG plots next to it (OUT_cdf.png, OUT_rates.png,
OUT_windows.png); prints a summary. `kvgate bench ...` and `python -m bench.cli ...` are the
same command; the `kvgate` client loads this module only for `bench`.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from bench.config import DEFAULT_LOG_DIR, DEFAULT_OUT, BenchConfig, served_model
from bench.runs import run_bench
from bench.stats import parse_slos
from bench.workloads import WORKLOADS, WorkloadConfig
from client.api import default_target
from client.cli import add_credential_flags, credentials_from_args
from common.model_files import check_model_path, model_id


def build_parser() -> argparse.ArgumentParser:
    """The flags of `kvgate bench`."""
    parser = argparse.ArgumentParser(
        prog="kvgate bench",
        description="Load a running gateway and report latencies and throughput.",
    )
    parser.add_argument("--target", default=default_target(), help="gateway HOST:PORT")
    add_credential_flags(parser)
    _add_load_flags(parser.add_argument)
    _add_output_flags(parser.add_argument)
    return parser


def _add_load_flags(add: Callable[..., object]) -> None:
    """Arrivals and workload."""
    add("--num-requests", type=int, default=100, help="requests (chat: turns) per run")
    add(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (chat: sessions/s, each sending its turns in turn); inf: all at once",
    )
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1: Poisson")
    add(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests (chat: sessions) in flight",
    )
    add("--workload", choices=WORKLOADS, default="random")
    add(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens (shared-prefix: suffix; chat: turn)",
    )
    add("--output-len", type=int, default=128, help="output tokens (ignore_eos, exact)")
    add(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]; 0: fixed",
    )
    add("--prefix-len", type=int, default=64, help="shared-prefix: tokens of each prefix")
    add("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    add("--num-turns", type=int, default=3, help="chat: turns per session")
    add(
        "--prompt-words",
        choices=("english", "vocab"),
        default="english",
        help="prompt text: built-in English words, or the words of --model's vocabulary",
    )
    add("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")


def _add_output_flags(add: Callable[..., object]) -> None:
    """Goodput bounds, results, sweeps and the transformers comparison."""
    add(
        "--slo",
        action="append",
        default=[],
        metavar="NAME=MS",
        help="ttft_ms=.., tpot_ms=.. or e2e_ms=.. (repeatable): goodput's bounds",
    )
    add("--out", type=Path, default=DEFAULT_OUT, help="results JSON; PNGs go next to it")
    add("--sweep-rates", type=_float_list, default=[], help="e.g. 1,2,4,inf: one run per rate")
    add(
        "--sweep-window",
        type=_float_list,
        default=[],
        dest="sweep_windows_ms",
        help="e.g. 0,5,20,100: batch_window_ms per run, on a local stack of --model",
    )
    add(
        "--sweep-policy",
        type=_name_list,
        default=[],
        dest="sweep_policies",
        help="e.g. fcfs,lpm: --policy of the scheduler and executor per run (the same "
        "requests), on a local stack of --model",
    )
    add(
        "--executor-flags",
        type=shlex.split,
        default=[],
        help="--sweep-window/--sweep-policy: flags of the local stack's executor, "
        "e.g. '--num-gpu-blocks 64 --max-num-seqs 4'",
    )
    add(
        "--log-dir",
        type=Path,
        default=DEFAULT_LOG_DIR,
        help="--sweep-window/--sweep-policy: where the local stack's processes log",
    )
    add("--model", default="", help="served model folder (default: KVGATE_MODEL or make run's)")
    add("--compare-hf", action="store_true", help="run the same requests through transformers")
    add("--hf-sample", type=int, default=4, help="requests transformers generate runs one by one")
    add("--no-progress", action="store_false", dest="progress", help="no progress bar")


def _float_list(text: str) -> list[float]:
    """An argparse type: comma-separated numbers (inf allowed), at least one."""
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    """An argparse type: comma-separated names, at least one."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected names like fcfs,lpm, got {text!r}")
    return names


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Raises: ValueError naming the flag when a value is out of range."""
    flags = vars(args)
    workload = WorkloadConfig(**{name: flags[name] for name in WorkloadConfig.__dataclass_fields__})
    return BenchConfig(
        target=args.target,
        workload=workload,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        slos_ms=parse_slos(args.slo),
        out=args.out,
        sweep_rates=args.sweep_rates,
        sweep_windows_ms=args.sweep_windows_ms,
        sweep_policies=args.sweep_policies,
        executor_flags=args.executor_flags,
        model=args.model,
        prompt_words=args.prompt_words,
        compare_hf=args.compare_hf,
        hf_sample=args.hf_sample,
        progress=args.progress,
        log_dir=args.log_dir,
        credentials=credentials_from_args(args),
    )


def check_inputs(config: BenchConfig) -> None:
    """Checks what the run will need before it starts, so a bad flag costs no run.

    Raises:
        ValueError naming the flag: --out is a folder, --model lacks the files a flag
            reads, or --compare-hf's --model is not the model --target serves.
        grpc.RpcError: --compare-hf could not ask --target for its model.
    """
    if config.out.is_dir():
        raise ValueError(f"--out must be a JSON file, got the folder {config.out}")
    model = served_model(config)
    if config.prompt_words == "vocab":
        try:
            check_model_path("--model", model, "tokenizer.json")
        except ValueError as error:
            raise ValueError(f"--prompt-words vocab reads --model's tokenizer: {error}") from None
    if config.compare_hf or config.sweep_windows_ms or config.sweep_policies:
        check_model_path("--model", model, "config.json")
    if config.compare_hf:
        with config.credentials.client(config.target, timeout_s=30.0) as client:
            served_id = client.model_info().model_id
        if model_id(model) != served_id:
            raise ValueError(f"--compare-hf: --target serves {served_id!r} but --model is {model}")


def rpc_failure(args: argparse.Namespace, error: grpc.RpcError) -> str:
    """The one-line message of a gateway call outside the measured requests (model info,
    tokenize), whose failure stops the bench."""
    status = f"{error.code().name}: {error.details()}"
    if args.sweep_windows_ms or args.sweep_policies:
        return f"the local stack's gateway failed: {status}"
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"cannot reach --target {args.target}: {status}"
    return f"--target {args.target} failed a call: {status}"


def fail(message: str) -> int:
    """Prints the one-line error. Returns: the exit status of bad input."""
    print(f"kvgate bench: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Runs `kvgate bench`. Args: its flags (None: sys.argv). Returns: the exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        check_inputs(config)
    except ValueError as error:
        return fail(str(error))
    except grpc.RpcError as error:
        return fail(rpc_failure(args, error))
    try:
        results = run_bench(config)
    except grpc.RpcError as error:
        return fail(rpc_failure(args, error))
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
