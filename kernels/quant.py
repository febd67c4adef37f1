"""Weight-only quantized linear weights: int8 (per-channel or group-wise) and int4 (group-wise).

One format per bit width, read by the C kernels, the Triton kernels and the reference alike:

- int8: `qweight` int8 [out, in], `scales` float32 [out, in / group_size]; w = q * scale.
  Per-channel (the default quantization) is group_size = in_features.
- int4: `qweight` uint8 [out, in / 2]; within each block of 32 weights of a row, byte j holds
  weight j in its low nibble and weight j + 16 in its high nibble (GGUF's Q4_0/Q4_1 layout);
  `scales` and `zeros` float16 [out, in / group_size]; w = q * scale + zero, q in 0..15 (zero is
  the weight that q = 0 stands for: Q4_1's `m`). group_size is a multiple of 32.

An int4 linear layer multiplies its weights with activations rounded to int8 in blocks of 32
values (`quantize_activations`, the Q8 blocks llama.cpp pairs with Q4 weights), so that the CPU
kernel's block products are integer multiply-adds (VNNI); every backend rounds the activations
the same way, and int8 weights multiply the activations as they are (the CPU's AMX kernel above
8 rows keeps float32 activations to 16 significant bits, a relative error of at most 2^-17 a
value of magnitude 2^-109 to 3.39e38: kernels/csrc/cpu_linear_tiles.c).

A loader that reads already-quantized tensors builds the weight directly (`int4_weight`,
`int8_weight`, or from GGUF blocks with `from_gguf_q8_0`, `from_gguf_q4_0`, `from_gguf_q4_1`:
their nibble order is this one, so the bytes are copied, not unpacked and repacked), reorders
rows with `permute_rows` and fuses projections with `concat_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

INT4_BLOCK = 32  # weights per packed block (16 bytes)
DEFAULT_INT4_GROUP_SIZE = 32
ACTIVATION_BLOCK = 32  # activation values per int8 scale in an int4 layer
# 1/127 rounded to float32: an activation block's scale is max |x| times it (a product, which
# the C kernels compute identically; a division by 127 the compiler may turn into this product).
_ONE_127TH = torch.tensor(1 / 127, dtype=torch.float32)


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A [out_features, in_features] linear weight stored as int8 or int4 (see the module)."""

    bits: int  # 8 or 4
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None  # int4 only
    group_size: int
    # int8 only: x rounded to int8 blocks of 32 before the product, as int4's always is
    # (integer block sums on the CPU); False: weight-only, x as it is
    int8_activations: bool = False

    def __post_init__(self) -> None:
        _check_format(self)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        parts = [self.qweight, self.scales] + ([] if self.zeros is None else [self.zeros])
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def rounds_activations(self) -> bool:
        """Whether x is rounded to int8 blocks of 32 before the product (quantize_activations)."""
        return self.bits == 4 or self.int8_activations

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense [out_features, in_features] tensor (computed in float32)."""
        return self.dequantize_rows(slice(None)).to(dtype)

    def dequantize_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Rows of the weight (an embedding lookup of a tied table) as float32."""
        groups = self.scales[rows].float().repeat_interleave(self.group_size, dim=1)
        if self.bits == 8:
            return self.qweight[rows].float() * groups
        values = unpack_int4(self.qweight[rows]).float()
        return values * groups + self.zeros[rows].float().repeat_interleave(self.group_size, dim=1)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        zeros = None if self.zeros is None else self.zeros.to(device)
        return QuantizedWeight(
            self.bits, self.qweight.to(device), self.scales.to(device), zeros, self.group_size,
            self.int8_activations,
        )  # fmt: skip


def _check_format(w: QuantizedWeight) -> None:
    """Raise a ValueError naming the field that does not fit the format."""
    if w.bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {w.bits}")
    expected = (torch.int8, torch.float32) if w.bits == 8 else (torch.uint8, torch.float16)
    if w.qweight.dim() != 2 or w.qweight.dtype != expected[0]:
        raise ValueError(f"qweight must be 2-D {expected[0]}, got {w.qweight.dtype} "
                         f"{tuple(w.qweight.shape)}")  # fmt: skip
    in_features = w.in_features
    if w.group_size < 1 or in_features % w.group_size != 0:
        raise ValueError(f"group_size must divide in_features {in_features}, got {w.group_size}")
    if w.bits == 4 and w.group_size % INT4_BLOCK != 0:
        raise ValueError(f"int4 group_size must be a multiple of {INT4_BLOCK}, got {w.group_size}")
    shape = (w.qweight.shape[0], in_features // w.group_size)
    tensors = {"scales": w.scales} | ({} if w.bits == 8 else {"zeros": w.zeros})
    for name, t in tensors.items():
        if t is None or tuple(t.shape) != shape or t.dtype != expected[1]:
            got = None if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"{name} must be {expected[1]} {shape}, got {got}")
        if not t.is_contiguous() or t.device != w.qweight.device:
            raise ValueError(f"{name} must be contiguous and on {w.qweight.device}")
    if not w.qweight.is_contiguous():
        raise ValueError("qweight must be contiguous")
    if w.bits == 8 and w.zeros is not None:
        raise ValueError("int8 weights have no zeros")
    if w.int8_activations and (w.bits != 8 or w.group_size % ACTIVATION_BLOCK != 0):
        raise ValueError(
            f"int8_activations needs int8 weights in groups of a multiple of {ACTIVATION_BLOCK} "
            f"(per channel: in_features), got {w.bits} bits, group_size {w.group_size}"
        )


def with_int8_activations(weight: QuantizedWeight) -> QuantizedWeight:
    """An int8 weight in groups of a multiple of ACTIVATION_BLOCK (per channel included) as one
    that multiplies x rounded to int8 blocks (integer products on the CPU); any other weight as
    it is (int4 always rounds x)."""
    if weight.bits != 8 or weight.group_size % ACTIVATION_BLOCK != 0:
        return weight
    return replace(weight, int8_activations=True)


def int8_weight(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None = None
) -> QuantizedWeight:
    """An int8 weight from its values [out, in] and float scales [out] or [out, in / group]."""
    scales = scales.reshape(qweight.shape[0], -1).float().contiguous()
    group_size = group_size or qweight.shape[1] // scales.shape[1]
    return QuantizedWeight(8, qweight.contiguous(), scales, None, group_size)


def int4_weight(
    values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> QuantizedWeight:
    """An int4 weight from unpacked values [out, in] in 0..15 and [out, in / group] scales and
    zeros (w = q * scale + zero)."""
    if values.dtype != torch.uint8 or (values.numel() and int(values.max()) > 15):
        raise ValueError("values must be uint8 in 0..15")
    return QuantizedWeight(
        4, pack_int4(values), scales.half().contiguous(), zeros.half().contiguous(), group_size
    )


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 of a float weight [out, in]: scale = max |w| / 127 per row (or group)."""
    out_features, in_features = weight.shape
    group_size = group_size or in_features
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scales = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe).clamp(-127, 127).to(torch.int8)
    return int8_weight(q.reshape(out_features, in_features), scales.squeeze(-1), group_size)


def quantize_int4(
    weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP_SIZE
) -> QuantizedWeight:
    """Asymmetric int4 of a float weight [out, in] per group: zero = the group's minimum,
    scale = (max - min) / 15, both rounded to float16 before the values are chosen (Q4_1's rule).
    """
    out_features, in_features = weight.shape
    if in_features % group_size != 0 or group_size % INT4_BLOCK != 0:
        raise ValueError(
            f"int4 needs in_features ({in_features}) divisible by group_size ({group_size}), "
            f"a multiple of {INT4_BLOCK}"
        )
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    zeros = low.half()
    scales = ((high - zeros.float()) / 15.0).half()
    safe = torch.where(scales.float() > 0, scales.float(), torch.ones_like(low))
    q = torch.round((groups - zeros.float()) / safe).clamp(0, 15).to(torch.uint8)
    shape = (out_features, in_features // group_size)
    return int4_weight(
        q.reshape(out_features, in_features), scales.reshape(shape), zeros.reshape(shape),
        group_size,
    )  # fmt: skip


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[out, in] uint8 values 0..15 (in a multiple of 32) into [out, in / 2] bytes, GGUF order."""
    out_features, in_features = values.shape
    if in_features % INT4_BLOCK != 0:
        raise ValueError(f"int4 in_features must be a multiple of {INT4_BLOCK}, got {in_features}")
    blocks = values.reshape(out_features, -1, 2, INT4_BLOCK // 2)
    packed = blocks[:, :, 0] | (blocks[:, :, 1] << 4)
    return packed.reshape(out_features, in_features // 2).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: [out, in / 2] bytes to [out, in] values 0..15."""
    blocks = qweight.reshape(qweight.shape[0], -1, 1, INT4_BLOCK // 2)
    values = torch.cat([blocks & 15, blocks >> 4], dim=2)
    return values.reshape(qweight.shape[0], qweight.shape[1] * 2)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format stacked along their output rows (q, k and v into one fused
    projection, as the loader fuses dense ones)."""
    first = weights[0]
    if any((w.bits, w.group_size, w.in_features) != (first.bits, first.group_size,
           first.in_features) for w in weights):  # fmt: skip
        raise ValueError("only weights of one format, group size and input width concatenate")
    zeros = None if first.zeros is None else torch.cat([w.zeros for w in weights])
    qweight, scales = (
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales for w in weights]),
    )
    return QuantizedWeight(first.bits, qweight, scales, zeros, first.group_size)


def permute_rows(weight: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """The weight with its output rows reordered (row i of the result is row order[i]): a
    row's packed values, scales and zeros move together (GGUF's Q/K head reordering)."""
    zeros = None if weight.zeros is None else weight.zeros[order].contiguous()
    return QuantizedWeight(weight.bits, weight.qweight[order].contiguous(),
                           weight.scales[order].contiguous(), zeros, weight.group_size)  # fmt: skip


def _gguf_blocks(data: torch.Tensor, out_features: int, block_bytes: int) -> torch.Tensor:
    """A GGUF tensor's raw bytes as [out_features, blocks per row, block_bytes] uint8."""
    data = torch.as_tensor(data).reshape(-1)
    if data.dtype != torch.uint8 or data.numel() % (out_features * block_bytes) != 0:
        raise ValueError(f"GGUF data must be uint8 rows of {block_bytes}-byte blocks")
    return data.reshape(out_features, -1, block_bytes)


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float16 at `offset` of every block, [out, blocks]."""
    return blocks[:, :, offset : offset + 2].contiguous().view(torch.float16).squeeze(-1)


def from_gguf_q8_0(data: torch.Tensor, out_features: int) -> QuantizedWeight:
    """A GGUF Q8_0 tensor (blocks of 32: float16 d, 32 int8 q; w = d * q) as int8, group 32."""
    blocks = _gguf_blocks(data, out_features, 34)
    scales = _f16_field(blocks, 0).float()
    q = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(out_features, -1)
    return int8_weight(q, scales, 32)


def from_gguf_q4_0(data: torch.Tensor, out_features: int) -> QuantizedWeight:
    """A GGUF Q4_0 tensor (blocks of 32: float16 d, 16 bytes; w = d * (q - 8)) as int4."""
    blocks = _gguf_blocks(data, out_features, 18)
    scales = _f16_field(blocks, 0)
    zeros = (-8.0 * scales.float()).half()
    return _int4_from_bytes(blocks[:, :, 2:], scales, zeros, out_features)


def from_gguf_q4_1(data: torch.Tensor, out_features: int) -> QuantizedWeight:
    """A GGUF Q4_1 tensor (blocks of 32: float16 d, float16 m, 16 bytes; w = d * q + m) as
    int4, copied byte for byte."""
    blocks = _gguf_blocks(data, out_features, 20)
    return _int4_from_bytes(blocks[:, :, 4:], _f16_field(blocks, 0), _f16_field(blocks, 2),
                            out_features)  # fmt: skip


def _int4_from_bytes(
    nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, out_features: int
) -> QuantizedWeight:
    qweight = nibbles.contiguous().reshape(out_features, -1)
    return QuantizedWeight(4, qweight, scales.contiguous(), zeros.contiguous(), INT4_BLOCK)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [N, K] (K a multiple of 32) as int8 in blocks of 32 values: (q [N, K] int8,
    scales [N, K / 32] float32), x ~ q * scale. In float32: scale = max |x| * float32(1/127),
    q = round-half-even(x * (1 / scale)) in -127..127 (0 for a block of zeros), the operations
    the C kernel does (kernels/csrc/cpu_int4.h)."""
    rows, k = x.shape
    if k % ACTIVATION_BLOCK != 0:
        raise ValueError(f"x.shape[1] must be a multiple of {ACTIVATION_BLOCK}, got {k}")
    blocks = x.float().reshape(rows, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    scales = blocks.abs().amax(dim=-1, keepdim=True) * _ONE_127TH
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)
    return q.reshape(rows, k), scales.squeeze(-1)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [N, K] as float32 values of its int8 blocks (q * scale, see quantize_activations):
    what an int4 linear layer multiplies."""
    q, scales = quantize_activations(x)
    blocks = q.float().reshape(x.shape[0], -1, ACTIVATION_BLOCK) * scales.unsqueeze(-1)
    return blocks.reshape(x.shape)
