"""CPU kernels in C: rotary embedding, KV-cache store, argmax, RMSNorm and SiLU-and-multiply
(here), paged attention (kernels/cpu_attention.py) and linear layers (kernels/cpu_linear.py).

Each wrapper has the signature and results of its twin in kernels.reference, for float32 and
bfloat16 CPU tensors; the KV cache may be float32, bfloat16, float16, or int8 or fp8 (rows with
their scale, kernels/kv_format.py) whatever the activations' dtype. The C code (kernels/csrc/) does
the rotary embedding and the KV-cache store in one pass each where the reference runs a dozen
small tensor ops, the greedy argmax down the columns of column-major logits, and RMSNorm with
its residual add in one pass over row- or column-major activations.
It is built by kernels/cpu_build.py at first use.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import CACHE_DTYPE_CODES, DTYPE_CODES, build_dir, why_unavailable
from kernels.cpu_build import library as _library
from kernels.validation import (
    check_argmax,
    check_rms_norm,
    check_rotary,
    check_silu_and_mul,
    check_store_kvcache,
    expect_inner_contiguous,
)

__all__ = [
    "argmax", "build_dir", "fp8_e4m3_bytes", "fp8_e4m3_values", "rms_norm", "rotary_embedding",
    "silu_and_mul", "store_kvcache", "why_unavailable",
]  # fmt: skip

ACTIVATION_DTYPES = tuple(DTYPE_CODES)


def check_cpu(
    tensors: dict[str, torch.Tensor], floats: tuple[str, ...], inner_dims: dict[str, int]
) -> None:
    """Raise unless every tensor is on the CPU, `floats` are float32 or bfloat16 (a KV cache,
    named `*_cache`, may be float16, int8 or uint8 (fp8) too), and each tensor is contiguous,
    or for those in `inner_dims`, contiguous in that many trailing dims."""
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; the CPU kernels need CPU tensors")
        is_cache = name.endswith("_cache")
        if name in floats and tensor.dtype not in (CACHE_DTYPE_CODES if is_cache else DTYPE_CODES):
            allowed = (
                "float32, bfloat16, float16, int8 or uint8 (fp8)" if is_cache
                else "float32 or bfloat16"
            )  # fmt: skip
            raise ValueError(f"{name} must be {allowed} for the CPU kernels, got {tensor.dtype}")
        if name in inner_dims:
            expect_inner_contiguous(name, tensor, inner_dims[name])
        elif not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def token_stride(tensor: torch.Tensor) -> int:
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
    check_cpu(
        {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
         "slot_mapping": slot_mapping},
        floats=("key", "value", "k_cache", "v_cache"),
        inner_dims={"key": 2, "value": 2},
    )  # fmt: skip
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = _library().kvgate_store_kvcache(
        key.data_ptr(), token_stride(key), value.data_ptr(), token_stride(value),
        DTYPE_CODES[key.dtype], k_cache.data_ptr(), v_cache.data_ptr(),
        CACHE_DTYPE_CODES[k_cache.dtype], slot_mapping.data_ptr(), key.shape[0], key.shape[1],
        key.shape[2], num_slots,
    )  # fmt: skip
    if bad == -2:
        raise MemoryError("store_kvcache could not allocate its row buffer")
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
    check_cpu(
        {"positions": positions, "q": q, "k": k, "cos_sin_cache": cos_sin_cache},
        floats=("q", "k"),
        inner_dims={"q": 2, "k": 2},
    )
    lib, threads = _library(), torch.get_num_threads()
    max_position, head_dim = cos_sin_cache.shape
    rotated = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=x.dtype)
        bad = lib.kvgate_rotary(
            positions.data_ptr(), cos_sin_cache.data_ptr(), max_position, x.data_ptr(),
            DTYPE_CODES[x.dtype], token_stride(x), x.shape[0], x.shape[1], head_dim,
            out.data_ptr(), threads,
        )  # fmt: skip
        if bad == -2:
            raise MemoryError("rotary embedding could not allocate its scratch buffer")
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
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 for the CPU argmax, got {logits.dtype}")
    check_cpu({"logits": logits}, floats=("logits",), inner_dims={"logits": 0})
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


def has_layout(t: torch.Tensor, column_major: bool) -> bool:
    """Whether 2-D `t` is dense along its rows (row-major) or its columns (column-major)."""
    inner, outer = (0, 1) if column_major else (1, 0)
    dense = t.stride(inner) == 1 or t.shape[inner] == 1
    return dense and (t.shape[outer] == 1 or t.stride(outer) >= t.shape[inner])


def leading_dim(t: torch.Tensor, column_major: bool) -> int:
    """Elements between consecutive columns (column-major) or rows (row-major) of 2-D `t`."""
    outer = 1 if column_major else 0
    return t.stride(outer) if t.shape[outer] > 1 else t.shape[1 - outer]


def empty_2d(rows: int, cols: int, column_major: bool, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [rows, cols] tensor in the given layout."""
    if column_major:
        return torch.empty(cols, rows, dtype=dtype).t()
    return torch.empty(rows, cols, dtype=dtype)


def is_column_major(x: torch.Tensor) -> bool:
    """Whether 2-D `x` is column-major and not also row-major (a single row or column)."""
    return not has_layout(x, False) and has_layout(x, True)


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
    check_cpu(tensors, floats=tuple(tensors), inner_dims={"x": 0, "residual": 0})
    column_major = is_column_major(x)
    if not column_major and not has_layout(x, False):
        x = x.contiguous()
    if residual is not None and not has_layout(residual, column_major):
        residual = residual.t().contiguous().t() if column_major else residual.contiguous()
    rows, hidden = x.shape
    out = empty_2d(rows, hidden, column_major, x.dtype)
    summed = x if residual is None else empty_2d(rows, hidden, column_major, x.dtype)
    if rows == 0:
        return out, summed
    _library().kvgate_rms_norm(
        x.data_ptr(), leading_dim(x, column_major),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else leading_dim(residual, column_major),
        weight.data_ptr(), out.data_ptr(), None if residual is None else summed.data_ptr(),
        rows, hidden, int(column_major), DTYPE_CODES[x.dtype], eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The CPU twin of kernels.reference.silu_and_mul: silu(gate) * up of [N, 2 * I].

    Row- and column-major x are read in place; the result takes x's layout (another x is
    copied to row-major first).
    """
    check_silu_and_mul(x)
    check_cpu({"x": x}, floats=("x",), inner_dims={"x": 0})
    column_major = is_column_major(x)
    if not column_major and not has_layout(x, False):
        x = x.contiguous()
    rows, width = x.shape
    half = width // 2
    out = empty_2d(rows, half, column_major, x.dtype)
    if rows == 0 or half == 0:
        return out
    x_ld, out_ld = leading_dim(x, column_major), leading_dim(out, column_major)
    # A run of contiguous elements is a token's features (row-major) or a feature's tokens.
    outer, inner, up_offset = (half, rows, half * x_ld) if column_major else (rows, half, half)
    _library().kvgate_silu_and_mul(
        x.data_ptr(), x_ld, up_offset, out.data_ptr(), out_ld, outer, inner,
        DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def _elementwise(name: str, x: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype,
                 function: str) -> torch.Tensor:  # fmt: skip
    """The C function `function` over every element of `x` (CPU, `dtype`) into a new tensor."""
    check_cpu({name: x}, floats=(), inner_dims={})
    if x.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {x.dtype}")
    out = torch.empty(x.shape, dtype=out_dtype)
    getattr(_library(), function)(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def fp8_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 values as e4m3 bytes (uint8) by the C kernels' encoding, as
    kernels.kv_format.fp8_e4m3_bytes."""
    return _elementwise("x", x, torch.float32, torch.uint8, "kvgate_fp8_from_f32")


def fp8_e4m3_values(data: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (uint8) as float32 by the C kernels' decoding, as
    kernels.kv_format.fp8_e4m3_values."""
    return _elementwise("data", data, torch.uint8, torch.float32, "kvgate_fp8_to_f32")
