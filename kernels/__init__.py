"""Attention, KV-cache, RMSNorm and rotary kernels: Triton and their PyTorch reference twins."""

from kernels.dispatch import KernelBackend, get_kernels
from kernels.rotary import build_cos_sin_cache

__all__ = ["KernelBackend", "build_cos_sin_cache", "get_kernels"]
