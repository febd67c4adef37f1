"""What every benchmark shares: its entry in `kvgate bench`, the flags defined once, where its
results go, the scratch folder its model is written to, and this machine's limits, measured
(read bandwidth, matmul FLOP/s per dtype, the CPU's number-format extensions, resident memory).

A benchmark module lists its runs in `BENCHMARKS` ("GROUP NAME" -> Benchmark); bench/cli.py
runs the one asked for, prints its summary and writes its JSON to --out (with --out-key KEY:
under KEY in the JSON object --out holds, so runs of one benchmark share one file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.model_files import default_gguf_path

if TYPE_CHECKING:
    import torch

RESULTS = Path("bench/results")
READ_BYTES = 1 << 30  # larger than any cache of the machines this runs on
RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


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
    # The key --out-key defaults to (None: the results are the whole file), for benchmarks
    # whose default --out they share with another.
    out_key: str | None = None


def add_out(parser: argparse.ArgumentParser, name: str, key: str | None = None) -> None:
    """--out: the results JSON (PNG plots, where a benchmark draws them, go next to it);
    --out-key: the key the results go under in --out's JSON object, its other keys kept."""
    parser.add_argument("--out", type=Path, default=RESULTS / name, help="results JSON file")
    parser.add_argument(
        "--out-key",
        default=key,
        metavar="KEY",
        help="write the results under KEY into the JSON object in --out (made if missing), "
        "keeping its other keys",
    )


def plot_path(out: Path, out_key: str | None, kind: str = "") -> Path:
    """Where a plot of the run goes: OUT[_KEY][_KIND].png next to --out."""
    stem = "_".join(part for part in (out.stem, out_key, kind) if part)
    return out.with_name(f"{stem}.png")


def add_model(
    parser: argparse.ArgumentParser, default: str | None, help: str, type: type = str
) -> None:
    """--model: what the benchmark loads (a folder, a file, or a name such as smollm2)."""
    parser.add_argument("--model", type=type, default=default, help=help)


def add_prompt_len(
    parser: argparse.ArgumentParser, default: int, help: str = "prompt tokens"
) -> None:
    """--prompt-len: the prompt's length in tokens."""
    parser.add_argument("--prompt-len", type=int, default=default, help=help)


def add_output_len(
    parser: argparse.ArgumentParser, default: int, help: str = "output tokens (EOS ignored)"
) -> None:
    """--output-len: the tokens each request or stream generates."""
    parser.add_argument("--output-len", type=int, default=default, help=help)


def add_workload(
    parser: argparse.ArgumentParser,
    num_requests: int = 64,
    prompt_len: int = 128,
    output_len: int = 128,
) -> None:
    """--num-requests, --prompt-len, --output-len: requests of exact lengths (EOS ignored)."""
    parser.add_argument("--num-requests", type=int, default=num_requests)
    add_prompt_len(parser, prompt_len)
    add_output_len(parser, output_len)


def add_stream_rounds(
    parser: argparse.ArgumentParser, output_len: int, repeats: int, streams: int = 64
) -> None:
    """--streams, --output-len, --repeats: rounds of streams sent at once, through a stack."""
    parser.add_argument("--streams", type=int, default=streams, help="streams at once per round")
    add_output_len(parser, output_len, "output tokens per stream")
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


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """Raises BenchFailure naming the first flag of `names` (argparse dests) that is under 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise BenchFailure(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def model_path(name: str) -> str:
    """What --model names: smollm2 is the cached SmolLM2 GGUF file, anything else a path.
    Raises BenchFailure naming --model when it is not there."""
    path = default_gguf_path() if name == "smollm2" else Path(name)
    if not path.exists():
        raise BenchFailure(f"--model {name}: {path} does not exist")
    return str(path)


def results_beside(out: Path, out_key: str | None) -> dict:
    """What a run leaves of --out: nothing, or with --out-key every other key of the JSON
    object it holds (empty when there is no file yet). Called before the run, so a bad --out
    costs none. Raises BenchFailure naming --out when it is a folder, or when --out-key is
    given and the file is not a JSON object."""
    if out.is_dir():
        raise BenchFailure(f"--out must be a JSON file, got the folder {out}")
    if out_key is None or not out.exists():
        return {}
    try:
        held = json.loads(out.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BenchFailure(
            f"--out {out} is not JSON ({error}): --out-key writes into an object"
        ) from None
    if not isinstance(held, dict):
        kind = type(held).__name__
        raise BenchFailure(f"--out {out} holds a JSON {kind}: --out-key writes into an object")
    return {key: value for key, value in held.items() if key != out_key}


# /proc/cpuinfo flags that make each x86 ISA level the kernels build for (kernels/cpu_build.py)
ISA_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma", "f16c")}


def run_stamp(argv: list[str]) -> dict:
    """What made a result, stored beside it: the command, when (UTC), and the machine (CPU
    model, widest ISA level by /proc/cpuinfo, cores, load averages). Reads no torch."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = info.splitlines()
    model = next((ln.partition(":")[2].strip() for ln in lines if ln.startswith("model name")),
                 "unknown")  # fmt: skip
    flags = next((set(ln.partition(":")[2].split()) for ln in lines if ln.startswith("flags")),
                 set())  # fmt: skip
    isa = next((level for level, need in ISA_FLAGS.items() if flags.issuperset(need)), "scalar")
    return {
        "command": shlex.join(["kvgate", "bench", *argv]),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": model,
        "cpu_isa": isa,
        "cpus": os.cpu_count(),
        "load_average": load_average(),
    }


def write_results(
    result: dict, out: Path, out_key: str | None = None, stamp: dict | None = None
) -> None:
    """Writes `result` as JSON to `out` (its folder made); with `out_key`, under that key in
    the JSON object `out` holds, its other keys kept (results_beside). `stamp` (run_stamp)
    goes in as the result's "run"."""
    if stamp is not None:
        result = {"run": stamp, **result}
    kept = results_beside(out, out_key)
    if out_key is not None:
        result = {**kept, out_key: result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}" + (f" (key {out_key})" if out_key is not None else ""))


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


def rss(fields: tuple[str, ...] = RSS_FIELDS) -> dict[str, int]:
    """This process's resident set size in bytes (VmRSS) and its parts (RssAnon, RssFile,
    RssShmem), or other fields of /proc/self/status given in kB (VmHWM: the peak)."""
    sizes = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            sizes[name] = int(value.split()[0]) * 1024
    if missing := set(fields) - set(sizes):
        raise RuntimeError(f"no {', '.join(sorted(missing))} in /proc/self/status")
    return sizes


def best_seconds(run: Callable[[], object], repeats: int, device: str = "cpu") -> float:
    """The fastest of `repeats` timed calls of `run` after one untimed warm-up (the run least
    disturbed by other work on a shared machine); CUDA work is waited for on both sides."""
    run()
    best = float("inf")
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        run()
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_bytes_per_s(num_bytes: int = READ_BYTES, repeats: int = 10) -> float:
    """Best read rate of a large float32 tensor summed by torch (every byte read once)."""
    import torch  # here, as in every limit below: `kvgate bench load` runs without it

    x = torch.ones(num_bytes // 4)
    return num_bytes / best_seconds(x.sum, repeats)


def matmul_flops_per_s(
    dtype: torch.dtype, rows: int = 2048, size: int = 2048, repeats: int = 10, device: str = "cpu"
) -> float:
    """Best FLOP/s of a [rows, size] @ [size, size] matmul in `dtype`."""
    import torch

    a = torch.randn(rows, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * rows * size * size / best_seconds(lambda: a @ b, repeats, device)


def int8_matmul_ops_per_s(size: int = 2048, repeats: int = 10) -> float:
    """Best int8 x int8 -> int32 matmul rate (torch._int_mm; AMX-INT8 where oneDNN has it)."""
    import torch

    a = torch.randint(-100, 100, (size, size), dtype=torch.int8)
    b = torch.randint(-100, 100, (size, size), dtype=torch.int8)
    return 2 * size**3 / best_seconds(lambda: torch._int_mm(a, b), repeats)


def sync_device(device: str) -> None:
    """Waits for the work queued on `device` when it is a CUDA device (a timer's other side)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def cpu_features() -> dict:
    """The CPU's model name and which of the number-format extensions the kernels route by it
    reports (/proc/cpuinfo): AVX-512 BF16 (vdpbf16ps), AMX tiles for bfloat16 and int8."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.partition(":")[2].strip() for line in info.splitlines()
                  if line.startswith("model name")), "unknown")  # fmt: skip
    flags = next((set(line.partition(":")[2].split()) for line in info.splitlines()
                  if line.startswith("flags")), set())  # fmt: skip
    wanted = ("avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return {"model_name": model, **{name: name in flags for name in wanted}, **isa_levels()}


def isa_levels() -> dict:
    """The ISA level the C CPU kernels run at in this process (`kernels_isa`: $KVGATE_CPU_ISA,
    else the CPU's) and the highest this CPU runs (`cpu_isa`), as kernels/cpu_build.py reads
    them; None where the kernels cannot be built here."""
    from kernels import cpu_build

    try:
        return {"kernels_isa": cpu_build.isa_level(), "cpu_isa": cpu_build.cpu_isa_level()}
    except RuntimeError:
        return {"kernels_isa": None, "cpu_isa": None}


def machine_limits() -> dict:
    """The CPU's features, read bandwidth, float32 / bfloat16 matmul FLOP/s (64 and 2048 rows),
    int8 matmul op/s. Each is the best of several runs (the least disturbed by other work on a
    shared machine), at torch's current thread count."""
    import torch

    limits: dict = {"torch_threads": torch.get_num_threads(), "cpu": cpu_features()}
    limits["read_bytes_per_s"] = read_bandwidth_bytes_per_s()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for rows in (64, 2048):
            limits[f"matmul_{name}_{rows}_rows_flops_per_s"] = matmul_flops_per_s(dtype, rows)
    limits["matmul_int8_2048_rows_ops_per_s"] = int8_matmul_ops_per_s()
    return limits
