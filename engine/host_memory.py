"""Host memory: freed activations kept in the process (glibc), so CPU steps stop
page-faulting; large tables of zeros that are resident only where they are written.

A CPU forward pass allocates and frees the same large activations every step. By default
glibc serves each allocation over its mmap threshold (128 KiB, raised on the fly up to
32 MiB) with fresh pages from the kernel and hands free memory at the top of the heap back
beyond its trim threshold; either way the next step faults in and zeroes those pages again.
For a 2048-token prefill step of the benchmark model that is several hundred MB a step, and
it took about as long as the matmuls. With both thresholds raised, freed blocks stay in
the process and are reused; the process keeps its peak activation memory, which the step's
token budget bounds. The thresholds are process-wide and stay raised once set: a later Engine
with retain_freed_memory=False in the same process does not lower them.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import platform

import torch

logger = logging.getLogger("kvgate.executor")

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest value glibc accepts on 64-bit systems
TRIM_THRESHOLD_BYTES = 1 << 30
_PAGE_PRESENT = 1 << 63  # /proc/self/pagemap entry bits (the kernel's pagemap.rst)
_PAGE_EXCLUSIVE = 1 << 56  # mapped by this process only


@functools.cache
def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once; later calls are no-ops).

    Returns:
        True when both were set; False on another C library or when glibc refused (logged).
    """
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        logger.info("malloc thresholds left alone: the C library is %r, not glibc", libc_name)
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not (mmap_ok and trim_ok):
        logger.warning("glibc refused mallopt (mmap threshold ok=%s, trim ok=%s)", mmap_ok, trim_ok)
        return False
    logger.info(
        "malloc keeps freed memory: mmap threshold %d MiB, trim threshold %d MiB",
        MMAP_THRESHOLD_BYTES >> 20,
        TRIM_THRESHOLD_BYTES >> 20,
    )
    return True


def release_freed_memory() -> bool:
    """Hand the pages of freed heap memory back to the kernel now (glibc's malloc_trim).

    Called once after loading a model, whose float checkpoint tensors were freed by then (a
    quantized model keeps a quarter of them or less), so that they do not stay resident.

    Returns:
        True when glibc released memory; False when there was none or the C library is another.
    """
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.malloc_trim(0) == 1


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages become resident only when first written.

    Its memory is a private anonymous mapping of its own: the kernel hands out zeroed pages
    on first write, so a KV cache sized for the worst case holds resident only the blocks
    that were ever written (torch.zeros writes, and so touches, every page at once). A page
    only read maps the kernel's shared zero page, which is not counted as resident.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous, zero-filled on demand
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps `pages` alive


def resident_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the pages a CPU tensor's memory spans that hold memory of this process's own
    now (/proc/self/pagemap: present and mapped by this process only), whole pages counted.

    A page that was only read maps the kernel's shared zero page: present, but not this
    process's memory (VmRSS leaves it out too), so it is not counted. Neither is a page shared
    with another process after a fork.
    """
    page = mmap.PAGESIZE
    first = tensor.data_ptr() // page
    count = -(-(tensor.data_ptr() + tensor.nbytes) // page) - first
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = array.array("Q", pagemap.read(count * 8))
    own = _PAGE_PRESENT | _PAGE_EXCLUSIVE
    return sum(1 for entry in entries if entry & own == own) * page
