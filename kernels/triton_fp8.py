"""float8 e4m3 for the Triton kernels, by integer arithmetic on float32 bits.

The bytes are torch.float8_e4m3fn's (kernels/kv_format.py): sign, 4 exponent bits of bias 7, 3
mantissa bits; 0x01-0x07 the subnormals k * 2^-9; 0x7F and 0xFF NaN; no infinities. Encoding
rounds to nearest, ties to even, and saturates at +-448.

Triton's own float8 casts are not used: in the interpreter (TRITON_INTERPRET=1) they flush
subnormals to zero, turn values past 448 into NaN and read 0x7F as 480, so a test there could
not hold a kernel to its reference. Shifts, masks and compares on the float32 bits give the
same bytes wherever Triton runs, and the interpreter tests hold them to torch's conversion bit
for bit.

`fp8_e4m3_bytes` and `fp8_e4m3_values` run the two conversions over whole tensors; their twins
are the functions of the same names in kernels/kv_format.py.
"""

import torch
import triton
import triton.language as tl

from kernels.validation import expect_triton_device

_BLOCK = 1024

# float32 bit patterns: 448 (the largest e4m3 value), 2^-6 (the smallest normal one), the
# exponent bias moved from 127 to 7, and the NaN torch reads 0x7F as.
_F32_448 = tl.constexpr(0x43E00000)
_F32_MIN_NORMAL = tl.constexpr(0x3C800000)
_REBIAS = tl.constexpr(0x3C000000)
_F32_NAN = tl.constexpr(0x7FF00000)


@triton.jit
def _shift_right_half_even(value, shift):
    """value >> shift (value >= 0, 1 <= shift < 31), rounded to nearest, ties to even."""
    kept = value >> shift
    rest = value & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    return kept + round_up.to(tl.int32)


@triton.jit
def fp8_e4m3_encode(x):
    """float32 values as e4m3 bytes (int32, 0..255)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    saturated = tl.minimum(magnitude, _F32_448)  # infinities too
    normal = _shift_right_half_even(saturated - _REBIAS, 20)
    # Below 2^-6: the value in units of 2^-9, from the 24-bit mantissa (exponents under 117,
    # values under 2^-10, shift it all out and round to 0).
    exponent = saturated >> 23
    shift = tl.minimum(tl.maximum(141 - exponent, 21), 25)
    subnormal = _shift_right_half_even((saturated & 0x7FFFFF) | 0x800000, shift)
    byte = tl.where(saturated >= _F32_MIN_NORMAL, normal, subnormal)
    return tl.where(magnitude > 0x7F800000, 0x7F, byte) | sign


@triton.jit
def fp8_e4m3_decode(byte):
    """e4m3 bytes (any integer type) as float32 values."""
    bits = byte.to(tl.int32) & 0xFF
    sign = (bits & 0x80) << 24
    magnitude = bits & 0x7F
    normal = (magnitude << 20) + _REBIAS
    # A subnormal k * 2^-9 (k = 1..7) normalized: its top bit (at 0, 1 or 2) becomes implicit.
    top = (magnitude >= 2).to(tl.int32) + (magnitude >= 4).to(tl.int32)
    subnormal = ((118 + top) << 23) | ((magnitude << (23 - top)) & 0x7FFFFF)
    value = tl.where(magnitude >= 8, normal, tl.where(magnitude == 0, 0, subnormal))
    value = tl.where(magnitude == 0x7F, _F32_NAN, value) | sign
    return value.to(tl.float32, bitcast=True)


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, fp8_e4m3_encode(x).to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(data_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    data = tl.load(data_ptr + offsets, mask=mask, other=0)
    tl.store(out_ptr + offsets, fp8_e4m3_decode(data), mask=mask)


def _elementwise(kernel, name: str, x: torch.Tensor, dtype: torch.dtype,
                 out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """`kernel` over every element of the contiguous `x` (of `dtype`) into a new tensor."""
    if x.dtype != dtype or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor, got {x.dtype} "
                         f"with strides {x.stride()}")  # fmt: skip
    expect_triton_device(name, x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel():
        kernel[(triton.cdiv(x.numel(), _BLOCK),)](x, out, x.numel(), BLOCK=_BLOCK)
    return out


def fp8_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 values as e4m3 bytes (uint8), as kernels.kv_format.fp8_e4m3_bytes."""
    return _elementwise(_encode_kernel, "x", x, torch.float32, torch.uint8)


def fp8_e4m3_values(data: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (uint8) as float32 values, as kernels.kv_format.fp8_e4m3_values."""
    return _elementwise(_decode_kernel, "data", data, torch.uint8, torch.float32)
