"""Build and load the C CPU kernels (kernels/csrc/*.c) with the system C compiler.

The sources are compiled at first use into a cache folder keyed by the sources, flags, ISA
level and CPU, in a few seconds, and loaded with ctypes; OpenMP threads follow
`torch.get_num_threads()` (the wrappers pass it). Element types cross the boundary as the
numbers in `DTYPE_CODES`.

The same sources are built once per ISA level (`ISA_LEVELS`): `avx512` (-march=native on a CPU
with AVX-512 F/BW/CD/DQ/VL, keeping its AVX512-BF16, VNNI and AMX), `avx2` (-march=x86-64-v3:
AVX2, FMA, F16C) and `scalar` (the baseline x86-64, whose vector code is only what the compiler
finds itself). The level loaded is the highest this CPU runs, read by CPUID at load
(kernels/csrc/cpu_isa.c), or a lower one named by $KVGATE_CPU_ISA (tests and benchmarks
compare them); each library reports the level it was compiled for, and one that differs from
the level asked for is an error. The build happens on the machine that serves, so an image
built elsewhere loads what its CPU runs.
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
        "cpu_int8_blocks.h",
    )
)
PROBE_SOURCE = CSRC / "cpu_isa.c"
BUILD_DIR_ENV = "KVGATE_BUILD_DIR"
ISA_ENV = "KVGATE_CPU_ISA"
# Lowest first: a level's index is the number cpu_isa.c and kvgate_isa_level() return.
ISA_LEVELS = ("scalar", "avx2", "avx512")
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# Each level's target flags; off x86 only `scalar` exists, built for the compiler's default.
_ISA_FLAGS = {
    "avx512": ("-march=native",),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "scalar": ("-march=x86-64", "-mtune=native") if _X86 else (),
}
# -ffast-math lets the compiler reorder float sums and call vectorized expf. It is given when
# compiling only: linking with it would add crtfastmath.o, which turns on flush-to-zero for the
# whole process when the library loads.
_COMPILE_FLAGS = ("-O3", "-ffast-math", "-funroll-loops", "-fopenmp", "-fPIC")
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
        ("x_int8", _int),
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
    "kvgate_isa_level": ([], _int),
    "kvgate_linear_columns_available": ([], _int),
    "kvgate_attention_tiles_built": ([], _int),
    "kvgate_int4_integer_built": ([], _int),
    "kvgate_int8_integer_built": ([], _int),
    "kvgate_rms_norm_vector_built": ([], _int),
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
    """Why the CPU kernels cannot be built or loaded here, or None when they can.

    Raises:
        ValueError: $KVGATE_CPU_ISA names a level this CPU cannot run (a setting to correct,
            not a reason to run other kernels).
    """
    try:
        library()
    except RuntimeError as err:
        return str(err)
    return None


def cpu_isa_level() -> str:
    """The highest level of ISA_LEVELS this CPU runs, by CPUID (kernels/csrc/cpu_isa.c).

    Raises:
        RuntimeError: no compiler, or the probe cannot be built or loaded (the message says).
    """
    return ISA_LEVELS[_probe().kvgate_cpu_isa_level()]


def runnable_isa_levels() -> tuple[str, ...]:
    """Every level of ISA_LEVELS this CPU runs, lowest first."""
    return ISA_LEVELS[: ISA_LEVELS.index(cpu_isa_level()) + 1]


def isa_level() -> str:
    """The level `library()` loads: $KVGATE_CPU_ISA where set, else cpu_isa_level().

    Raises:
        ValueError: KVGATE_CPU_ISA names no level, or one this CPU cannot run.
    """
    return choose_isa_level(os.environ.get(ISA_ENV, ""), cpu_isa_level())


def choose_isa_level(requested: str, best: str) -> str:
    """The level to load when $KVGATE_CPU_ISA is `requested` ("": unset) on a CPU that runs up
    to `best`.

    Raises:
        ValueError: `requested` is no level of ISA_LEVELS, or one above `best`.
    """
    requested = requested.strip().lower()
    if not requested:
        return best
    if requested not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={requested!r} is no ISA level; use one of {ISA_LEVELS}")
    if ISA_LEVELS.index(requested) > ISA_LEVELS.index(best):
        allowed = ISA_LEVELS[: ISA_LEVELS.index(best) + 1]
        raise ValueError(
            f"{ISA_ENV}={requested}: this CPU ({_cpu_model()}) runs up to {best}; "
            f"ask for one of {allowed} or unset {ISA_ENV}"
        )
    return requested


@functools.cache
def library() -> ctypes.CDLL:
    """The kernels of isa_level(), built first when the cache holds no build of these sources.
    Read once per process: tests that switch levels clear this cache (`library.cache_clear()`).

    Raises:
        RuntimeError: no compiler, a failed build, or an unwritable cache folder (the message
            says which).
        ValueError: $KVGATE_CPU_ISA names a level this CPU cannot run.
    """
    return library_for(isa_level())


@functools.cache
def library_for(level: str) -> ctypes.CDLL:
    """The kernels built for `level` of ISA_LEVELS (the caller checks the CPU runs it).

    Raises:
        RuntimeError: as `library`, or the library reports another level than `level`.
    """
    lib = _load(SOURCES, _ISA_FLAGS[level] + _COMPILE_FLAGS, f"cpu-kernels-{level}")
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    built = ISA_LEVELS[lib.kvgate_isa_level()]
    if built != level:
        raise RuntimeError(
            f"the CPU kernels built for {level} report {built}: the compiler "
            f"{_compiler()} did not take {' '.join(_ISA_FLAGS[level])}"
        )
    return lib


@functools.cache
def _probe() -> ctypes.CDLL:
    lib = _load((PROBE_SOURCE,), ("-O2", "-fPIC"), "cpu-isa")
    lib.kvgate_cpu_isa_level.argtypes, lib.kvgate_cpu_isa_level.restype = [], _int
    return lib


def _load(sources: tuple[Path, ...], compile_flags: tuple[str, ...], stem: str) -> ctypes.CDLL:
    """`sources` built into one library (cached by their text, the flags and the CPU), loaded."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found to build the CPU kernels (install gcc, or set CC)")
    try:
        texts = [path.read_bytes() for path in sources + HEADERS]
    except OSError as err:
        raise RuntimeError(f"the CPU kernels' source is missing: {err}") from err
    flags = " ".join(compile_flags + _LINK_FLAGS + _LIBS)
    parts = [*texts, compiler.encode(), flags.encode(), _cpu_model().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = build_dir() / f"{stem}-{key}.so"
    try:
        if not path.exists():
            _compile(compiler, sources, compile_flags, path)
        return ctypes.CDLL(str(path))
    except OSError as err:
        raise RuntimeError(
            f"cannot build or load the CPU kernels in {path.parent}: {err} "
            f"(set {BUILD_DIR_ENV} to a writable folder)"
        ) from err


def _compile(
    compiler: str, sources: tuple[Path, ...], compile_flags: tuple[str, ...], path: Path
) -> None:
    """Compile `sources` to `path`, atomically: concurrent builders each write their own file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        objects = []
        for source in sources:
            obj = Path(scratch) / f"{source.stem}.o"
            _run(compiler, *compile_flags, "-c", str(source), "-o", str(obj))
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
