"""Build and load the C CPU kernels (kernels/csrc/*.c) with the system C compiler.

The sources are compiled at first use into a cache folder keyed by the sources, flags and CPU,
in about a second, and loaded with ctypes; OpenMP threads follow `torch.get_num_threads()` (the
wrappers pass it). Element types cross the boundary as the numbers in `DTYPE_CODES`.
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

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "cpu_attention.c",
        "cpu_kernels.c",
        "cpu_linear.c",
        "cpu_linear_columns.c",
        "cpu_linear_tiles.c",
        "cpu_decoder.c",
    )
)
HEADERS = tuple(
    CSRC / name
    for name in (
        "cpu_common.h",
        "cpu_attend.h",
        "cpu_attention_tiles.h",
        "cpu_transpose.h",
        "cpu_int4.h",
    )
)
BUILD_DIR_ENV = "KVGATE_BUILD_DIR"
# -ffast-math lets the compiler reorder float sums and call vectorized expf. It is given when
# compiling only: linking with it would add crtfastmath.o, which turns on flush-to-zero for the
# whole process when the library loads.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-funroll-loops", "-fopenmp", "-fPIC")
_LINK_FLAGS = ("-shared", "-fopenmp")
_LIBS = ("-lmvec", "-lm")
# The element types the kernels read and write (cpu_common.h's KVGATE_F32, KVGATE_BF16), and
# a KV cache's formats: those, int8 rows with their scale (KVGATE_I8, kernels/kv_format.py),
# float16 (KVGATE_F16) and fp8 rows with their scale (uint8, KVGATE_FP8).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 2, torch.float16: 3, torch.uint8: 4}

_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class AttentionStepStruct(ctypes.Structure):
    """cpu_common.h's kvgate_attention_step: one step's attention inputs for every layer."""

    _fields_ = [
        ("positions", _ptr),
        ("cos_sin", _ptr),
        ("slot_mapping", _ptr),
        ("decode_tables", _ptr),
        ("decode_lens", _ptr),
        ("prefill_tables", _ptr),
        ("cu_seqlens", _ptr),
        ("prefill_lens", _ptr),
        ("num_tokens", _i64),
        ("num_decode", _i64),
        ("decode_width", _i64),
        ("num_prefill_seqs", _i64),
        ("prefill_width", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("block_size", _i64),
        ("scale", _float),
        ("num_threads", _int),
    ]


class LinearWeightsStruct(ctypes.Structure):
    """cpu_common.h's kvgate_linear_weights: one linear layer's weight and bias."""

    _fields_ = [
        ("kind", _int),
        ("q", _ptr),
        ("scales", _ptr),
        ("zeros", _ptr),
        ("bias", _ptr),
        ("group_size", _i64),
        ("out_features", _i64),
        ("in_features", _i64),
    ]


# Weight formats (cpu_common.h's KVGATE_W_*).
WEIGHT_KINDS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}


class LayerStruct(ctypes.Structure):
    """cpu_decoder.c's kvgate_layer."""

    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", LinearWeightsStruct),
        ("o", LinearWeightsStruct),
        ("gate_up", LinearWeightsStruct),
        ("down", LinearWeightsStruct),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
    ]


class DecoderStruct(ctypes.Structure):
    """cpu_decoder.c's kvgate_decoder."""

    _fields_ = [
        ("layers", ctypes.POINTER(LayerStruct)),
        ("num_layers", _i64),
        ("hidden", _i64),
        ("intermediate", _i64),
        ("eps", _float),
        ("act_dtype", _int),
        ("cache_dtype", _int),
        ("small_rows", _i64),
    ]


_linear_p = ctypes.POINTER(LinearWeightsStruct)
# Argument and result types of every exported function.
_SIGNATURES = {
    "kvgate_first_invalid_sequence": ([_ptr, _ptr, _i64, _i64, _i64, _i64], _i64),
    "kvgate_first_out_of_range": ([_ptr, _i64, _i64, _i64], _i64),
    "kvgate_paged_decode_attention": (
        [_ptr, _int, _ptr, _ptr, _int, _ptr, _ptr, _ptr]
        + [_i64] * 6 + [_float, _int], _int,
    ),
    "kvgate_paged_prefill_attention": (
        [_ptr, _int, _i64, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _ptr]
        + [_i64] * 6 + [_float, _int], _int,
    ),
    "kvgate_attention_layer": (
        [ctypes.POINTER(AttentionStepStruct), _ptr, _int, _i64, _i64, _ptr, _ptr, _int, _ptr,
         _ptr], _int,
    ),
    "kvgate_rotary": ([_ptr, _ptr, _i64, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _int], _i64),
    "kvgate_store_kvcache": (
        [_ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _int, _ptr, _i64, _i64, _i64, _i64], _i64,
    ),
    "kvgate_argmax_f32": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "kvgate_fp8_from_f32": ([_ptr, _i64, _ptr], None),
    "kvgate_fp8_to_f32": ([_ptr, _i64, _ptr], None),
    "kvgate_rms_norm": (
        [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int, _int, _float, _int], None,
    ),
    "kvgate_silu_and_mul": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _int, _int], None),
    "kvgate_linear": ([_linear_p, _ptr, _int, _i64, _i64, _i64, _ptr, _int, _int], _int),
    "kvgate_dequantize": ([_linear_p, _i64, _i64, _ptr, _int, _int], _int),
    "kvgate_linear_columns_available": ([], _int),
    "kvgate_linear_tiles_available": ([], _int),
    "kvgate_linear_tiles": ([_linear_p, _ptr, _int, _i64, _ptr, _int, _int], _int),
    "kvgate_linear_columns_quantized": ([_linear_p, _ptr, _i64, _ptr, _int], _int),
    "kvgate_linear_columns": ([_ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int], _int),
    "kvgate_decoder_timing": ([_int, _ptr], None),
    "kvgate_decode_layers": (
        [ctypes.POINTER(DecoderStruct), ctypes.POINTER(AttentionStepStruct), _ptr, _ptr, _ptr,
         _i64, _int], _int,
    ),
}  # fmt: skip


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
        library()
    except RuntimeError as err:
        return str(err)
    return None


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernels, built first when the cache holds no build of these sources.

    Raises:
        RuntimeError: no compiler, a failed build, or an unwritable cache folder (the message
            says which).
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found to build the CPU kernels (install gcc, or set CC)")
    try:
        sources = [path.read_bytes() for path in SOURCES + HEADERS]
    except OSError as err:
        raise RuntimeError(f"the CPU kernels' source is missing: {err}") from err
    flags = " ".join(_COMPILE_FLAGS + _LINK_FLAGS + _LIBS)
    parts = [*sources, compiler.encode(), flags.encode(), _cpu_model().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = build_dir() / f"cpu-kernels-{key}.so"
    try:
        if not path.exists():
            _compile(compiler, path)
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise RuntimeError(
            f"cannot build or load the CPU kernels in {path.parent}: {err} "
            f"(set {BUILD_DIR_ENV} to a writable folder)"
        ) from err
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def _compile(compiler: str, path: Path) -> None:
    """Compile SOURCES to `path`, atomically: concurrent builders each write their own file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        objects = []
        for source in SOURCES:
            obj = Path(scratch) / f"{source.stem}.o"
            _run(compiler, *_COMPILE_FLAGS, "-c", str(source), "-o", str(obj))
            objects.append(str(obj))
        lib = Path(scratch) / "kernels.so"
        _run(compiler, *_LINK_FLAGS, *objects, "-o", str(lib), *_LIBS)
        os.replace(lib, path)


def _run(*command: str) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as err:
        raise RuntimeError(f"cannot run the C compiler {command[0]}: {err}") from err
    if result.returncode != 0:
        raise RuntimeError(f"building the CPU kernels failed: {' '.join(command)}\n{result.stderr}")
