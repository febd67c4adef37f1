"""CPU kernels: paged attention, rotary, KV-cache store, argmax and RMSNorm in C (compiled at
first use), and linear layers computed transposed.

The reference attention gathers every sequence's blocks into a (padded) copy each layer of
each step; on a CPU that copy and the masked attention over it cost more than the model's
matmuls at long contexts. `kernels/csrc/cpu_kernels.c` walks the block table instead, for
decode and for prefill chunks (one query token per work item); it does
the rotary embedding and the KV-cache store in one pass each where the reference runs a dozen
small tensor ops, the greedy argmax down the columns of column-major logits, and RMSNorm with
its residual add in one pass over row- or column-major activations. It is built
with the system C compiler (`cc`, or `$CC`) into a cache folder keyed by the source, flags and
CPU, in well under a second, and loaded with ctypes; OpenMP threads follow
`torch.get_num_threads()`. Every wrapper has the signature and results of its
twin in kernels.reference, for float32 CPU tensors.

`linear` runs x @ weight^T as weight @ x^T: at decode batch sizes MKL runs that 20-40% faster
on this kind of CPU, and its result is a column-major view that the next linear reads in place
(elementwise ops keep the layout; RMSNorm reads and writes it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.validation import (
    check_argmax,
    check_decode,
    check_linear,
    check_prefill,
    check_rms_norm,
    check_rotary,
    check_store_kvcache,
    expect_inner_contiguous,
)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
BUILD_DIR_ENV = "KVGATE_BUILD_DIR"
# -ffast-math lets the compiler reorder float sums and call vectorized expf. It is given when
# compiling only: linking with it would add crtfastmath.o, which turns on flush-to-zero for the
# whole process when the library loads.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-funroll-loops", "-fopenmp", "-fPIC")
_LINK_FLAGS = ("-shared", "-fopenmp")
_LIBS = ("-lmvec", "-lm")

_i64, _f32p, _i32p, _i64p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p


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
    try:
        source = SOURCE.read_bytes()
    except OSError as err:
        raise RuntimeError(f"the CPU kernels' source is missing: {err}") from err
    flags = " ".join(_COMPILE_FLAGS + _LINK_FLAGS + _LIBS)
    parts = [source, compiler.encode(), flags.encode(), _cpu_model().encode()]
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
    lib.kvgate_first_invalid_sequence.argtypes = [_i32p, _i32p, _i64, _i64, _i64, _i64]
    lib.kvgate_first_invalid_sequence.restype = _i64
    lib.kvgate_paged_decode_attention_f32.argtypes = [
        _f32p, _f32p, _f32p, _i32p, _i32p, _f32p,
        _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    lib.kvgate_paged_decode_attention_f32.restype = ctypes.c_int
    lib.kvgate_rotary_f32.argtypes = [
        _i64p, _f32p, _i64, _f32p, _i64, _i64, _i64, _i64, _f32p, ctypes.c_int,
    ]  # fmt: skip
    lib.kvgate_rotary_f32.restype = _i64
    lib.kvgate_store_kvcache_f32.argtypes = [
        _f32p, _i64, _f32p, _i64, _f32p, _f32p, _i64p, _i64, _i64, _i64,
    ]  # fmt: skip
    lib.kvgate_store_kvcache_f32.restype = _i64
    lib.kvgate_argmax_f32.argtypes = [_f32p, _i64, _i64, _i64, _i64, _i64p, _f32p]
    lib.kvgate_argmax_f32.restype = None
    lib.kvgate_rms_norm_f32.argtypes = [
        _f32p, _i64, _f32p, _i64, _f32p, _f32p, _f32p, _i64, _i64, ctypes.c_int, ctypes.c_float,
        ctypes.c_int,
    ]  # fmt: skip
    lib.kvgate_rms_norm_f32.restype = None
    lib.kvgate_paged_prefill_attention_f32.argtypes = [
        _f32p, _i64, _f32p, _f32p, _i32p, _i32p, _i32p, _f32p,
        _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    lib.kvgate_paged_prefill_attention_f32.restype = ctypes.c_int
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


def _check_cpu(
    tensors: dict[str, torch.Tensor], floats: tuple[str, ...], inner_dims: dict[str, int]
) -> None:
    """Raise unless every tensor is on the CPU, `floats` are float32, and each tensor is
    contiguous, or for those in `inner_dims`, contiguous in that many trailing dims."""
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; the CPU kernels need CPU tensors")
        if name in floats and tensor.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 for the CPU kernels, got {tensor.dtype}")
        if name in inner_dims:
            expect_inner_contiguous(name, tensor, inner_dims[name])
        elif not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def _token_stride(tensor: torch.Tensor) -> int:
    """Elements between consecutive tokens of [tokens, heads, head_dim] (0 tokens: any)."""
    return tensor.stride(0) if tensor.shape[0] > 1 else tensor.shape[1] * tensor.shape[2]


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The CPU twin of kernels.reference.store_kvcache (same arguments, writes in place).

    Key and value rows may lie any distance apart (slices of a fused projection); each
    token's heads and head_dim must be contiguous. A slot outside [-1, cache slots) is a
    ValueError and nothing is written.
    """
    check_store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    _check_cpu(
        {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
         "slot_mapping": slot_mapping},
        floats=("key", "value", "k_cache", "v_cache"),
        inner_dims={"key": 2, "value": 2},
    )  # fmt: skip
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = _library().kvgate_store_kvcache_f32(
        key.data_ptr(), _token_stride(key), value.data_ptr(), _token_stride(value),
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
        key.shape[1] * key.shape[2], num_slots,
    )  # fmt: skip
    if bad >= 0:
        raise ValueError(
            f"slot_mapping[{bad}] = {int(slot_mapping[bad])} is outside the cache's "
            f"{num_slots} slots (-1 skips a token)"
        )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU twin of kernels.reference.rotary_embedding (same arguments and results).

    q and k rows may lie any distance apart (slices of a fused projection); each token's
    heads and head_dim must be contiguous. A position outside the cache is a ValueError.
    """
    check_rotary(positions, q, k, cos_sin_cache)
    _check_cpu(
        {"positions": positions, "q": q, "k": k, "cos_sin_cache": cos_sin_cache},
        floats=("q", "k"),
        inner_dims={"q": 2, "k": 2},
    )
    lib, threads = _library(), torch.get_num_threads()
    max_position, head_dim = cos_sin_cache.shape
    rotated = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=x.dtype)
        bad = lib.kvgate_rotary_f32(
            positions.data_ptr(), cos_sin_cache.data_ptr(), max_position, x.data_ptr(),
            _token_stride(x), x.shape[0], x.shape[1], head_dim, out.data_ptr(), threads,
        )  # fmt: skip
        if bad >= 0:
            raise ValueError(
                f"positions[{bad}] = {int(positions[bad])} is outside the rotary cache's "
                f"{max_position} positions"
            )
        rotated.append(out)
    return rotated[0], rotated[1]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The CPU twin of kernels.reference.argmax: torch.argmax(logits, dim=-1) of a float32
    [rows, vocab] CPU tensor of any strides (the column-major logits of weight @ hidden^T
    are read down their columns, all rows at once)."""
    check_argmax(logits)
    _check_cpu({"logits": logits}, floats=("logits",), inner_dims={"logits": 0})
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return out
    best = torch.empty(rows, dtype=torch.float32)
    _library().kvgate_argmax_f32(
        logits.data_ptr(), rows, cols, logits.stride(0), logits.stride(1), out.data_ptr(),
        best.data_ptr(),
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU twin of kernels.reference.linear, computed as weight @ x^T: the result is the
    [N, out_features] transposed view of a contiguous [out_features, N] (column-major)."""
    check_linear(x, weight, bias)
    if bias is None:
        return torch.mm(weight, x.t()).t()
    return torch.addmm(bias.unsqueeze(1), weight, x.t()).t()


def _has_layout(t: torch.Tensor, column_major: bool) -> bool:
    """Whether 2-D `t` is dense along its rows (row-major) or its columns (column-major)."""
    inner, outer = (0, 1) if column_major else (1, 0)
    dense = t.stride(inner) == 1 or t.shape[inner] == 1
    return dense and (t.shape[outer] == 1 or t.stride(outer) >= t.shape[inner])


def _leading_dim(t: torch.Tensor, column_major: bool) -> int:
    """Floats between consecutive columns (column-major) or rows (row-major) of 2-D `t`."""
    outer = 1 if column_major else 0
    return t.stride(outer) if t.shape[outer] > 1 else t.shape[1 - outer]


def _empty_2d(rows: int, cols: int, column_major: bool) -> torch.Tensor:
    return torch.empty(cols, rows).t() if column_major else torch.empty(rows, cols)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU twin of kernels.reference.rms_norm (same arguments and results up to float32
    rounding: each row's sum of squares runs in another order).

    Row- and column-major x (the output of `linear`) are read in place and the results take
    x's layout; a residual in another layout, or an x in neither, is copied first.
    """
    check_rms_norm(x, weight, residual)
    tensors = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
    _check_cpu(tensors, floats=tuple(tensors), inner_dims={"x": 0, "residual": 0})
    column_major = not _has_layout(x, False) and _has_layout(x, True)
    if not column_major and not _has_layout(x, False):
        x = x.contiguous()
    if residual is not None and not _has_layout(residual, column_major):
        residual = residual.t().contiguous().t() if column_major else residual.contiguous()
    rows, hidden = x.shape
    out = _empty_2d(rows, hidden, column_major)
    summed = x if residual is None else _empty_2d(rows, hidden, column_major)
    if rows == 0:
        return out, summed
    _library().kvgate_rms_norm_f32(
        x.data_ptr(), _leading_dim(x, column_major),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else _leading_dim(residual, column_major),
        weight.data_ptr(), out.data_ptr(), None if residual is None else summed.data_ptr(),
        rows, hidden, int(column_major), eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, summed


def _check_tables(
    lib: ctypes.CDLL,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    sequences: torch.Tensor | None = None,
) -> None:
    """Raise a ValueError naming the first sequence (of `sequences`, default all) whose
    context or block ids the C attention would read out of range."""
    tables, lens = block_tables, context_lens
    if sequences is not None and len(sequences) < len(context_lens):
        tables, lens = block_tables[sequences].contiguous(), context_lens[sequences].contiguous()
    num_seqs, max_blocks = tables.shape
    bad = lib.kvgate_first_invalid_sequence(
        tables.data_ptr(), lens.data_ptr(), num_seqs, max_blocks, block_size, num_blocks
    )
    if bad >= 0:
        seq = int(sequences[bad]) if tables is not block_tables else bad
        raise ValueError(_bad_sequence(seq, block_tables, context_lens, num_blocks, block_size))


def _bad_sequence(
    seq: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
) -> str:
    """What is wrong with sequence `seq`, which the C check found invalid."""
    context_len = int(context_lens[seq])
    if context_len < 1:
        return f"context_lens[{seq}] = {context_len}: every sequence needs at least one token"
    needed = -(-context_len // block_size)
    if needed > block_tables.shape[1]:
        return (
            f"context_lens[{seq}] = {context_len} needs {needed} blocks of {block_size}, but "
            f"block_tables has {block_tables.shape[1]} columns"
        )
    row = block_tables[seq, :needed].tolist()
    column = next(i for i, block in enumerate(row) if not 0 <= block < num_blocks)
    return (
        f"block_tables[{seq}, {column}] = {row[column]} is not a block of the cache "
        f"[0, {num_blocks}); sequence {seq} uses its first {needed} columns"
    )


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
    _check_cpu(
        {"q": q, "k_cache": k_cache, "v_cache": v_cache,
         "block_tables": block_tables, "context_lens": context_lens},
        floats=("q", "k_cache", "v_cache"),
        inner_dims={},
    )  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    lib = _library()
    max_blocks = block_tables.shape[1]
    _check_tables(lib, block_tables, context_lens, num_blocks, block_size)
    failed = lib.kvgate_paged_decode_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
        block_size, max_blocks, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged decode attention could not allocate its score buffer")
    return out


def _check_query_offsets(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, n: int) -> None:
    """Raise unless cu_seqlens_q runs from 0 to n without going down, and no sequence has more
    queries than context (the C code trusts both)."""
    starts = cu_seqlens_q.tolist()
    if starts[0] != 0 or starts[-1] != n or any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"cu_seqlens_q must rise from 0 to the {n} packed queries, got {starts}")
    for seq, context_len in enumerate(context_lens.tolist()):
        if starts[seq + 1] - starts[seq] > context_len:
            raise ValueError(
                f"sequence {seq} has {starts[seq + 1] - starts[seq]} queries but "
                f"context_lens[{seq}] is {context_len}; the cache must already hold every "
                "query's key"
            )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU twin of kernels.reference.paged_prefill_attention (same arguments and result).

    Each query token attends through the block table in place, as in decode, where the
    reference gathers a copy of every sequence's cache. q's tokens may lie any distance apart
    (heads and head_dim contiguous); every block-table entry a context uses is checked.
    """
    check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    _check_cpu(
        {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
         "cu_seqlens_q": cu_seqlens_q, "context_lens": context_lens},
        floats=("q", "k_cache", "v_cache"),
        inner_dims={"q": 2},
    )  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    _check_query_offsets(cu_seqlens_q, context_lens, num_tokens)
    out = torch.empty(q.shape, dtype=q.dtype)
    if num_tokens == 0:
        return out
    lib, num_seqs, max_blocks = _library(), context_lens.shape[0], block_tables.shape[1]
    # Sequences without new tokens are not read (the reference skips them too).
    querying = (cu_seqlens_q[1:] > cu_seqlens_q[:-1]).nonzero().flatten()
    _check_tables(lib, block_tables, context_lens, num_blocks, block_size, querying)
    failed = lib.kvgate_paged_prefill_attention_f32(
        q.data_ptr(), _token_stride(q), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), cu_seqlens_q.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks,
        scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged prefill attention could not allocate its score buffer")
    return out
