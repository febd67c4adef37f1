"""CPU linear layers: dense float32 and bfloat16 weights, and weight-only int8 / int4.

Results are column-major: the [N, out_features] transposed view of a contiguous
[out_features, N], which the next layer's kernels read in place (elementwise ops keep the
layout; RMSNorm, SiLU-and-multiply and attention read and write it).

- The C kernels run at the ISA level kernels/cpu_build.py loads (AVX-512, AVX2 or portable);
  every path below exists at each level (docs/cpu-speed.md says what each level runs).
- At small batches (at most SMALL_BATCH_ROWS rows) every format goes through the C kernels of
  kernels/csrc/cpu_linear.c, which read each weight once in its own format (torch's bfloat16
  matrix-vector product and its packed int8/int4 kernels read these weights at half the speed
  or less on this machine: `kvgate bench kernels linear` measures them side by side).
- Dense float32 weights at up to COLUMNS_MAX_ROWS rows (a decode step of up to 64 streams) go
  through the outer-product kernel of kernels/csrc/cpu_linear_columns.c, which reads the weights
  where they lie (MKL's sgemm copies them into packed panels on every call, and a decode
  step's weights come from memory; `kvgate bench kernels linear` measures both).
- Dense bfloat16 products above SMALL_BATCH_ROWS rows on CPUs without AMX tiles are summed in
  float32 from the exact widened values (_widens_bfloat16): up to COLUMNS_MAX_ROWS rows on the
  outer-product kernel, which widens each block's chunk of weights into a buffer in the L1
  cache, more by torch's float32 matmul on widened slices of weight rows. There one vdpbf16ps
  (32 multiply-adds) issues at a quarter of the rate of a float32 vfmadd (16), so oneDNN's
  bfloat16 matmul runs at half the float32 rate. With AMX tiles oneDNN's bfloat16 matmul is
  the fast one and runs them.
- Per-channel int8 weights above SMALL_BATCH_ROWS rows go through the AMX tile kernel of
  kernels/csrc/cpu_linear_tiles.c where the CPU has one (the exact int8 values as bfloat16, x
  split into two bfloat16 parts, float32 sums). Without it, and for other quantized layers, at
  up to COLUMNS_MAX_ROWS rows the outer-product kernel dequantizes each block's chunk of
  weights into the L1 cache (int8 in groups that are no multiple of 16: slices of 48 weight
  rows at a time into the L2 cache).
- At larger batches dense weights are multiplied by torch as weight @ x^T (MKL, 20-40% faster
  than x @ weight^T on this kind of CPU; oneDNN with AMX for bfloat16 where the CPU has it),
  and quantized ones are first dequantized into the activation dtype, a slice of rows at a
  time. On CPUs without AMX tiles, quantized layers above SMALL_BATCH_ROWS rows with bfloat16
  activations widen them to float32 and take the float32 paths (the reference's arithmetic).
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import check_cpu
from kernels.cpu_build import DTYPE_CODES, WEIGHT_KINDS, LinearWeightsStruct, library
from kernels.quant import QuantizedWeight, round_activations
from kernels.validation import check_linear, check_quantized_linear

# Largest batch the C small-batch kernels take; larger ones run a dense matmul.
SMALL_BATCH_ROWS = 8
# Largest batch of float32 rows the outer-product kernel takes (cpu_linear_columns.c).
COLUMNS_MAX_ROWS = 64
# Elements of weight dequantized at a time for a dense matmul (a slice that stays in cache).
DEQUANTIZE_CHUNK_ELEMENTS = 1 << 20


def weights_struct(
    weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None
) -> LinearWeightsStruct:
    """The C description of a linear layer's weight (dense float32/bfloat16, or quantized)."""
    if isinstance(weight, QuantizedWeight):
        kind = WEIGHT_KINDS["int8" if weight.bits == 8 else "int4"]
        zeros = None if weight.zeros is None else weight.zeros.data_ptr()
        return LinearWeightsStruct(
            kind, weight.qweight.data_ptr(), weight.scales.data_ptr(), zeros, _pointer(bias),
            weight.group_size, weight.out_features, weight.in_features, weight.int8_activations,
        )  # fmt: skip
    kind = WEIGHT_KINDS[str(weight.dtype).removeprefix("torch.")]
    return LinearWeightsStruct(kind, weight.data_ptr(), None, None, _pointer(bias), 0,
                               weight.shape[0], weight.shape[1])  # fmt: skip


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The CPU twin of kernels.reference.linear, column-major (see the module)."""
    check_linear(x, weight, bias)
    out_dtype = out_dtype or x.dtype
    if x.shape[0] == 0:  # a prefill chunk that ends no prompt asks the head for no rows
        return torch.empty(weight.shape[0], 0, dtype=out_dtype).t()
    if x.shape[0] <= SMALL_BATCH_ROWS:
        _check_small_batch(x, weight, bias)
        return _small_batch(x, weights_struct(weight, bias), weight.shape[0], out_dtype)
    if _widens_bfloat16(x, weight, out_dtype):
        return _widened(x, weight, bias, out_dtype)
    if x.shape[0] <= COLUMNS_MAX_ROWS and _takes_columns(x, weight, bias, out_dtype):
        return _columns(x, weight, bias)
    if bias is None:
        out = torch.mm(weight, x.t())
    else:
        out = torch.addmm(bias.unsqueeze(1), weight, x.t())
    return out.t().to(out_dtype)


def linear_quantized(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The CPU twin of kernels.reference.linear_quantized, column-major (see the module).

    Small batches accumulate in float32 from the exact weights (int4: integer block sums
    against x rounded to int8 blocks, see kernels/csrc/cpu_int4.h), and so do per-channel int8
    layers on the AMX tile kernel (x to 16 significant bits). Other larger ones multiply weights
    dequantized to float32 (float32 x, and bfloat16 x widened to float32 on CPUs without AMX)
    or to x.dtype (bfloat16 with AMX, rounded to it) with torch, for int4 by x rounded to its
    int8 blocks as well (kernels.quant.round_activations, then to x.dtype).
    """
    check_quantized_linear(x, weight, bias)
    check_cpu({"x": x}, floats=("x",), inner_dims={"x": 0})
    out_dtype = out_dtype or x.dtype
    if bias is not None:
        bias = bias.contiguous()  # the C kernels read it by its pointer
    if x.shape[0] > SMALL_BATCH_ROWS and _takes_tiles(weight):
        return _tiles(x, weight, bias, out_dtype)
    if x.shape[0] > SMALL_BATCH_ROWS and x.dtype == torch.bfloat16 and not _tiles_built():
        # Without AMX, bfloat16 products run at half the float32 rate (see _widens_bfloat16): x
        # widened to float32 takes the float32 paths, which are the reference's own arithmetic.
        return _dequantized_matmul(x.float(), weight, bias).t().to(out_dtype)
    if x.shape[0] > SMALL_BATCH_ROWS:
        return _dequantized_matmul(x, weight, bias).t().to(out_dtype)
    if x.shape[0] == 0:
        return torch.empty(weight.out_features, 0, dtype=out_dtype).t()
    return _small_batch(x, weights_struct(weight, bias), weight.out_features, out_dtype)


def _check_small_batch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    tensors = {"x": x, "weight": weight} | ({} if bias is None else {"bias": bias})
    check_cpu(tensors, floats=tuple(tensors), inner_dims={"x": 0})


def _columns_built() -> bool:
    return bool(library().kvgate_linear_columns_available())


def _takes_columns(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> bool:
    """Whether the outer-product kernel takes this float32 product (CPU tensors, x's rows
    SMALL_BATCH_ROWS < m <= COLUMNS_MAX_ROWS, checked by the caller)."""
    tensors = [x, weight] + ([] if bias is None else [bias])
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and out_dtype == torch.float32
        and (bias is None or bias.is_contiguous())
        and _columns_read(weight)
    )


def takes_columns(weight: torch.Tensor | QuantizedWeight, act_dtype: torch.dtype) -> bool:
    """Whether `linear` / `linear_quantized` run this weight (with its bias, of act_dtype) over
    SMALL_BATCH_ROWS < rows <= COLUMNS_MAX_ROWS rows of act_dtype x on the outer-product kernels:
    x widened to float32 where it is bfloat16, float32 sums, the bias added in float32 and the
    result rounded once. The one-call decoder stack (kernels/csrc/cpu_decoder.c) does the same
    in C for such steps when every layer's weights take this path."""
    if not _columns_built() or act_dtype not in (torch.float32, torch.bfloat16):
        return False
    if isinstance(weight, QuantizedWeight):
        return not _takes_tiles(weight) and (act_dtype == torch.float32 or not _tiles_built())
    if weight.dtype != act_dtype or not _columns_read(weight):
        return False
    return act_dtype == torch.float32 or not _tiles_built()


def _columns_read(weight: torch.Tensor) -> bool:
    """Whether the outer-product kernel is built and can read `weight` where it lies (a
    contiguous CPU matrix with at least one input feature)."""
    return (
        weight.device.type == "cpu"
        and weight.shape[1] > 0
        and weight.is_contiguous()
        and _columns_built()
    )


def _columns(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(weight.shape[0], x.shape[0], dtype=torch.float32)
    _columns_into(_features_major(x), weight, bias, out)
    return out.t()


def _features_major(x: torch.Tensor) -> torch.Tensor:
    """x^T as the 9-64-row kernels read it, [in, rows] contiguous: the engine's column-major
    activations as they are, others (the attention's row-major output) transposed by torch."""
    return x.t().contiguous()


def _columns_into(
    x_t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """out (contiguous [out_features, rows] float32) = weight @ x_t (+ bias), x_t [in, rows]
    float32 contiguous (_features_major); weight and bias float32, or weight bfloat16 (widened
    exactly by the kernel) and bias float32."""
    failed = library().kvgate_linear_columns(
        weight.data_ptr(), int(weight.dtype == torch.bfloat16), _pointer(bias), x_t.data_ptr(),
        x_t.shape[1], weight.shape[0], weight.shape[1], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_for(failed, "kvgate_linear_columns")


def _raise_for(failed: int, kernel: str) -> None:
    """The C kernels' return codes: 0 done, 1 out of memory, 2 not built or not applicable."""
    if failed == 1:
        raise MemoryError(f"{kernel} could not allocate its scratch buffer")
    if failed:
        raise RuntimeError(f"{kernel} cannot run these arguments on this build (code {failed})")


def _small_batch(
    x: torch.Tensor, weights: LinearWeightsStruct, out_features: int, out_dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(out_features, x.shape[0], dtype=out_dtype)
    failed = library().kvgate_linear(
        ctypes.byref(weights), x.data_ptr(), DTYPE_CODES[x.dtype], x.stride(0), x.stride(1),
        x.shape[0], out.data_ptr(), DTYPE_CODES[out_dtype], torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("linear could not allocate its scratch buffer")
    return out.t()


def dequantize(
    weight: QuantizedWeight, dtype: torch.dtype, rows: slice = slice(None)
) -> torch.Tensor:
    """Rows of a quantized weight as a dense contiguous tensor of `dtype` (float32 or bfloat16),
    computed by the C kernels (the twin of QuantizedWeight.dequantize)."""
    start, stop, _ = rows.indices(weight.out_features)
    count = max(stop - start, 0)
    out = torch.empty(count, weight.in_features, dtype=dtype)
    if count == 0:
        return out
    failed = library().kvgate_dequantize(
        ctypes.byref(weights_struct(weight, None)), start, count, out.data_ptr(),
        DTYPE_CODES[dtype], torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("dequantize could not allocate its scratch buffer")
    return out


def _dequantized_matmul(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """[out_features, N] = dequantized weight @ x^T (+ bias) in x.dtype (see the module); int4
    layers multiply x rounded to its int8 blocks (in C on the 9-64-row path)."""
    rows = x.shape[0]
    if rows <= COLUMNS_MAX_ROWS and x.dtype == torch.float32 and _columns_built():
        out = torch.empty(weight.out_features, rows, dtype=torch.float32)
        _quantized_columns_into(_features_major(x), weight, out)
    else:
        if weight.rounds_activations:
            x = round_activations(x).to(x.dtype)
        out = torch.empty(weight.out_features, rows, dtype=x.dtype)
        rows_per_chunk = max(1, DEQUANTIZE_CHUNK_ELEMENTS // weight.in_features)
        for start in range(0, weight.out_features, rows_per_chunk):
            chunk = slice(start, min(start + rows_per_chunk, weight.out_features))
            torch.mm(dequantize(weight, x.dtype, chunk), x.t(), out=out[chunk])
    if bias is not None:
        out += bias.unsqueeze(1)
    return out


def _tiles_built() -> bool:
    return bool(library().kvgate_linear_tiles_available())


def _takes_tiles(weight: QuantizedWeight) -> bool:
    """Whether the AMX tile kernel takes this layer (above SMALL_BATCH_ROWS rows): per-channel
    int8, on a CPU with AMX whose kernel lets the process use it."""
    return weight.bits == 8 and weight.group_size == weight.in_features and _tiles_built()


def _tiles(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x @ weight^T (+ bias) on the AMX tile kernel, column-major [rows, out_features]."""
    if weight.int8_activations:
        x = round_activations(x).to(x.dtype)
    weights = weights_struct(weight, bias)
    out = torch.empty(weights.out_features, x.shape[0], dtype=out_dtype)
    x_t = _features_major(x)
    failed = library().kvgate_linear_tiles(
        ctypes.byref(weights), x_t.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], out.data_ptr(),
        DTYPE_CODES[out_dtype], torch.get_num_threads(),
    )  # fmt: skip
    _raise_for(failed, "kvgate_linear_tiles")
    return out.t()


def _widens_bfloat16(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this bfloat16 product (more than SMALL_BATCH_ROWS rows, checked by the caller) is
    summed in float32 from the exact widened values: on CPUs without AMX tiles, where one
    vdpbf16ps (32 multiply-adds) issues at a quarter of the rate of a float32 vfmadd (16), so
    oneDNN's bfloat16 matmul runs at half the float32 one's rate (and without AVX512-BF16 far
    below it)."""
    return (
        x.dtype == torch.bfloat16
        and x.shape[0] > 0
        and out_dtype in (torch.float32, torch.bfloat16)
        and _columns_read(weight)
        and not _tiles_built()
    )


def _widened(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x @ weight^T (+ bias) for bfloat16 x and weight, column-major, summed in float32 from the
    exact widened values and rounded once to out_dtype: up to COLUMNS_MAX_ROWS rows on the
    outer-product kernel (which widens them a block's chunk at a time), more by torch's float32
    matmul on DEQUANTIZE_CHUNK_ELEMENTS-sized slices of weight rows widened by torch."""
    rows, x32 = x.shape[0], x.float()
    bias32 = None if bias is None else bias.float().contiguous()
    out = torch.empty(weight.shape[0], rows, dtype=torch.float32)
    if rows <= COLUMNS_MAX_ROWS:
        _columns_into(_features_major(x32), weight, bias32, out)
        return out.t().to(out_dtype)
    rows_per_chunk = max(1, DEQUANTIZE_CHUNK_ELEMENTS // weight.shape[1])
    for start in range(0, weight.shape[0], rows_per_chunk):
        chunk = slice(start, start + rows_per_chunk)
        torch.mm(weight[chunk].float(), x32.t(), out=out[chunk])
    if bias32 is not None:
        out += bias32.unsqueeze(1)
    return out.t().to(out_dtype)


def _quantized_columns_into(x_t: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """out (contiguous [out_features, rows] float32) = weight @ x_t, x_t [in, rows] float32
    (int4: rounded to its rows' int8 blocks by the C function): the outer-product kernel over
    weight rows dequantized a block's chunk at a time into the L1 cache (int8 in groups that
    are no multiple of 16: 48 whole rows at a time into the L2 cache)."""
    failed = library().kvgate_linear_columns_quantized(
        ctypes.byref(weights_struct(weight, None)), x_t.data_ptr(), x_t.shape[1],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_for(failed, "kvgate_linear_columns_quantized")


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
