"""Dense linear layers on CUDA: torch's cuBLAS matmul.

The twin is kernels.reference.linear, but for one difference: float32 logits of a 16-bit
model (out_dtype) are the 16-bit matmul's result cast to float32, as transformers computes
them, instead of a float32 matmul of the weights cast to float32 (a copy of the output layer
per step on a GPU).
"""

import torch
import torch.nn.functional as F

from kernels.validation import check_linear


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight^T + bias in x.dtype, then cast to out_dtype (see the module)."""
    check_linear(x, weight, bias)
    out = F.linear(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)
