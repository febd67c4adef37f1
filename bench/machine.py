"""This machine's limits, measured: read bandwidth and matmul FLOP/s per dtype.

Each is the best of several runs (the least disturbed by other work on a shared machine), at
torch's current thread count.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

READ_BYTES = 1 << 30  # larger than any cache of the machines this runs on


RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


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


def read_bandwidth_bytes_per_s(num_bytes: int = READ_BYTES, repeats: int = 10) -> float:
    """Best read rate of a large float32 tensor summed by torch (every byte read once)."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def matmul_flops_per_s(
    dtype: torch.dtype, rows: int = 2048, size: int = 2048, repeats: int = 10, device: str = "cpu"
) -> float:
    """Best FLOP/s of a [rows, size] @ [size, size] matmul in `dtype`."""
    a = torch.randn(rows, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * size * size / best


def int8_matmul_ops_per_s(size: int = 2048, repeats: int = 10) -> float:
    """Best int8 x int8 -> int32 matmul rate (torch._int_mm; AMX-INT8 where oneDNN has it)."""
    a = torch.randint(-100, 100, (size, size), dtype=torch.int8)
    b = torch.randint(-100, 100, (size, size), dtype=torch.int8)
    torch._int_mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch._int_mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
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
    int8 matmul op/s."""
    limits: dict = {"torch_threads": torch.get_num_threads(), "cpu": cpu_features()}
    limits["read_bytes_per_s"] = read_bandwidth_bytes_per_s()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for rows in (64, 2048):
            limits[f"matmul_{name}_{rows}_rows_flops_per_s"] = matmul_flops_per_s(dtype, rows)
    limits["matmul_int8_2048_rows_ops_per_s"] = int8_matmul_ops_per_s()
    return limits
