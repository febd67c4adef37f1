"""What every benchmark shares: its entry in `kvgate bench`, the flags defined once, where its
results go, and the scratch folder its model is written to.

A benchmark module lists its runs in `BENCHMARKS` ("GROUP NAME" -> Benchmark); bench/cli.py
runs the one asked for, prints its summary and writes its JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path("bench/results")


class BenchFailure(Exception):
    """A benchmark that cannot run as asked (a bad flag, an unreachable target): its message
    is printed as one line and the command exits with status 2."""


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One `kvgate bench GROUP NAME`."""

    # Adds the benchmark's own flags (the shared ones through the add_* helpers below).
    add_arguments: Callable[[argparse.ArgumentParser], None]
    # Runs it; returns what goes into the JSON file.
    run: Callable[[argparse.Namespace], dict]
    # The results file --out defaults to, under bench/results/.
    out: str
    # Prints what a reader looks at first (None: the run prints as it goes).
    summarize: Callable[[dict], None] | None = None
    # What the results show went wrong, if anything: the command then exits with status 1.
    failure: Callable[[dict], str | None] | None = None


def add_out(parser: argparse.ArgumentParser, name: str) -> None:
    """--out: the results JSON (PNG plots, where a benchmark draws them, go next to it)."""
    parser.add_argument("--out", type=Path, default=RESULTS / name, help="results JSON file")


def add_model(
    parser: argparse.ArgumentParser, default: str | None, help: str, type: type = str
) -> None:
    """--model: what the benchmark loads (a folder, a file, or a name such as smollm2)."""
    parser.add_argument("--model", type=type, default=default, help=help)


def add_workload(
    parser: argparse.ArgumentParser,
    num_requests: int = 64,
    prompt_len: int = 128,
    output_len: int = 128,
) -> None:
    """--num-requests, --prompt-len, --output-len: requests of exact lengths (EOS ignored)."""
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--prompt-len", type=int, default=prompt_len, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=output_len, help="output tokens")


def add_stream_rounds(
    parser: argparse.ArgumentParser, output_len: int, repeats: int, streams: int = 64
) -> None:
    """--streams, --output-len, --repeats: rounds of streams sent at once, through a stack."""
    parser.add_argument("--streams", type=int, default=streams, help="streams at once per round")
    parser.add_argument(
        "--output-len", type=int, default=output_len, help="output tokens per stream"
    )
    add_repeats(parser, repeats)


def add_ttft_turns(parser: argparse.ArgumentParser, requests: int, what: str) -> None:
    """--ttft-requests, --ttft-interval-s: TTFT samples per `what`, the kinds taking turns."""
    parser.add_argument(
        "--ttft-requests", type=int, default=requests, help=f"TTFT samples per {what}"
    )
    parser.add_argument("--ttft-interval-s", type=float, default=0.05, help="gap between turns")


def add_repeats(parser: argparse.ArgumentParser, default: int) -> None:
    """--repeats: interleaved rounds of every measure; a figure is its best or median round."""
    parser.add_argument("--repeats", type=int, default=default, help="rounds of every measure")


def add_threads(parser: argparse.ArgumentParser, default: int = 0) -> None:
    """--threads: torch CPU threads for every measure, set before the run (0: torch's default)."""
    parser.add_argument("--threads", type=int, default=default, help="torch threads (0: default)")


def add_device(parser: argparse.ArgumentParser) -> None:
    """--device: cuda when there is one, else cpu."""
    import torch  # here: `kvgate bench load` runs without it

    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def write_results(result: dict, out: Path) -> None:
    """Writes `result` as JSON to `out` (its folder made)."""
    if out.is_dir():
        raise BenchFailure(f"--out must be a JSON file, got the folder {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def print_json(result: dict) -> None:
    """A summary for results read as a whole."""
    print(json.dumps(result, indent=2))


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, stored beside every result."""
    return list(os.getloadavg())


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


@contextmanager
def scratch_folder(prefix: str = "kvgate-bench-") -> Iterator[Path]:
    """A new empty folder, removed with its contents when the block ends or on SIGTERM.

    A benchmark model is hundreds of MB. SIGTERM (what `timeout` and a job runner send) ends
    the process without leaving a `with` block, so it is turned into SystemExit for the
    length of the block; one that comes while the folder is being removed is held until the
    removal is done. The folder goes in every ending but SIGKILL.
    """
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        held: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if held:
            sys.exit(128 + signal.SIGTERM)
