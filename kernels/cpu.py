"""CPU kernels in C, compiled at first use: paged decode attention that reads the cache in place.

The reference decode attention gathers every sequence's blocks into a padded copy each layer of
each step; on a CPU that copy and the masked attention over it cost more than the model's
matmuls at long contexts. `kernels/cpu/paged_decode.c` walks the block table instead. It is
built with the system C compiler (`cc`, or `$CC`) into a cache folder keyed by the source,
flags and CPU, in well under a second, and loaded with ctypes; OpenMP threads follow
`torch.get_num_threads()`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.validation import check_decode

SOURCE = Path(__file__).with_name("cpu") / "paged_decode.c"
BUILD_DIR_ENV = "KVGATE_BUILD_DIR"
# -ffast-math lets the compiler reorder float sums and call vectorized expf. It is given when
# compiling only: linking with it would add crtfastmath.o, which turns on flush-to-zero for the
# whole process when the library loads.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-funroll-loops", "-fopenmp", "-fPIC")
_LINK_FLAGS = ("-shared", "-fopenmp")
_LIBS = ("-lmvec", "-lm")

_i64, _f32p, _i32p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p


def build_dir() -> Path:
    """Where compiled kernels are cached: $KVGATE_BUILD_DIR, else ~/.cache/kvgate."""
    configured = os.environ.get(BUILD_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kvgate"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def why_unavailable() -> str | None:
    """Why the CPU kernels cannot be built or loaded here, or None when they can."""
    try:
        _library()
    except RuntimeError as err:
        return str(err)
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found to build the CPU kernels (install gcc, or set CC)")
    source = SOURCE.read_bytes()
    flags = " ".join(_COMPILE_FLAGS + _LINK_FLAGS + _LIBS)
    parts = [source, compiler.encode(), flags.encode(), _cpu_model().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = build_dir() / f"paged_decode-{key}.so"
    try:
        if not path.exists():
            _compile(compiler, path)
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise RuntimeError(
            f"cannot build or load the CPU kernels in {path.parent}: {err} "
            f"(set {BUILD_DIR_ENV} to a writable folder)"
        ) from err
    lib.kvgate_first_invalid_sequence.argtypes = [_i32p, _i32p, _i64, _i64, _i64, _i64]
    lib.kvgate_first_invalid_sequence.restype = _i64
    lib.kvgate_paged_decode_attention_f32.argtypes = [
        _f32p, _f32p, _f32p, _i32p, _i32p, _f32p,
        _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    lib.kvgate_paged_decode_attention_f32.restype = ctypes.c_int
    return lib


def _compile(compiler: str, path: Path) -> None:
    """Compile SOURCE to `path`, atomically: concurrent builders each write their own file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        obj, lib = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        _run(compiler, *_COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj))
        _run(compiler, *_LINK_FLAGS, str(obj), "-o", str(lib), *_LIBS)
        os.replace(lib, path)


def _run(*command: str) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as err:
        raise RuntimeError(f"cannot run the C compiler {command[0]}: {err}") from err
    if result.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed: {' '.join(command)}\n{result.stderr}")


def _check_cpu_float32(tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; the CPU kernels need CPU tensors")
        if name in ("q", "k_cache", "v_cache") and tensor.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 for the CPU kernels, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU twin of kernels.reference.paged_decode_attention (same arguments and result).

    Also requires float32, contiguous CPU tensors, and checks every block-table entry a
    sequence's context uses (the C code trusts them).
    """
    check_decode(q, k_cache, v_cache, block_tables, context_lens)
    _check_cpu_float32(
        {"q": q, "k_cache": k_cache, "v_cache": v_cache,
         "block_tables": block_tables, "context_lens": context_lens}
    )  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    lib = _library()
    max_blocks = block_tables.shape[1]
    bad = lib.kvgate_first_invalid_sequence(
        block_tables.data_ptr(), context_lens.data_ptr(), num_seqs, max_blocks, block_size,
        num_blocks,
    )  # fmt: skip
    if bad >= 0:
        raise ValueError(
            f"sequence {bad}: context_lens[{bad}] = {int(context_lens[bad])} needs block_tables "
            f"entries in [0, {num_blocks}) for its first "
            f"ceil(context / {block_size}) of {max_blocks} columns, and at least one token"
        )
    failed = lib.kvgate_paged_decode_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
        block_size, max_blocks, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged decode attention could not allocate its score buffer")
    return out
